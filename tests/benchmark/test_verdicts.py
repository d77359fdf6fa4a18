"""Timing verdicts need evidence: a spread too wide to decide is *inconclusive*, not PASS/WARN/FAIL, and two
tiers that timed the same step far apart are said to disagree. Injected timings, plus one real benchmark."""
import pytest
import torch
from tiny import tiny

from tier_utils.benchmark import amp as bench
from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.benchmark.verdicts import (
    FAR_APART,
    Thresholds,
    compile_check,
    speed_check,
    speedup,
    step_agreement,
    too_wide,
)
from tier_utils.core.measure import Load, Stats, summarize

BUSY, IDLE = Load(3.1, 2), Load(0.2, 2)


def _stats(q1, median, q3, n=5):
    return Stats(n, median, q1, q3, q1, q3)


def test_a_spread_across_both_the_threshold_and_1x_is_inconclusive():
    # As seen on a busy 2-core machine: 0.75x with an IQR range of 0.05-13x says nothing either way.
    sp = speedup(_stats(40, 77.5, 1300), _stats(100, 103, 800))
    assert sp.low < 1 < Thresholds().speedup < sp.high
    row = speed_check("bf16", sp, 5, Thresholds(), load=BUSY)
    assert row.status == "WARN"
    assert row.detail.startswith("inconclusive: the machine was busy (load 3.1 on 2 cores); "
                                 "rerun idle or with more repeats; measured 0.75x")
    assert "PASS" not in row.detail and "FAIL" not in row.detail
    idle = speed_check("bf16", sp, 5, Thresholds(), load=IDLE)
    assert idle.detail.startswith("inconclusive: the timings spread too widely to judge (load 0.2 on 2 cores)")


def test_a_narrow_spread_keeps_its_verdict():
    assert speed_check("bf16", speedup(_stats(96, 97, 98), _stats(99, 100, 101)), 5, Thresholds()).status == "FAIL"
    assert speed_check("bf16", speedup(_stats(100, 105, 110), _stats(40, 42, 45)), 5, Thresholds()).status == "PASS"
    # The range holds the threshold but not 1.0: faster for sure, the target undecided (WARN, not inconclusive).
    between = speed_check("bf16", speedup(_stats(100, 105, 110), _stats(60, 70, 80)), 5, Thresholds())
    assert between.status == "WARN" and not between.detail.startswith("inconclusive")
    assert not too_wide(speedup(_stats(96, 97, 98), _stats(99, 100, 101)), 1.5)


def test_step_times_whose_spread_exceeds_their_median_are_inconclusive():
    noisy = speedup(summarize([10, 11, 12, 60, 70]), summarize([5, 5.5, 6, 6.5, 7]))  # fp32 IQR 49 > median 12
    assert noisy.spread_over_median > 1 and too_wide(noisy, 1.5)
    assert speed_check("bf16", noisy, 5, Thresholds(), load=BUSY).detail.startswith("inconclusive")
    # compile's threshold is 1.0: a range holding it is "no measurable difference", only noise is inconclusive
    same = speedup(_stats(99, 100, 101), _stats(98, 100, 102))
    assert compile_check("fp32", same, 5, 3.0, 0.1, Thresholds()).status == "WARN"
    assert not compile_check("fp32", same, 5, 3.0, 0.1, Thresholds()).detail.startswith("inconclusive")
    assert compile_check("fp32", noisy, 5, 3.0, 0.1, Thresholds(), BUSY).detail.startswith("inconclusive")


def test_the_benchmark_says_inconclusive_for_injected_timings_with_a_huge_spread(monkeypatch):
    calls = []

    def fake(adapter, prec, start, batches, cfg, bar, step_adapter=None):  # every other repeat stalls 100x
        calls.append(prec.name)
        ms = 5.0 * (100 if len(calls) % 2 else 1)
        return [ms] * (len(batches) - cfg.untimed_steps), torch.zeros(len(batches))

    monkeypatch.setattr(bench, "timed_repeat", fake)
    monkeypatch.setattr(bench, "cpu_load", lambda: BUSY)
    result = amp_benchmark(tiny(seed=0), precisions=("fp32", "bf16"), force=True, batch_size=4, seq_len=16,
                           untimed_steps=1, timed_steps=2, repeats=4, accuracy_steps=0, progress=False, device="cpu")
    v = result.verdicts
    row = v[(v.precision == "bf16") & (v.check == "speedup vs fp32")].iloc[0]
    assert row.status == "WARN" and row.detail.startswith("inconclusive: the machine was busy (load 3.1 on 2 cores)")


def test_two_tiers_timing_the_same_step_far_apart_are_said_to_disagree():
    train_ms = _stats(1300, 1428, 1500, n=60)
    bench_ms = _stats(60, 77.5, 90)
    row = step_agreement(train_ms, bench_ms, "tiny-gpt, fp32 eager, batch 8 x 64 tokens", BUSY)
    assert row.status == "WARN" and row.value == pytest.approx(1428 / 77.5, abs=0.01) and row.threshold == FAR_APART
    assert "18.4x apart" in row.detail and "load 3.1 on 2 cores" in row.detail
    assert "train 1,428 ms" in row.detail and "amp_benchmark 77.5 ms" in row.detail
    assert step_agreement(_stats(95, 100, 105), _stats(90, 96, 99), "x") is None  # agree
    # Far apart medians whose IQRs overlap: the noise covers it, nothing to say.
    assert step_agreement(_stats(50, 300, 900), _stats(60, 100, 400), "x") is None
