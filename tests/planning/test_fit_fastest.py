"""fit names the fastest mode as well as the cheapest: measured here where the run measured it (the AMP
benchmark's speedups in `all`), predicted on each GPU and said so."""
import pytest
import torch

from tier_utils import TinyGPT
from tier_utils.planning.planner import fit


@pytest.fixture(scope="module")
def plan():
    torch.manual_seed(0)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")  # native bf16 here, fp16 emulated
        return fit(TinyGPT(d_model=16, n_layer=2, n_head=2, max_len=16), seq_len=16, lora=None, validate=False,
                   device="cpu", progress=False)


def _names(picked: dict) -> dict:
    return {col.replace(" (predicted)", ""): c.name if c else None for col, c in picked.items()}


def test_predicted_fastest_follows_each_cards_tensor_cores_and_true_before_mixed(plan):
    fastest = _names(plan.fastest())
    assert fastest["T4 16 GB"] == "fp16-true"  # fp16 tensor cores, no bf16 ones
    assert fastest["L4 24 GB"] == fastest["H100 80 GB"] == "bf16-true"
    assert fastest["this_device"] == "bf16-true"  # native bf16 here (the flags), a true mode before a mixed one
    assert _names(plan.cheapest())["this_device"] == "bf16"  # the cheapest is another question
    line = plan.summary_line()
    assert "fastest here bf16-true (predicted)" in line and "T4 16 GB fp16 / fp16-true" in line


def test_measured_speedups_decide_here_and_the_line_says_where_they_came_from(plan):
    measured = plan.with_measured_speedups({"fp32": 1.0, "bf16": 1.45, "fp16": 0.6}, "by the AMP benchmark")
    assert _names(measured.fastest())["this_device"] == "bf16"  # only the measured modes compete
    assert _names(measured.fastest())["T4 16 GB"] == "fp16-true"  # the GPUs stay predicted
    assert "fastest here bf16 (1.45x fp32, measured by the AMP benchmark)" in measured.summary_line()
    assert measured.to_json()["fastest"]["this_device"] == "bf16"
    slower = plan.with_measured_speedups({"fp32": 1.0, "bf16": 0.85}, "by the AMP benchmark")
    assert _names(slower.fastest())["this_device"] == "fp32"  # bf16 ran 0.85x: fp32 is the fastest here
    assert plan.with_measured_speedups({}, "nowhere").measured_speedups is None
