"""The AMP benchmark's judgement: thresholds, speedup with its spread, loss-curve parity, and the
PASS / WARN / FAIL / SKIP rows (one per precision x criterion).

Pure functions of measured numbers, so they are tested without running a model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .measure import Stats
from .results import Check

MEMORY_BASES = ("activations", "total", "peak_allocated")
CRITERIA = ("speedup", "memory", "accuracy", "parity")


@dataclass(frozen=True)
class Thresholds:
    """What a low precision must show against fp32 to PASS; every field is configurable.

    memory: which memory the reduction threshold applies to: `activations` (bytes saved for
    backward in one training step), `total` (weights + gradients + optimizer state + activations)
    or `peak_allocated` (CUDA only). The other two are still reported in the row's detail.
    """

    speedup: float = 1.5  # fp32 median step time / this precision's
    memory_reduction: float = 0.40  # 1 - bytes / fp32's bytes
    memory: str = "activations"
    accuracy_diff: float = 0.01  # |val accuracy - fp32's val accuracy|
    parity_tolerance: float = 0.05  # relative band around fp32's training-loss curve
    min_repeats: int = 3  # below this the IQR is no estimate of noise: a PASS/FAIL on speed becomes WARN

    def __post_init__(self):
        if self.memory not in MEMORY_BASES:
            raise ValueError(f"Thresholds.memory must be one of {', '.join(MEMORY_BASES)}, got {self.memory!r}")
        for name in ("speedup", "accuracy_diff", "parity_tolerance"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Thresholds.{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.memory_reduction < 1:
            raise ValueError(f"Thresholds.memory_reduction is a fraction in [0, 1), got {self.memory_reduction}")
        if self.min_repeats < 1:
            raise ValueError(f"Thresholds.min_repeats must be >= 1, got {self.min_repeats}")


@dataclass
class PrecisionCheck(Check):
    """A verdict row that also names the precision it judges."""

    precision: str = ""
    mode: str = "eager"  # or "compiled" (torch.compile)


def speedup(base: Stats, other: Stats) -> dict:
    """fp32's step time over `other`'s: ratio of medians, and the range the two IQRs allow.

    When the two step-time IQRs overlap the precisions are indistinguishable at this noise level.
    """
    return {
        "median": base.median / other.median,
        "low": base.q1 / other.q3,
        "high": base.q3 / other.q1,
        "no_measurable_difference": base.q1 <= other.q3 and other.q1 <= base.q3,
    }


def reduction(base_bytes, other_bytes) -> float | None:
    """1 - other / base (0.4 = 40 % less memory); None when either side was not measured."""
    if base_bytes is None or other_bytes is None or base_bytes <= 0:
        return None
    return 1 - other_bytes / base_bytes


def parity(base_curve, curve, tolerance: float) -> dict:
    """Per-step relative deviation of `curve` from fp32's over the steps both ran.

    Both runs see the same batches from the same weights, so the deviation is the precision's doing.
    """
    steps = min(len(base_curve), len(curve))
    devs = []
    for b, c in zip(base_curve[:steps], curve[:steps]):
        finite = math.isfinite(b) and math.isfinite(c)
        devs.append(abs(c - b) / max(abs(b), 1e-12) if finite else math.inf)
    first_out = next((i for i, d in enumerate(devs) if d > tolerance), None)
    return {"steps": steps, "max_rel_dev": max(devs) if devs else None, "first_step_out": first_out,
            "tolerance": tolerance}


def speed_check(precision: str, sp: dict, n: int, t: Thresholds) -> PrecisionCheck:
    detail = f"{sp['median']:.2f}x (IQR range {sp['low']:.2f}-{sp['high']:.2f}x, n={n} repeats)"
    if sp["low"] >= t.speedup:
        status = "PASS"
    elif sp["high"] < t.speedup:
        status = "FAIL"
    else:
        status = "WARN"
        detail += f"; {t.speedup}x lies inside the spread"
    if sp["no_measurable_difference"]:
        detail += "; no measurable difference from fp32 (step-time IQRs overlap)"
    if n < t.min_repeats and status != "WARN":
        status = "WARN"
        detail += f"; only {n} repeat(s), too few to judge noise: use repeats>={t.min_repeats}"
    return PrecisionCheck("speedup vs fp32", status, round(sp["median"], 4), t.speedup, detail, precision)


def memory_check(precision: str, reductions: dict, t: Thresholds) -> PrecisionCheck:
    """`reductions`: basis -> fraction (or None when that memory was not measured on this device)."""
    name = f"{t.memory} memory reduction"
    others = "; ".join(f"{k} {_pct(v)}" for k, v in reductions.items() if k != t.memory and v is not None)
    value = reductions.get(t.memory)
    if value is None:
        return PrecisionCheck(name, "SKIP", None, t.memory_reduction,
                              f"{t.memory} is not measured on this device (CUDA only); "
                              "use Thresholds(memory='activations') or 'total'", precision)
    status = "PASS" if value >= t.memory_reduction else "FAIL"
    detail = f"{t.memory} {_pct(value)} vs fp32" + (f" (also: {others})" if others else "")
    return PrecisionCheck(name, status, round(value, 4), t.memory_reduction, detail, precision)


def accuracy_check(precision: str, diff: float | None, diverged: str | None, t: Thresholds) -> PrecisionCheck:
    """`diff` = this precision's val accuracy minus fp32's; `diverged` says where and why training stopped."""
    name = "val accuracy diff"
    if diverged is not None or diff is None or not math.isfinite(diff):
        return PrecisionCheck(name, "FAIL", None, t.accuracy_diff,
                              f"training diverged {diverged or 'to a non-finite accuracy'}", precision)
    value = round(diff, 4)
    if abs(diff) < t.accuracy_diff:
        return PrecisionCheck(name, "PASS", value, t.accuracy_diff, f"{diff:+.4f} vs fp32", precision)
    if diff < 0:
        return PrecisionCheck(name, "FAIL", value, t.accuracy_diff, f"{diff:+.4f} vs fp32: less accurate", precision)
    return PrecisionCheck(name, "WARN", value, t.accuracy_diff,
                          f"{diff:+.4f} vs fp32: more accurate by more than the threshold, so the runs "
                          "differ by more than rounding alone should explain", precision)


def parity_check(precision: str, par: dict, diverged: str | None, t: Thresholds) -> PrecisionCheck:
    name = "loss-curve parity"
    if diverged is not None:
        return PrecisionCheck(name, "FAIL", None, t.parity_tolerance, f"training diverged {diverged}", precision)
    dev = par["max_rel_dev"]
    if par["first_step_out"] is None:
        return PrecisionCheck(name, "PASS", round(dev, 4), t.parity_tolerance,
                              f"max relative deviation {dev:.4f} over {par['steps']} steps", precision)
    return PrecisionCheck(name, "WARN", _rounded(dev), t.parity_tolerance,
                          f"max relative deviation {dev:.4f}; first left the +/-{t.parity_tolerance} band "
                          f"at step {par['first_step_out']} of {par['steps']}", precision)


def compile_check(precision: str, sp: dict, n: int, compile_s: float, saved_ms: float,
                  t: Thresholds) -> PrecisionCheck:
    """Compiled against the same precision eager: PASS when the whole IQR range is faster, FAIL when
    it is all slower; the detail says after how many steps the compile time is paid back."""
    detail = f"{sp['median']:.2f}x eager (IQR range {sp['low']:.2f}-{sp['high']:.2f}x, n={n} repeats); " \
             f"compile {compile_s:.1f} s"
    if sp["low"] > 1:
        status = "PASS"
        detail += f", paid back after {math.ceil(compile_s * 1e3 / saved_ms)} steps at the median step times"
    elif sp["high"] < 1:
        status, detail = "FAIL", detail + "; slower than eager"
    else:
        status = "WARN"
    if sp["no_measurable_difference"]:
        detail += "; no measurable difference from eager (step-time IQRs overlap)"
    if n < t.min_repeats and status != "WARN":
        status = "WARN"
        detail += f"; only {n} repeat(s), too few to judge noise: use repeats>={t.min_repeats}"
    return PrecisionCheck("compile speedup vs eager", status, round(sp["median"], 4), 1.0, detail, precision,
                          "compiled")


def skip_checks(precision: str, reason: str, t: Thresholds, criteria=CRITERIA) -> list[PrecisionCheck]:
    """SKIP rows, one per criterion, all carrying the same reason."""
    names = {"speedup": ("speedup vs fp32", t.speedup),
             "memory": (f"{t.memory} memory reduction", t.memory_reduction),
             "accuracy": ("val accuracy diff", t.accuracy_diff),
             "parity": ("loss-curve parity", t.parity_tolerance)}
    return [PrecisionCheck(names[c][0], "SKIP", None, names[c][1], reason, precision) for c in criteria]


def _pct(fraction: float) -> str:
    return f"{-fraction:+.1%}"  # a 40 % reduction reads as -40.0 %


def _rounded(x: float):
    return round(x, 4) if math.isfinite(x) else None
