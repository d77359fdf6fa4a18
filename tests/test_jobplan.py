"""`all`'s plan (batches, steps, probes, the benchmark's growth) is the same on every card unless the user asks
for more: work the user didn't ask for has a cap that doesn't grow with the device (issue 41 §2)."""
import pytest

from tier_utils.core.budget import FREE_MEMORY_ENV, GPU_PROBE_BYTES, Budget
from tier_utils.core.device import GPU_PROFILE_ENV, GPU_PROFILES
from tier_utils.jobplan import job_plan
from tier_utils.presets import FAST, JOB


def _plan_under(monkeypatch, card: str, preset) -> dict:
    """The plan with the card's profile and its whole memory free (the budget a profile stands for)."""
    monkeypatch.setenv(GPU_PROFILE_ENV, card)
    monkeypatch.setenv(FREE_MEMORY_ENV, f"{GPU_PROFILES[card].memory_mib}MiB")
    return job_plan(preset, "cpu").to_dict()


@pytest.mark.parametrize("preset", [JOB, FAST], ids=["job", "fast"])
def test_the_plan_is_the_same_on_a_t4_and_an_h200(monkeypatch, preset):
    t4, h200 = (_plan_under(monkeypatch, card, preset) for card in ("T4", "H200"))
    assert t4 == h200
    assert t4["growth"] == {"from_batch": preset.batch_size, "max_batch": 256, "budget_bytes": 4 << 30}
    assert t4["fit_validate"] == "off" and t4["train_steps"] == preset.train.max_steps


def test_asking_for_more_changes_the_plan_and_no_card_grows_it(monkeypatch):
    from dataclasses import replace

    big = replace(JOB, batch_size=512)
    asked = _plan_under(monkeypatch, "H200", big)
    assert asked["batch_size"] == 512 and asked["growth"]["max_batch"] == 512  # measured as asked, not grown
    monkeypatch.delenv(GPU_PROFILE_ENV)
    assert job_plan(JOB, "cpu").growth is None  # a CPU: the preset's batch, no growth


def test_a_probe_on_a_gpu_holds_the_same_on_every_card():
    t4, h200 = (Budget("cuda", GPU_PROFILES[k].memory_mib << 20, "profile").probe_limit for k in ("T4", "H200"))
    assert t4 == h200 == GPU_PROBE_BYTES < Budget("cuda", GPU_PROFILES["T4"].memory_mib << 20, "profile").limit
