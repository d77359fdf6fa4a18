"""The main job (`all`): every tier on one model, then the folder report (`report.write_report`).

`run_all` runs tier 1, tier 2, a short training run, the fit planner and the AMP benchmark on one model and
returns an `AllResult`; the page itself is `report.py`'s.
"""
from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from .adapter.adapter import ModelAdapter, adapt
from .analysis import analyze
from .benchmark.amp import amp_benchmark
from .benchmark.mainjob.batch_size import fp32_measure, grow_batch
from .benchmark.mainjob.consistency import consistency, recorded_load
from .core.errors import (
    Fp16RangeError,
    HostMemoryShort,
    ModelForwardError,
    OutputError,
    TierError,
    TrainingDiverged,
    TrainingOutOfMemory,
    describe,
)
from .core.files import holds_lock, jsonable
from .core.inputs import writable_dir
from .core.measure import load_average
from .core.memory_settings import MemorySettings, memory_setting
from .core.precision import dtype_name, resolve_device, resolve_precision
from .core.results import Result, TierFailure, checks_table, run_metadata, verdict_line, worst_status
from .core.threads import chooses_threads
from .jobplan import Growth, JobPlan, job_plan
from .models.builtins import DEFAULT_MODEL, DEMO_MODEL
from .models.heads import sized_to_data
from .models.loading import load_model
from .planning.planner import FitResult, fit
from .planning.ranks import plan_ranks
from .presets import FAST, JOB, Preset
from .report import write_report
from .smoketest.suite import smoke
from .training.config import CHECKPOINTS_FOLDER, METRICS_FILE, PLOT_FILE, TrainConfig
from .training.loop import train


@dataclass(frozen=True)
class JobTier:
    """One tier as the job runs it: its name (the report's file stem), how it runs given the results so far, whether
    it reads data (a model whose forward raised gets only the tiers that read none: they report it), and its place
    in the summary and the report (the tiers run in the order run_all declares them)."""

    name: str
    run: Callable[[dict], Result]
    shown: int
    reads_data: bool = True


@dataclass(repr=False)
class AllResult(Result):
    """What `run_all` returns: each tier's result, its status and seconds, and the report's index.html."""

    results: dict
    statuses: dict  # tier -> worst PASS/WARN/FAIL/SKIP, or None (training has no verdicts unless it diverged)
    seconds: dict
    index: Path
    metadata: dict
    bench_size: dict | None = None  # grow_batch()'s choice on a GPU; None where the default size was used
    plan: JobPlan | None = None  # what the job planned to run (batches, steps, probes), before it ran

    @property
    def model_status(self) -> str:
        """The worst verdict of the results that judge the model (smoke, analysis, training, ...), not of those
        that judge the device (the benchmark's: this device's precisions against targets a CPU seldom reaches;
        they are reported, but don't make the model's run fail)."""
        return worst_status(r.verdict for r in self.results.values() if r.verdict and r.judges == "model")

    @property
    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"tier": n, "status": self.statuses[n] or "", "seconds": round(self.seconds[n], 1),
                              "csv": f"{n}.csv", "png": f"{n}.png"} for n in self.results])

    def plot(self, name: str = "train"):
        """One tier's figure (the report folder holds all of them as PNG)."""
        if name not in self.results:
            raise ValueError(f"no tier {name!r} in this run; it has: {', '.join(self.results)}")
        return self.results[name].plot()

    def to_json(self) -> dict:
        return jsonable({"status": self.status, "model_status": self.model_status, "summary": self.summary_line(),
                         "tiers": self.table,
                         "index": self.index, "bench_size": self.bench_size,
                         "plan": self.plan.to_dict() if self.plan else None, "run_metadata": self.metadata,
                         "consistency": checks_table(consistency(self.results, recorded_load(self.metadata)))})

    def summary_text(self, width: int = 110) -> str:
        """The one-screen summary the CLI prints: the machine and model, each result's own line and the rows behind
        a verdict other than PASS, the job's own notes, then the last line (`summary_line`: the answer first)."""
        m = self.metadata
        busy = m.get("load_average_1m") is not None and m["load_average_1m"] > m["cpu_count"]
        threads = m.get("threads_reason") or f"{m['threads']} torch threads"
        lines = [f"{m['device_name']} · torch {m['torch']} · {threads}"
                 + (f" · machine busy: load {m['load_average_1m']:.1f} on {m['cpu_count']} cores, "
                    "so the timings below are slower than on an idle machine" if busy else "")]
        if "tokenizer" in m:
            lines.append(f"{m['model']} · weights stored {m['stored_dtype']} · tokenizer {m['tokenizer']} · "
                         f"data: {m['data']}")
        for name, result in self.results.items():
            lines.append(f"{result.summary_line()} · {self.seconds[name]:.1f} s")
            lines += _rows_block(result.problems(), width)
        if self.bench_size:
            lines.append(f"  the benchmark's batch grew from {self.bench_size['from_batch_size']} to "
                         f"{self.bench_size['batch_size']}: {self.bench_size['reason']}")
        lines += [f"consistency: {c.status} {c.detail}" for c in consistency(self.results, recorded_load(m))]
        lines.append(self.summary_line())
        return "\n".join(lines)

    def summary_line(self) -> str:
        """The job's last line, the answer first (the benchmark's: the mode to train in here and what it buys),
        then the verdicts and the report."""
        return f"{verdict_line(self.results)} · report: {self.index}"


def _rows_block(rows: pd.DataFrame, width: int) -> list[str]:
    """A result's problem rows, indented, each detail cut to what is left of `width`."""
    if rows.empty:
        return []
    shown = rows.drop(columns="detail", errors="ignore")
    if "value" in shown.columns:
        shown["value"] = shown["value"].map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
    lines = shown.to_string(index=False).splitlines()
    if "detail" not in rows.columns:
        return [f"  {line}" for line in lines]
    room = max(20, width - 2 - max(len(line) for line in lines) - 2)
    details = ["detail"] + [d if len(d) <= room else d[:room - 3] + "..." for d in map(str, rows["detail"])]
    return [f"  {line}  {d}" for line, d in zip(lines, details)]


@contextlib.contextmanager
def each_warning_once():
    """Within it, a warning already said is not said again. Every tier of the job reads the data anew (its own split),
    and each reading says what it left out or cut; Python's once-per-place registry doesn't keep them to one, since
    every catch_warnings a tier enters resets it."""
    said = set()
    with warnings.catch_warnings():
        show = warnings.showwarning

        def once(message, category, *args, **kwargs):
            if (str(message), category) not in said:
                said.add((str(message), category))
                show(message, category, *args, **kwargs)

        warnings.showwarning = once
        yield


@chooses_threads  # one thread count for every tier, chosen as the job starts
@holds_lock("out_dir")  # one run per report folder
@each_warning_once()  # the data's lines (rows left out, conversations cut) once, not once per tier that reads it
def run_all(model=DEFAULT_MODEL, out_dir="runs/report", *, data=None, precision=TrainConfig.precision,
            device=TrainConfig.device, fast: bool = False, batch_size: int | None = None, seed: int = TrainConfig.seed,
            progress: bool = TrainConfig.progress, model_kwargs: dict | None = None,
            memory: MemorySettings | str | None = None, data_format: str = TrainConfig.data_format,
            loss_on: str = TrainConfig.loss_on, chat_template: str | None = TrainConfig.chat_template) -> AllResult:
    """Tier 1, tier 2, a short training run and the AMP benchmark on one model, then `write_report`.

    model: a load_model spec (`model_kwargs` build it) or an nn.Module; every tier starts from the same
    initial weights (training works on a copy), except that with the default model and no model_kwargs,
    tier 2 analyses the shipped trained demo model (`tiny-gpt-trained`) and the report names it.
    Run lengths: presets.JOB, or presets.FAST with fast=True; `batch_size` replaces the preset's.
    memory: the memory settings training and the benchmark run in (MemorySettings, or full/lora/qlora/adamw8bit;
    docs/precision.md); with checkpointing the benchmark adds checkpointed rows. data_format, loss_on, chat_template:
    how chat rows are read (TrainConfig's), the same in every tier that reads the data. Training
    that diverges is recorded as FAIL with its partial history; a model whose forward raises gets smoke and
    analysis FAIL rows and no training or benchmark; bad input raises as in each tier. Ctrl-C raises KeyboardInterrupt
    (the CLI exits 130) and writes no report.
    """
    writable_dir(out_dir, "out_dir")  # before an hour of work, not after it
    _not_a_training_run(Path(out_dir))
    preset = _job_preset(fast, batch_size, data_format=data_format, loss_on=loss_on, chat_template=chat_template)
    torch.manual_seed(seed)
    base = load_model(model, **sized_to_data(model, model_kwargs or {}, data))  # a classifier's head: the data's
    # Tier 2 on fresh weights only shows what an untrained model does: with the default model left as is,
    # it analyses the shipped trained demo model instead. Tiers 1 and 3 start from fresh weights.
    default = isinstance(model, str) and model.strip() == DEFAULT_MODEL and not model_kwargs
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)  # decided once: every tier runs this one
    # The adapter, built once: every tier gets it (training a copy of it), none resolves the module again.
    adapter, preset, ran_on = _fit_to_model(base, data, preset, seed)
    analysed = load_model(DEMO_MODEL) if default else adapter
    plan = job_plan(preset, dev)  # every cap decided here, the same on every card
    memory = memory_setting(memory)  # train's and the benchmark's
    grown = {}  # the benchmark's grown batch on a GPU (grow_batch's choice), for the summary and JSON
    # In the order they run, each given the results so far: the benchmark before training (the trained copy the
    # report keeps is not held beside it), fit after it (with the speeds it measured, at the data's longest batch).
    tiers = [
        JobTier("smoke", lambda done: smoke(adapter, preset.smoke_config(precision=prec, device=dev,
                                                                          progress=progress)), 0, reads_data=False),
        JobTier("analysis", lambda done: analyze(analysed, data, preset.analysis_config(
            precision=prec, device=dev, progress=progress)), 1, reads_data=False),
        JobTier("amp_benchmark", lambda done: _benchmark(adapter, data, plan, dev, progress, memory, grown), 5),
        # A copy: training changes weights, and every tier must start from the same ones.
        JobTier("train", lambda done: _train(adapter.copied(), data, preset.train_config(
            precision=prec, device=dev, seed=seed, progress=progress, memory=memory)), 2),
        JobTier("fit", lambda done: _measured(fit(adapter, preset.fit_config(device=dev, validate=plan.fit_validate,
                                                                          progress=progress), data=data), done), 3),
        JobTier("ranks", lambda done: plan_ranks(adapter, seq_len=preset.seq_len, precision=prec, device=dev,
                                                 progress=progress), 4),
    ]
    results, seconds = _run_tiers(tiers, "data" in ran_on)
    # The 1-minute load average at the end (training, the last timed tier): above the core count, other jobs
    # slowed the timings.
    meta = {**ran_on, **run_metadata(dev, prec.dtype), "load_average_1m": load_average(),
            "cpu_count": os.cpu_count()}
    title = f"tier_utils report: {type(base).__name__}" + (f", tier 2 on {DEMO_MODEL}" if default else "")
    index = write_report(results, out_dir, title=title, metadata=meta,
                         leading={"consistency": checks_table(consistency(results, recorded_load(meta)))})
    statuses = {name: result.verdict for name, result in results.items()}
    return AllResult(results, statuses, seconds, index, meta, grown or None, plan)


def _job_preset(fast: bool, batch_size: int | None, **chat) -> Preset:
    """FAST or JOB, with `batch_size` for its own where given, and the chat reading (TrainConfig's data_format,
    loss_on, chat_template) in its TrainConfig: checked there (an unknown value, a file that is no template: one
    line, before any work), then every tier's config carries it (Preset.train_config, analysis_config,
    bench_config)."""
    preset = FAST if fast else JOB
    preset = replace(preset, train=replace(preset.train, **chat))
    return preset if batch_size is None else replace(preset, batch_size=batch_size)


def _fit_to_model(base, data, preset: Preset, seed: int) -> tuple[ModelAdapter | torch.nn.Module, Preset, dict]:
    """The model's adapter, the preset with its window fitted to the model (no warning), and what the report names:
    model, tokenizer, data. Bad data fails here, before any tier runs; a model whose forward raises is handed on as
    the module, with no tokenizer or data named (smoke and analyze report it)."""
    ran_on = {"model": type(base).__name__}
    try:
        adapter = adapt(base)
        preset = replace(preset, seq_len=min(preset.seq_len, adapter.max_len))
        described = adapter.datasets(data, preset.seq_len, seed, chat=preset.train.chat).describe()
    except ModelForwardError:
        return base, preset, ran_on
    return adapter, preset, {**ran_on, "tokenizer": described.tokenizer, "data": described.data,
                             "stored_dtype": dtype_name(adapter.stored_dtype)}


def _run_tiers(tiers: list[JobTier], has_data: bool) -> tuple[dict, dict]:
    """Each tier's result and seconds, each `_attempt`ed in the order of `tiers` (each given the results so far),
    then put in the order the summary and the report show them (`JobTier.shown`). Without data (the model's forward
    raised) only the tiers that read none run: they report it."""
    tiers = [tier for tier in tiers if has_data or not tier.reads_data]
    results, seconds = {}, {}
    for tier in tiers:
        results[tier.name], seconds[tier.name] = _attempt(tier.name, lambda tier=tier: tier.run(results))
    return {t.name: results[t.name] for t in sorted(tiers, key=lambda t: t.shown)}, seconds


def _attempt(name: str, run) -> tuple:
    """`run()` and its seconds. The model breaking a tier is a FAIL in the report (a TierFailure) and the
    other tiers run, and so is running out of memory (training's line, whole: it says what fits) and a weight fp16
    makes inf (the line names it); the user's input (any other TierError) raises: one line, its exit code (2), no
    report."""
    start = time.perf_counter()
    try:
        outcome = run()
    except (TrainingOutOfMemory, HostMemoryShort, Fp16RangeError) as exc:
        outcome = TierFailure(name, describe(exc, limit=None))
    except TierError as exc:
        if not isinstance(exc, ModelForwardError):
            raise
        outcome = TierFailure.of(name, exc)
    except Exception as exc:
        outcome = TierFailure.of(name, exc)
    return outcome, time.perf_counter() - start


def _benchmark(adapter: ModelAdapter, data, plan: JobPlan, dev, progress: bool, memory: MemorySettings,
               grown: dict) -> Result:
    """The AMP benchmark at its batch: `_grown_batch`'s on a GPU (its choice put in `grown`), else the preset's."""
    preset = plan.preset
    grown.update(_grown_batch(adapter, dev, plan.growth, preset.seq_len) or {})
    size = grown.get("batch_size", preset.batch_size)
    # Checkpointing is the benchmark's extra rows (each precision with and without it), the rest every row's.
    return amp_benchmark(adapter, data, preset.bench_config(
        batch_size=size, device=dev, progress=progress, memory=replace(memory, checkpointing=False),
        activation_checkpointing=memory.checkpointing))


def _measured(planned: FitResult, done: dict) -> FitResult:
    """fit's plan with this device's fastest mode read from the speedups a result of this run measured (the
    benchmark's, where its baseline was fp32); else as planned (predicted)."""
    measured = next((m for r in done.values() if (m := r.speedup_measurements()) is not None), None)
    return planned if measured is None else planned.with_measured_speedups(*measured)


def _grown_batch(adapter: ModelAdapter, dev, growth: Growth | None, seq_len: int) -> dict | None:
    """On a GPU, `grow_batch`'s choice within the plan's caps: grown until fp32's step is mostly arithmetic (a
    tiny model at the default batch is launch-bound there, and every precision then times the same). None
    elsewhere, and under a GPU profile whose tensors are on the CPU (the caps are planned, nothing is measured)."""
    if growth is None or dev.type != "cuda":
        return None
    was_training = adapter.model.training
    adapter.model.to(dev).train()
    try:
        return grow_batch(growth.from_batch, fp32_measure(adapter, seq_len), growth.budget_bytes,
                          max_batch=growth.max_batch)
    finally:
        adapter.model.train(was_training)


def _not_a_training_run(out: Path) -> None:
    """Refuse a report folder that holds a training run (`train --out`'s files): the report's own train.csv and
    plots would sit beside the run's metrics, checkpoints and training.png, and read as one run's."""
    found = [name for name in (CHECKPOINTS_FOLDER, METRICS_FILE, PLOT_FILE) if (out / name).exists()]
    if found:
        raise OutputError(f"{out} holds a training run ({', '.join(found)}), and `all` writes a report of its own "
                          f"beside nothing else; give it another folder, e.g. --out {out / 'report'}")


def _train(model, data, config: TrainConfig):
    """A short training run; divergence keeps its partial result (its summary says where).
    Ctrl-C during it stops the whole job: train() hands back its partial result, we re-raise."""
    try:
        result = train(model, data, config)
    except TrainingDiverged as exc:
        if exc.result is None:
            raise
        return exc.result
    if result.interrupted:
        raise KeyboardInterrupt
    result.model.zero_grad(set_to_none=True)  # the report keeps the trained copy; its gradients, not
    return result
