"""Precision headroom: is each layer's output range safe for fp16, and how far do bf16/fp16 drift?

Forward hooks on every leaf module record, over the real batches in fp32: the output abs-max
against fp16's largest finite value (65504) and the share of non-zero values below fp16's
smallest normal (6.1e-5, where fp16 loses precision and later flushes to zero). The first batch
is then run again under bf16 and under fp16 autocast and each layer's output is compared with
its fp32 output (relative L2 deviation; errors accumulate along the network, as in training): all of
its sequences, or as many as the probe budget holds, or one where a low precision is emulated. Weights held in
bf16/fp16 are measured as an fp32 copy of the same values, and the rows say so.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.nn as nn

from ..core.budget import gib, row_chunks
from ..core.plotting import category_ticks, decade_limits
from ..core.precision import (
    BASELINE,
    Bf16Mixed,
    Fp16Mixed,
    autocast_precisions,
    dtype_name,
    native_support,
    resolve_precision,
)
from ..core.results import Check
from .common import Context, Outcome, first_tensor, head, on_fp32_weights

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure

# The range is fp16's, the mode whose range runs out (its class says its largest value, 65504, and its smallest
# normal, 6.1e-5); bf16, with fp32's range, is what avoids it.
FP16, BF16 = Fp16Mixed.name, Bf16Mixed.name
FP16_MAX, FP16_TINY = Fp16Mixed.range_max(), Fp16Mixed.smallest_normal()
CARE_FACTOR = 16  # abs-max within 16x (4 bits) of 65504 leaves too little room: fp16 needs care
CARE_UNDERFLOW = 0.05  # more than 5% of a layer's non-zero outputs are fp16-subnormal: fp16 needs care
PREFER, CARE = f"prefer {BF16}", f"{FP16} needs scaling care"  # the recommendations short of "fp16 safe"
DRIFT = 0.05  # relative deviation of the model output from fp32 above this: WARN
# The range columns are fp16's; the deviation columns one per registered autocast mode's compute dtype
# (bf16_rel_dev, fp16_rel_dev), where fp16's also counts its non-finite outputs.
HEADROOM, BELOW_NORMAL, NONFINITE = f"{FP16}_headroom", f"below_{FP16}_normal", f"{FP16}_nonfinite"
BASE_NONFINITE = f"{BASELINE}_nonfinite"  # already in the baseline: no precision can be safe
RANGE = f"{FP16} max {FP16_MAX:g}"  # the plots' line


def _columns(modes: dict) -> list[str]:
    return ["layer", "type", "calls", "abs_max", HEADROOM, BELOW_NORMAL, *(f"{dt}_rel_dev" for dt in modes), NONFINITE,
            BASE_NONFINITE]


def _autocast_modes(dev) -> dict:
    """The registered autocast modes decided on `dev`, one per compute dtype (autocast's result depends on that
    alone), by the dtype's short name."""
    modes = {}
    for name in autocast_precisions():
        prec = resolve_precision(name, dev, warn=False)
        modes.setdefault(dtype_name(prec.compute_dtype), prec)
    return modes


def leaf_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name or type(model).__name__, m) for name, m in model.named_modules() if not any(m.children())]


@contextlib.contextmanager
def tap_outputs(model: nn.Module, on_output):
    """Call `on_output(name, module, tensor)` for every leaf module's floating output."""
    def hook(name, module, args, output):
        tensor = first_tensor(output)
        if tensor is not None:
            on_output(name, module, tensor.detach())

    handles = [m.register_forward_hook(lambda mod, a, out, n=name: hook(n, mod, a, out))
               for name, m in leaf_modules(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _RangeStats:
    def __init__(self):
        self.rows: dict[str, dict] = {}  # insertion order = first call order
        self.bytes = 0  # of every output seen, as fp32

    def __call__(self, name, module, t):
        row = self.rows.setdefault(name, {"type": type(module).__name__, "calls": 0, "abs_max": 0.0,
                                          "nonzero": 0, "tiny": 0, "nonfinite": 0})
        row["calls"] += 1
        for (chunk,) in row_chunks(t):  # in slices: a (batch, length, vocabulary) output's masks stay small
            chunk = chunk.float()
            finite = torch.isfinite(chunk)
            nonzero = chunk != 0
            row["nonfinite"] += int((~finite).sum())  # already in fp32: no precision can be safe
            row["abs_max"] = max(row["abs_max"], float(chunk[finite].abs().max()) if finite.any() else 0.0)
            row["nonzero"] += int(nonzero.sum())
            row["tiny"] += int((nonzero & (chunk.abs() < FP16_TINY)).sum())
        self.bytes += t.numel() * 4


def _outputs(ctx: Context, batch: dict, precision) -> dict[str, list[torch.Tensor]]:
    outs: dict[str, list[torch.Tensor]] = {}
    with tap_outputs(ctx.adapter.model, lambda n, m, t: outs.setdefault(n, []).append(t)), torch.no_grad():
        with precision.autocast():
            ctx.adapter.batch_logits(batch)
    return outs


def _deviation(ref: list[torch.Tensor], low: list[torch.Tensor]) -> tuple[float, int]:
    """(relative L2 deviation over every call, count of non-finite low-precision values).

    inf when the low-precision output overflowed; NaN when the calls don't line up (not comparable).
    """
    if len(ref) != len(low) or any(a.shape != b.shape for a, b in zip(ref, low)):
        return float("nan"), 0
    nonfinite = sum(int((~torch.isfinite(c)).sum()) for b in low for (c,) in row_chunks(b))
    if nonfinite:
        return float("inf"), nonfinite
    pairs = [chunks for a, b in zip(ref, low) for chunks in row_chunks(a, b)]  # slices: small temporaries
    err = sum(float((b.float() - a.float()).pow(2).sum()) for a, b in pairs)
    norm = sum(float(a.float().pow(2).sum()) for a, _ in pairs)
    return (err / norm) ** 0.5 if norm > 0 else 0.0, 0


def run(ctx: Context) -> Outcome:
    return on_fp32_weights(ctx, _run)


def _run(ctx: Context) -> Outcome:
    model = ctx.adapter.model
    stats = _RangeStats()
    out_nonfinite = 0  # the model's own output, which may be computed outside every leaf module
    with tap_outputs(model, stats), torch.no_grad():
        for i, batch in enumerate(ctx.batches):  # fp32 reference: no autocast
            logits = ctx.adapter.batch_logits(batch)
            out_nonfinite += int((~torch.isfinite(logits)).sum())
            if i == 0:
                row_bytes = stats.bytes / len(batch["labels"])
    dev = ctx.adapter.device
    n, scope = _compared_rows(ctx, row_bytes)
    sample = head(ctx.batches[0], n)
    ref = _outputs(ctx, sample, resolve_precision(BASELINE, dev, warn=False))
    modes = _autocast_modes(dev)
    low = {dt: _outputs(ctx, sample, prec) for dt, prec in modes.items()}
    rows = []
    for name, s in stats.rows.items():
        devs = {dt: _deviation(ref.get(name, []), out.get(name, [])) for dt, out in low.items()}
        rows.append({"layer": name, "type": s["type"], "calls": s["calls"], "abs_max": s["abs_max"],
                     HEADROOM: FP16_MAX / s["abs_max"] if s["abs_max"] else float("inf"),
                     BELOW_NORMAL: s["tiny"] / s["nonzero"] if s["nonzero"] else 0.0,
                     **{f"{dt}_rel_dev": d for dt, (d, _) in devs.items()},
                     NONFINITE: devs.get(FP16, (0, 0))[1], BASE_NONFINITE: s["nonfinite"]})
    df = pd.DataFrame(rows, columns=_columns(modes))
    broken = df[df[BASE_NONFINITE] > 0].layer.tolist()
    if broken or out_nonfinite:
        first = df[df[BASE_NONFINITE] > 0].iloc[0] if broken else None
        where = (f"first in {first.layer} ({first[BASE_NONFINITE]} values)" if broken
                 else f"at the model output ({out_nonfinite} values), computed outside every leaf layer")
        reason = f"fp32 outputs are already NaN/inf {where}; no precision is safe until fp32 is finite"
        checks = [Check("recommendation", "FAIL", "fp32 is not finite", "finite fp32 outputs", reason)]
        checks += [Check(f"{prec} drift", "FAIL", None, f"<= {DRIFT} at the output",
                         f"no finite fp32 reference: {reason}") for prec in modes]
        return Outcome(checks, {"headroom": df}, {"drivers": broken})
    recommendation, drivers, status = recommend(df)
    if status == "WARN" and recommendation == PREFER and ctx.precision.range_max() == FP16_MAX:
        status = "FAIL"  # an fp16 mode (mixed or true) was asked for and these layers overflow it
    checks = [Check("recommendation", status, recommendation,
                    f"abs_max < {FP16_MAX:g}/{CARE_FACTOR}, < {CARE_UNDERFLOW:.0%} below {FP16_TINY:.2g}",
                    _explain(df, recommendation, drivers, len(ctx.batches)))]
    checks += [_drift_check(df, prec, scope) for prec in modes]
    return Outcome(checks, {"headroom": df}, {"drivers": drivers})


def _compared_rows(ctx: Context, row_bytes: float) -> tuple[int, str]:
    """How many sequences of the first batch the bf16/fp16 comparison runs on, and why (or "": all of them).

    It holds every layer's output in three precisions at once: as many sequences as the probe budget allows.
    Where a low precision is emulated (no native support: often 10x slower than fp32), one sequence."""
    total = len(ctx.batches[0]["labels"])
    n, why = total, ""
    if ctx.budget is not None and 3 * row_bytes * total > ctx.budget.probe_limit:
        n = max(1, int(ctx.budget.probe_limit // (3 * row_bytes)))
        why = f"every layer's output in 3 precisions, at most {gib(ctx.budget.probe_limit)} here"
    emulated = [p for p in autocast_precisions() if not native_support(p, ctx.adapter.device)[0]]
    if emulated and n > 1:
        n, why = 1, f"{' and '.join(emulated)} emulated on {ctx.adapter.device.type} (slow)"
    return n, f" (on {n} of the first batch's {ctx.adapter.task.rows(total)}: {why})" if n < total else ""


def _drift_check(df: pd.DataFrame, prec: str, scope: str = "") -> Check:
    """Deviation at the model output (the last leaf in execution order, usually the head)."""
    col = f"{prec}_rel_dev"
    if df.empty:
        return Check(f"{prec} drift", "SKIP", None, None, "no layer outputs captured")
    out, worst = df.iloc[-1], df.loc[df[col].fillna(-1.0).idxmax()]
    value = float(out[col])
    status = "PASS" if value <= DRIFT else "WARN"  # inf: the output overflowed
    return Check(f"{prec} drift", status, round(value, 5), f"<= {DRIFT} at the output",
                 f"{out.layer} output deviates {value:.2g} from fp32 under {prec} autocast; largest: "
                 f"{worst.layer} {worst[col]:.2g}{scope}")


def recommend(df: pd.DataFrame) -> tuple[str, list[str], str]:
    """(recommendation, the layers that drive it, status) from the per-layer table."""
    over = df[df.abs_max > FP16_MAX].layer.tolist()
    if not over and (df[NONFINITE] > 0).any():
        over = df[df[NONFINITE] > 0].layer.tolist()[:1]  # the first layer to produce inf/NaN under fp16
    if over:
        return PREFER, over, "WARN"
    # Many subnormal outputs only matter if they cost accuracy: a layer whose own fp16 output was measured
    # within DRIFT of fp32 (softmax tails, small-init projections) lost nothing measurable. Range can't be
    # cleared that way: activations grow in training.
    care = df[(df.abs_max > FP16_MAX / CARE_FACTOR) | (_underflow(df) & ~_within_drift(df))].layer.tolist()
    if care:
        return CARE, care, "WARN"
    return f"{FP16} safe", [], "PASS"


def _underflow(df: pd.DataFrame) -> pd.Series:
    return df[BELOW_NORMAL] > CARE_UNDERFLOW


def _within_drift(df: pd.DataFrame) -> pd.Series:
    return df[f"{FP16}_rel_dev"] <= DRIFT  # NaN (not comparable) and inf (overflow) are not


def _explain(df: pd.DataFrame, recommendation: str, drivers: list[str], n_batches: int) -> str:
    named = ", ".join(drivers[:5]) + (f" and {len(drivers) - 5} more" if len(drivers) > 5 else "")
    if recommendation == PREFER:
        peak = df[df.layer.isin(drivers)].abs_max.max()
        return (f"{named} output up to {peak:.3g} (> {RANGE}, inf under {FP16}); {BF16} has {BASELINE}'s range "
                f"({n_batches} batches)")
    if recommendation == CARE:
        return (f"{named} within {CARE_FACTOR}x of {FP16_MAX:g} or > {CARE_UNDERFLOW:.0%} {FP16}-subnormal outputs; "
                f"{FP16} works with care, {BF16} avoids it ({n_batches} batches)")
    if df.empty:
        return "no layer outputs captured"
    top = df.loc[df.abs_max.idxmax()]
    text = (f"largest output {top.abs_max:.3g} ({top.layer}) leaves {top[HEADROOM]:.0f}x headroom; at most "
            f"{df[BELOW_NORMAL].max():.1%} subnormal in any layer ({n_batches} batches)")
    harmless = df[_underflow(df) & _within_drift(df)]
    if len(harmless):
        drift = harmless[f"{FP16}_rel_dev"]
        worst = harmless.loc[drift.idxmax()]
        text += (f"; {len(harmless)} layer(s) have > {CARE_UNDERFLOW:.0%} of outputs below {FP16}'s smallest normal "
                 f"(e.g. {worst.layer}, {worst[BELOW_NORMAL]:.1%}), but {FP16} autocast kept their outputs within "
                 f"{drift.max():.2g} of {BASELINE} (measured, <= {DRIFT}): no measurable cost")
    return text


def plot(outcome: Outcome) -> Figure:
    """Per layer: output abs-max against fp16's max, and deviation from fp32 under bf16 / fp16."""
    df = outcome.frames["headroom"]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(8, 0.28 * len(df)), 6.5), layout="constrained")
    ax_range, ax_dev = fig.subplots(2, 1, sharex=True)
    x = range(len(df))
    drivers = set(outcome.artifacts["drivers"])
    from matplotlib.patches import Patch

    ax_range.bar(x, df.abs_max.clip(lower=1e-12), color=["C3" if n in drivers else "C0" for n in df.layer])
    limit = ax_range.axhline(FP16_MAX, color="k", ls="--", lw=1, label=RANGE)
    ax_range.set(yscale="log", ylabel="output abs-max (fp32)")
    keys = [Patch(color="C3", label="drives the recommendation")] if drivers else []
    ax_range.legend(handles=[*keys, Patch(color="C0", label="other layers" if drivers else "layer"), limit], fontsize=8)
    for i, prec in enumerate(c[:-len("_rel_dev")] for c in df.columns if c.endswith("_rel_dev")):
        dev, color = df[f"{prec}_rel_dev"], f"C{(2 - i) % 10}"  # bf16 green, fp16 orange, as before
        ax_dev.plot(x, dev.where(dev > 0), marker=".", color=color, label=prec)  # exact (0) has no log: a gap
    ax_dev.set_yscale("log")
    decade_limits(ax_dev)
    ax_dev.set_ylabel("relative deviation from fp32")
    ax_dev.set_title("under autocast (a gap: that layer's output is exact)", fontsize=9)
    ax_dev.legend(fontsize=8)
    ax_dev.set_xlabel("leaf layer (execution order)")
    category_ticks(ax_dev, list(df.layer))
    fig.suptitle("Precision headroom per layer (execution order; red: drives the recommendation)")
    return fig


def panel(ax, outcome: Outcome) -> None:
    df = outcome.frames["headroom"]
    ax.bar(range(len(df)), df.abs_max.clip(lower=1e-12), color="C0")
    ax.axhline(FP16_MAX, color="k", ls="--", lw=1, label=RANGE)
    ax.set(yscale="log", xlabel="leaf layer (execution order)", ylabel="output abs-max (fp32)",
           title=f"output abs-max vs {FP16} max")
    ax.legend(fontsize=7)
