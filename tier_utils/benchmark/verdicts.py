"""The AMP benchmark's judgement: thresholds, speedup with its spread, loss-curve parity, and the
PASS / WARN / FAIL / SKIP rows (one per precision x criterion).

Pure functions of measured numbers, so they are tested without running a model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..core.measure import Load, Stats
from ..core.memory_settings import memory_setting
from ..core.precision import BASELINE
from ..core.results import Check
from ..engine.step import ROUNDING_SAMPLE_NOTE
from .config import Mode, Thresholds

# The fixed per-step cost's share of fp32's step that leaves room for AMP's arithmetic speedup to show:
# the batch `launch_bound` suggests, and the one the main job grows to on a GPU, aim at it.
TARGET_FIXED_SHARE = 0.2
CRITERIA = ("speedup", "memory", "accuracy", "parity")
# A memory row's (BenchConfig.memory_rows): what its setting saves, and whether its loss kept to the baseline's; its
# step time is a figure in its memory row's detail, not a target (a memory setting buys bytes, not speed).
MEMORY_ROW_CRITERIA = ("memory row", "accuracy", "parity")
MEMORY_ROW_CHECK = "static memory vs fp32"  # memory_row_check's row


@dataclass
class PrecisionCheck(Check):
    """A verdict row that also names the precision it judges."""

    precision: str = ""
    mode: Mode = "eager"


@dataclass(frozen=True)
class Speedup:
    """One step time over another's: the ratio of medians and the range the two IQRs allow (`low`, `high`).
    `no_measurable_difference`: the two IQRs overlap, so at this noise the steps are indistinguishable.
    `spread_over_median`: the wider of the two IQRs over its own median (above 1: noise as large as the step)."""

    median: float
    low: float
    high: float
    no_measurable_difference: bool
    spread_over_median: float

    @property
    def measurably_faster(self) -> bool:
        """Faster outside the noise: the IQRs don't overlap and the median is above 1. Every "faster" and "fastest"
        a line names follows it (the answer's lead, fit's fastest here)."""
        return not self.no_measurable_difference and self.median > 1.0

    def describe(self, base: str) -> str:
        """"1.04× fp32, IQR range 0.92–1.17×", `base` the step it is measured against."""
        return f"{self.median:.2f}× {base}, IQR range {self.low:.2f}–{self.high:.2f}×"


def speedup(base: Stats, other: Stats) -> Speedup:
    """`base`'s step time (fp32's, or eager's) over `other`'s."""
    return Speedup(base.median / other.median, base.q1 / other.q3, base.q3 / other.q1,
                   base.q1 <= other.q3 and other.q1 <= base.q3,
                   max(base.iqr / base.median, other.iqr / other.median))


def too_wide(sp: Speedup, threshold: float) -> bool:
    """Is the spread too wide to decide anything? Either the ratio's IQR range holds both `threshold`
    and 1.0 (it allows "slower" and "fast enough" alike), or a step time's IQR exceeds its median."""
    spans = sp.low <= min(1.0, threshold) and sp.high >= max(1.0, threshold)
    return spans or sp.spread_over_median > 1.0


def inconclusive(load: Load | None) -> str:
    """The detail of a timing verdict too noisy to give: why, and what to do (first, to survive clipping)."""
    if load is None:
        return "inconclusive: the timings spread too widely to judge; rerun idle or with more repeats"
    cause = "the machine was busy" if load.busy else "the timings spread too widely to judge"
    return f"inconclusive: {cause} ({load}); rerun idle or with more repeats"


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
    trailing = next((i for i, d in enumerate(reversed(devs)) if not d > tolerance), len(devs))
    return {"steps": steps, "max_rel_dev": max(devs) if devs else None, "first_step_out": first_out,
            "trailing_out": trailing, "tolerance": tolerance}


def launch_bound(step_ms: float, floor_ms: float, mfu: float | None, batch_size: int, t: Thresholds) -> dict:
    """Is fp32's step at this size about per-step overhead (launches, dispatch, the optimizer) rather
    than arithmetic? Then no precision can make it much faster, and a speed FAIL would mislead.

    step_ms: fp32's median step; floor_ms: the median step of the same model on one short sequence,
    which is almost all fixed per-step cost; mfu: fp32's achieved over its measured peak FLOP/s.
    suggest_batch: the power-of-two batch at which the per-sequence time, grown linearly from this
    batch, brings the fixed cost down to TARGET_FIXED_SHARE of the step (None when the step is no
    longer than its floor).
    """
    share = floor_ms / step_ms
    bound = share > t.max_fixed_share or (mfu is not None and mfu < t.min_mfu)
    variable = step_ms - floor_ms
    suggest = None
    if variable > 0:
        need = batch_size * (1 / TARGET_FIXED_SHARE - 1) * floor_ms / variable
        suggest = max(2 * batch_size, 2 ** math.ceil(math.log2(need)))
    mfu_text = "" if mfu is None else f", and fp32 reaches {mfu:.1%} of its measured matmul peak"
    # Advice first: a one-screen summary clips the detail, and what to do must survive the clipping.
    reason = ((f"try batch >= {suggest} or a larger model" if suggest else "try a larger batch or model")
              + f": a 1-sequence step takes {floor_ms:.3g} ms of fp32's {step_ms:.3g} ms ({share:.0%} fixed "
              f"per-step cost){mfu_text}; AMP speeds arithmetic, not launches")
    return {"launch_bound": bound, "fixed_share": share, "mfu": mfu, "step_ms": step_ms, "floor_ms": floor_ms,
            "suggest_batch": suggest, "reason": reason}


def speed_check(precision: str, sp: Speedup, n: int, t: Thresholds, bound: dict | None = None,
                load: Load | None = None) -> PrecisionCheck:
    """`bound`: `launch_bound()`'s diagnosis of fp32's step; a launch-bound size turns a miss into WARN.
    A spread too wide to decide (`too_wide`) gives WARN "inconclusive: ..." naming the CPU `load`."""
    detail = f"{sp.median:.2f}x (IQR range {sp.low:.2f}-{sp.high:.2f}x, n={n} repeats)"
    if too_wide(sp, t.speedup):
        return PrecisionCheck("speedup vs fp32", "WARN", round(sp.median, 4), t.speedup,
                              f"{inconclusive(load)}; measured {detail}", precision)
    if sp.low >= t.speedup:
        status = "PASS"
    elif sp.high < t.speedup:
        status = "FAIL"
    else:
        status = "WARN"
        detail += f"; {t.speedup}x lies inside the spread"
    if sp.no_measurable_difference:
        detail += "; no measurable difference from fp32 (step-time IQRs overlap)"
    if n < t.min_repeats and status != "WARN":
        status = "WARN"
        detail += f"; only {n} repeat(s), too few to judge noise: use repeats>={t.min_repeats}"
    if bound is not None and bound["launch_bound"] and status != "PASS":
        status = "WARN"  # the answer is about overhead at this size, not about the precision
        detail = f"launch-bound at this size, {bound['reason']}; measured {detail}"
    return PrecisionCheck("speedup vs fp32", status, round(sp.median, 4), t.speedup, detail, precision)


def nonfinite_checks(precision: str, reason: str, t: Thresholds, criteria=CRITERIA) -> list[PrecisionCheck]:
    """A run whose loss is NaN/inf: FAIL on every criterion that reads a loss or a step time, no figures."""
    rows = skip_checks(precision, f"{reason}: no verdict on a model whose loss is not finite; "
                                  "run smoke(model) to find where it starts", t, criteria)
    for row in rows:
        if row.check != f"{t.memory} memory reduction":  # bytes are not a loss: not measured, not failed
            row.status = "FAIL"
    return rows


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


def parity_check(precision: str, par: dict, diverged: str | None, t: Thresholds,
                 skipped: int | None = None, scales: list | None = None, rounded: float | None = None
                 ) -> PrecisionCheck:
    """Curves compare applied optimizer updates (a skipped fp16 step is retried, not counted as one);
    `skipped` and the loss-scale trace `scales` (fp16 only), and the share of non-zero updates the stored
    dtype `rounded` away, are reported beside the deviation."""
    name = "loss-curve parity"
    if diverged is not None:
        return PrecisionCheck(name, "FAIL", None, t.parity_tolerance, f"training diverged {diverged}", precision)
    dev, steps = par["max_rel_dev"], par["steps"]
    scaler = ""
    if skipped is not None:
        trace = f"; loss scale {scales[0]:g} -> {scales[-1]:g}" if scales else ""
        scaler = (f"; {skipped} skipped step(s), each retried on the same batch" if skipped else "; no skipped step")
        scaler += trace
    if rounded is not None:
        scaler += (f"; {rounded:.1%} of non-zero parameter updates rounded away by the weights' dtype "
                   f"({ROUNDING_SAMPLE_NOTE})")
    if dev is None or not math.isfinite(dev):
        return PrecisionCheck(name, "FAIL", None, t.parity_tolerance,
                              f"a loss became NaN/inf within the {steps} applied updates compared{scaler}", precision)
    if par["first_step_out"] is None:
        return PrecisionCheck(name, "PASS", round(dev, 4), t.parity_tolerance,
                              f"max relative deviation {dev:.4f} over {steps} applied updates{scaler}", precision)
    detail = (f"max relative deviation {dev:.4f}; first left the +/-{t.parity_tolerance} band at update "
              f"{par['first_step_out']} of {steps}")
    # Out of the band for the last quarter of the run (at least 2 updates): it went away and stayed away.
    if par["trailing_out"] >= max(2, steps // 4):
        return PrecisionCheck(name, "FAIL", round(dev, 4), t.parity_tolerance,
                              f"{detail} and stayed out for the last {par['trailing_out']}: the curves diverge"
                              f"{scaler}", precision)
    return PrecisionCheck(name, "WARN", round(dev, 4), t.parity_tolerance, f"{detail}{scaler}", precision)


def compile_check(precision: str, sp: Speedup, n: int, compile_s: float, saved_ms: float, t: Thresholds,
                  load: Load | None = None) -> PrecisionCheck:
    """Compiled against the same precision eager: PASS when the whole IQR range is faster, FAIL when
    it is all slower; the detail says after how many steps the compile time is paid back.
    A step-time IQR wider than its median gives WARN "inconclusive: ..." (the threshold here is 1.0
    itself, so a range holding it is "no measurable difference", a finding, not noise)."""
    detail = f"{sp.median:.2f}x eager (IQR range {sp.low:.2f}-{sp.high:.2f}x, n={n} repeats); " \
             f"compile {compile_s:.1f} s"
    if sp.spread_over_median > 1.0:
        return PrecisionCheck("compile speedup vs eager", "WARN", round(sp.median, 4), 1.0,
                              f"{inconclusive(load)}; measured {detail}", precision, "compiled")
    if sp.low > 1:
        status = "PASS"
        detail += f", paid back after {math.ceil(compile_s * 1e3 / saved_ms)} steps at the median step times"
    elif sp.high < 1:
        status, detail = "FAIL", detail + "; slower than eager"
    else:
        status = "WARN"
    if sp.no_measurable_difference:
        detail += "; no measurable difference from eager (step-time IQRs overlap)"
    if n < t.min_repeats and status != "WARN":
        status = "WARN"
        detail += f"; only {n} repeat(s), too few to judge noise: use repeats>={t.min_repeats}"
    return PrecisionCheck("compile speedup vs eager", status, round(sp.median, 4), 1.0, detail, precision,
                          "compiled")


def skip_checks(precision: str, reason: str, t: Thresholds, criteria=CRITERIA) -> list[PrecisionCheck]:
    """SKIP rows, one per criterion, all carrying the same reason."""
    names = {"speedup": ("speedup vs fp32", t.speedup),
             "memory": (f"{t.memory} memory reduction", t.memory_reduction),
             "accuracy": ("val accuracy diff", t.accuracy_diff),
             "parity": ("loss-curve parity", t.parity_tolerance), "memory row": (MEMORY_ROW_CHECK, 0.0)}
    return [PrecisionCheck(names[c][0], "SKIP", None, names[c][1], reason, precision) for c in criteria]


def memory_row_check(precision: str, memory: dict, base_memory: dict, sp: Speedup) -> PrecisionCheck:
    """A memory row against the baseline's full fine-tune: its static bytes (weights, gradients, optimizer state:
    what a memory setting changes), PASS when fewer, else WARN; its CUDA peak and its step time beside, measured."""
    red = memory["reduction"]
    static = [m["weights_bytes"] + m["grads_bytes"] + m["optimizer_state_bytes"] for m in (memory, base_memory)]
    peak = red.get("peak_allocated")
    detail = (f"static {static[0] / 2**20:.2f} MiB vs fp32's {static[1] / 2**20:.2f} MiB ({_pct(red['static'])})"
              + (f"; peak allocated {_pct(peak)}" if peak is not None else "")
              + f"; step {sp.median:.2f}x fp32's speed (IQR range {sp.low:.2f}-{sp.high:.2f}x)")
    return PrecisionCheck(MEMORY_ROW_CHECK, "PASS" if red["static"] > 0 else "WARN", round(red["static"], 4), 0.0,
                          detail, precision)


def record_checks(rec, base, skip_reason: str | None, t: Thresholds, accuracy_steps: int,
                  overhead: dict | None, load: Load | None = None) -> list[PrecisionCheck]:
    """The verdict rows of a benchmark's PrecisionRecord `rec` against the baseline's `base`; a compiled
    one's also judge it against the same precision eager. `skip_reason`: why it did not run; `load`:
    the CPU load the timings ran under, named by a timing verdict too noisy to give."""
    if rec.memory_row is not None:
        return _memory_row_checks(rec, base, skip_reason, t, accuracy_steps)
    rows = _precision_checks(rec, base, skip_reason, t, accuracy_steps, overhead, load)
    info, vs_eager = rec.compile, rec.speed and rec.speed.speedup_vs_eager
    if rec.checkpointing:
        if rec.vs_without is not None:
            rows.insert(0, checkpointing_check(rec.precision, rec.vs_without, rec.speed.speedup_vs_eager,
                                               rec.speed.step_ms.n))
    elif info is not None and not info.compiled:
        rows.insert(0, PrecisionCheck("compile", "WARN", None, None, info.reason, rec.precision))
    elif vs_eager is not None:
        ms = rec.speed.step_ms
        saved_ms = vs_eager.median * ms.median - ms.median  # eager's median step minus this one's
        rows.insert(0, compile_check(rec.precision, vs_eager, ms.n, info.compile_s, saved_ms, t, load))
    for row in rows:
        row.mode = rec.mode
    return rows


def checkpointing_check(precision: str, vs: dict, sp: Speedup, n: int) -> PrecisionCheck:
    """Activation checkpointing against the same precision without it: what it saves (activation bytes, PASS
    when they fall) and what it costs (step time, the recompute)."""
    cost = "no measurable difference in step time" if sp.no_measurable_difference else \
        f"step time x{1 / sp.median:.2f} (IQR range x{1 / sp.high:.2f}-x{1 / sp.low:.2f}, n={n} repeats)"
    detail = (f"activations {vs['activation_bytes'] / 2**20:.2f} MiB vs {vs['activation_bytes_without'] / 2**20:.2f} "
              f"MiB without checkpointing ({_pct(vs['activation_reduction'])}); {cost}, same precision")
    status = "PASS" if vs["activation_reduction"] > 0 else "WARN"
    return PrecisionCheck("activation checkpointing", status, round(vs["activation_reduction"], 4), 0.0, detail,
                          precision, "eager+checkpointing")


def _precision_checks(rec, base, skip_reason: str | None, t: Thresholds, accuracy_steps: int,
                      overhead: dict | None, load: Load | None) -> list[PrecisionCheck]:
    name = rec.precision
    if rec.stopped:
        return nonfinite_checks(name, rec.stopped, t)
    if rec is base:
        return skip_checks(name, f"{name} is the baseline the others are compared with", t)
    if not rec.ran:
        return skip_checks(name, skip_reason, t)
    forced = " [forced: not native on this device]" if rec.forced else ""
    rows = []
    if name != base.precision:  # compiled against eager in the baseline's precision: only correctness
        rows += [speed_check(name, rec.speed.speedup, rec.speed.step_ms.n, t, overhead, load),
                 memory_check(name, rec.memory["reduction"], t)]
    rows += _correctness_checks(rec, base, t, accuracy_steps)
    return _against(rows, base, forced)


def _memory_row_checks(rec, base, skip_reason: str | None, t: Thresholds, accuracy_steps: int
                       ) -> list[PrecisionCheck]:
    """A memory row's verdicts: what its setting saves against the baseline, and its accuracy and loss curve."""
    name = rec.precision
    if rec.stopped:
        rows = nonfinite_checks(name, rec.stopped, t, MEMORY_ROW_CRITERIA)
    elif not rec.ran:
        rows = skip_checks(name, skip_reason, t, MEMORY_ROW_CRITERIA)
    else:
        rows = _against([memory_row_check(name, rec.memory, base.memory, rec.speed.speedup),
                         *_correctness_checks(rec, base, t, accuracy_steps)], base, "")
    for row in rows:
        row.mode = rec.mode
    if rec.ran and not rec.stopped and memory_setting(rec.memory_row).lora is not None:
        _judge_adapter_row(rows, rec, t)
    return rows


def _judge_adapter_row(rows: list[PrecisionCheck], rec, t: Thresholds) -> None:
    """An adapter row (LoRA, QLoRA) trains a small share of the weights: its loss curve leaving the full
    fine-tune's is what training adapters costs, not a numerics fault, so against the baseline its accuracy and
    parity rows are figures (a FAIL there becomes WARN, said so). A 4-bit row whose 16-bit twin ran (QLoRA beside
    LoRA) is judged on its loss curve against the twin's: the 4-bit base's own cost, PASS or FAIL."""
    twin = (rec.accuracy or {}).get("parity_vs_row")  # no accuracy run: its rows are SKIPs, left as they are
    for i, row in enumerate(rows):
        if row.check not in ("val accuracy diff", "loss-curve parity"):
            continue
        if twin and row.check == "loss-curve parity" and twin["max_rel_dev"] is not None:
            judged = parity_check(row.precision, twin, None, t)
            rows[i] = replace(judged, mode=row.mode, detail=f"vs the {twin['row']} row (the 16-bit base): "
                                                            f"{judged.detail}; against the fp32 full fine-tune: "
                                                            f"{row.status}, {row.detail}")
        elif row.status == "FAIL":
            rows[i] = replace(row, status="WARN", detail=f"{row.detail}; adapters train a small share of the "
                                                         "weights, so a gap to the full fine-tune is expected: "
                                                         "compare modes by it, not as a fault")


def _correctness_checks(rec, base, t: Thresholds, accuracy_steps: int) -> list[PrecisionCheck]:
    """Val accuracy and loss-curve parity against the baseline's accuracy run (SKIP where there was none)."""
    name = rec.precision
    if not accuracy_steps:
        return skip_checks(name, "accuracy_steps=0: no accuracy run", t, ("accuracy", "parity"))
    if base.accuracy["diverged_at"] is not None:
        return skip_checks(name, f"fp32 baseline diverged at step {base.accuracy['diverged_at']}; lower lr", t,
                           ("accuracy", "parity"))
    acc = rec.accuracy
    diverged = None if acc["diverged_at"] is None else f"at step {acc['diverged_at']}: {acc['diverged_reason']}"
    return [accuracy_check(name, acc["val_accuracy_diff"], diverged, t),
            parity_check(name, acc["parity"], diverged, t, acc["skipped_steps"], acc["loss_scale"],
                         acc.get("rounded_away_share"))]


def _against(rows: list[PrecisionCheck], base, forced: str) -> list[PrecisionCheck]:
    """`rows` with `forced` added to their detail, and naming the baseline where it is not fp32 (fp32 did not fit
    here)."""
    for row in rows:
        row.detail += forced
        if base.precision != BASELINE:
            row.check = row.check.replace("vs fp32", f"vs {base.precision}")
            row.detail = row.detail.replace("vs fp32", f"vs {base.precision}").replace(
                "fp32's", f"{base.precision}'s")
    return rows


def _pct(fraction: float) -> str:
    return f"{-fraction:+.1%}"  # a 40 % reduction reads as -40.0 %



FAR_APART = 2.0  # train's step also fetches its batch and keeps its history: a few per cent, never 2x


def step_agreement(train_ms: Stats, bench_ms: Stats, same: str, load: Load | None = None) -> Check | None:
    """Did two tiers time the same step alike? `train_ms`, `bench_ms`: step-time stats of training and of the
    benchmark at the same model, precision and batch, described by `same`.
    A WARN row when their medians lie more than FAR_APART apart and their IQRs don't overlap: the load
    changed between them, and neither figure describes the model alone; None when they agree."""
    ratio = max(train_ms.median, bench_ms.median) / min(train_ms.median, bench_ms.median)
    overlap = train_ms.q1 <= bench_ms.q3 and bench_ms.q1 <= train_ms.q3
    if ratio <= FAR_APART or overlap:
        return None
    busy = f" ({load})" if load is not None else ""

    def said(s):
        return f"{s.median:,.4g} ms (median, IQR {s.iqr:,.3g}, n={s.n})"

    return Check("step time: train vs amp_benchmark", "WARN", round(ratio, 2), FAR_APART,
                 f"the same step timed {ratio:.1f}x apart: the machine's load changed between the two{busy}; "
                 f"rerun idle; train {said(train_ms)}, amp_benchmark {said(bench_ms)} at {same}")
