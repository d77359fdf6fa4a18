"""Training history and `TrainResult`.

Per-step loss and grad-norm tensors stay on the device until a log point, where one host transfer
brings the whole window back, the first non-finite step (if any) is found, and the window becomes
one `step` row. `eval` rows carry validation metrics, `epoch` rows whole-epoch aggregates.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import pandas as pd
import torch

from .measure import StepTimer, summarize
from .results import Result, atomic_write_bytes, jsonable

HISTORY_COLUMNS = ["kind", "step", "epoch", "train_loss", "val_loss", "perplexity", "accuracy", "grad_norm", "lr",
                   "loss_scale", "skipped_steps", "tokens_per_s", "step_time_ms", "max_memory_mb", "gpu_util_pct"]
MAX_STEP_ROWS = 2000  # step rows are aggregated so a run of any length keeps at most about this many
NAN = float("nan")


def _acc() -> dict:
    return {"steps": 0, "loss_sum": 0.0, "loss_n": 0, "gn_sum": 0.0, "gn_n": 0, "skipped": 0, "tokens": 0,
            "time_ms": 0.0, "lr": NAN, "scale": NAN}


def _mean(total: float, n: int) -> float:
    return total / n if n else NAN


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


class History:
    """Rows of a run. `record()` each step; `sync()` at log points; `emit()` / `eval_row()` / `epoch_row()`."""

    def __init__(self, device: torch.device, reduce_mean=None):
        self.device = device
        self.reduce_mean = reduce_mean or (lambda t: t)
        self.rows: list[dict] = []
        self.timer = StepTimer(device)
        self.skipped_total = 0
        self.loss_scale_trace: list[tuple[int, float, float]] = []
        self._pending: list[tuple] = []  # (step, loss tensor, grad-norm tensor, skipped, scale, lr, tokens)
        self._window, self._epoch = _acc(), _acc()

    def record(self, step: int, out, lr: float, tokens: int) -> None:
        self._pending.append((step, out.loss, out.grad_norm, out.skipped, out.scale_after, lr, tokens))
        if out.skipped:
            self.skipped_total += 1
        if out.scale_before is not None and out.scale_after != out.scale_before:
            # Only changes are kept (skips and growths): the trace stays small however long the run.
            self.loss_scale_trace.append((step, out.scale_before, out.scale_after))

    def sync(self) -> tuple[int, float, str] | None:
        """Bring pending steps to the host (one transfer); (step, value, "loss"|"gradient norm") of the first
        diverged one, or None.

        A step diverged when its loss or grad norm is non-finite and no GradScaler skipped it.
        Steps before it are kept; it and the steps after are dropped.
        """
        if not self._pending:
            return None
        values = torch.stack([torch.stack((p[1].float(), p[2].float())) for p in self._pending])
        values = self.reduce_mean(values).tolist()
        pending, self._pending = self._pending, []
        for (step, _, _, skipped, scale, lr, tokens), (loss, gn) in zip(pending, values):
            bad = next(((v, q) for v, q in ((loss, "loss"), (gn, "gradient norm")) if not math.isfinite(v)), None)
            if bad is not None and not skipped:
                return step, *bad
            for acc in (self._window, self._epoch):
                acc["steps"] += 1
                acc["tokens"] += tokens
                acc["lr"], acc["scale"] = lr, NAN if scale is None else scale
                if skipped:
                    acc["skipped"] += 1
                else:
                    acc["loss_sum"] += loss
                    acc["loss_n"] += 1
                    acc["gn_sum"] += gn
                    acc["gn_n"] += 1
        return None

    def _row(self, kind: str, step: int, epoch: float, acc: dict, metrics: dict | None = None) -> dict:
        metrics = metrics or {}
        time_ms = acc["time_ms"]
        row = {"kind": kind, "step": step, "epoch": epoch, "train_loss": _mean(acc["loss_sum"], acc["loss_n"]),
               "val_loss": metrics.get("val_loss", NAN), "perplexity": metrics.get("perplexity", NAN),
               "accuracy": metrics.get("accuracy", NAN), "grad_norm": _mean(acc["gn_sum"], acc["gn_n"]),
               "lr": acc["lr"], "loss_scale": acc["scale"], "skipped_steps": acc["skipped"],
               "tokens_per_s": acc["tokens"] / (time_ms / 1e3) if time_ms > 0 else NAN,
               "step_time_ms": _mean(time_ms, acc["steps"]), **_gpu_stats(self.device)}
        self.rows.append(row)
        return row

    def emit(self, step: int, epoch: float) -> dict | None:
        """Close the window (call `sync()` first) into a `step` row; None if it holds no step."""
        ms = sum(self.timer.milliseconds())
        self.timer = StepTimer(self.device)
        self._window["time_ms"] += ms
        self._epoch["time_ms"] += ms
        if not self._window["steps"]:
            return None
        row = self._row("step", step, epoch, self._window)
        self._window = _acc()
        return row

    def eval_row(self, step: int, epoch: float, metrics: dict, lr: float) -> dict:
        return self._row("eval", step, epoch, {**_acc(), "lr": lr}, metrics)

    def epoch_row(self, step: int, epoch: float, metrics: dict) -> dict:
        row = self._row("epoch", step, epoch, self._epoch, metrics)
        self._epoch = _acc()
        return row

    def last(self, kind: str) -> dict | None:
        return next((r for r in reversed(self.rows) if r["kind"] == kind), None)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=HISTORY_COLUMNS)

    def state_dict(self) -> dict:
        """Plain containers for a checkpoint (call `sync()` first: pending tensors are not saved)."""
        return {"rows": [dict(r) for r in self.rows], "window": dict(self._window), "epoch": dict(self._epoch),
                "skipped_total": self.skipped_total, "loss_scale_trace": [list(t) for t in self.loss_scale_trace]}

    def load_state_dict(self, state: dict) -> None:
        self.rows = [dict(r) for r in state["rows"]]
        self._window, self._epoch = dict(state["window"]), dict(state["epoch"])
        self.skipped_total = state["skipped_total"]
        self.loss_scale_trace = [tuple(t) for t in state["loss_scale_trace"]]


def _gpu_stats(device: torch.device) -> dict:
    """Peak allocated memory and utilisation through torch (never an nvidia-smi subprocess)."""
    if device.type != "cuda":
        return {"max_memory_mb": NAN, "gpu_util_pct": NAN}
    try:
        util = float(torch.cuda.utilization(device))
    except Exception:  # needs pynvml / amdsmi; absent is normal
        util = NAN
    return {"max_memory_mb": torch.cuda.max_memory_allocated(device) / 2**20, "gpu_util_pct": util}


def step_stats(history: pd.DataFrame, column: str) -> dict | None:
    """Median and spread of a per-step-row figure (n = step rows), or None when there are none."""
    xs = history.loc[history["kind"] == "step", column].dropna()
    return summarize(xs).to_dict() if len(xs) else None


@dataclass
class TrainResult(Result):
    """What `train()` returns (also attached, partial, to `TrainingDiverged.result`)."""

    history: pd.DataFrame
    summary: dict
    model: torch.nn.Module = field(repr=False)
    skipped_steps: int = 0
    loss_scale_trace: list = field(default_factory=list)
    interrupted: bool = False
    config: dict = field(default_factory=dict)

    @property
    def table(self) -> pd.DataFrame:
        """The summary as (metric, value) rows; nested figures flattened to dotted names."""
        rows = []
        for key, value in self.summary.items():
            if isinstance(value, dict):
                rows += [(f"{key}.{k}", v) for k, v in value.items()]
            else:
                rows.append((key, value))
        return pd.DataFrame(rows, columns=["metric", "value"])

    def plot(self):
        from matplotlib.figure import Figure

        h = self.history
        steps, evals = h[h["kind"] == "step"], h[h["kind"].isin(["eval", "epoch"])]
        fig = Figure(figsize=(11, 7), layout="constrained")
        (ax_loss, ax_lr), (ax_gn, ax_scale) = fig.subplots(2, 2)
        ax_loss.plot(steps["step"], steps["train_loss"], label="train")
        ax_loss.plot(evals["step"], evals["val_loss"], "o-", label="val")
        ax_loss.set(title="loss", xlabel="step")
        ax_loss.legend()
        ax_lr.plot(steps["step"], steps["lr"])
        ax_lr.set(title="learning rate", xlabel="step")
        ax_gn.plot(steps["step"], steps["grad_norm"])
        ax_gn.set(title="gradient norm (before clipping)", xlabel="step")
        if steps["loss_scale"].notna().any():
            ax_scale.step(steps["step"], steps["loss_scale"], where="post")
            ax_scale.set_yscale("log", base=2)
            ax_scale.set(title=f"fp16 loss scale ({self.skipped_steps} skipped steps)", xlabel="step")
        else:
            ax_scale.set_axis_off()
            ax_scale.text(0.5, 0.5, f"no loss scaler in {self.summary.get('precision', '?')}",
                          ha="center", va="center")
        fig.suptitle(f"{self.summary.get('model', '')} · {self.summary.get('precision', '')} · "
                     f"{self.summary.get('device_name', '')}")
        return fig

    def to_csv(self, path):
        return atomic_write_bytes(path, self.history.to_csv(index=False).encode())

    def save_plot(self, path):
        buf = io.BytesIO()
        self.plot().savefig(buf, format="png", dpi=100)
        return atomic_write_bytes(path, buf.getvalue())

    def to_json(self) -> dict:
        return jsonable({"summary": self.summary, "interrupted": self.interrupted, "skipped_steps": self.skipped_steps,
                         "loss_scale_trace": self.loss_scale_trace, "config": self.config, "history": self.history})
