"""The fit planner: its largest batch against a bisection under the same budget, checkpointing, CLI."""
import json
import re

import pandas as pd
import pytest
import torch
import torch.nn as nn
from tiny import TINY_ARGS

from tier_utils import TinyGPT
from tier_utils.adapter.adapter import adapt
from tier_utils.cli import main
from tier_utils.core.budget import FREE_MEMORY_ENV
from tier_utils.core.measure import SavedTensorMeter, static_memory
from tier_utils.core.precision import resolve_precision
from tier_utils.engine.activation_checkpointing import checkpointed
from tier_utils.engine.step import TrainStep, make_optimizer
from tier_utils.planning.planner import GPU_COLUMNS, FitConfig, device_room, fit, static_bytes
from tier_utils.planning.validation import bisect_batch
from tier_utils.tasks import task_named

T = 64
MODEL = dict(d_model=32, n_layer=3, n_head=2, max_len=T)


def _step_bytes(adapter, precision: str, batch: int) -> int:
    """A real training step at (batch, T), counted where the planner predicts: static bytes after the step
    (AdamW's state exists then), activations saved during its forward, the output's gradient."""
    adapter.model.zero_grad(set_to_none=True)
    optimizer = make_optimizer(adapter.model, 1e-3, 0.1)
    step = TrainStep(adapter, resolve_precision(precision, "cpu", warn=False), optimizer)
    example = adapter.example_batch(batch, T)
    with SavedTensorMeter(adapter.model) as meter:
        step([example])
    output = 4 * batch * T * adapter.vocab_size
    return sum(static_memory(adapter.model, optimizer).values()) + meter.bytes + output


def test_largest_batch_agrees_with_a_bisection_under_the_same_injected_budget(monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    monkeypatch.setenv(FREE_MEMORY_ENV, "120MiB")  # a safe share of 60 MiB: batches in the tens
    result = fit(model, seq_len=T, precisions="fp32,bf16", lora=0, optimizers="adamw", device="cpu", progress=False)
    room = device_room(result.budget)
    assert room == 60 * 2**20
    table = result.table.set_index(["precision", "checkpointing"])
    adapter = adapt(model)
    for precision in ("fp32", "bf16"):
        planned = table.loc[(precision, "off"), "this_device"]
        found = bisect_batch(lambda b, p=precision: _step_bytes(adapter, p, b) <= room, 1)
        assert 10 <= found and abs(planned - found) <= max(1, 0.02 * found), (precision, planned, found)
        assert table.loc[(precision, "on"), "this_device"] > planned  # checkpointing fits more
    assert (table.status == "PASS").all()
    assert (table[next(iter(GPU_COLUMNS))] > table.this_device).all()  # 15 GB holds more than 60 MiB


def test_static_bytes_match_a_real_adamw_step_without_allocating_one():
    model = TinyGPT(**MODEL)
    optimizer = make_optimizer(model, 1e-3, 0.1)
    model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    optimizer.step()
    assert static_bytes(model) == static_memory(model, optimizer)


def test_checkpointing_wraps_the_repeated_blocks_and_gives_them_back():
    model = TinyGPT(**MODEL)
    with checkpointed(model) as blocks:
        assert len(blocks) == MODEL["n_layer"] and all("forward" in vars(b) for b in blocks)
        out = model(torch.zeros(2, 8, dtype=torch.long))
        out.sum().backward()  # the recompute runs
    assert not any("forward" in vars(b) for b in model.blocks)
    assert all(p.grad is not None for p in model.parameters())


def test_nothing_fits_is_a_warn_row_and_a_model_without_blocks_gets_no_checkpointing_rows(monkeypatch):
    monkeypatch.setenv(FREE_MEMORY_ENV, "64KiB")
    plain = nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 256))
    plain.task, plain.max_len = task_named("causal-lm"), 32
    result = fit(plain, precisions="fp32", optimizers="adamw", device="cpu", progress=False)
    row = result.full_table().iloc[0]
    assert list(result.table.checkpointing) == ["off", "off"]  # fp32, and LoRA over it
    assert row.this_device == 0 and row.status == "WARN" and "; not even batch 1 fits at T=32" in row.detail
    assert result.cheapest()["this_device"] is None and "cheapest mode that fits here none fits" in \
        result.summary_line()


def test_seq_len_is_a_setting_and_model_kwargs_build_the_model():
    # seq_len was fit's second positional argument; now it is a FitConfig field like the rest.
    with pytest.raises(ValueError, match="config must be a FitConfig or a dict, got int"):
        fit("tiny-gpt", 16)
    with pytest.raises(ValueError, match=r"unknown fit setting\(s\) d_model; valid: batch_size, seq_len, target_len, "
                                         "precisions"):
        fit("tiny-gpt", d_model=32)
    config = FitConfig(seq_len=16, precisions="fp32", checkpointing=False, lora=None, optimizers="adamw", device="cpu",
                       progress=False)
    result = fit("tiny-gpt", config, model_kwargs={**MODEL, "n_layer": 1})
    built = TinyGPT(**{**MODEL, "n_layer": 1})
    assert result.seq_len == 16 and result.model["parameters"] == sum(p.numel() for p in built.parameters())
    assert [(c.precision, c.checkpointing) for c in result.configs] == [("fp32", False)]


def test_cli_fit_prints_every_mode_with_whole_batches_in_100_columns_and_writes_json_and_csv(tmp_path, capsys,
                                                                                              monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "")  # no native bf16/fp16: the true modes are SKIP rows (no batch)
    code = main(["fit", *TINY_ARGS, "--model-arg", "n_layer=2", "--seq-len", "16", "--precisions", "bf16,bf16-true",
                 "--optimizers", "adamw", "--no-progress", "--json", str(tmp_path / "fit.json")])
    out = capsys.readouterr().out
    assert code == 0 and "predicted" in out and "for the CUDA context" in out
    assert max(len(line) for line in out.splitlines() if not line.startswith("every column")) <= 100  # not the path
    # LoRA over the base each fp32-weight mode computes in, and QLoRA's 4-bit base under bf16
    modes = ["fp32", "fp32 + checkpointing", "bf16", "bf16 + checkpointing", "bf16-true", "bf16-true + checkpointing",
             "LoRA r=8 · fp32 base · fp32", "LoRA r=8 · fp32 base · fp32 + checkpointing",
             "LoRA r=8 · bf16 base · bf16", "LoRA r=8 · bf16 base · bf16 + checkpointing",
             "QLoRA r=8 · nf4 base · bf16", "QLoRA r=8 · nf4 base · bf16 + checkpointing"]
    rows = [line for line in out.splitlines() if any(line.startswith(m + " ") for m in modes)]
    assert len(rows) == 2 * len(modes)  # the table here and the GPUs' table, each row naming its mode
    assert not re.search(r"\d\.\d+e[+-]\d+|\d\.0\b", "\n".join(rows))  # no 1.193e+04, no 12.0: whole batches
    skip = next(r for r in rows if r.startswith("bf16-true ") and "SKIP" in r)
    assert skip.split()[-2:] == ["-", "-"]  # no batch here, none validated
    data = json.loads((tmp_path / "fit.json").read_text())
    assert [r["mode"] for r in data["table"]] == modes  # fp32, the baseline, always; LoRA over each
    assert "T4 16 GB" in " ".join(out.split()[-60:])  # the cheapest mode on each card, the T4's included
    assert data["budget"]["device"] == "cpu" and data["seq_len"] == 16
    assert data["table"][4]["this_device"] is None and isinstance(data["table"][0]["this_device"], int)
    csv = pd.read_csv(tmp_path / "fit.csv")
    assert list(csv["mode"]) == modes and "detail" in csv.columns and "validation" in csv.columns


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_prediction_is_validated_by_bisection():
    torch.manual_seed(0)
    result = fit(TinyGPT(d_model=256, n_layer=4, n_head=4, max_len=1024), seq_len=1024, precisions="fp32,bf16",
                 lora=0, optimizers="adamw", device="cuda", validate="all", progress=False)
    table = result.full_table()
    assert table.validated.notna().all()
    for r in table.itertuples():  # predicted within 25 % of what really ran (bench/RESULTS.md: GPT-2-small)
        assert abs(r.this_device - r.validated) <= 0.25 * r.validated, r


def test_fit_names_the_cheapest_mode_that_fits_each_device_at_the_batch_asked(monkeypatch):
    """Every mode planned at the user's batch and length; under an injected budget where no mode without
    checkpointing fits here, the cheapest that does is the native mixed one with checkpointing; the GPUs
    (predicted) follow their hardware rule: fp16 on a T4 (no bf16 tensor cores), bf16 from an L4 up."""
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    free = fit(model, batch_size=16, seq_len=T, optimizers="adamw", device="cpu", progress=False)
    need = {c.name: c.step_bytes(16, T) for c in free.configs}
    # 5 precisions, LoRA under fp32, bf16 and fp16, QLoRA under bf16 and fp16, each with and without checkpointing
    assert len(need) == 20
    # Room for bf16 with checkpointing, less than any mixed mode without it: it is the cheapest (the true modes,
    # half the static bytes, may fit too, but cost rounded-away updates).
    room = need["bf16 + checkpointing"]
    assert room < min(need[k] for k in ("fp32", "bf16", "fp16"))
    monkeypatch.setenv(FREE_MEMORY_ENV, str(2 * room + 2))  # the safe share is half
    result = fit(model, batch_size=16, seq_len=T, optimizers="adamw", device="cpu", progress=False)
    cheapest = {k: c.name for k, c in result.cheapest().items()}
    assert cheapest["this_device"] == "bf16 + checkpointing"
    assert cheapest["T4 16 GB (predicted)"] == "fp16" and cheapest["H100 80 GB (predicted)"] == "bf16"
    table = result.table
    assert len(table.columns) <= 12 and table.index.name == "mode"
    assert table.loc["bf16 + checkpointing", "cheapest_on"] == "this_device"
    assert table.loc["bf16", "status"] == "WARN" and table.loc["bf16 + checkpointing", "status"] == "PASS"
    assert "fit at B=16, T=64: cheapest mode that fits here bf16 + checkpointing (predicted" in result.summary_line()
    assert "T4 16 GB fp16" in result.summary_line()
    fig = result.plot()  # one bar per mode per device, and the batch asked as a line
    assert len(fig.axes[0].patches) == len(table) * (1 + len(GPU_COLUMNS))
    assert result.to_json()["cheapest"]["this_device"] == "bf16 + checkpointing"


def test_cost_rank_orders_modes_by_what_they_cost_then_speed():
    """Plain mixed, then checkpointing, then true modes, then LoRA; within one, a native 2-byte compute before
    fp32 before an emulated one, bf16 (no scaler) before fp16."""
    from tier_utils.core.budget import ActivationFit
    from tier_utils.core.device import GPU_PROFILES, predicted_facts
    from tier_utils.core.memory_settings import DecidedMemory, LoraSettings, MemorySettings
    from tier_utils.planning.planner import ModeRow, cost_rank

    nothing = ActivationFit(0, 0, 0, 0, ())
    cpu = torch.device("cpu")

    def config(name, ck=False, memory=None):
        return ModeRow(name, ck, 0, nothing, 0.0, memory=memory, mode=resolve_precision(name, cpu, warn=False))

    lora = DecidedMemory(MemorySettings(lora=LoraSettings()), torch.bfloat16, "")
    eight_bit = DecidedMemory(MemorySettings(lora=LoraSettings(), optimizer="adamw8bit"), torch.bfloat16, "")
    modes = [config("bf16"), config("fp16"), config("fp32"), config("bf16", True), config("bf16-true"),
             config("bf16-true", True), config("bf16", memory=lora), config("bf16", memory=eight_bit)]
    l4, t4 = predicted_facts(GPU_PROFILES["L4"]), predicted_facts(GPU_PROFILES["T4"])  # bf16 native; emulated
    assert sorted(modes, key=lambda c: cost_rank(c, l4)) == modes
    assert cost_rank(config("fp32"), t4) < cost_rank(config("bf16"), t4)  # emulated bf16: fp32 first


def test_fit_csv_holds_every_column_the_page_cuts(tmp_path):
    import pandas as pd

    from tier_utils.report import write_report

    result = fit("tiny-gpt", model_kwargs=MODEL, seq_len=16, precisions="fp32", optimizers="adamw", device="cpu",
                 progress=False)
    write_report({"fit": result}, tmp_path)
    csv = pd.read_csv(tmp_path / "fit.csv")
    assert list(csv.columns[:2]) == ["mode", "precision"] and {"static_gib", "detail"} <= set(csv.columns)
    assert len(csv) == len(result.table) == 4
