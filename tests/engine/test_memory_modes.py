"""Memory modes (issue 32): activation checkpointing and LoRA through peft, in train, the planner, the benchmark
and the CLI; a tiny HF Llama folder with its own BPE tokenizer, made here, for LoRA's round trips."""
import os

import pytest
import torch
import torch.nn as nn

from tier_utils import TinyGPT, load_model, train
from tier_utils.adapter.adapter import adapt
from tier_utils.cli import main
from tier_utils.core.budget import FREE_MEMORY_ENV
from tier_utils.core.errors import LoraError, NoRepeatedBlocks
from tier_utils.core.measure import SavedTensorMeter, static_memory
from tier_utils.core.memory_settings import DecidedMemory, MemorySettings
from tier_utils.core.precision import resolve_precision
from tier_utils.engine.activation_checkpointing import checkpointed, repeated_blocks
from tier_utils.engine.lora import LoraSettings, apply_lora, lora_setting, lora_static_bytes
from tier_utils.engine.step import TrainStep, make_optimizer
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.planning.planner import device_room, fit, static_bytes
from tier_utils.planning.validation import bisect_batch
from tier_utils.tasks import task_named

pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TWO = dict(d_model=32, n_layer=2, n_head=2, max_len=32)  # two blocks: something to checkpoint
RUN = dict(batch_size=4, seq_len=32, eval_batches=1, progress=False, device="cpu", precision="fp32")
LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def _losses(result) -> list[float]:
    return result.history.train_loss.dropna().tolist()


# -- activation checkpointing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,kwargs", [("tiny-gpt", dict(TWO, dropout=0.1)),
                                         ("hf:LlamaForCausalLM", dict(LLAMA, vocab_size=256))])
def test_checkpointing_leaves_the_fp32_loss_curve_unchanged(spec, kwargs):
    runs = []
    for on in (False, True):
        torch.manual_seed(0)
        result = train(load_model(spec, **kwargs), None, max_steps=5, eval_every=0,
                       memory=MemorySettings(checkpointing=on), seed=3, **RUN)
        runs.append(result)
    plain, ck = (_losses(r) for r in runs)
    assert len(plain) >= 5 and plain == pytest.approx(ck, rel=1e-6)
    assert runs[0].summary.activation_checkpointing is None
    assert runs[1].summary.activation_checkpointing.startswith("2 blocks")
    assert not any("forward" in vars(b) for b in repeated_blocks(runs[1].model))  # the model comes back as it was


def test_checkpointing_a_t5_turns_its_caches_off_without_transformers_notice_and_undo_puts_them_back(caplog):
    """T5's decoder stack reads its own copy of the config: with its use_cache on, transformers logs "`use_cache=True`
    is incompatible with gradient checkpointing" (a red line in a notebook) from the fit cell and from `all`."""

    import transformers

    from tier_utils.engine.activation_checkpointing import enable_checkpointing

    model = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2, decoder_start_token_id=0)).train()
    transformers.utils.logging.warning_once.cache_clear()  # said once per process: an earlier test may have said it
    logger = transformers.utils.logging.get_logger("transformers")
    logger.addHandler(caplog.handler)  # transformers' loggers don't propagate to the root, where caplog listens
    try:
        on = enable_checkpointing(model)
        ids = torch.randint(1, 60, (2, 8), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        logger.removeHandler(caplog.handler)
    assert not [r for r in caplog.records if "use_cache" in r.getMessage()], caplog.text
    assert model.config.use_cache is False and model.decoder.config.use_cache is False
    on.undo()
    assert model.config.use_cache is True and model.decoder.config.use_cache is True  # the user's, as it came


def test_checkpointing_saves_fewer_activation_bytes():
    model = TinyGPT(**TWO)
    batch = adapt(model).example_batch(4, 32)
    saved = []
    for on in (False, True):
        with SavedTensorMeter(model) as meter, checkpointed(model, meter) if on else torch.enable_grad():
            adapt(model).forward_loss(batch)[0].backward()
        saved.append(meter.bytes)
    assert saved[1] < 0.6 * saved[0]


def _checkpointed_step_bytes(adapter, batch: int, length: int) -> int:
    """A real training step with checkpointing at (batch, length), counted where the planner predicts: static bytes
    after the step, what the checkpointed forward keeps (block inputs included), the output's gradient, and one
    block's activations as its recompute holds them (measured: what block 0 saves without checkpointing, less its
    input, which checkpointing already keeps)."""
    adapter.model.zero_grad(set_to_none=True)
    optimizer = make_optimizer(adapter.model, 1e-3, 0.1)
    step = TrainStep(adapter, resolve_precision("fp32", "cpu", warn=False), optimizer)
    example = adapter.example_batch(batch, length)
    with SavedTensorMeter(adapter.model) as meter, checkpointed(adapter.model, meter):
        step([example])
    first = repeated_blocks(adapter.model)[0]
    marks = []

    def before(_module, args):
        block_meter.add(args[0])  # kept by checkpointing anyway: not part of the recompute
        marks.append(block_meter.bytes)

    hooks = [first.register_forward_pre_hook(before), first.register_forward_hook(lambda *_: marks.append(
        block_meter.bytes))]
    with SavedTensorMeter(adapter.model) as block_meter:
        adapter.forward_loss(example)
    for h in hooks:
        h.remove()
    output = 4 * batch * length * adapter.vocab_size
    return sum(static_memory(adapter.model, optimizer).values()) + meter.bytes + output + (marks[1] - marks[0])


@pytest.mark.slow  # real checkpointed steps at every batch the bisection tries
def test_planner_with_checkpointing_agrees_with_a_bisection_under_an_injected_budget(monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layer=3, n_head=2, max_len=64)
    monkeypatch.setenv(FREE_MEMORY_ENV, "120MiB")
    result = fit(model, seq_len=64, precisions="fp32", lora=0, optimizers="adamw", device="cpu", progress=False)
    room = device_room(result.budget)
    planned = result.table.set_index("checkpointing").loc["on", "this_device"]
    adapter = adapt(model)
    found = bisect_batch(lambda b: _checkpointed_step_bytes(adapter, b, 64) <= room, 1)
    assert 10 <= found and abs(planned - found) <= max(1, 0.02 * found), (planned, found)


def test_bf16_with_checkpointing_fits_more_than_without():
    # Issue 32: the planner took autocast's batch-independent weight copies as per-sequence recompute bytes, so
    # bf16 with checkpointing looked smaller (13.5k) than without (15.8k) on the default model at T=64.
    result = fit("tiny-gpt", seq_len=64, precisions="bf16", lora=0, optimizers="adamw", device="cpu",
                 progress=False)
    table = result.table[result.table.precision == "bf16"].set_index("checkpointing")
    assert table.loc["on", "this_device"] > table.loc["off", "this_device"]


def test_a_model_without_repeated_blocks_is_refused():
    plain = nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 256))
    plain.task, plain.max_len = task_named("causal-lm"), 32
    with pytest.raises(NoRepeatedBlocks, match="drop activation_checkpointing"):
        train(plain, None, max_steps=1, memory=MemorySettings(checkpointing=True), **RUN)


@pytest.mark.parametrize("args,needle", [
    (["--checkpointing", "--model-arg", "n_layer=1"], "has none; drop activation_checkpointing"),
    (["--lora", "r=0"], "r must be a whole number >= 1"),
    (["--lora", "r=4,targets=q_proj"], "matches no linear layer of TinyGPT; its linear layers: attn.qkv, attn.proj"),
    (["--merge"], "give lora and save_hf too"),
])
def test_cli_bad_memory_settings_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--max-steps", "1", "--model-arg", "d_model=32", "--model-arg",
                 "n_head=2", "--device", "cpu", "--no-progress", "--json", str(tmp_path / "s.json"), *args]) \
        if args[0] != "--lora" or "=0" not in args[1] else None
    if code is None:  # argparse's own error: a SystemExit
        with pytest.raises(SystemExit) as exc:
            main(["train", "--out", str(out), *args])
        code = exc.value.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("warning")]
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not out.exists() and not (tmp_path / "s.json").exists()


# -- LoRA ---------------------------------------------------------------------------------------------------------
def test_lora_settings_parse_and_refuse():
    assert LoraSettings.parse("r=4,alpha=8,targets=q_proj,v_proj") == LoraSettings(4, 8.0, 0.0, ("q_proj", "v_proj"))
    assert lora_setting(8) == LoraSettings(r=8, alpha=16) and lora_setting(0) is None and lora_setting("off") is None
    for bad in ("r=0", "r=4,beta=2", "alpha=-1", "dropout=1"):
        with pytest.raises(LoraError):
            lora_setting(bad)


@pytest.mark.parametrize("spec,kwargs", [("tiny-gpt", TWO), ("hf:LlamaForCausalLM", dict(LLAMA, vocab_size=256)),
                                         ("hf:GPT2LMHeadModel", dict(vocab_size=256, n_embd=32, n_layer=2, n_head=2,
                                                                     n_positions=32))])  # Conv1D, not nn.Linear
def test_lora_static_bytes_are_those_of_the_wrapped_model(spec, kwargs):
    model = load_model(spec, **kwargs)
    settings = LoraSettings(r=4, alpha=8)
    fp32_base = DecidedMemory(MemorySettings(lora=settings), torch.float32, "test")
    predicted = lora_static_bytes(model, fp32_base)
    wrapped = apply_lora(model, settings)
    assert predicted == static_bytes(wrapped)
    trainable = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(p.dtype == torch.float32 for p in wrapped.parameters() if p.requires_grad)


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    """A tiny Llama with its own BPE tokenizer (trained on the bundled corpus), as save_pretrained writes it."""
    from real import bpe_tokenizer

    folder = tmp_path_factory.mktemp("llama")
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    load_model("hf:LlamaForCausalLM", vocab_size=len(tokenizer), **LLAMA).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


LORA_RUN = dict(batch_size=4, seq_len=32, eval_every=3, eval_batches=1, progress=False, device="cpu",
                precision="fp32", memory=MemorySettings(lora=LoraSettings(r=4, alpha=8)), seed=1)


@pytest.mark.slow  # peft over a transformers Llama, trained, saved and resumed
def test_lora_on_a_tiny_llama_trains_a_small_share_and_checkpoints_only_the_adapters(llama_folder, tmp_path):
    full = train(str(llama_folder), None, max_steps=2, checkpoint_dir=tmp_path / "full",
                 **{**LORA_RUN, "memory": MemorySettings()})
    lora = train(str(llama_folder), None, max_steps=6, checkpoint_dir=tmp_path / "lora", lr=1e-2, **LORA_RUN)
    info = lora.summary.lora
    assert info["trainable_share"] < 0.05 and info["base_dtype"] == "float32" and info["adapter_dtype"] == "float32"
    assert "self_attn.q_proj" in info["targets"] and "mlp.down_proj" in info["targets"]
    from transformers import AutoModelForCausalLM

    before = AutoModelForCausalLM.from_pretrained(llama_folder).state_dict()
    after = lora.model.get_base_model().state_dict()
    base = {k.replace(".base_layer", ""): v for k, v in after.items() if "lora_" not in k}
    assert base.keys() == before.keys() and all(torch.equal(base[k], before[k]) for k in before)  # frozen
    assert any(p.abs().sum() > 0 for n, p in lora.model.named_parameters() if "lora_B" in n)  # B starts at 0
    size = {name: (tmp_path / name / "last.pt").stat().st_size for name in ("full", "lora")}
    assert size["lora"] < 0.10 * size["full"], size
    assert set(load_checkpoint(tmp_path / "lora" / "last.pt")["model"]) == {
        n.replace(".default", "") for n, p in lora.model.named_parameters() if p.requires_grad}
    assert full.summary.lora is None
    again = load_model(str(tmp_path / "lora" / "last.pt")).eval()  # the base its spec rebuilds, with the adapters
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, lora.model.eval()(input_ids=ids).logits)


def test_lora_resume_is_exact(llama_folder, tmp_path):
    whole = train(str(llama_folder), None, max_steps=6, checkpoint_dir=tmp_path / "whole", **LORA_RUN)

    def stop(step, metrics):
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):  # dies at its first evaluation (step 3), after step 2's save
        train(str(llama_folder), None, max_steps=6, checkpoint_dir=tmp_path / "cut", checkpoint_every=2,
              on_eval=stop, **LORA_RUN)
    assert load_checkpoint(tmp_path / "cut" / "last.pt")["step"] == 2
    resumed = train(str(llama_folder), None, max_steps=6, checkpoint_dir=tmp_path / "cut", resume=True, **LORA_RUN)
    assert resumed.summary.resumed_from_step == 2
    final = [load_checkpoint(tmp_path / name / "last.pt")["model"] for name in ("whole", "cut")]
    assert final[0].keys() == final[1].keys()
    for name, tensor in final[0].items():
        assert torch.equal(tensor, final[1][name]), name
    assert _losses(whole)[-3:] == _losses(resumed)[-3:]


def test_lora_save_hf_is_peft_format_and_merge_loads_in_plain_transformers(llama_folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = dict(max_steps=3, lr=1e-2, **{**LORA_RUN, "eval_every": 0})
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    trained = train(str(llama_folder), None, save_hf=str(adapter_dir), **run).model.eval()
    assert (adapter_dir / "adapter_config.json").is_file() and not (adapter_dir / "config.json").exists()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(llama_folder)
        loaded = PeftModel.from_pretrained(base, adapter_dir).eval()
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        again = load_model(str(adapter_dir)).eval()  # load_model reads the adapter folder: base + adapter
        torch.testing.assert_close(again(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
    assert main(["train", "--model", str(llama_folder), "--out", str(tmp_path / "run"), "--max-steps", "3",
                 "--lr", "1e-2", "--batch-size", "4", "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1",
                 "--seed", "1", "--precision", "fp32", "--device", "cpu", "--lora", "r=4,alpha=8", "--save-hf",
                 str(merged_dir), "--merge", "--no-progress"]) == 0
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
        assert not any("lora" in n for n, _ in merged.named_parameters())
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)


# -- the benchmark and search ---------------------------------------------------------------------------------------
BENCH = dict(batch_size=4, seq_len=32, untimed_steps=1, timed_steps=2, repeats=2, accuracy_steps=3, eval_batches=1,
             progress=False, device="cpu")


@pytest.mark.slow  # a benchmark run per precision, with and without checkpointing
def test_bench_measures_checkpointing_against_the_same_precision_without_it():
    from tier_utils import amp_benchmark

    result = amp_benchmark(TinyGPT(**TWO, dropout=0.1), precisions="fp32", activation_checkpointing=True, **BENCH)
    plain, ck = result.records
    assert (plain.mode, plain.checkpointing, ck.mode, ck.checkpointing) == ("eager", False, "eager+checkpointing", True)
    assert ck.memory["activation_bytes"] < plain.memory["activation_bytes"]
    assert ck.vs_without["activation_bytes_without"] == plain.memory["activation_bytes"]
    assert ck.vs_without["step_time_ratio"] == pytest.approx(ck.speed.step_ms.median / plain.speed.step_ms.median)
    assert ck.accuracy["loss_curve"] == pytest.approx(plain.accuracy["loss_curve"], rel=1e-6)
    row = result.verdicts.set_index(["mode", "check"]).loc[("eager+checkpointing", "activation checkpointing")]
    assert row.status == "PASS" and "without checkpointing" in row.detail and "same precision" in row.detail
    assert list(result.table.checkpointing) == ["off", "on"]


def test_bench_trains_lora_in_every_precision_row_and_gives_the_model_back(monkeypatch):
    from tier_utils import amp_benchmark

    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")  # bf16 native here, whatever this CPU has
    model = TinyGPT(**TWO)
    names = [n for n, _ in model.named_parameters()]
    result = amp_benchmark(model, precisions="fp32,bf16", memory=MemorySettings(lora="r=4,alpha=8"), **BENCH)
    assert [r.precision for r in result.records if r.ran] == ["fp32", "bf16"]
    info = result.to_json()["config"]["lora_detail"]
    assert info["r"] == 4 and info["trainable_share"] < 0.1 and info["base_dtype"] == "float32"
    trainable = info["trainable_parameters"]
    for r in result.records:  # optimizer state for the adapters only: AdamW's two fp32 states and a step count
        assert r.memory["optimizer_state_bytes"] == 8 * trainable + 4 * 16
    assert [n for n, _ in model.named_parameters()] == names  # unloaded: the caller's module as it was


def test_search_trials_run_in_the_memory_modes():
    from tier_utils.tuning.study import search

    result = search(TinyGPT(**TWO), n_trials=1, max_steps=2, eval_every=1, eval_batches=1, batch_size=4, seq_len=32,
                    device="cpu", precision="fp32", memory=MemorySettings(lora=4, checkpointing=True),
                    space={"lr": ("log", 1e-3, 1e-2)})
    assert result.best_config.memory == MemorySettings(lora=LoraSettings(r=4, alpha=8), checkpointing=True)
    assert len(result.table) == 1 and result.table.state.iloc[0] == "COMPLETE"


def test_all_trains_and_benchmarks_in_the_memory_modes(tmp_path):
    import pandas as pd

    out = tmp_path / "report"
    code = main(["all", "--model-arg", "d_model=32", "--model-arg", "n_layer=2", "--model-arg", "n_head=2",
                 "--model-arg", "max_len=32", "--out", str(out), "--fast", "--no-progress", "--device", "cpu",
                 "--precision", "fp32", "--checkpointing", "--lora", "4"])
    assert code in (0, 1)
    trained = dict(pd.read_csv(out / "train.csv").values)
    assert trained["activation_checkpointing"].startswith("2 blocks") and trained["lora"].startswith("LoRA r=4")
    bench = pd.read_csv(out / "amp_benchmark.csv")
    assert "eager+checkpointing" in set(bench["mode"])
