"""QLoRA's 4-bit base (issue 42): block Linear layers in NF4 through bitsandbytes (its CPU backend runs here), LoRA
through peft over it; then `train --qlora` end to end through the CLI's in-process entry: a falling loss, a run
stopped and resumed ending bitwise on the whole run's adapters (checkpoints of the adapters only), the adapter folder
over a freshly quantised base, the merge back to a plain model, and a hand-written model file.

The Llama here is wide enough (hidden 256) that NF4's blocks of 64 weights and their absmax are what a real model
holds; it is saved in bf16 and loaded as users load a folder."""
import itertools
import json
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from tier_utils import cli
from tier_utils.adapter.adapter import adapt
from tier_utils.core.device import CPU_FLAGS_ENV
from tier_utils.core.errors import QuantizationError
from tier_utils.core.memory_settings import BASE_DTYPES
from tier_utils.engine.lora import LoraSettings, apply_lora, model_state
from tier_utils.engine.quantization import (
    describe_quantized,
    load_quantized,
    merge_to_plain,
    quantized_bytes_per_param,
    quantized_layers,
    require_adapters,
)
from tier_utils.engine.step import TrainStep
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.models.loading import load_model, source_of
from tier_utils.training.history import TrainResult
from tier_utils.training.loop import train

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

LLAMA = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64, vocab_size=256)
BLOCK_LINEARS = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"}
LORA = LoraSettings(r=8, alpha=16)
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    """A Llama saved with save_pretrained in bf16 (its config and safetensors header say so)."""
    folder = tmp_path_factory.mktemp("llama-bf16")
    torch.manual_seed(0)
    load_model("hf:LlamaForCausalLM", **LLAMA).to(torch.bfloat16).save_pretrained(folder)
    return folder


def _batches(n=4, rows=4, length=24):
    """Token rows with structure to learn (each row counts up from its start), so the loss can fall."""
    g = torch.Generator().manual_seed(3)
    starts = torch.randint(0, 200, (n, rows, 1), generator=g)
    return [s + torch.arange(length) for s in starts]


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def _weight_bytes(layer: nn.Module) -> int:
    """A layer's weight as its state dict holds it (a 4-bit layer's packed weight and quantisation state)."""
    return sum(t.numel() * t.element_size() for k, t in layer.state_dict().items() if k.startswith("weight"))


def test_a_bf16_llama_loads_with_its_block_linears_in_nf4_and_a_third_of_the_bytes(llama_bf16):
    plain = load_model(str(llama_bf16))
    quantized = load_quantized(str(llama_bf16), torch.bfloat16)
    layers = quantized_layers(quantized)
    assert {name.split("layers.")[1].split(".", 1)[1] for name in layers} == BLOCK_LINEARS and len(layers) == 14
    assert all(layer.weight.quant_type == "nf4" and layer.compute_dtype == torch.bfloat16 for layer in layers.values())
    # The embeddings and the head stay in the stored bf16.
    assert type(quantized.lm_head) is nn.Linear and quantized.lm_head.weight.dtype == torch.bfloat16
    assert quantized.model.embed_tokens.weight.dtype == torch.bfloat16
    plain_modules = dict(plain.named_modules())
    ratio = sum(map(_weight_bytes, layers.values())) / sum(_weight_bytes(plain_modules[n]) for n in layers)
    assert ratio <= 0.35, ratio
    assert 0.5 <= quantized_bytes_per_param() <= 0.6  # 4 bits + a 4-byte absmax per 64 weights
    assert describe_quantized(quantized).startswith("NF4 4-bit base (14 Linear4bit)")
    assert "embeddings and head in bfloat16" in describe_quantized(quantized)
    assert describe_quantized(plain) is None
    assert source_of(quantized).quantized == {"compute_dtype": "bfloat16"}
    assert source_of(quantized).kwargs == {}  # the config object is not a recordable argument
    # A 4-bit base trains through adapters only: without them its whole model would be the checkpoint; refused.
    with pytest.raises(QuantizationError, match="no LoRA adapters"):
        require_adapters(quantized)


def test_the_adapters_get_the_gradients_of_the_dequantised_base_after_an_eval_forward(llama_bf16):
    """bitsandbytes' CPU backend repacks a Linear4bit for an inference kernel with no backward at its first eval
    forward without gradients (adapt's probe is one): the gradients must still be those of the same weights held
    plainly (in fp32, where the two agree to the bit; the repacked layers' were off by 100 %)."""
    models = []
    for plain in (False, True):
        base = load_quantized(str(llama_bf16), torch.float32, dtype=torch.float32)
        if plain:
            base = merge_to_plain(base, torch.float32)  # the same weights, dequantised into nn.Linear layers
        torch.manual_seed(1)
        model = apply_lora(base, LORA)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # non-zero, so every adapter's A gets a gradient
                p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
        adapter = adapt(model.eval())  # probes the model in eval mode under inference_mode
        ids = _batches()[0]
        adapter.forward_loss({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})[0].backward()
        models.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert not quantized_layers(model) and models[0].keys() == models[1].keys()
    for name, grad in models[0].items():
        torch.testing.assert_close(grad, models[1][name], atol=1e-7, rtol=1e-5, msg=name)


MODEL_FILE = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm = nn.LayerNorm(d)
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(self.norm(x))))

    class GPT(nn.Module):
        """A hand-written LM with a head tied to its embedding."""
        task, max_len = "causal-lm", 32

        def __init__(self, d=128, vocab=256, layers=2):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, input_ids, attention_mask=None):
            x = self.emb(input_ids)
            for block in self.blocks:
                x = block(x)
            return self.head(x)
''')


def test_smoke_and_analysis_run_the_4bit_model_as_loaded_and_name_it(llama_bf16, monkeypatch):
    import tier_utils as tu

    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512_bf16")  # the bf16 stability check runs (it SKIPs where bf16 is emulated)

    model = load_quantized(str(llama_bf16), torch.bfloat16)
    report = tu.smoke(model, checks="init,stability", device="cpu", progress=False)
    named = "NF4 4-bit base (14 Linear4bit)"
    assert report.to_json()["model"]["quantized"].startswith(named)
    rows = report.table.set_index("check")
    assert rows.loc["init: weights dtype", "detail"].startswith(named)
    # The packed 4-bit codes are not read as weights (they looked like 60-sigma matrices with dead rows).
    assert rows.loc["init: weight scale", "status"] == "PASS" and "14 quantised" in rows.loc["init: weights dtype",
                                                                                               "detail"]
    assert not any("proj" in name for name in report.parameters["name"])
    assert rows.loc["stability: bf16 vs fp32 logits", "status"] == "PASS"  # no .float() of a quantised model
    assert len(quantized_layers(model)) == 14  # as loaded, still
    analysis = tu.analyze(model, analyses="dtypes", device="cpu", progress=False)
    assert analysis.to_json()["model"]["quantized"].startswith(named)
    assert set(analysis.table.status) <= {"PASS", "WARN"}, analysis.table


# -- train --qlora end to end, through the CLI's in-process entry ----------------------------------------------------
# fp32 decides the compute dtype on any CPU (a machine fact otherwise); 20 steps of 2 x 32 bytes of the bundled corpus.
TRAIN = ["--precision", "fp32", "--device", "cpu", "--no-progress", "--batch-size", "2", "--seq-len", "32",
         "--max-steps", "20", "--checkpoint-every", "2", "--eval-every", "0", "--eval-batches", "1", "--lr", "3e-3"]


def _base_dtype(result) -> torch.dtype:
    """The dtype the run held its base's unquantised weights in (embeddings, head), as its summary says."""
    return BASE_DTYPES[result.summary.memory["decided_base_dtype"]]


def _step_losses(result) -> list[float]:
    return result.history.query("kind == 'step'").train_loss.tolist()


def _cli_train(model: str, out, *extra, stop_at: int | None = None):
    """`python -m tier_utils train --model MODEL --out OUT TRAIN EXTRA` in this process: its exit code and the
    TrainResult it printed (the trained model in it). stop_at: Ctrl-C as step `stop_at` starts (the run keeps its
    last checkpoint; the steps after it are lost, as on a kill)."""
    results = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "train", lambda *a, **k: results.append(train(*a, **k)) or results[-1])
        # training.png is drawn in tests/test_plots.py; here it was half of each run's time (0.8 s of matplotlib).
        patch.setattr(TrainResult, "save_plot", lambda self, path: path)
        if stop_at is not None:
            calls, step = itertools.count(1), TrainStep.__call__

            def interrupted(self, micro):
                if next(calls) == stop_at:
                    raise KeyboardInterrupt
                return step(self, micro)

            patch.setattr(TrainStep, "__call__", interrupted)
        code = cli.main(["train", "--model", model, "--out", str(out), *TRAIN, *extra])
    return code, results[0]


@pytest.fixture(scope="module")
def qlora_runs(llama_bf16, tmp_path_factory):
    """`train --qlora` on the bf16 Llama: a whole run writing its adapter folder; the same run stopped at step 11
    (its last checkpoint: step 10), then resumed to the end writing the merged model. 1.7 s on one idle core."""
    root = tmp_path_factory.mktemp("qlora-train")
    runs = {"whole": _cli_train(str(llama_bf16), root / "whole", "--qlora", "--save-hf", str(root / "adapter"))}
    runs["stopped"] = _cli_train(str(llama_bf16), root / "cut", "--qlora", stop_at=11)
    runs["resumed"] = _cli_train(str(llama_bf16), root / "cut", "--lora", "r=8,alpha=16,bits=4", "--resume",
                                 "--save-hf", str(root / "merged"), "--merge")
    return root, runs


def test_train_qlora_trains_the_adapters_over_the_4bit_base_with_a_falling_loss(qlora_runs):
    _, runs = qlora_runs
    code, result = runs["whole"]
    losses = _step_losses(result)
    assert code == 0 and len(losses) == 20 and sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses
    model = result.model
    assert len(quantized_layers(model)) == 14  # still 4-bit under the adapters
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n and p.dtype == torch.float32 for n, p in trainable.items())
    assert result.summary.memory["describe"].startswith("QLoRA r=8 over a 4-bit NF4 base")
    assert result.summary.quantized.startswith("NF4 4-bit base (14 Linear4bit)")  # the result names what is 4-bit
    base = str(_base_dtype(result)).removeprefix("torch.")  # bf16 as stored, where this CPU computes in it
    assert f"embeddings and head in {base}, compute in float32" in result.summary.quantized


def test_train_qlora_stopped_and_resumed_ends_bitwise_on_the_whole_runs_adapters(qlora_runs):
    root, runs = qlora_runs
    (stopped, cut), (resumed, done) = runs["stopped"], runs["resumed"]
    assert stopped == 130 and cut.interrupted and cut.summary.steps == 10
    assert resumed == 0 and done.summary.resumed_from_step == 10 and done.summary.steps == 20
    whole, again = (load_checkpoint(root / run / "checkpoints" / "last.pt")["model"] for run in ("whole", "cut"))
    assert whole and all("lora_" in k for k in whole)  # the adapters only: no 4-bit base in the checkpoint
    assert whole.keys() == again.keys()
    for name, tensor in whole.items():
        assert torch.equal(tensor, again[name]), name
    for name, tensor in model_state(runs["whole"][1].model).items():  # and the models the two runs return
        assert torch.equal(tensor, model_state(done.model)[name]), name


def test_train_qlora_save_hf_adapters_over_a_freshly_quantised_base_give_the_trained_logits(qlora_runs, llama_bf16):
    from peft import PeftModel

    root, runs = qlora_runs
    trained = runs["whole"][1]
    expected, base = _logits(trained.model), _base_dtype(trained)  # the base loaded as the run held it
    fresh = PeftModel.from_pretrained(load_quantized(str(llama_bf16), torch.float32, dtype=base), root / "adapter")
    torch.testing.assert_close(_logits(fresh), expected, atol=1e-4, rtol=0)
    again = load_quantized(str(root / "adapter"), torch.float32, dtype=base)  # the folder's base, quantised, + adapters
    assert len(quantized_layers(again)) == 14
    torch.testing.assert_close(_logits(again), expected, atol=1e-4, rtol=0)


def test_train_qlora_merge_writes_a_plain_model_in_the_stored_bf16(qlora_runs):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    root, runs = qlora_runs
    folder = root / "merged"
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert {t.dtype for t in load_file(folder / "model.safetensors").values()} == {torch.bfloat16}
    assert "4-bit base dequantised to bfloat16" in runs["resumed"][1].summary.hf_detail
    merged = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert not quantized_layers(merged) and not any("lora" in n for n, _ in merged.named_parameters())
    # The same function up to bf16 rounding: the trained 4-bit base computed in fp32, against its merged copy.
    assert (_logits(merged) - _logits(runs["resumed"][1].model)).abs().max() < 0.1


def test_train_qlora_on_a_hand_written_model_file_quantises_its_block_linears_and_learns(tmp_path):
    (tmp_path / "gpt.py").write_text(MODEL_FILE)
    code, result = _cli_train(f"{tmp_path}/gpt.py:GPT", tmp_path / "run", "--lora", "r=8,alpha=16,bits=4")
    model = result.model.get_base_model()
    quantized = [f"blocks.{i}.{n}.base_layer" for i in range(2) for n in ("down", "up")]  # under peft's LoRA layers
    assert code == 0 and sorted(quantized_layers(model)) == quantized
    assert type(model.head) is nn.Linear and model.head.weight is model.emb.weight  # the tied head stays
    assert "embeddings and head in float32, compute in float32" in result.summary.quantized
    losses = _step_losses(result)
    assert sum(losses[-5:]) < 0.9 * sum(losses[:5]), losses


NO_LINEAR = textwrap.dedent('''
    import torch.nn as nn

    class Bag(nn.Module):
        """An embedding bag: nothing a 4-bit base could hold."""
        task, max_len = "causal-lm", 32

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 256)

        def forward(self, input_ids, attention_mask=None):
            return self.emb(input_ids)
''')


@pytest.mark.parametrize("case,says", [
    ("no-linear", "Bag has no nn.Linear layer to quantise to 4 bits; drop bits=4"),
    ("no-bitsandbytes", "a 4-bit base (QLoRA) needs bitsandbytes; pip install 'tier_utils[qlora]'"),
])
def test_train_qlora_bad_input_is_one_line_exit_2_nothing_written(case, says, llama_bf16, tmp_path, capsys,
                                                                   monkeypatch):
    (tmp_path / "bag.py").write_text(NO_LINEAR)
    model = f"{tmp_path}/bag.py:Bag" if case == "no-linear" else str(llama_bf16)
    if case == "no-bitsandbytes":
        monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # its import fails, as where it is not installed
    code = cli.main(["train", "--model", model, "--out", str(tmp_path / "run"), "--qlora", *TRAIN])
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("warning")]
    assert code == 2 and len(err) == 1 and says in err[0], err
    assert not any(p.is_file() for p in (tmp_path / "run").rglob("*"))


def test_search_qlora_trials_train_adapters_over_the_4bit_base_and_leave_the_folder_as_it_was(llama_bf16, tmp_path):
    """Each trial quantises its own base from the folder (the trials share no state) and trains its adapters."""
    before = {p.name: p.read_bytes() for p in llama_bf16.iterdir()}
    out = tmp_path / "study.json"
    code = cli.main(["search", "--model", str(llama_bf16), "--qlora", "--trials", "2", "--max-steps", "4",
                     "--eval-every", "2", "--eval-batches", "1", "--batch-size", "2", "--seq-len", "32",
                     "--precision", "fp32", "--device", "cpu", "--no-progress", "--json", str(out)])
    summary = json.loads(out.read_text())
    assert code == 0 and summary["states"] == {"COMPLETE": 2}, summary
    assert summary["ran_on"]["memory"].startswith("QLoRA r=8 over a 4-bit NF4 base"), summary["ran_on"]
    assert summary["ran_on"]["model"].startswith("LlamaForCausalLM"), summary["ran_on"]
    assert {p.name: p.read_bytes() for p in llama_bf16.iterdir()} == before
