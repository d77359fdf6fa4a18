"""QLoRA's 4-bit base (issue 42): block Linear layers in NF4 through bitsandbytes (its CPU backend runs here), LoRA
through peft over it, adapters saved and loaded, the merge back to a plain model, checkpoints of the adapters only.

The Llama here is wide enough (hidden 256) that NF4's blocks of 64 weights and their absmax are what a real model
holds; it is saved in bf16 and loaded as users load a folder."""
import sys
import textwrap

import pytest
import torch
import torch.nn as nn

from tier_utils.adapter.adapter import adapt
from tier_utils.core.errors import QuantizationError
from tier_utils.engine.lora import LoraSettings, apply_lora, load_model_state, model_state
from tier_utils.engine.quantization import (
    describe_quantized,
    load_quantized,
    merge_to_plain,
    quantize_linears,
    quantized_bytes_per_param,
    quantized_layers,
    require_adapters,
    require_bitsandbytes,
)
from tier_utils.engine.step import make_optimizer
from tier_utils.models.loading import load_model

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


def _train(model, stop, lr=3e-3, optimizer=None, start=0):
    """Steps start..stop-1 with AdamW on the adapters (the project's optimizer), step i on batch i of _batches()
    (cycling), so a resumed run sees what the whole one did; the losses and the optimizer."""
    optimizer = optimizer or make_optimizer(model, lr, 0.0)
    adapter, losses = adapt(model.train()), []  # from_pretrained returns a model in eval mode
    batches = _batches()
    for step in range(start, stop):
        ids = batches[step % len(batches)]
        loss = adapter.forward_loss({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, optimizer


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def qlora_trained(llama_bf16):
    torch.manual_seed(1)
    model = apply_lora(load_quantized(str(llama_bf16), torch.bfloat16), LORA)
    losses, _ = _train(model, 20)
    return model, losses


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
    assert quantized.tier_utils_source.quantized == {"compute_dtype": "bfloat16"}
    assert quantized.tier_utils_source.kwargs == {}  # the config object is not a recordable argument


def test_qlora_on_the_4bit_llama_trains_with_a_falling_loss(qlora_trained):
    model, losses = qlora_trained
    assert sum(losses[-5:]) / 5 < 0.92 * sum(losses[:5]) / 5, losses
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)  # peft's fp32 adapters
    assert len(quantized_layers(model)) == 14  # still 4-bit under the adapters


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


def test_the_adapter_folder_over_a_freshly_quantised_base_gives_the_same_logits(qlora_trained, llama_bf16, tmp_path):
    from peft import PeftModel

    model, _ = qlora_trained
    model.save_pretrained(tmp_path / "adapter")  # what save_hf writes for a LoRA model
    expected = _logits(model)
    fresh = PeftModel.from_pretrained(load_quantized(str(llama_bf16), torch.bfloat16), tmp_path / "adapter")
    torch.testing.assert_close(_logits(fresh), expected, atol=1e-4, rtol=0)
    again = load_quantized(str(tmp_path / "adapter"), torch.bfloat16)  # the folder's base, quantised, + adapters
    assert len(quantized_layers(again)) == 14
    torch.testing.assert_close(_logits(again), expected, atol=1e-4, rtol=0)


def test_the_merged_model_is_plain_bf16_and_loads_in_plain_transformers(llama_bf16, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = apply_lora(load_quantized(str(llama_bf16), torch.bfloat16), LORA)
    _train(model, 3, lr=1e-2)
    expected = _logits(model)
    merge_to_plain(model, torch.bfloat16).save_pretrained(tmp_path / "merged")
    assert "quantization_config" not in (tmp_path / "merged" / "config.json").read_text()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert not quantized_layers(merged) and not any("lora" in n for n, _ in merged.named_parameters())
    assert {p.dtype for p in merged.parameters()} == {torch.bfloat16}
    # The same function up to bf16 rounding: the 4-bit base computed in bf16, against its dequantised copy.
    assert (_logits(merged) - expected).abs().max() < 0.1


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


def test_qlora_on_a_hand_written_model_file_quantises_its_block_linears_and_trains(tmp_path):
    (tmp_path / "gpt.py").write_text(MODEL_FILE)
    torch.manual_seed(0)
    model = load_quantized(f"{tmp_path}/gpt.py:GPT", torch.float32)
    assert sorted(quantized_layers(model)) == [f"blocks.{i}.{n}" for i in range(2) for n in ("down", "up")]
    assert type(model.head) is nn.Linear and model.head.weight is model.emb.weight  # the tied head stays
    assert model.tier_utils_source.quantized == {"compute_dtype": "float32"}
    model = apply_lora(model, LoraSettings(r=8, alpha=16, targets=("up", "down")))
    adapter = adapt(model.train())
    losses = []
    optimizer = make_optimizer(model, 1e-2, 0.0)
    for ids in _batches(n=1) * 20:
        loss = adapter.forward_loss({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})[0]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses


def test_a_qlora_checkpoint_holds_the_adapters_only_and_resumes_bitwise(llama_bf16):
    def fresh():
        torch.manual_seed(1)
        return apply_lora(load_quantized(str(llama_bf16), torch.bfloat16), LORA)

    whole = fresh()
    _train(whole, 6)
    cut = fresh()
    _, optimizer = _train(cut, 3)
    state = {"model": model_state(cut), "optimizer": optimizer.state_dict()}
    assert state["model"] and all("lora_" in k for k in state["model"])  # no 4-bit base in it
    require_adapters(cut)  # a QLoRA model passes; the bare 4-bit base would be written whole, so it is refused:
    with pytest.raises(QuantizationError, match="no LoRA adapters"):
        require_adapters(load_quantized(str(llama_bf16), torch.bfloat16))
    assert all(t.dtype == torch.float32 for t in state["model"].values())
    resumed = fresh()  # a new process's model: quantised again from the folder, adapters from the checkpoint
    load_model_state(resumed, state["model"])
    optimizer = make_optimizer(resumed, 3e-3, 0.0)
    optimizer.load_state_dict(state["optimizer"])
    _train(resumed, 6, optimizer=optimizer, start=3)
    for name, tensor in model_state(whole).items():
        assert torch.equal(tensor, model_state(resumed)[name]), name


class _NoLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)


def test_a_model_with_no_linear_layer_is_refused_in_one_line():
    with pytest.raises(QuantizationError, match="no nn.Linear layer to quantise") as exc:
        quantize_linears(_NoLinear(), torch.float32)
    assert "\n" not in str(exc.value)


def test_without_bitsandbytes_the_line_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    with pytest.raises(QuantizationError, match=r"pip install 'tier_utils\[qlora\]'") as exc:
        require_bitsandbytes("QLoRA (bits=4)")
    assert str(exc.value).startswith("QLoRA (bits=4) needs bitsandbytes") and "\n" not in str(exc.value)


def test_smoke_and_analysis_run_the_4bit_model_as_loaded_and_name_it(llama_bf16):
    import tier_utils as tu

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
