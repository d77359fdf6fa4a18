"""Tier 1: `smoke(model)` runs quick checks on a transformer and returns a SmokeReport.

Check groups: shapes, gradients, stability, init, memory, latency, determinism. Each is isolated:
an exception becomes a FAIL row carrying its message and the other checks still run. The model's
train/eval mode, its gradients and the global RNG are left as they were found.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace
from types import MappingProxyType

import pandas as pd
import torch

from ..adapter.adapter import resolve_model
from ..core.budget import ActivationFit, Budget, read_budget
from ..core.display import round_to_spread
from ..core.errors import ModelForwardError, describe
from ..core.files import jsonable
from ..core.inputs import select_names, whole_number
from ..core.measure import percentile, summarize
from ..core.plotting import category_ticks
from ..core.precision import Precision, precision_setting, resolve_precision
from ..core.progress import progress_bar
from ..core.results import Check, Result, checks_table, failed_check, problem_rows, run_metadata
from ..core.settings import check_fields, device_field, merge, precision_field, progress_field, setting
from ..core.threads import chooses_threads
from ..data.chat_formats import ChatOptions
from ..data.collate import LongestBatch
from ..engine.quantization import quantized_summary
from ..engine.strategies import canonical_strategy, resolve_strategy, smoke_strategies
from ..models.builtins import DEFAULT_MODEL
from .across_ranks import gathered, per_rank_groups, shared_budget
from .checks import CHECK_GROUPS
from .run import Found, SmokeRun


@dataclass
class SmokeConfig:
    """What `smoke` runs: the check groups, and the memory and latency grid with the autocast it runs under."""

    batch_sizes: tuple[int, ...] = setting((1, 4), "batch sizes for memory and latency, e.g. 1,4")
    seq_lens: tuple[int, ...] | None = setting(None, "sequence lengths for memory and latency (none: the model's "
                                                     "max length)")
    precision: str | Precision = precision_field()
    checks: tuple | None = setting(None, f"check groups to run (none: all): {', '.join(CHECK_GROUPS)}")
    strategy: str | None = setting(None, "fsdp: under torchrun, shard the model (FSDP2) and run the gradient and "
                                         "memory checks on every rank (none: one process, the whole model)")
    device: str | torch.device | None = device_field()
    progress: bool = progress_field()
    chat: ChatOptions = setting(factory=ChatOptions)  # how the data's chat rows are read

    def __post_init__(self):
        self.batch_sizes = _positive_ints(self.batch_sizes, "batch_sizes")
        if self.seq_lens is not None:
            self.seq_lens = _positive_ints(self.seq_lens, "seq_lens")
        self.precision = precision_setting(self.precision)
        if self.strategy is not None:  # a strategy that holds the whole model would check it again on every rank
            runs = smoke_strategies()
            if canonical_strategy(self.strategy) not in runs:
                raise ValueError(f"smoke's strategy is {' or '.join(runs)} or none, got {self.strategy!r}")
            self.strategy = canonical_strategy(self.strategy)
        if self.checks is not None:  # None stays "all", as the CLI's default shows it
            self.checks = tuple(select_names(self.checks, CHECK_GROUPS, "check group"))
        check_fields(self)


@dataclass(repr=False, frozen=True)
class SmokeReport(Result):
    """Tier 1 result: one row per check in `.table`, plus what the plots and JSON need; built once, complete, when
    every group has run (the groups yield their data: run.py)."""

    checks: list[Check]
    model: dict
    precision: Precision
    metadata: dict
    batch_sizes: list[int]
    seq_lens: list[int]
    grad_norms: dict[str, float] = field(default_factory=dict)  # layer (module path) -> gradient norm
    latency: list[dict] = field(default_factory=list)  # batch_size, seq_len, samples_ms
    memory: list[dict] = field(default_factory=list)  # batch_size, seq_len, activation_bytes, peak_bytes, predicted
    parameters: pd.DataFrame | None = None  # per-parameter initialisation statistics
    seconds: float = 0.0
    budget: Budget | None = None  # the device's free memory, read at the start: probes are sized to it
    activation_fit: ActivationFit | None = None  # saved bytes by (B, T), measured small: predicts the big sizes
    sharding: str | None = None  # strategy="fsdp": how the model was sharded (sharding.Sharding.describe)
    rank: int = 0  # this process's torchrun rank, of world_size
    world_size: int = 1
    from_data: LongestBatch | None = None  # smoke(data=...): the longest batch the data makes, one of seq_lens

    @property
    def table(self) -> pd.DataFrame:
        """For reading: float values shown to 4 significant digits (pandas would print 1e-9 as 0.0).
        `.to_json()["checks"]` keeps them as numbers."""
        table = checks_table(self.checks)
        table["value"] = [f"{v:.4g}" if isinstance(v, float) else v for v in table["value"]]
        return table

    @property
    def passed(self) -> bool:
        return self.status != "FAIL"

    @property
    def latency_table(self) -> pd.DataFrame:
        """Per batch size and sequence length (the index), milliseconds rounded to their spread; the JSON keeps
        them whole."""
        return round_to_spread(self._latency()).set_index(["batch_size", "seq_len"])

    def _latency(self) -> pd.DataFrame:
        rows = []
        for r in self.latency:
            s = summarize(r["samples_ms"])
            rows.append({"batch_size": r["batch_size"], "seq_len": r["seq_len"], "n": s.n, "median_ms": s.median,
                         "p95_ms": percentile(r["samples_ms"], 95), "iqr_ms": s.iqr,
                         "tokens_per_s": r["batch_size"] * r["seq_len"] / (s.median / 1e3)})
        return pd.DataFrame(rows, columns=["batch_size", "seq_len", "n", "median_ms", "p95_ms", "iqr_ms",
                                           "tokens_per_s"])

    def headline(self) -> str:
        counts = ", ".join(f"{sum(c.status == s for c in self.checks)} {s}" for s in ("PASS", "WARN", "FAIL", "SKIP"))
        return (f"smoke {self.model.get('model')}: {self.status} ({counts}) in {self.seconds:.1f} s on "
                f"{self.metadata['device_name']}, {self.precision.name}"
                + (f", sharded over {self.world_size} ranks (rows per rank)" if self.sharding else "")
                + (f"; memory and latency at {self.from_data.describe()}" if self.from_data else ""))

    def summary_line(self) -> str:
        return self.headline()  # it says the verdict and counts each status

    def problems(self) -> pd.DataFrame:
        return problem_rows(self.table, ["check", "status", "value", "detail"])

    def to_json(self) -> dict:
        return jsonable({"passed": self.passed, "status": self.status, "checks": [asdict(c) for c in self.checks],
                         "model": self.model, "precision": self.precision.to_dict(), "run_metadata": self.metadata,
                         "batch_sizes": self.batch_sizes, "seq_lens": self.seq_lens, "seconds": self.seconds,
                         "grad_norms": self.grad_norms, "latency": self._latency(),
                         "latency_samples_ms": self.latency, "memory": self.memory,
                         "budget": self.budget.to_dict() if self.budget else None,
                         "activation_fit": asdict(self.activation_fit) if self.activation_fit else None,
                         "sharding": self.sharding, "from_data": self.from_data and self.from_data.to_dict(),
                         "parameters": self.parameters if self.parameters is not None else []})

    def plot(self):
        from matplotlib.figure import Figure

        fig = Figure(figsize=(15, 4.5), layout="constrained")
        ax_g, ax_l, ax_m = fig.subplots(1, 3)
        fig.suptitle(f"{self.headline()} (torch {self.metadata['torch']})", fontsize=10)
        _plot_grad_norms(ax_g, self.grad_norms)
        if self.latency:
            ax_l.boxplot([r["samples_ms"] for r in self.latency])
            ax_l.set_xticks(range(1, len(self.latency) + 1),
                            [f"B={r['batch_size']}\nT={r['seq_len']}" for r in self.latency])
            ax_l.set(ylabel="forward latency (ms)",
                     xlabel=f"batch size B, sequence length T (n={len(self.latency[0]['samples_ms'])} each)")
        _not_run(ax_l, not self.latency, "inference latency (eval, no grad)")
        _plot_memory(ax_m, self.memory, self.model)
        return fig


def _not_run(ax, empty: bool, title: str) -> None:
    ax.set_title(title, fontsize=10)
    if empty:
        ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)


def _plot_grad_norms(ax, norms: dict) -> None:
    _not_run(ax, not norms, "gradient norm per layer (one backward)")
    shown = {k: v for k, v in norms.items() if v > 0 and math.isfinite(v)}
    if not shown:
        return
    ax.plot(range(len(shown)), list(shown.values()), "o-", ms=3)
    ax.set_yscale("log")
    category_ticks(ax, list(shown))
    ax.set_ylabel("L2 norm of the layer's gradients")
    hidden = len(norms) - len(shown)
    note = f"; {hidden} with zero or non-finite gradient not shown" if hidden else ""
    ax.set_xlabel("layer (forward order)" + note)


def _plot_memory(ax, memory: list, model: dict) -> None:
    _not_run(ax, not memory, "memory by batch size")
    if not memory:
        return
    xs = [f"B={r['batch_size']}\nT={r['seq_len']}" for r in memory]
    measured = [r["activation_bytes"] / 2**20 if not r.get("predicted") else 0 for r in memory]
    ax.bar(xs, measured, label="activations saved for backward")
    if any(r.get("predicted") for r in memory):
        ax.bar(xs, [r["activation_bytes"] / 2**20 if r.get("predicted") else 0 for r in memory], fill=False,
               hatch="//", label="predicted (too big to run here)")
    ax.axhline(model["parameter_bytes"] / 2**20, color="k", ls="--", label="parameters")
    peaks = [(x, r["peak_bytes"] / 2**20) for x, r in zip(xs, memory) if r.get("peak_bytes")]
    if peaks:
        ax.plot(*zip(*peaks), "rs-", label="CUDA peak, forward + backward")
    ax.set(xlabel="batch size B, sequence length T", ylabel="MiB")
    ax.legend(fontsize=8)


@chooses_threads  # the run's torch thread count, chosen as it starts
def smoke(model=DEFAULT_MODEL, config: SmokeConfig | dict | None = None, *, data=None,
          model_kwargs: dict | None = None, **overrides) -> SmokeReport:
    """Run the tier 1 checks on `model` (an nn.Module, an adapter or any load_model spec, built with
    `model_kwargs`). Every check runs on random token batches; `data` (anything `train` takes; None: none read)
    adds the longest batch that data makes at the longest of seq_lens to the memory and latency grid (without
    seq_lens: that length alone), and the report says so.

    config / overrides: a SmokeConfig (or dict) and/or its field names as keywords. batch_sizes and seq_lens
    (default: the model's max length) set the memory and latency grid; precision is the autocast used for
    those two; checks: None (every group in CHECK_GROUPS), a list of group names or a comma-separated string.
    The model is moved to `device` (default: CUDA when available). strategy="fsdp", under torchrun: the model is
    sharded (and left so), its gradient and memory checks run on every rank, and every rank's report holds every
    rank's rows (smoketest/across_ranks.py).
    """
    start = time.perf_counter()
    cfg = merge(SmokeConfig, config, overrides, "smoke")
    strategy = resolve_strategy(cfg.strategy, cfg.device, "smoke") if cfg.strategy else None  # no torchrun: one line
    try:
        return _smoke(model, cfg, model_kwargs or {}, strategy, start, data)
    finally:
        if strategy is not None:
            strategy.close()


def _smoke(model, cfg: SmokeConfig, model_kwargs: dict, strategy, start: float, data=None) -> SmokeReport:
    env = strategy and strategy.env
    groups = list(cfg.checks or CHECK_GROUPS)
    batch_sizes = list(cfg.batch_sizes)
    prec = resolve_precision(cfg.precision, env.device if env else cfg.device)
    try:
        adapter = resolve_model(model, **model_kwargs)
    except ModelForwardError as exc:  # a model that cannot run is a finding, not a crash
        checks = [Check(name, "FAIL", None, None, f"not run: {exc}") for name in groups]
        return SmokeReport(checks, exc.model, prec, run_metadata(prec.device, prec.dtype), batch_sizes,
                           list(cfg.seq_lens or ()), seconds=time.perf_counter() - start)
    adapter.model.to(prec.device)
    budget = read_budget(prec.device)  # once, before anything of ours is allocated
    if env is not None:
        budget = shared_budget(budget, env)
    lengths = sorted({adapter.fit_length(t, "seq_lens entry")  # capped to the model: the report records these
                      for t in cfg.seq_lens or (adapter.max_len,)})
    from_data = adapter.longest_batch(data, lengths[-1], chat=cfg.chat) if data is not None else None
    if from_data is not None:  # the length training on it meets at most (batches are cut to the data)
        lengths = sorted({*(lengths if cfg.seq_lens else ()), from_data.length})
    summary = {**adapter.summary(), **quantized_summary(adapter.model)}  # a 4-bit base is run, and named, as loaded
    checks = {name: CHECK_GROUPS[name] for name in groups}
    # The summary, taken before, stays unsharded.
    sharded = strategy.setup_module(adapter.model, prec) if env is not None else None
    if env is not None:
        checks = per_rank_groups(checks, strategy)
    run = SmokeRun(prec, run_metadata(prec.device, prec.dtype), summary, tuple(batch_sizes), tuple(lengths), budget,
                   sharded)
    ran, found = _run_groups(adapter, run, checks, cfg.progress and (env is None or env.is_main))
    rows = gathered(ran, strategy) if env is not None else [row for _, rows in ran for row in rows]
    return SmokeReport(rows, summary, prec, run.metadata, batch_sizes, lengths, **found,
                       seconds=time.perf_counter() - start, budget=budget, sharding=sharded,
                       rank=env.rank if env else 0, world_size=env.world_size if env else 1, from_data=from_data)


def _run_groups(adapter, run: SmokeRun, checks: dict, progress: bool) -> tuple[list[tuple[str, list[Check]]], dict]:
    """Each group's rows, in order, each group isolated, and what the groups found for the report (by SmokeReport
    field; each group sees what those before it found); the model's mode, its gradients and the RNG as found."""
    net, dev, budget = adapter.model, run.precision.device, run.budget
    was_training, grads = net.training, [(p, p.grad) for p in net.parameters()]
    rng_devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
    ran, found = [], {}
    with torch.random.fork_rng(devices=rng_devices):
        torch.manual_seed(0)
        bar = progress_bar(list(checks), desc="smoke", unit="group", enabled=progress)
        for name in bar:
            bar.set_postfix_str(name)
            rows = []
            try:
                for row in checks[name](adapter, replace(run, found=MappingProxyType(dict(found)))):
                    if isinstance(row, Found):
                        found[row.name] = row.value
                    else:
                        rows.append(row)
            except torch.cuda.OutOfMemoryError as exc:  # the device's limit, not the model's bug: WARN
                rows.append(Check(name, "WARN", None, None, f"ran out of memory ({budget.describe()} at the start): "
                                                            f"{describe(exc, 240)}"))
            except Exception as exc:
                rows.append(failed_check(name, exc))
            finally:
                net.train(was_training)
                for p, g in grads:
                    p.grad = g
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            ran.append((name, rows))
    return ran, found


def _positive_ints(values, what: str) -> tuple[int, ...]:
    values = [values] if isinstance(values, int) else list(values)
    if not values:
        raise ValueError(f"{what} is empty; give at least one whole number >= 1")
    return tuple(sorted({whole_number(v, f"every entry of {what}") for v in values}))
