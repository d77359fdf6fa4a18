"""fit names the fastest mode as well as the cheapest: measured here where the run measured it (the AMP
benchmark's speedups in `all`), predicted on each GPU and said so."""
import pytest
import torch
from tiny import TINY_ARGS

from tier_utils import TinyGPT
from tier_utils.benchmark.verdicts import Speedup
from tier_utils.cli import main
from tier_utils.planning import planner
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


def _measured(median, iqr=0.05) -> Speedup:
    """A speedup over fp32 measured with an IQR range of ±`iqr` around it (the benchmark's Speedup)."""
    low, high = median - iqr, median + iqr
    return Speedup(median, low, high, low <= 1 <= high, iqr)


def test_measured_speedups_decide_here_and_the_line_says_where_they_came_from(plan):
    measured = plan.with_measured_speedups({"fp32": None, "bf16": _measured(1.45), "fp16": _measured(0.6)},
                                           "by the AMP benchmark")
    assert _names(measured.fastest())["this_device"] == "bf16"  # only the measured modes compete
    assert _names(measured.fastest())["T4 16 GB"] == "fp16-true"  # the GPUs stay predicted
    assert "fastest here bf16: 1.45× fp32, IQR range 1.40–1.50×, measured by the AMP benchmark;" in \
        measured.summary_line()
    data = measured.to_json()
    assert data["fastest"]["this_device"] == "bf16" and data["measured_speedups"]["bf16"]["low"] == 1.4
    slower = plan.with_measured_speedups({"fp32": None, "bf16": _measured(0.85)}, "by the AMP benchmark")
    assert _names(slower.fastest())["this_device"] is None  # bf16 ran 0.85x: nothing ran faster than fp32
    assert plan.with_measured_speedups({}, "nowhere").measured_speedups is None


def test_a_lead_inside_the_noise_is_no_fastest(plan):
    """Issue 50: the main job's fit said "fastest here bf16-true (1.04x fp32)" while the same run's benchmark gave
    it an IQR range of 0.92-1.17x and called it no measurable difference; fit now reads the benchmark's rule."""
    noisy = plan.with_measured_speedups({"fp32": None, "bf16-true": Speedup(1.04, 0.92, 1.17, True, 0.12)},
                                        "by this run's benchmark")
    assert _names(noisy.fastest())["this_device"] is None and noisy.cheapest()["this_device"] is not None
    line = noisy.summary_line()
    assert "no mode was measurably faster here (closest: bf16-true 1.04× fp32, IQR range 0.92–1.17×, measured by " \
           "this run's benchmark);" in line
    assert "fastest here" not in line and noisy.to_json()["fastest"]["this_device"] is None


def test_fit_names_no_file_it_does_not_write(tmp_path, capsys, monkeypatch):
    """Issue 50: fit's line said "every mode: fit.csv", a file nothing wrote; with --json it writes <name>.csv."""
    monkeypatch.chdir(tmp_path)
    args = ["fit", "--model", "tiny-gpt", *TINY_ARGS, "--seq-len", "16", "--batch-size", "2", "--no-checkpointing",
            "--lora", "0", "--validate", "off", "--device", "cpu", "--no-progress"]
    assert main(args) == 0
    assert ".csv" not in capsys.readouterr().out and not list(tmp_path.iterdir())
    assert main([*args, "--json", "plan.json"]) == 0
    assert "every column and each row's detail: plan.csv (and plan.json)" in capsys.readouterr().out
    assert (tmp_path / "plan.csv").exists()


def test_where_a_mode_fits_a_fastest_does(plan):
    """Issue 50: a Qwen2.5-3B shape at 1x1024 on a T4 fit only as LoRA with checkpointing, and the line read
    "LoRA r=8 · fp16 base · fp16 + checkpointing / none fits". Here the T4's room fits only checkpointed rows."""
    t4 = next(col for col in plan.devices() if col.startswith("T4"))
    rows = {c.name: c.step_bytes(plan.batch_size, plan.seq_len) for c in plan.configs}
    plain = min(b for name, b in rows.items() if "checkpointing" not in name)
    checkpointed = min(rows.values())
    assert checkpointed < plain
    room = (checkpointed + plain) / 2
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(planner, "gpu_room", lambda mib: room)
        cheapest, fastest = plan.cheapest()[t4], plan.fastest()[t4]
        line = plan.summary_line()
    assert cheapest is not None and fastest is not None and fastest.checkpointing
    assert f"T4 16 GB {cheapest.name} / {fastest.name}" in line and "none fits" not in line
