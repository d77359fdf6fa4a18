"""Per-op dtype report: under bf16 and fp16 autocast, which aten ops ran in low precision and which in fp32.

A TorchDispatchMode sits below autocast, so it sees each op after autocast's casts, with the dtype
the op really computed in. Forward + loss run, as in a training step (the backward follows the
forward's dtypes). View ops (reshape, transpose, detach...) compute nothing and are left out;
`_to_copy` rows are the casts autocast inserted. Weights held in bf16/fp16 are recorded on an fp32 copy (what a
mixed-precision training step runs), and the rows say so.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..core.precision import autocast_precisions, resolve_precision
from ..core.results import Check
from .common import Context, Outcome, head, on_fp32_weights

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure

COLUMNS = ["autocast", "op", "dtype", "count"]
SAMPLE_TOKENS = 16


class OpDtypeRecorder(TorchDispatchMode):
    """Counts (op name, output dtype) for every floating-point, non-view aten op run inside it."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not getattr(func, "is_view", False):
            dtype = next((t.dtype for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()),
                         None)
            if dtype is not None:
                self.counts[(func.overloadpacket.__name__, str(dtype).replace("torch.", ""))] += 1
        return out


def op_dtypes(ctx: Context, batch: dict, precision: str) -> pd.DataFrame:
    """The (op, dtype, count) table for one forward + loss of `batch` under `precision` autocast."""
    prec = resolve_precision(precision, ctx.adapter.device, warn=False)
    recorder = OpDtypeRecorder()
    with torch.enable_grad(), prec.autocast(), recorder:  # grad on: the code path a training step takes
        ctx.adapter.forward_loss(batch)
    rows = [{"autocast": precision, "op": op, "dtype": dt, "count": n} for (op, dt), n in recorder.counts.items()]
    return pd.DataFrame(rows, columns=COLUMNS).sort_values(["dtype", "count", "op"], ascending=[True, False, True])


def _summary(df: pd.DataFrame, dtype: str, limit: int = 6) -> str:
    sub = df[(df.dtype == dtype) & (df.op != "_to_copy")]
    listed = ", ".join(f"{r.op} x{r.count}" for r in sub.head(limit).itertuples())
    return listed + (f", +{len(sub) - limit} more" if len(sub) > limit else "") if listed else "none"


def run(ctx: Context) -> Outcome:
    return on_fp32_weights(ctx, _run)


def _run(ctx: Context) -> Outcome:
    frames, checks = [], []
    # Which dtype an op computes in does not depend on the batch's size: one short sequence shows it, in a
    # fraction of the time (an emulated fp16 forward of a big model takes minutes on a CPU).
    sample = head(ctx.batches[0], 1, SAMPLE_TOKENS)
    for precision in autocast_precisions():  # the registered autocast modes (bf16, fp16)
        df = op_dtypes(ctx, sample, precision)
        frames.append(df)
        compute = df[df.op != "_to_copy"]
        low_dtype = str(resolve_precision(precision, ctx.adapter.device, warn=False).compute_dtype)[len("torch."):]
        low = int(compute[compute.dtype == low_dtype]["count"].sum())
        total = int(compute["count"].sum())
        casts = int(df[df.op == "_to_copy"]["count"].sum())
        detail = (f"{low_dtype}: {_summary(df, low_dtype)}; float32: "
                  f"{_summary(df, 'float32')}; {casts} casts")
        status = "PASS" if low else "WARN"
        if not low:
            detail = "no op ran in low precision: autocast found nothing it lowers (no matmul/linear/conv?); " + detail
        checks.append(Check(f"{precision} autocast", status, f"{low}/{total} ops low precision", None, detail))
    return Outcome(checks, {"dtypes": pd.concat(frames, ignore_index=True)})


def plot(outcome: Outcome) -> Figure:
    """Op counts by dtype, one panel per autocast precision (casts left out)."""
    df = outcome.frames["dtypes"]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    modes = list(dict.fromkeys(df.autocast))  # the modes run, in their order
    axes = fig.subplots(1, len(modes), squeeze=False)[0]
    for ax, precision in zip(axes, modes):
        sub = df[(df.autocast == precision) & (df.op != "_to_copy")]
        grid = sub.pivot_table(index="op", columns="dtype", values="count", aggfunc="sum", fill_value=0)
        grid = grid.loc[grid.sum(axis=1).sort_values().index]
        grid.plot.barh(ax=ax, stacked=True, fontsize=7)
        ax.set(title=f"{precision} autocast", xlabel="calls (forward + loss, one batch)", ylabel="op")
    fig.suptitle("Ops by output dtype (casts left out)")
    return fig


def panel(ax, outcome: Outcome) -> None:
    df = outcome.frames["dtypes"]
    sub = df[df.op != "_to_copy"].pivot_table(index="autocast", columns="dtype", values="count", aggfunc="sum",
                                               fill_value=0)
    sub.plot.bar(ax=ax, stacked=True, rot=0)
    ax.set(ylabel="op calls", xlabel="autocast precision", title="ops by dtype under autocast")
    ax.legend(title="output dtype", fontsize=7, title_fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
