"""The AMP benchmark's figure: throughput with IQR bars, stacked memory, loss curves, fp16 loss scale."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure

_MIB = 2**20


def plot_benchmark(result) -> Figure:
    from matplotlib.figure import Figure

    from .analysis.common import message_figure

    ran = [r for r in result.records if r["speed"] is not None]  # neither skipped nor stopped
    if not ran:
        stopped = next((r["stopped"] for r in result.records if r["stopped"]), "no precision was timed")
        return message_figure("AMP benchmark: nothing measured", stopped)
    names = [r["precision"] for r in ran]
    fig = Figure(figsize=(12, 8), layout="constrained")
    ax_speed, ax_mem, ax_loss, ax_scale = fig.subplots(2, 2).ravel()
    device = result.metadata["device_name"]
    fig.suptitle(f"AMP benchmark: {result.config['model']} on {device} (torch {result.metadata['torch']})")

    tps = [r["speed"]["tokens_per_s"] for r in ran]
    err = [[s["median"] - s["q1"] for s in tps], [s["q3"] - s["median"] for s in tps]]
    ax_speed.bar(names, [s["median"] for s in tps], yerr=err, capsize=6, color="tab:blue")
    ax_speed.set_title(f"throughput, median and IQR of n={result.config['repeats']} repeats")
    ax_speed.set_ylabel("tokens / s")

    bottom = [0.0] * len(ran)
    for key, label in (("weights_bytes", "weights"), ("grads_bytes", "gradients"),
                       ("optimizer_state_bytes", "optimizer state"), ("activation_bytes", "activations")):
        heights = [r["memory"][key] / _MIB for r in ran]
        ax_mem.bar(names, heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax_mem.set_title("memory of one training step (saved-tensor accounting)")
    ax_mem.set_ylabel("MiB")
    ax_mem.legend(fontsize="small")

    curves = [r for r in ran if r["accuracy"]]
    for r in curves:
        ax_loss.plot(r["accuracy"]["loss_curve"], label=r["precision"])
    ax_loss.set_title("training loss, same start and batches")
    ax_loss.set_xlabel("applied optimizer update")
    if curves:
        ax_loss.legend()

    scaled = [r for r in curves if r["accuracy"]["loss_scale"]]
    for r in scaled:
        ax_scale.plot(r["accuracy"]["loss_scale"], label=f"{r['precision']} ({r['accuracy']['skipped_steps']} skipped)")
    ax_scale.set_title("GradScaler loss scale")
    ax_scale.set_xlabel("attempted step (a skipped one is retried)")
    if scaled:
        ax_scale.set_yscale("log")
        ax_scale.legend()
    else:
        ax_scale.text(0.5, 0.5, "no fp16 accuracy run\n(the loss scale exists only for fp16)",
                      ha="center", va="center", transform=ax_scale.transAxes)
    return fig
