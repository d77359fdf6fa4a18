"""The strategies that run on ranks (DDP, FSDP2 and any registered) side by side under torchrun:
`strategy_benchmark`, the multi-rank layer beside the single-process AMP benchmark (amp.py).

Each strategy x precision x mode is one short `train()` on every rank, so it shards, wraps and steps exactly as a
training run does (engine/strategies.py), from the same initial weights (a spec is rebuilt
from the seed, a module copied) on the same batches. Repeats are interleaved across the runs, so drift on a shared
machine hits all of them alike. Per rank, over the timed steps (the first `untimed_steps` of each run are warm-up):
step time (median, IQR, n: a training step as train() runs it, its batch's transfer included), tokens/s of the
rank's own batch, peak memory and the parameter bytes the rank holds. Peak memory is CUDA's peak allocated over
the training steps on a GPU, and on a CPU the rank's peak RSS increase over its whole run (the model's build
included); the result says which. The figures are gathered to every rank (all_gather_object); the CLI shows and
writes them on rank 0 only.

The BenchConfig settings it reads: strategy, precisions, batch_size, seq_len, untimed_steps, timed_steps, repeats,
lr, weight_decay, grad_clip, seed, force, compile (as amp_benchmark: "both" gives eager and compiled rows),
compile_mode, activation_checkpointing (extra rows with it on), memory (every row), device and progress. The accuracy
runs, thresholds and loggers are the single-process benchmark's.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace

import pandas as pd
import torch

from ..adapter.adapter import ModelAdapter
from ..core.errors import LaunchError
from ..core.files import jsonable
from ..core.measure import PeakRSS, load_average, summarize
from ..core.precision import resolve_precision
from ..core.progress import progress_bar
from ..core.results import Result, run_metadata
from ..core.settings import merge
from ..core.threads import chooses_threads
from ..engine import distributed
from ..engine.strategies import launched_strategies, strategy_class
from ..training.config import TrainConfig
from ..training.loop import train
from .config import CHECKPOINTED, COMPILE_CHOICES, BenchConfig

SCHEMA = "tier_utils.bench_strategies/1"
MIB = 2**20
KEYS = ["strategy", "precision", "mode"]  # one run; a row is one run on one rank
CUDA_PEAK = "peak allocated over the training steps (CUDA)"
SPREAD = {"step_ms_median": "step_ms", "peak_memory_mib": "peak_mib", "tokens_per_s_median": "tokens_per_s"}
FIGURES = ("n", "step_ms_median", "step_ms_iqr", "tokens_per_s_median", "tokens_per_s_iqr", "peak_memory_mib",
           "param_mib", "train_loss")  # a skipped run's rows have none
USED = ("strategy", "precisions", "batch_size", "seq_len", "untimed_steps", "timed_steps", "repeats", "lr",
        "weight_decay", "grad_clip", "seed", "force", "compile", "compile_mode", "activation_checkpointing", "memory")


@dataclass(repr=False)
class StrategyBenchResult(Result):
    """What `strategy_benchmark` measured: a row per strategy x precision x mode x rank, the run's config (model,
    data, settings), metadata, how peak memory was read, and this process's rank."""

    rows: list[dict]
    config: dict
    metadata: dict
    memory: str  # what peak_memory_mib is
    rank: int

    @property
    def table(self) -> pd.DataFrame:
        """One row per rank of each run, with the spread of its run across ranks (min, max, max/min)."""
        table = pd.DataFrame(self.rows)
        runs = table.groupby(KEYS, sort=False)
        for column, name in SPREAD.items():
            low, high = runs[column].transform("min"), runs[column].transform("max")
            table[f"{name}_rank_min"], table[f"{name}_rank_max"] = low, high
            table[f"{name}_rank_ratio"] = high / low
        return table

    def overview(self) -> pd.DataFrame:
        """The strategies side by side: a row per run, its ranks summed (tokens/s) or spanned (the rest)."""
        runs = self.table.groupby(KEYS, sort=False)
        return pd.DataFrame({
            "ranks": runs["rank"].count(), "step_ms_median": runs["step_ms_median"].median(),
            "step_ms_rank_min": runs["step_ms_median"].min(), "step_ms_rank_max": runs["step_ms_median"].max(),
            "tokens_per_s_all_ranks": runs["tokens_per_s_median"].sum(min_count=1),
            "peak_mib_rank_max": runs["peak_memory_mib"].max(), "param_mib_per_rank": runs["param_mib"].max(),
            "detail": runs["detail"].first()}).reset_index()

    def headline(self) -> str:
        c, s = self.config, self.config["settings"]
        return (f"{c['model']} · {c['compared']} on {c['world_size']} ranks · {self.metadata['device_name']} · batch "
                f"{s['batch_size']} x {c['seq_len']} tokens per rank · {s['repeats']} x {s['timed_steps']} timed "
                f"steps per rank · memory: {self.memory}")

    def plot(self):
        from matplotlib.figure import Figure

        fig = Figure(figsize=(13, 4.5), layout="constrained")
        ax_t, ax_m = fig.subplots(1, 2)
        fig.suptitle(self.headline(), fontsize=9)
        table = self.table[self.table["ran"]]
        runs = list(table.groupby(KEYS, sort=False))
        width = 0.8 / max(1, len(runs))
        for i, ((strategy, precision, mode), g) in enumerate(runs):
            x = g["rank"].to_numpy() + (i - (len(runs) - 1) / 2) * width
            label = f"{strategy} {precision}" + ("" if mode == "eager" else f" {mode}")
            ax_t.bar(x, g["step_ms_median"], width, yerr=g["step_ms_iqr"] / 2, capsize=3, label=label)
            ax_m.bar(x, g["peak_memory_mib"], width, label=label)
            ax_m.plot(x, g["param_mib"], "k_", ms=12)
        ranks = sorted(table["rank"].unique())
        n = int(table["n"].max()) if len(table) else 0
        ax_t.set(xlabel="rank", ylabel=f"step time (ms), median and IQR (n={n} per rank)",
                 xticks=ranks, title="step time per rank")
        ax_m.set(xlabel="rank", ylabel="MiB", xticks=ranks, title=f"{self.memory}; black: parameters held")
        for ax in (ax_t, ax_m):
            if runs:
                ax.legend(fontsize=8)
        return fig

    def to_json(self) -> dict:
        return jsonable({"schema": SCHEMA, "config": self.config, "metadata": self.metadata, "memory": self.memory,
                         "ranks": self.table, "strategies": self.overview()})


@chooses_threads  # the run's torch thread count, chosen as it starts
def strategy_benchmark(model, data=None, config: BenchConfig | dict | None = None, *,
                       model_kwargs: dict | None = None, **overrides) -> StrategyBenchResult:
    """The strategies side by side on `model` (a load_model spec, an nn.Module or an adapter; a module is copied
    for every run), under torchrun: every rank calls it and gets the same result, every rank's figures in it.

    Settings: `config` (a BenchConfig, a dict of its fields or None) with `overrides` by field name; `strategy`
    (None: every registered strategy that runs on ranks) names the strategies compared. Outside torchrun: a
    LaunchError saying how to launch.
    """
    cfg = merge(BenchConfig, config, overrides, "benchmark")
    strategies = cfg.strategy or launched_strategies()
    if not distributed.launched_by_torchrun():
        raise LaunchError("the strategy benchmark compares ranks under torchrun; launch with "
                          + distributed.launch_hint("bench", ",".join(strategies)))
    # The process group every run joins, and the figures' gathering.
    env = distributed.join(cfg.device, "bench", ",".join(strategies))
    try:
        return _benchmark(model, model_kwargs or {}, data, cfg, strategies, env)
    finally:
        env.close()


def _benchmark(model, model_kwargs: dict, data, cfg: BenchConfig, strategies, env) -> StrategyBenchResult:
    dev = env.device
    modes = COMPILE_CHOICES[cfg.compile] + [CHECKPOINTED] * cfg.activation_checkpointing
    runs, skipped = [], {}
    for strategy in strategies:
        for name in cfg.precisions:
            why = _skip_reason(name, dev, cfg.force)
            for mode in modes:
                if why:
                    skipped[strategy, name, mode] = why
                else:
                    runs.append((strategy, name, mode))
    measured = {run: {"ms": [], "peak_bytes": 0} for run in runs}
    memory = PeakRSS.HOW if dev.type != "cuda" else CUDA_PEAK
    if runs:  # one step of the first run, not measured: the process's first-time costs (lazy imports, the
        # allocator's growth) would otherwise land on the first run's memory and time alone
        _measure({"ms": [], "peak_bytes": 0}, runs[0], model, model_kwargs, data, replace(
            cfg, untimed_steps=0, timed_steps=1), dev)
    with progress_bar(total=cfg.repeats * len(runs), desc="strategy benchmark", unit="run",
                      enabled=cfg.progress and env.is_main) as bar:
        for _ in range(cfg.repeats):
            for run in runs:
                _measure(measured[run], run, model, model_kwargs, data, cfg, dev)
                bar.update()
    every = env.gather(measured)
    rows = [_row(run, rank, len(every), got.get(run), skipped.get(run))
            for run in [*runs, *skipped] for rank, got in enumerate(every)]
    first = next(iter(measured.values()), {}).get("run", {})
    config = {**first, "model": first.get("model", _name(model)), "world_size": env.world_size,
              "compared": " vs ".join(strategy_class(name).label for name in strategies),
              "settings": {k: v for k, v in replace(cfg, strategy=tuple(strategies)).to_dict().items() if k in USED}}
    metadata = {**run_metadata(dev), "load_average_1m": load_average()}
    return StrategyBenchResult(rows, config, metadata, memory, env.rank)


def _skip_reason(name: str, dev: torch.device, force: bool) -> str | None:
    """Why a precision is not run here (not native and not forced, or a true mode only emulated); None: it runs."""
    prec = resolve_precision(name, dev, warn=False)
    if not prec.native and not force:
        return f"not native: {prec.native_support(dev)[1]}; force=True (CLI --force) runs it anyway"
    try:
        prec.check_runnable()
    except ValueError as exc:
        return str(exc)
    return None


def _fresh(model):
    """What one run trains: a spec builds its own model (from the seed), a module or adapter is copied."""
    if isinstance(model, ModelAdapter):
        return replace(model, model=copy.deepcopy(model.model))
    return copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model


def _name(model) -> str:
    return model if isinstance(model, str) else type(getattr(model, "model", model)).__name__


def _measure(into: dict, run: tuple, model, model_kwargs: dict, data, cfg: BenchConfig, dev: torch.device) -> None:
    """One repeat of `run` on this rank: a train() of untimed + timed steps; its figures added to `into`."""
    strategy, precision, mode = run
    train_cfg = TrainConfig(
        precision=precision, batch_size=cfg.batch_size, seq_len=cfg.seq_len, lr=cfg.lr,
        max_steps=cfg.untimed_steps + cfg.timed_steps, weight_decay=cfg.weight_decay, warmup_steps=0,
        grad_clip=cfg.grad_clip, seed=cfg.seed, eval_every=0, eval_batches=1, log_every=1, progress=False,
        device=dev, strategy=strategy, compile=mode == "compiled", compile_mode=cfg.compile_mode,
        memory=replace(cfg.memory, checkpointing=mode == CHECKPOINTED))
    rss = PeakRSS() if dev.type != "cuda" else contextlib.nullcontext()
    with rss:
        result = train(_fresh(model), data, train_cfg, model_kwargs=model_kwargs)
    steps = result.history.query("kind == 'step'")
    timed = steps.iloc[cfg.untimed_steps:]
    into["ms"] += timed["step_time_ms"].tolist()
    # history's tokens/s counts every rank's tokens: this rank's share of a step
    into["tokens"] = float((timed["tokens_per_s"] * timed["step_time_ms"] / 1e3).median()) / result.summary.world_size
    peak = rss.increase if dev.type != "cuda" else steps["max_memory_mb"].max() * MIB
    into["peak_bytes"] = None if peak is None or into["peak_bytes"] is None else max(into["peak_bytes"], peak)
    s = result.summary
    detail = [s.sharding or f"{s.strategy}: one process, the whole model", s.weights_detail, s.precision_reason,
              s.compile_reason] + ([s.lora["detail"]] if s.lora else [])
    into.update(param_bytes=s.param_bytes_per_rank, loss=s.train_loss, detail="; ".join(detail),
                run={"model": s.model, "task": s.task, "parameters": s.parameters, "data": s.data,
                     "tokenizer": s.tokenizer, "seq_len": result.config.seq_len})


def _row(run: tuple, rank: int, world: int, got: dict | None, skipped: str | None) -> dict:
    row = {"strategy": run[0], "precision": run[1], "mode": run[2], "rank": rank, "world_size": world,
           "ran": got is not None}
    if got is None:
        return {**row, **dict.fromkeys(FIGURES), "detail": f"SKIPPED: {skipped}"}
    ms = summarize(got["ms"])
    tps = summarize(got["tokens"] / (m / 1e3) for m in got["ms"])
    return {**row, "n": ms.n, "step_ms_median": ms.median, "step_ms_iqr": ms.iqr,
            "tokens_per_s_median": tps.median, "tokens_per_s_iqr": tps.iqr,
            "peak_memory_mib": got["peak_bytes"] / MIB if got["peak_bytes"] is not None else None,
            "param_mib": got["param_bytes"] / MIB, "train_loss": got["loss"], "detail": got["detail"]}
