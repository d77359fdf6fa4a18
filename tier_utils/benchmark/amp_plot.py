"""The AMP benchmark's figure: throughput with IQR bars, stacked memory, loss curves, fp16 loss scale."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.plotting import caption, integer_axis, power_of_two_axis
from ..tasks import task_named
from .record import MIB

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure


def plot_benchmark(result) -> Figure:
    from matplotlib.figure import Figure

    from ..analysis.common import message_figure

    ran = [r for r in result.records if r.speed is not None]  # neither skipped nor stopped
    if not ran:
        stopped = next((r.stopped for r in result.records if r.stopped), "no precision was timed")
        return message_figure("AMP benchmark: nothing measured", stopped)
    shown = [r.memory_row or ("" if r.mode == "eager" else r.mode) for r in ran]  # a memory row by its name
    names = [r.precision + (f" {what}" if what else "") for r, what in zip(ran, shown)]
    ticks = [r.precision + (f"\n{what}" if what else "") for r, what in zip(ran, shown)]  # bar labels, two lines
    curves = [(name, r) for name, r in zip(names, ran) if r.accuracy]
    scaled = [(name, r) for name, r in curves if r.accuracy["loss_scale"]]
    # The loss-scale panel only when an fp16 run has a trace: no empty panel on fp32/bf16-only runs.
    fig = Figure(figsize=(12, 8) if scaled else (15, 4.5), layout="constrained")
    axes = fig.subplots(2, 2).ravel() if scaled else fig.subplots(1, 3)
    ax_speed, ax_mem, ax_loss = axes[:3]
    device = result.metadata["device_name"]
    cfg = result.config.settings
    fig.suptitle(f"AMP benchmark: {result.config.model} on {device} (torch {result.metadata['torch']})")

    tps = [r.speed.tokens_per_s for r in ran]
    err = [[s.median - s.q1 for s in tps], [s.q3 - s.median for s in tps]]
    ax_speed.bar(ticks, [s.median for s in tps], yerr=err, capsize=6, color="tab:blue")
    ax_speed.set(title=f"throughput, median and IQR of n={cfg.repeats} repeats", ylabel="tokens / s",
                 xlabel="precision")

    _memory_panel(ax_mem, ticks, ran)

    for name, r in curves:
        curve = r.accuracy["loss_curve"]
        ax_loss.plot(range(1, len(curve) + 1), curve, label=name)
    ax_loss.set(title="training loss, same start and batches", xlabel="applied optimizer update",
                ylabel="cross-entropy (nats)")
    if curves:
        ax_loss.legend()
    else:
        ax_loss.text(0.5, 0.5, "no accuracy run (accuracy_steps=0)", ha="center", va="center",
                     transform=ax_loss.transAxes)

    if scaled:
        _loss_scale_panel(axes[3], scaled)
    for ax in axes[2:]:
        integer_axis(ax.xaxis)
    rows = [r for r in result.records if r.memory_row is not None]
    caption(fig, f"every precision starts from the same weights and sees the same batches · speed: "
                 f"{cfg.repeats} interleaved repeats of {cfg.timed_steps} timed steps, "
                 f"{task_named(result.config.task).batch_words(cfg.batch_size, cfg.seq_len)}, "
                 f"{result.metadata['threads']} threads"
                 + (f" · memory rows {', '.join(r.memory_row for r in rows)}: their settings in .table"
                    if rows else ""))
    return fig


def _memory_panel(ax, ticks: list[str], ran: list) -> None:
    """One training step's memory per precision, stacked: weights, gradients, optimizer state, activations."""
    bottom = [0.0] * len(ran)
    for key, label in (("weights_bytes", "weights"), ("grads_bytes", "gradients"),
                       ("optimizer_state_bytes", "optimizer state"), ("activation_bytes", "activations")):
        heights = [r.memory[key] / MIB for r in ran]
        ax.bar(ticks, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set(title="memory of one training step (saved-tensor accounting)", ylabel="MiB", xlabel="precision")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))  # beside the bars, never over them


def _loss_scale_panel(ax, scaled: list[tuple[str, object]]) -> None:
    """fp16's GradScaler loss scale at every attempted step, one line per (name, record) with a trace."""
    for name, r in scaled:
        trace, skipped = r.accuracy["loss_scale"], r.accuracy["skipped_steps"]
        ax.plot(range(1, len(trace) + 1), trace, label=f"{name} ({skipped} skipped)")
    ax.set(title="GradScaler loss scale", ylabel="loss scale", xlabel="attempted step (a skipped one is retried)")
    power_of_two_axis(ax, [v for _, r in scaled for v in r.accuracy["loss_scale"]])
    ax.legend()
