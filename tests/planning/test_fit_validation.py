"""fit's validation: the recommended mode and fp32 by default ("all": every mode), a time cap after which rows
stay predicted, memory released after each probe, rows that say which figures were validated."""
import json

import pytest
import torch
from tiny import TINY_ARGS

from tier_utils import TinyGPT
from tier_utils.adapter.adapter import adapt
from tier_utils.cli import main
from tier_utils.planning import validation
from tier_utils.planning.planner import FitConfig, fit

MODEL = dict(d_model=16, n_layer=2, n_head=2, max_len=16)


@pytest.fixture
def fake_steps(monkeypatch):
    """A step runs up to batch 40; each call recorded as (mode, batch); what each probe released counted."""
    calls, released = [], []
    monkeypatch.setattr(validation, "step_runs", lambda adapter, c, b, length: calls.append((c.name, b)) or b <= 40)
    monkeypatch.setattr(validation, "_release", lambda device: released.append(device))
    return calls, released


def _fit(**settings):
    torch.manual_seed(0)
    settings.setdefault("optimizers", "adamw")  # 8-bit optimizer rows: test_8bit_optimizer_rows_stay_predicted
    return fit(TinyGPT(**MODEL), seq_len=16, precisions="fp32,bf16", device="cpu", progress=False, **settings)


def test_by_default_validation_runs_the_recommended_mode_and_fp32_only(fake_steps):
    calls, released = fake_steps
    result = _fit(validate=True)
    recommended = result.cheapest()["this_device"].name
    assert set(result.validation.found) == {recommended, "fp32"} == {m for m, _ in calls}
    assert all(b == 40 for b in result.validation.found.values()) and len(released) == 1  # at the end
    table = result.full_table().set_index("mode")
    assert table.loc["fp32", "validation"] == "largest batch validated: 40 ran a step"
    assert table.loc["LoRA r=8 · fp32 base · fp32", "validation"] == "predicted (LoRA rows are not validated)"
    others = set(table.index) - {recommended, "fp32"} - {m for m in table.index if "LoRA" in m}
    assert others and all("validate='all' runs every mode" in table.loc[m, "validation"] for m in others)


def test_validate_all_runs_every_mode_but_lora_and_off_runs_none(fake_steps):
    result = _fit(validate="all", lora=None)
    assert set(result.validation.found) == {c.name for c in result.configs}
    assert not _fit(validate="off").validation.found
    with pytest.raises(ValueError, match="validate must be one of on, off, all"):
        FitConfig(validate="some")


def test_8bit_optimizer_rows_stay_predicted(fake_steps):
    """A step with bitsandbytes' 8-bit state builds another optimizer than the probe's: its rows stay predicted."""
    result = _fit(validate="all", lora=None, optimizers="adamw,adamw8bit")
    eight_bit = {c.name for c in result.configs if c.memory is not None}
    assert eight_bit and not eight_bit & set(result.validation.found)
    assert {result.validation.predicted[m] for m in eight_bit} == {"8-bit optimizer rows are not validated"}
    assert set(result.validation.found) == {c.name for c in result.configs} - eight_bit


def test_past_the_time_cap_the_remaining_rows_stay_predicted(monkeypatch, fake_steps):
    clock = iter(range(0, 10_000, 50))  # every reading 50 s after the last: the cap passes in the first bisection
    monkeypatch.setattr(validation.time, "monotonic", lambda: next(clock))
    result = _fit(validate="all", lora=None, validate_seconds=60)
    assert not result.validation.found
    why = set(result.validation.predicted.values())
    assert "validation's 60 s cap was reached during its bisection" in why
    assert "validation's 60 s cap was reached before it" in why
    assert result.full_table()["validated"].isna().all()


def test_a_real_step_probe_gives_the_weights_back_and_releases_what_it_held(monkeypatch):
    released = []
    monkeypatch.setattr(validation, "_release", lambda device: released.append(device))
    result = _fit(validate="off", lora=None, checkpointing=False)
    adapter = adapt(TinyGPT(**MODEL))
    before = {k: v.clone() for k, v in adapter.model.state_dict().items()}
    assert validation.step_runs(adapter, result.configs[-1], 2, 16)  # bf16
    assert all(torch.equal(before[k], v) for k, v in adapter.model.state_dict().items()) and released


def test_cli_validate_takes_all_and_refuses_anything_else(tmp_path, fake_steps):
    assert main(["fit", *TINY_ARGS, "--seq-len", "16", "--precisions", "fp32,bf16", "--lora", "0",
                 "--no-checkpointing", "--validate", "all", "--no-progress", "--json", str(tmp_path / "f.json")]) == 0
    data = json.loads((tmp_path / "f.json").read_text())
    assert [v["mode"] for v in data["validated"]] == ["fp32", "bf16"]
    with pytest.raises(SystemExit) as exc:
        main(["fit", *TINY_ARGS, "--validate", "maybe"])
    assert exc.value.code == 2


def test_fit_and_its_validation_are_built_whole():
    """Issue 51: no assignment to a result after it is made: validation's record and the plan carrying it are each
    built complete (frozen)."""
    from tier_utils.planning.planner import FitResult
    from tier_utils.planning.validation import Validation

    for record in (FitResult, Validation):
        assert record.__dataclass_params__.frozen, record
