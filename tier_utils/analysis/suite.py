"""`analyze`: run the tier-2 analyses on real batches, each isolated, into one AnalysisReport."""
from __future__ import annotations

import itertools
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import pandas as pd
import torch

from ..adapter.adapter import resolve_model
from ..core.budget import read_budget
from ..core.errors import DataError, ModelForwardError, describe
from ..core.files import jsonable
from ..core.inputs import select_names
from ..core.plotting import readable_legends
from ..core.precision import Precision, precision_setting, resolve_device, resolve_precision
from ..core.progress import progress_bar
from ..core.results import Check, Result, failed_check, problem_rows, run_metadata, status_counts
from ..core.settings import check_fields, device_field, merge, precision_field, progress_field, setting
from ..core.threads import chooses_threads
from ..data.chat_formats import ChatOptions
from ..data.datasets import DataDescription, DataSplits, make_loader, to_device
from ..engine.quantization import quantized_summary
from ..engine.strategies import refuse_placed
from ..models.builtins import DEFAULT_MODEL
from ..models.demo_model import provenance_of
from . import attention, attribution, dtypes, headroom, robustness
from .common import Context, Outcome, message_figure
from .pixels import grid_figure

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class Analysis:
    run: Callable  # Context -> Outcome
    plot: Callable  # (Outcome, **options) -> Figure
    panel: Callable  # (Axes, Outcome) -> None: its cell in the overview figure


# Run order = this order. Names (each module's own) are what `analyses=` and `--analyses` take.
ANALYSES: dict[str, Analysis] = {m.__name__.rpartition(".")[2]: Analysis(m.run, m.plot, m.panel)
                                 for m in (attention, robustness, attribution, headroom, dtypes)}
TABLE_COLUMNS = ["analysis", "check", "status", "value", "threshold", "detail"]


@dataclass
class AnalysisConfig:
    """What `analyze` runs and on how much data. precision: the autocast the plain forwards run under;
    headroom and dtypes always compare fp32, bf16 and fp16."""

    analyses: tuple | None = setting(None, f"analyses to run (none: all): {', '.join(ANALYSES)}")
    precision: str | Precision = precision_field()
    device: str | torch.device | None = device_field()
    batch_size: int = setting(8, "sequences per batch", low=1)
    n_batches: int = setting(2, "validation batches to analyse", low=1)
    seq_len: int = setting(64, "tokens per example (capped at the model's max)", low=1)
    progress: bool = progress_field()
    chat: ChatOptions = setting(factory=ChatOptions)  # how chat rows are read (TrainConfig's, where a job decided it)

    def __post_init__(self):
        if self.analyses is not None:  # None stays "all", as the CLI's default shows it
            self.analyses = tuple(select_names(self.analyses, ANALYSES, "analysis"))
        self.precision = precision_setting(self.precision)
        check_fields(self)


def real_batches(adapter, data, batch_size: int, n_batches: int, seq_len: int,
                 device, chat: ChatOptions | None = None) -> tuple[list[dict], DataSplits]:
    """Up to `n_batches` validation batches for the adapter's task (the bundled corpus when data is None), and the
    splits they came from (what the data was, its class names); the sizes are AnalysisConfig's, checked there;
    `chat`: how chat rows are read."""
    splits = adapter.datasets(data, adapter.fit_length(seq_len), chat=chat)
    loader = make_loader(splits.val, batch_size, collate=splits.collate, shuffle=True, device=device, seed=0)
    batches = [to_device(b, device) for b in itertools.islice(loader, n_batches)]
    if not batches:
        raise DataError("the validation split is empty; give more data")
    return batches, splits


def _isolated(name: str, ctx: Context) -> tuple[Outcome, float]:
    """Run one analysis; whatever it raises becomes a FAIL row and the others still run."""
    t0 = time.perf_counter()
    try:
        outcome = ANALYSES[name].run(ctx)
    except torch.cuda.OutOfMemoryError as exc:  # the device's limit, not the model's bug: WARN
        outcome = Outcome([Check("out of memory", "WARN", None, None, f"{ctx.budget.describe()} at the start: "
                                                                      f"{describe(exc, 240)}")])
    except Exception as exc:  # noqa: BLE001 - isolation is the point; KeyboardInterrupt still stops the run
        outcome = Outcome([failed_check("error", exc)], artifacts={"traceback": traceback.format_exc()})
    if torch.cuda.is_initialized():  # what a failed analysis held goes back to the device
        torch.cuda.empty_cache()
    return outcome, time.perf_counter() - t0


@dataclass(frozen=True)
class AnalysedBatches:
    """What tier 2 read: its data (None where the model could not run), and how many batches of what shape."""

    described: DataDescription | None
    batches: int
    batch_size: int
    seq_len: int

    def to_dict(self) -> dict:
        data = self.described.to_dict() if self.described else {"data": "none", "source": "none"}
        return {**data, "batches": self.batches, "batch_size": self.batch_size, "seq_len": self.seq_len}


class AnalysisReport(Result):
    """Tier-2 findings. `.table`: one row per finding; `.frames`: each analysis' DataFrames;
    `.plot(name)`: one analysis' figure (`.plot()`: an overview); `.to_json()`."""

    def __init__(self, outcomes: dict[str, Outcome], seconds: dict[str, float], model: dict, precision: Precision,
                 data: AnalysedBatches, metadata: dict):
        self.outcomes, self.seconds = outcomes, seconds
        self.model, self.precision, self.data, self.metadata = model, precision, data, metadata

    @property
    def table(self) -> pd.DataFrame:
        rows = [{"analysis": name, **asdict(c)} for name, o in self.outcomes.items() for c in o.checks]
        return pd.DataFrame(rows, columns=TABLE_COLUMNS)

    def summary_line(self) -> str:
        """"analysis: WARN (5 PASS, 1 WARN) in 3.2 s", and the model it analysed where it is the shipped demo one."""
        line = (f"analysis {self.model['model']}: {self.verdict} ({status_counts(self.table['status'])}) in "
                f"{sum(self.seconds.values()):.1f} s")
        provenance = self.model.get("provenance")  # the shipped demo model, not fresh weights
        return line + (f" on {provenance['summary']}" if provenance else "")

    def problems(self) -> pd.DataFrame:
        return problem_rows(self.table, ["analysis", "check", "status", "value", "detail"])

    @property
    def frames(self) -> dict[str, pd.DataFrame]:
        return {key: df for o in self.outcomes.values() for key, df in o.frames.items()}

    def plot(self, name: str | None = None, **options) -> Figure:
        """`name` one of the analyses run; options go to that figure (attention: layers=, heads=)."""
        if name is None:
            return self._overview()
        if name not in self.outcomes:
            raise ValueError(f"no analysis {name!r} in this report; it has: {', '.join(self.outcomes)}")
        outcome = self.outcomes[name]
        if not outcome.ran:
            return message_figure(name, self._why_not(outcome))
        return ANALYSES[name].plot(outcome, **options)

    def more_plots(self) -> dict[str, Figure]:
        """An image model's first images: their predictions by class name, and where the attention analysis drew
        one, what the model looked at (its attention rollout, or its gradient saliency map) over them."""
        overlays = {name: o.artifacts["overlay"] for name, o in self.outcomes.items() if "overlay" in o.artifacts}
        if not overlays:
            return {}
        plots = {"predictions": grid_figure(next(iter(overlays.values())).without_heats())}
        if "attention" in overlays:
            plots["attention_overlay"] = grid_figure(overlays["attention"])
        return plots

    @staticmethod
    def _why_not(outcome: Outcome) -> str:
        return "; ".join(f"{c.status}: {c.detail}" for c in outcome.checks)

    def _overview(self) -> Figure:
        names = list(self.outcomes)
        cols = min(3, len(names))
        rows = math.ceil(len(names) / cols)
        from matplotlib.figure import Figure

        fig = Figure(figsize=(5 * cols, 3.8 * rows), layout="constrained")
        axes = fig.subplots(rows, cols, squeeze=False).ravel()
        for ax, name in zip(axes, names):
            outcome = self.outcomes[name]
            if outcome.ran:
                ANALYSES[name].panel(ax, outcome)
            else:
                ax.axis("off")
                ax.set_title(name)
                ax.text(0.5, 0.5, self._why_not(outcome)[:160], ha="center", va="center", wrap=True, fontsize=8)
        for ax in axes[len(names):]:
            fig.delaxes(ax)  # no blank panels in the grid's last row
        readable_legends(fig)
        name = self.model.get("provenance", {}).get("name", self.model["model"])
        fig.suptitle(f"{name} · {self.precision.name} on {self.metadata['device_name']} · "
                     f"worst status {self.status}")
        return fig

    def to_json(self) -> dict:
        errors = {n: o.artifacts["traceback"] for n, o in self.outcomes.items() if "traceback" in o.artifacts}
        return jsonable({"status": self.status, "findings": self.table, "frames": self.frames, "seconds": self.seconds,
                         "model": self.model, "precision": self.precision.to_dict(), "data": self.data,
                         "errors": errors, "run_metadata": self.metadata})


@chooses_threads  # the run's torch thread count, chosen as it starts
def analyze(model=DEFAULT_MODEL, data=None, config: AnalysisConfig | dict | None = None, *,
            model_kwargs: dict | None = None, **overrides) -> AnalysisReport:
    """Explain a model: attention patterns, robustness, attribution, precision headroom, per-op dtypes.

    model: an nn.Module, an adapter or a load_model spec (`model_kwargs` build it). data: None (the bundled
    corpus) or any form build_datasets takes; its validation split supplies `n_batches` batches of `batch_size`.
    config / overrides: an AnalysisConfig (or dict) and/or its field names as keywords; analyses: None (all)
    or names from ANALYSES. The model runs in eval mode and is left in the mode it came in.
    """
    cfg = merge(AnalysisConfig, config, overrides, "analysis")
    refuse_placed(model, "analyze")  # it reads the whole model on one device: rank 0 with the consolidated one
    names = list(cfg.analyses or ANALYSES)
    dev = resolve_device(cfg.device)
    prec = resolve_precision(cfg.precision, dev)
    try:
        adapter = resolve_model(model, **(model_kwargs or {}))
    except ModelForwardError as exc:  # a model that cannot run is a finding, not a crash
        outcomes = {name: Outcome([Check("error", "FAIL", None, None, f"not run: {exc}")]) for name in names}
        return AnalysisReport(outcomes, dict.fromkeys(names, 0.0), exc.model, prec,
                              AnalysedBatches(None, 0, cfg.batch_size, 0),
                              run_metadata(dev, prec.dtype))
    module = adapter.model.to(dev)
    batches, splits = real_batches(adapter, data, cfg.batch_size, cfg.n_batches, cfg.seq_len, dev, cfg.chat)
    ctx = Context(adapter, batches, prec, read_budget(dev), splits.classes)
    outcomes, seconds = {}, {}
    was_training = module.training
    module.eval()
    try:
        for name in progress_bar(names, desc="analyze", unit="analysis", enabled=cfg.progress):
            outcomes[name], seconds[name] = _isolated(name, ctx)
    finally:
        module.train(was_training)
    length = int(batches[0][adapter.task.input_key].size(-1))  # tokens, or an image's side
    data_info = AnalysedBatches(splits.describe(), len(batches), cfg.batch_size, length)
    provenance = provenance_of(module)  # the shipped demo model, with its weights as shipped, is named as such
    model_info = {**adapter.summary(), **quantized_summary(module),
                  **({"provenance": provenance} if provenance else {})}
    return AnalysisReport(outcomes, seconds, model_info, prec, data_info, run_metadata(dev, prec.dtype))
