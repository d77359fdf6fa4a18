"""Training history and `TrainResult`.

Per-step loss and grad-norm tensors stay on the device until a log point, where one host transfer
brings the whole window back, the first non-finite step (if any) is found, and the window becomes
one `step` row. `eval` rows carry validation metrics, `epoch` rows whole-epoch aggregates.
`max_memory_mb` (CUDA) is the peak allocated during what a row covers: a step row its window, an
epoch row its epoch, an eval row the time since the row before it (the evaluation, mostly).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..core.files import atomic_write_bytes, jsonable
from ..core.measure import Stats, StepTimer, summarize
from ..core.plotting import caption, integer_axis, power_of_two_axis, save_png
from ..core.results import Result
from ..engine.generation import Generated
from . import versus_base

if TYPE_CHECKING:
    from .config import TrainConfig

HISTORY_COLUMNS = ["kind", "step", "epoch", "train_loss", "val_loss", "perplexity", "accuracy", "grad_norm", "lr",
                   "loss_scale", "skipped_steps", "tokens_per_s", "step_time_ms", "max_memory_mb", "gpu_util_pct"]
MAX_STEP_ROWS = 2000  # step rows are aggregated so a run of any length keeps at most about this many
NAN = float("nan")


def _acc() -> dict:
    return {"steps": 0, "loss_sum": 0.0, "loss_n": 0, "gn_sum": 0.0, "gn_n": 0, "skipped": 0, "tokens": 0,
            "time_ms": 0.0, "lr": NAN, "scale": NAN, "peak_mb": NAN}


def _mean(total: float, n: int) -> float:
    return total / n if n else NAN


class History:
    """Rows of a run. `record()` each step; `sync()` at log points; `emit()` / `eval_row()` / `epoch_row()`."""

    def __init__(self, device: torch.device, reduce_mean=None):
        self.device = device
        self.reduce_mean = reduce_mean or (lambda t: t)
        self.rows: list[dict] = []
        self.timer = StepTimer(device)
        self.skipped_total = 0
        # The first step whose loss and whose gradient norm were not finite, skipped or not: (step, value) by name.
        self.first_nonfinite: dict[str, tuple[int, float]] = {}
        self.loss_scale_trace: list[tuple[int, float, float]] = []
        self._pending: list[tuple] = []  # (step, StepOutput, lr, tokens)
        self._window, self._epoch = _acc(), _acc()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)  # peaks count from the start of this run

    def record(self, step: int, out, lr: float, tokens: int) -> None:
        self._pending.append((step, out, lr, tokens))

    def sync(self) -> tuple[int, float, str] | None:
        """Bring pending steps to the host (one transfer); (step, value, "loss"|"gradient norm"|"loss scale")
        of the first diverged one, or None.

        A step diverged when its loss or grad norm is non-finite and no GradScaler skipped it, or
        when it was skipped and the loss scale collapsed (`StepOutput.scale_collapsed`).
        Steps before it are kept (skip count and loss-scale trace too); it and the steps after are dropped.
        """
        if not self._pending:
            return None
        values = torch.stack([torch.stack((o.loss.float(), o.grad_norm.float())) for _, o, _, _ in self._pending])
        values = self.reduce_mean(values).tolist()
        pending, self._pending = self._pending, []
        for (step, out, lr, tokens), (loss, gn) in zip(pending, values):
            skipped = out.skipped
            for value, name in ((loss, "loss"), (gn, "gradient norm")):
                if not math.isfinite(value):
                    self.first_nonfinite.setdefault(name, (step, value))
            bad = next(((v, q) for v, q in ((loss, "loss"), (gn, "gradient norm")) if not math.isfinite(v)), None)
            if bad is not None and not skipped:
                return step, *bad
            if out.scale_collapsed:
                return step, out.scale_after, "loss scale"
            self.skipped_total += bool(skipped)
            if out.scale_before is not None and out.scale_after != out.scale_before:
                # Only changes are kept (skips and growths): the trace stays small however long the run.
                self.loss_scale_trace.append((step, out.scale_before, out.scale_after))
            for acc in (self._window, self._epoch):
                acc["steps"] += 1
                acc["tokens"] += tokens
                acc["lr"], acc["scale"] = lr, NAN if out.scale_after is None else out.scale_after
                if skipped:
                    acc["skipped"] += 1
                else:
                    acc["loss_sum"] += loss
                    acc["loss_n"] += 1
                    acc["gn_sum"] += gn
                    acc["gn_n"] += 1
        return None

    def _fold_peak(self, *accs: dict) -> None:
        """Read (and reset) the device's peak since the last reading into each accumulator, once each."""
        peak = _take_peak_mb(self.device)
        for a in {id(x): x for x in accs}.values():
            a["peak_mb"] = peak if math.isnan(a["peak_mb"]) else max(a["peak_mb"], peak)

    def close_training_peak(self) -> None:
        """Call before an evaluation: the training steps' peak goes to their rows, not the evaluation's."""
        self._fold_peak(self._window, self._epoch)

    def _row(self, kind: str, step: int, epoch: float, acc: dict, metrics: dict | None = None) -> dict:
        metrics = metrics or {}
        time_ms = acc["time_ms"]
        # An evaluation's peak belongs to its own row and its epoch, never to the next step row.
        self._fold_peak(*((acc, self._epoch) if kind == "eval" else (acc, self._window, self._epoch)))
        row = {"kind": kind, "step": step, "epoch": epoch, "train_loss": _mean(acc["loss_sum"], acc["loss_n"]),
               "val_loss": metrics.get("val_loss", NAN), "perplexity": metrics.get("perplexity", NAN),
               "accuracy": metrics.get("accuracy", NAN), "grad_norm": _mean(acc["gn_sum"], acc["gn_n"]),
               "lr": acc["lr"], "loss_scale": acc["scale"], "skipped_steps": acc["skipped"],
               "tokens_per_s": acc["tokens"] / (time_ms / 1e3) if time_ms > 0 else NAN,
               "step_time_ms": _mean(time_ms, acc["steps"]), "max_memory_mb": acc["peak_mb"],
               "gpu_util_pct": _gpu_util(self.device)}
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
                "skipped_total": self.skipped_total, "loss_scale_trace": [list(t) for t in self.loss_scale_trace],
                "first_nonfinite": {k: list(v) for k, v in self.first_nonfinite.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.rows = [dict(r) for r in state["rows"]]
        self._window, self._epoch = {**_acc(), **state["window"]}, {**_acc(), **state["epoch"]}
        self.skipped_total = state["skipped_total"]
        self.loss_scale_trace = [tuple(t) for t in state["loss_scale_trace"]]
        # A checkpoint written before this was recorded has none to give.
        self.first_nonfinite = {k: tuple(v) for k, v in state.get("first_nonfinite", {}).items()}


def _take_peak_mb(device: torch.device) -> float:
    """Peak allocated MiB since the previous call (or the run's start), then the peak restarts; NaN off CUDA."""
    if device.type != "cuda":
        return NAN
    peak = torch.cuda.max_memory_allocated(device) / 2**20
    torch.cuda.reset_peak_memory_stats(device)
    return peak


def _gpu_util(device: torch.device) -> float:
    """Utilisation through torch, never by running a monitoring subprocess."""
    if device.type != "cuda":
        return NAN
    try:
        return float(torch.cuda.utilization(device))
    except Exception:  # needs pynvml / amdsmi; absent is normal
        return NAN


def step_stats(history: pd.DataFrame, column: str) -> Stats | None:
    """Median and spread of a per-step-row figure (n = step rows), or None when there are none."""
    xs = history.loc[history["kind"] == "step", column].dropna()
    return summarize(xs) if len(xs) else None


@dataclass
class TrainSummary:
    """A run's figures and metadata (None: not measured yet); `to_dict()` is the JSON's `summary`."""

    model: str
    task: str
    parameters: int
    data: str  # what it trained on, e.g. "text file notes.txt"
    tokenizer: str  # what turned it into ids
    validation: str  # how the validation part was made
    steps: int
    total_steps: int
    epochs: float
    train_loss: float | None
    val_loss: float | None
    perplexity: float | None
    accuracy: float | None
    val_targets: int | None  # the n behind val_loss and accuracy
    skipped_steps: int | None  # steps a GradScaler skipped (None: the precision has none)
    precision: str
    precision_reason: str
    device: str
    device_name: str
    tokens_per_s: Stats | None  # step_stats over the step rows
    step_time_ms: Stats | None
    optimizer: str
    compiled: bool
    compile_s: float | None
    compile_reason: str
    global_batch: int
    world_size: int
    rank: int
    resumed_from_step: int | None
    checkpoint: str | None
    interrupted: bool
    diverged_at_step: int | None  # the step TrainingDiverged names (None: the run did not diverge)
    run_metadata: dict
    best_val_loss: float | None = None  # the lowest val loss of any evaluation, and its step
    best_step: int | None = None
    best_checkpoint: str | None = None  # best.pt, holding best_step's state
    early_stopped_at_step: int | None = None  # None: ran its steps (or was interrupted / diverged)
    early_stop_reason: str | None = None
    weights: str | None = None  # restore_best: which weights the returned model holds
    hf_folder: str | None = None  # the save_pretrained folder save_hf wrote
    hf_detail: str | None = None  # which weights went into it, whether its tokenizer did, or why it was not written
    stored_dtype: str | None = None  # what the loaded weights were stored in (the loader's record)
    master_dtype: str | None = None  # what the run held them in: the parameters' dtype, read at the end
    weights_detail: str | None = None  # the precision's statement: "weights stored bf16 → fp32 master weights, ..."
    activation_checkpointing: str | None = None  # how many blocks, and how (None: off)
    lora: dict | None = None  # engine.lora.describe_lora: r, targets, trainable share, base dtype (None: off)
    memory: dict | None = None  # the decided memory settings (DecidedMemory.to_dict): base and adapter dtypes, why
    # A 4-bit base (engine.quantization.describe_quantized): which layers are NF4, which stayed in the base dtype
    # (embeddings, head), the compute dtype (None: no 4-bit base).
    quantized: str | None = None
    strategy: str | None = None  # the distributed strategy's name (engine/strategies.py)
    # How the strategy holds the model on its ranks (its own description; None: one process). FSDP: what
    # fully_shard wrapped, the MixedPrecisionPolicy, reshard_after_forward.
    sharding: str | None = None
    param_bytes_per_rank: int | None = None  # the parameter bytes this rank holds (its shard under fsdp)
    consolidated: str | None = None  # fsdp with consolidate: the unsharded last.pt rank 0 wrote
    # A generating task's last evaluation (engine.generation.Generated.to_dict: chrF, BLEU, exact match, samples),
    # or {"skipped": why}; None: the task generates nothing.
    generation: dict | None = None
    # Chat or instruction data (data.chat_reading.ChatReading.to_dict): the format, which tokens were scored and
    # their share, the template and its end of turn, the rows left out, example 0 with its scored part marked.
    chat: dict | None = None
    diverged: str | None = None  # TrainingDiverged's line: the step, and the likeliest cause the run saw
    unit: str = "token"  # what tokens_per_s counts (the task's unit: an image classifier's images)
    top5_accuracy: float | None = None  # a classifier of more than 5 classes: the label among its 5 best guesses
    lr_schedule: str | None = None  # the decided schedule (engine.schedules.Schedule.describe)
    order: str | None = None  # the training rows' order: shuffled from the seed each epoch, or the data's own
    new_head: str | None = None  # the head the loader started new for the data's classes, and how it trained
    # The last evaluation's counts by [true class][predicted class] (a classifier of at most 50 classes) and the
    # data's class names (None: none known).
    confusion: list | None = None
    classes: list | None = None
    # The fine-tune against its base (training/versus_base.VersusBase.summary): the paired per-example scores and
    # each metric's verdict, which model the base is, what it cost, or why it did not run.
    versus_base: dict | None = None
    # The share of the positions this call's training batches computed that was padding, and what padding every
    # example to seq_len would have made it (data.collate.PaddingTally.to_dict; None: not counted).
    padding: dict | None = None
    recompiles: int | None = None  # compiled: the compiles after the warm-up (a new batch shape, ...); None: not

    def to_dict(self) -> dict:
        return {**asdict(self), **{k: getattr(self, k) and getattr(self, k).to_dict()  # with their IQR
                                   for k in ("tokens_per_s", "step_time_ms")}}


def _fig(v) -> str:
    """2,442 rather than 2.442e+03; 0.1235 for small figures."""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _spread(t, unit: str) -> str | None:
    return f"{_fig(t.median)} {unit} median (IQR {_fig(t.iqr)}, n={t.n} rows)" if t else None


def _number(v, fmt: str) -> str | None:
    return None if v is None else format(v, fmt)


@dataclass(repr=False)
class TrainResult(Result):
    """What `train()` returns (also attached, partial, to `TrainingDiverged.result`)."""

    history: pd.DataFrame
    summary: TrainSummary
    model: torch.nn.Module = field(repr=False)
    skipped_steps: int = 0
    loss_scale_trace: list = field(default_factory=list)
    interrupted: bool = False
    config: TrainConfig | None = None  # as the run used it (seq_len capped to the model's)

    @property
    def status(self) -> str | None:
        """Training's only verdict is divergence: FAIL then, else None (a finished run has none)."""
        return "FAIL" if self.summary.diverged_at_step is not None else None

    @property
    def table(self) -> pd.DataFrame:
        """The summary to read at a glance, as (metric, value) rows of text; `.summary` and the JSON
        keep every figure as numbers (quartiles, run metadata, ...)."""
        s = self.summary
        rows = [
            ("model", f"{s.model} ({s.parameters:,} parameters, {s.task})"),
            ("new_head", s.new_head),
            ("data", f"{s.data} (tokenizer: {s.tokenizer})"),
            ("validation", s.validation),
            ("precision", s.precision),
            ("precision_reason", s.precision_reason),
            ("weights_dtype", s.weights_detail),
            ("device", s.device_name),
            ("steps", f"{s.steps} of {s.total_steps}"),
            ("global_batch", s.global_batch),
            ("strategy", None if s.sharding is None else f"{s.strategy} over {s.world_size} rank(s)"),
            ("sharding", s.sharding),
            ("param_bytes_per_rank", None if s.sharding is None else f"{s.param_bytes_per_rank:,} (rank {s.rank})"),
            ("train_loss", _number(s.train_loss, ".4f")),
            ("val_loss", _number(s.val_loss, ".4f")),
            # NaN where the task has none (a classifier): no row, rather than "nan"
            ("perplexity", None if s.perplexity is None or math.isnan(s.perplexity) else _number(s.perplexity, ".4g")),
            ("accuracy", None if s.accuracy is None else f"{s.accuracy:.4f} (n={s.val_targets} targets)"),
            ("generation", s.generation and (s.generation.get("skipped") if "n" not in s.generation
                                             else Generated(**s.generation).describe())),
            ("top-5 accuracy", None if s.top5_accuracy is None else f"{s.top5_accuracy:.4f}"),
            ("best_val_loss", None if s.best_step is None else f"{s.best_val_loss:.4f} at step {s.best_step}"
                                                               + (f" ({s.best_checkpoint})" * bool(s.best_checkpoint))),
            ("early_stop", s.early_stop_reason and f"at step {s.early_stopped_at_step}: {s.early_stop_reason}"),
            ("tokens_per_s", _spread(s.tokens_per_s, f"{s.unit}s/s")),
            ("step_time_ms", _spread(s.step_time_ms, "ms")),
            ("padding", s.padding and s.padding["describe"]),
            ("optimizer", s.optimizer),
            ("lr_schedule", s.lr_schedule),
            ("order", s.order),
            ("memory", s.memory and f"{s.memory['describe']} ({s.memory['reason']})"),
            ("activation_checkpointing", s.activation_checkpointing),
            ("lora", s.lora and s.lora["detail"]),
            ("quantized", s.quantized),
            ("compile_reason", s.compile_reason),
            ("compile_s", _number(s.compile_s, ".1f")),
            ("skipped_steps", s.skipped_steps),
            ("diverged_at_step", s.diverged_at_step),
            ("interrupted", True if s.interrupted else None),
            ("checkpoint", s.checkpoint),
            ("consolidated", s.consolidated),
            ("weights", s.weights),
            ("save_hf", s.hf_detail and (f"{s.hf_folder}: " if s.hf_folder else "") + s.hf_detail),
            ("versus_base", versus_base.describe(s.versus_base)),
        ]
        return pd.DataFrame([(k, v) for k, v in rows if v is not None], columns=["metric", "value"])

    def headline(self) -> str:
        return f"TrainResult: {self.summary.model} · {self.summary.precision}"

    def more_tables(self) -> dict[str, pd.DataFrame]:
        """What a generating model wrote at the last evaluation: source, target, generated."""
        samples = (self.summary.generation or {}).get("samples")
        # Columns as the samples name them: prompt, reference, generated; chat: prompt, reference, base, generated.
        tables = {"samples": pd.DataFrame(samples, columns=list(samples[0]))} if samples else {}
        if self.summary.chat:  # the reading of chat data, with example 0's scored part marked
            tables["chat_example"] = pd.DataFrame([{k: self.summary.chat[k] for k in ("format", "scored", "example")}])
        if self.summary.confusion:
            names = self._class_names()
            counts = pd.DataFrame(self.summary.confusion, columns=[f"predicted {n}" for n in names])
            tables["confusion"] = pd.concat([pd.Series(names, name="true class"), counts], axis=1)
        if pairing := versus_base.pairing(self.summary.versus_base):  # per metric; the examples that got worse most
            tables.update(versus_base=pairing.table(), regressed=pairing.worst_table())
        return tables

    def more_plots(self) -> dict:
        fig = self.plot_versus_base()
        return {"versus_base": fig} if fig is not None else {}

    def plot_versus_base(self):
        """Each validation example's score under the base against the fine-tune's (None: no comparison ran)."""
        pairing = versus_base.pairing(self.summary.versus_base)
        return pairing and pairing.plot(f"{self.summary.model}: the fine-tune against its base, per example")

    def answer(self) -> str | None:
        """"fine-tune vs base: val loss −0.42 [−0.47, −0.38], improved (...)" (None: the run evaluates nothing)."""
        line = versus_base.describe(self.summary.versus_base, cost=False)
        return line and f"fine-tune vs base: {line}"

    def _class_names(self) -> list[str]:
        """The data's class names where they fit the head, else the class ids."""
        n, classes = len(self.summary.confusion), self.summary.classes
        return [str(c) for c in classes] if classes and len(classes) == n else [str(i) for i in range(n)]

    def plot_confusion(self):
        """The last evaluation's confusion matrix, each row a true class and each column a predicted one, named by
        class (None: the run has none: not a classifier, or one of more than 50 classes)."""
        if not self.summary.confusion:
            return None
        from matplotlib.figure import Figure

        names, counts = self._class_names(), self.summary.confusion
        fig = Figure(figsize=(2 + 0.5 * len(names), 1.5 + 0.5 * len(names)), layout="constrained")
        ax = fig.subplots()
        ax.imshow(counts, cmap="Blues")
        for i, row in enumerate(counts):
            for j, count in enumerate(row):
                ax.text(j, i, count, ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
        ax.set_yticks(range(len(names)), names)
        ax.set(xlabel="predicted class", ylabel="true class",
               title=f"{self.summary.model}: the last evaluation (n={sum(map(sum, counts))} images or rows)")
        return fig

    def summary_line(self) -> str:
        """"train: 60 steps, global batch 8, bf16 (...), train_loss 2.1 · val_loss 2.3 · 41,000 tokens/s median"."""
        s = self.summary
        losses = " · ".join(f"{k} {v:.4f}" for k in ("train_loss", "val_loss") if (v := getattr(s, k)) is not None)
        line = f"train: {s.steps} steps, global batch {s.global_batch}, {s.precision} ({self.held()}), {losses}"
        if t := s.tokens_per_s:
            line += f" · {t.median:,.0f} {s.unit}s/s median (IQR {t.iqr:,.0f}, n={t.n})"
        if s.padding and s.padding["describe"]:
            line += f" · {s.padding['describe']}"
        if s.diverged_at_step is not None:
            line += f" · FAIL: {s.diverged}"
        return line

    def held(self) -> str:
        """What trained, in words: a full fine-tune's weights (the precision's statement) and its memory setting; a
        LoRA or QLoRA run's memory setting alone (its frozen base is not the precision's master weights)."""
        s = self.summary
        if s.memory is None:
            return s.weights_detail
        return s.memory["describe"] if s.memory["lora"] else f"{s.weights_detail}; {s.memory['describe']}"

    def plot(self):
        from matplotlib.figure import Figure

        h = self.history
        steps, evals = h[h["kind"] == "step"], h[h["kind"].isin(["eval", "epoch"])]
        fig = Figure(figsize=(11, 7), layout="constrained")
        (ax_loss, ax_lr), (ax_gn, ax_last) = fig.subplots(2, 2)
        line = "o-" if len(steps) <= 60 else "-"  # a short run's every logged point stays visible
        stride = int(steps["step"].diff().median()) if len(steps) > 1 else 1
        per_row = "per step" if stride == 1 else f"mean of {stride} steps per point"
        ax_loss.plot(steps["step"], steps["train_loss"], line, ms=3, label=f"train ({per_row})")
        ax_loss.plot(evals["step"], evals["val_loss"], "s-", label="validation")
        ax_loss.set(title="loss", ylabel="cross-entropy (nats)")
        ax_loss.legend()
        ax_lr.plot(steps["step"], steps["lr"], line, ms=3)
        ax_lr.set(title="learning rate (warm-up, then cosine decay)", ylabel="learning rate")
        ax_gn.plot(steps["step"], steps["grad_norm"], line, ms=3)
        ax_gn.set(title="gradient norm (before clipping)", ylabel="L2 norm")
        if steps["loss_scale"].notna().any():
            ax_last.step(steps["step"], steps["loss_scale"], where="post")
            power_of_two_axis(ax_last, steps["loss_scale"].dropna())
            ax_last.set(title=f"fp16 loss scale ({self.skipped_steps} skipped steps)", ylabel="loss scale")
        else:  # no loss scaler outside fp16: throughput is the next most useful trace
            ax_last.plot(steps["step"], steps["tokens_per_s"], line, ms=3)
            ax_last.set(title=f"throughput (no loss scaler in {self.summary.precision})",
                        ylabel="tokens / s (wall time)")
        for ax in (ax_loss, ax_lr, ax_gn, ax_last):
            ax.set_xlabel("optimizer step")
            integer_axis(ax.xaxis)
        fig.suptitle(f"{self.summary.model} · {self.summary.precision} · {self.summary.device_name}")
        if c := self.config:
            evals = "never" if not c.evaluates else f"every {c.eval_interval} steps and at epoch ends" \
                if c.eval_interval else "at epoch ends"
            caption(fig, f"LR: {c.lr_schedule.describe()} · validation {evals}"
                         f"{f' on up to {c.eval_batches} batches' if c.evaluates and c.eval_batches else ''} · "
                         f"global batch {self.summary.global_batch}")
        return fig

    def to_csv(self, path):
        return atomic_write_bytes(path, self.history.to_csv(index=False).encode())

    def save_plot(self, path):
        return save_png(self.plot(), path)

    def to_json(self) -> dict:
        return jsonable({"summary": self.summary, "interrupted": self.interrupted, "skipped_steps": self.skipped_steps,
                         "loss_scale_trace": self.loss_scale_trace, "config": self.config, "history": self.history})
