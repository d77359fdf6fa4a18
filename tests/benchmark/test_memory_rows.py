"""The benchmark's memory rows (issue 42: "a QLoRA row beside LoRA and the full fine-tune"): BenchConfig.memory_rows
adds, beside the precisions' full fine-tune, a row per memory setting in the precision auto picks here, measured
like the others and judged against the fp32 baseline; the caller's model comes back as it was."""
import json
import sys

import pytest
import torch
import torch.nn as nn
from matplotlib.figure import Figure
from tiny import TINY_ARGS, tiny

from tier_utils.adapter.adapter import adapt
from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.benchmark.config import BenchConfig
from tier_utils.benchmark.memory_rows import memory_row_plans
from tier_utils.cli import main
from tier_utils.core.precision import resolve_precision

pytest.importorskip("peft")

CPU = torch.device("cpu")
QUICK = dict(precisions=("fp32",), batch_size=4, seq_len=16, untimed_steps=0, timed_steps=1, repeats=1,
             eval_batches=1, progress=False, device="cpu")


def _has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny step on a shared CPU: one thread keeps it quick and its timings sane
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def caller_model():
    return tiny(seed=0)


@pytest.fixture(scope="module")
def caller_before(caller_model):
    return {k: v.clone() for k, v in caller_model.state_dict().items()}, [type(m) for m in caller_model.modules()]


@pytest.fixture(scope="module")
def rows_run(one_thread, caller_model, caller_before):
    return amp_benchmark(caller_model, None, memory_rows="lora,qlora,adamw8bit", accuracy_steps=3, **QUICK)


def _rows(result) -> dict:
    return {r.memory_row: r for r in result.records if r.memory_row is not None}


def test_each_memory_row_is_there_named_in_autos_precision(rows_run):
    rows = _rows(rows_run)
    assert list(rows) == ["lora", "qlora", "adamw8bit"]
    auto = resolve_precision("auto", CPU, warn=False).name
    assert {r.precision for r in rows.values()} == {auto}
    assert {r.mode for r in rows.values()} == {"eager+lora", "eager+qlora", "eager+adamw8bit"}
    assert rows["lora"].memory_settings["describe"].startswith("LoRA r=8 over a ")
    assert rows["qlora"].memory_settings["base_bits"] == 4 and "QLoRA" in rows["qlora"].memory_settings["describe"]
    assert "AdamW8bit" in rows["adamw8bit"].memory_settings["describe"]
    table = rows_run.table.set_index("mode")
    assert table.loc["eager+qlora", "memory_settings"] == rows["qlora"].memory_settings["describe"]
    assert len(rows_run.overview().columns) <= 12


def _static(record) -> int:
    m = record.memory
    return m["weights_bytes"] + m["grads_bytes"] + m["optimizer_state_bytes"]


def test_the_lora_row_holds_fewer_static_bytes_than_the_full_fine_tune_and_is_judged_so(rows_run):
    full, rows = rows_run.records[0], _rows(rows_run)
    assert full.memory_row is None and full.precision == "fp32"
    assert _static(rows["lora"]) < _static(full)
    assert rows["lora"].memory["grads_bytes"] < 0.5 * full.memory["grads_bytes"]  # the adapters only train
    checks = {(c.mode, c.check): c for c in rows_run.checks}
    static = checks[("eager+lora", "static memory vs fp32")]
    assert static.status == "PASS" and static.value > 0 and "MiB vs fp32's" in static.detail
    # Adapters train a small share of the weights: a gap to the full fine-tune is a figure (never FAIL).
    assert checks[("eager+lora", "loss-curve parity")].status in ("PASS", "WARN")
    assert ("eager+lora", "speedup vs fp32") not in checks  # a memory setting buys bytes: its speed is a figure
    assert len(rows["lora"].accuracy["loss_curve"]) == 3 and rows["lora"].speed.speedup is not None
    if _has_bitsandbytes():
        assert rows["qlora"].ran and rows["qlora"].memory["weights_bytes"] < rows["lora"].memory["weights_bytes"]
        # What the 4-bit base costs apart from LoRA's own cost: QLoRA's curve against LoRA's too.
        assert rows["qlora"].accuracy["parity_vs_row"]["row"] == "lora"
        qlora_parity = checks[("eager+qlora", "loss-curve parity")]  # judged against LoRA: the 4-bit base's cost
        assert qlora_parity.detail.startswith("vs the lora row (the 16-bit base): max relative deviation")
        assert qlora_parity.value == pytest.approx(rows["qlora"].accuracy["parity_vs_row"]["max_rel_dev"], abs=1e-4)
        assert "parity_vs_row" not in rows["lora"].accuracy
    answer = rows_run.answer()
    assert " · memory rows in " in answer and "lora " in answer and "× static memory" in answer
    assert "qlora (QLoRA r=8" in rows_run.summary_line()
    assert isinstance(rows_run.plot(), Figure)


def test_the_callers_model_comes_back_unchanged(rows_run, caller_model, caller_before):
    state, types = caller_before
    after = caller_model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], state[k]) for k in state)
    assert [type(m) for m in caller_model.modules()] == types  # no Linear4bit, no LoRA layer left behind
    assert not hasattr(caller_model, "peft_config") and not [k for k in vars(caller_model) if "tier_utils" in k]
    assert all(p.requires_grad and p.dtype == torch.float32 for p in caller_model.parameters())


def test_without_bitsandbytes_the_qlora_row_is_skipped_naming_the_extra(one_thread, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    result = amp_benchmark(tiny(seed=0), None, memory_rows="qlora", accuracy_steps=0, **QUICK)
    row = _rows(result)["qlora"]
    assert not row.ran and row.speed is None
    skipped = [c for c in result.checks if c.mode == "eager+qlora"]
    assert {c.status for c in skipped} == {"SKIP"} and len(skipped) == 3
    assert all("pip install 'tier_utils[qlora]'" in c.detail and "\n" not in c.detail for c in skipped)
    assert "qlora skipped" in result.answer() and result.status != "FAIL"


class NoLinear(nn.Module):
    """A language model without one nn.Linear: an embedding, a mixing Conv1d, logits against the embedding."""

    def __init__(self, vocab=256, width=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mix = nn.Conv1d(width, width, 1)

    def forward(self, input_ids):
        h = self.mix(self.embed(input_ids).transpose(1, 2)).transpose(1, 2)
        return h @ self.embed.weight.T


def test_qlora_on_a_model_without_linear_layers_is_skipped_with_the_reason():
    pytest.importorskip("bitsandbytes")
    (plan, why), = memory_row_plans(adapt(NoLinear(), vocab_size=256, max_len=32), BenchConfig(memory_rows="qlora"),
                                    CPU)
    assert plan.memory_row == "qlora" and plan.start is None
    assert "no nn.Linear layer to quantise" in why and why.startswith("QLoRA r=8 over a 4-bit NF4 base")
    assert "\n" not in why


@pytest.mark.parametrize("given, match", [
    (dict(memory_rows="lora,qlor"), r"unknown memory_rows 'qlor'; choose from: lora, qlora, adamw8bit"),
    (dict(memory_rows=("lora",), memory="lora"), "memory_rows are judged against the full fine-tune"),
    (dict(memory_rows="qlora", compile="on"), "memory_rows run eager"),
    (dict(memory_rows=3), "memory_rows must be names"),
])
def test_bad_memory_rows_are_one_line(given, match):
    with pytest.raises(ValueError, match=match) as exc:
        BenchConfig(**given)
    assert "\n" not in str(exc.value)


def test_cli_bench_memory_rows(one_thread, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["bench", "--memory-rows", "qlor", "--no-progress", *TINY_ARGS]) == 2
    err = capsys.readouterr().err
    assert "memory_rows 'qlor'" in err and err.count("\n") == 1
    code = main(["bench", "--precisions", "fp32", "--memory-rows", "lora", "--batch-size", "4", "--seq-len", "16",
                 "--untimed-steps", "0", "--timed-steps", "1", "--repeats", "1", "--accuracy-steps", "0",
                 "--no-progress", "--json", str(out), *TINY_ARGS])
    doc = json.loads(out.read_text())
    assert code == (1 if doc["status"] == "FAIL" else 0) and doc["config"]["memory_rows"] == ["lora"]
    row = next(r for r in doc["precisions"] if r["memory_row"] == "lora")
    assert row["ran"] and row["memory_settings"]["describe"].startswith("LoRA r=8")
    assert " · memory rows in " in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_each_rows_peak_is_its_own():
    """The other rows' model copies and the shared start are resident the whole run: a row's peak is the device's
    less what the run holds beside its model, so it holds at least its own static bytes, and QLoRA's is below
    the fp32 full fine-tune's."""
    pytest.importorskip("bitsandbytes")
    from tier_utils.models.loading import load_model

    torch.manual_seed(0)
    llama = load_model("hf:LlamaForCausalLM", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, vocab_size=256)
    result = amp_benchmark(llama, None, memory_rows="lora,qlora", accuracy_steps=0,
                           **{**QUICK, "device": "cuda", "seq_len": 32})
    ran = [r for r in result.records if r.speed is not None]
    assert {r.memory_row for r in ran} == {None, "lora", "qlora"}
    for r in ran:
        assert r.memory["peak_allocated_bytes"] >= _static(r), (r.mode, r.memory)
    assert _rows(result)["qlora"].memory["peak_allocated_bytes"] < result.records[0].memory["peak_allocated_bytes"]
