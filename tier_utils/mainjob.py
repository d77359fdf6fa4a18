"""The main job (`all`): every tier on one model, then the folder report (`report.write_report`).

`run_all` runs tier 1, tier 2, a short training run, the fit planner and the AMP benchmark on one model and
returns an `AllResult`; the page itself is `report.py`'s.
"""
from __future__ import annotations

import copy
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from .adapter.adapter import adapt
from .analysis import analyze
from .benchmark.amp import BenchmarkResult, amp_benchmark
from .benchmark.consistency import consistency, recorded_load
from .benchmark.size import MEMORY_FRACTION, fp32_measure, grow_batch
from .core.errors import ModelForwardError, TierError, TrainingDiverged
from .core.files import holds_lock, jsonable
from .core.inputs import writable_dir
from .core.measure import load_average
from .core.memory_settings import MemorySettings, memory_setting
from .core.precision import dtype_name, resolve_device, resolve_precision
from .core.results import STATUSES, Result, TierFailure, checks_table, run_metadata, verdict_line, worst_status
from .core.threads import chooses_threads
from .models.builtins import DEFAULT_MODEL, DEMO_MODEL
from .models.loading import load_model
from .planning.planner import fit
from .planning.ranks import plan_ranks
from .presets import FAST, JOB, Preset
from .report import write_report
from .smoketest.suite import smoke
from .training.config import TrainConfig
from .training.history import TrainSummary
from .training.loop import train


@dataclass(repr=False)
class AllResult(Result):
    """What `run_all` returns: each tier's result, its status and seconds, and the report's index.html."""

    results: dict
    statuses: dict  # tier -> worst PASS/WARN/FAIL/SKIP, or None (training has no verdicts unless it diverged)
    seconds: dict
    index: Path
    metadata: dict
    bench_size: dict | None = None  # grow_batch()'s choice on a GPU; None where the default size was used

    @property
    def model_status(self) -> str:
        """The worst status of the model's own checks (smoke, analysis, training), not the benchmark's.

        The benchmark's verdicts judge this device's precisions against targets (a CPU seldom
        reaches a 1.5x bf16 speedup); they are reported, but don't make the model's run fail.
        """
        return worst_status(s for n, s in self.statuses.items() if s and n != "amp_benchmark")

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
        return jsonable({"status": self.status, "model_status": self.model_status, "tiers": self.table,
                         "index": self.index, "bench_size": self.bench_size, "run_metadata": self.metadata,
                         "consistency": checks_table(consistency(self.results, recorded_load(self.metadata)))})

    def summary_text(self, width: int = 110) -> str:
        """The one-screen summary the CLI prints: non-PASS rows of tiers 1-2, training, benchmark verdicts."""
        r, m = self.results, self.metadata
        busy = m.get("load_average_1m") is not None and m["load_average_1m"] > m["cpu_count"]
        threads = m.get("threads_reason") or f"{m['threads']} torch threads"
        lines = [f"{m['device_name']} · torch {m['torch']} · {threads}"
                 + (f" · machine busy: load {m['load_average_1m']:.1f} on {m['cpu_count']} cores, "
                    "so the timings below are slower than on an idle machine" if busy else "")]
        if "tokenizer" in m:
            lines.append(f"{m['model']} · weights stored {m['stored_dtype']} · tokenizer {m['tokenizer']} · "
                         f"data: {m['data']}")
        r = {n: t for n, t in r.items() if not isinstance(t, TierFailure)}
        lines += [f"{f.tier}: FAIL, it raised {f.error}" for f in self.results.values() if isinstance(f, TierFailure)]
        if "smoke" in r:
            lines += _verdict_block("smoke", self, r["smoke"].table[["check", "status", "value", "detail"]], width)
        if "analysis" in r:
            block = _verdict_block("analysis", self, r["analysis"].table[["analysis", "check", "status", "value",
                                                                          "detail"]], width)
            if provenance := r["analysis"].model.get("provenance"):  # the shipped demo model, not fresh weights
                block.insert(1, f"  on {provenance['summary']}")
            lines += block
        if "train" in r:
            lines.append(_train_line(r["train"].summary, self.seconds["train"]))
        if "fit" in r:
            lines.append(r["fit"].summary_line())
        if "ranks" in r:
            lines.append(r["ranks"].summary_line())
        if "amp_benchmark" in r:
            v, run = r["amp_benchmark"].verdicts, r["amp_benchmark"].config
            lines += _verdict_block("amp_benchmark", self, v[v["precision"] != "fp32"], width, only_problems=False)
            size = f"  at batch {run.settings.batch_size} x {run.settings.seq_len} tokens"
            if self.bench_size:
                size += f", grown from batch {self.bench_size['from_batch_size']}: {self.bench_size['reason']}"
            if run.fit.reason:
                size += f"; {run.fit.reason}"
            lines += [size, _bench_weights(r["amp_benchmark"])]
        lines += [f"consistency: {c.status} {c.detail}" for c in consistency(r, recorded_load(m))]
        lines.append(f"{verdict_line(self.statuses)} · report: {self.index}")
        return "\n".join(lines)


def _verdict_block(name: str, res: AllResult, table, width: int, only_problems: bool = True) -> list[str]:
    counts = table["status"].value_counts()
    head = f"{name}: {res.statuses[name]} ({', '.join(f'{counts[s]} {s}' for s in STATUSES if s in counts)}) " \
           f"in {res.seconds[name]:.1f} s"
    rows = table[table["status"] != "PASS"] if only_problems else table
    if rows.empty:
        return [head]
    shown = rows.drop(columns="detail")
    shown["value"] = shown["value"].map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
    lines = shown.to_string(index=False).splitlines()
    room = max(20, width - 2 - max(len(line) for line in lines) - 2)
    details = ["detail"] + [d if len(d) <= room else d[:room - 3] + "..." for d in map(str, rows["detail"])]
    return [head] + [f"  {line}  {d}" for line, d in zip(lines, details)]


def _bench_weights(bench: BenchmarkResult) -> str:
    """What each benchmarked precision held the weights in (measured in its run), after the stored dtype."""
    held = [f"{r.precision} {r.mode}: {r.memory['weights_dtype']}" for r in bench.records if r.memory]
    return f"  weights stored {bench.metadata['stored_dtype']}, held in the runs as " + (", ".join(held) or "none ran")


def _train_line(s: TrainSummary, seconds: float) -> str:
    losses = " · ".join(f"{k} {v:.4f}" for k in ("train_loss", "val_loss") if (v := getattr(s, k)) is not None)
    line = f"train: {s.steps} steps, global batch {s.global_batch}, {s.precision} ({s.weights_detail}), {losses}"
    if t := s.tokens_per_s:
        line += f" · {t.median:,.0f} tokens/s median (IQR {t.iqr:,.0f}, n={t.n})"
    return line + f" · {seconds:.1f} s"


@chooses_threads  # one thread count for every tier, chosen as the job starts
@holds_lock("out_dir")  # one run per report folder
def run_all(model=DEFAULT_MODEL, out_dir="runs/report", *, data=None, precision=TrainConfig.precision,
            device=TrainConfig.device, fast: bool = False, batch_size: int | None = None, seed: int = TrainConfig.seed,
            progress: bool = TrainConfig.progress, model_kwargs: dict | None = None,
            memory: MemorySettings | str | None = None) -> AllResult:
    """Tier 1, tier 2, a short training run and the AMP benchmark on one model, then `write_report`.

    model: a load_model spec (`model_kwargs` build it) or an nn.Module; every tier starts from the same
    initial weights (training works on a copy), except that with the default model and no model_kwargs,
    tier 2 analyses the shipped trained demo model (`tiny-gpt-trained`) and the report names it.
    Run lengths: presets.JOB, or presets.FAST with fast=True; `batch_size` replaces the preset's.
    memory: the memory settings training and the benchmark run in (MemorySettings, or full/lora/qlora/adamw8bit;
    docs/precision.md); with checkpointing the benchmark adds checkpointed rows. Training
    that diverges is recorded as FAIL with its partial history; a model whose forward raises gets smoke and
    analysis FAIL rows and no training or benchmark; bad input raises as in each tier. Ctrl-C raises KeyboardInterrupt
    (the CLI exits 130) and writes no report.
    """
    writable_dir(out_dir, "out_dir")  # before an hour of work, not after it
    preset = FAST if fast else JOB
    if batch_size is not None:
        preset = replace(preset, batch_size=batch_size)
    torch.manual_seed(seed)
    base = load_model(model, **(model_kwargs or {}))
    # Tier 2 on fresh weights only shows what an untrained model does: with the default model left as is,
    # it analyses the shipped trained demo model instead. Tiers 1 and 3 start from fresh weights.
    default = isinstance(model, str) and model.strip() == DEFAULT_MODEL and not model_kwargs
    analysed = load_model(DEMO_MODEL) if default else base
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)  # decided once: every tier runs this one
    preset, ran_on = _fit_to_model(base, data, preset, seed)
    memory = memory_setting(memory)  # train's and the benchmark's
    steps = {
        "smoke": lambda: smoke(base, preset.smoke_config(precision=prec, device=dev, progress=progress)),
        "analysis": lambda: analyze(analysed, data, preset.analysis_config(precision=prec, device=dev,
                                                                            progress=progress)),
        # A copy: training changes weights, and the benchmark must start from the same ones as the rest.
        "train": lambda: _train(copy.deepcopy(base), data, preset.train_config(precision=prec, device=dev, seed=seed,
                                                                               progress=progress, memory=memory)),
        # predictions only
        "fit": lambda: fit(base, preset.fit_config(device=dev, validate=False, progress=progress)),
        "ranks": lambda: plan_ranks(base, seq_len=preset.seq_len, precision=prec, device=dev, progress=progress),
    }
    if "data" not in ran_on:  # the forward raised: smoke and analyze report it; nothing else can run
        del steps["train"], steps["fit"], steps["ranks"]
    results, seconds, bench_size = _run_tiers(steps, lambda: _benchmark(base, data, preset, dev, progress, memory))
    # The 1-minute load average at the end (training, the last timed tier): above the core count, other jobs
    # slowed the timings.
    meta = {**ran_on, **run_metadata(dev, prec.dtype), "load_average_1m": load_average(),
            "cpu_count": os.cpu_count()}
    title = f"tier_utils report: {type(base).__name__}" + (f", tier 2 on {DEMO_MODEL}" if analysed is not base else "")
    index = write_report(results, out_dir, title=title, metadata=meta)
    statuses = {name: result.status for name, result in results.items()}
    return AllResult(results, statuses, seconds, index, meta, bench_size)


def _fit_to_model(base, data, preset: Preset, seed: int) -> tuple[Preset, dict]:
    """The preset with its window fitted to the model (no warning), and what the report names: model,
    tokenizer, data. Bad data fails here, before any tier runs; a model whose forward raises gets no
    tokenizer or data named (smoke and analyze report it)."""
    ran_on = {"model": type(base).__name__}
    try:
        adapter = adapt(base)
        preset = replace(preset, seq_len=min(preset.seq_len, adapter.max_len))
        described = adapter.datasets(data, preset.seq_len, seed).describe()
    except ModelForwardError:
        return preset, ran_on
    return preset, {**ran_on, "tokenizer": described.tokenizer, "data": described.data,
                    "stored_dtype": dtype_name(adapter.stored_dtype)}


def _run_tiers(steps: dict, bench) -> tuple[dict, dict, dict | None]:
    """Each tier's result and seconds, each `_attempt`ed in order, with the benchmark (`bench`) run just before
    training and shown last; and the benchmark's grown batch (None: the preset's, or no benchmark)."""
    results, seconds, outcome = {}, {}, None
    for name, run in steps.items():
        if name == "train":  # the benchmark first: the trained copy the report keeps is not held beside it
            outcome, bench_s = _attempt("amp_benchmark", bench)
        results[name], seconds[name] = _attempt(name, run)
    bench_size = None
    if outcome is not None:  # shown last, as before
        results["amp_benchmark"], bench_size = outcome if isinstance(outcome, tuple) else (outcome, None)
        seconds["amp_benchmark"] = bench_s
    return results, seconds, bench_size


def _attempt(name: str, run) -> tuple:
    """`run()` and its seconds. The model breaking a tier is a FAIL in the report (a TierFailure) and the
    other tiers run; the user's input (any other TierError) raises: one line, its exit code (2), no report."""
    start = time.perf_counter()
    try:
        outcome = run()
    except TierError as exc:
        if not isinstance(exc, ModelForwardError):
            raise
        outcome = TierFailure.of(name, exc)
    except Exception as exc:
        outcome = TierFailure.of(name, exc)
    return outcome, time.perf_counter() - start


def _benchmark(model, data, preset: Preset, dev, progress: bool,
               memory: MemorySettings) -> tuple[BenchmarkResult, dict | None]:
    """The AMP benchmark at its batch (`_grown_batch` on a GPU), and that batch's choice (None: the preset's)."""
    grown = _grown_batch(model, dev, preset.batch_size, preset.seq_len)
    size = grown["batch_size"] if grown else preset.batch_size
    # Checkpointing is the benchmark's extra rows (each precision with and without it), the rest every row's.
    return amp_benchmark(model, data, preset.bench_config(
        batch_size=size, device=dev, progress=progress, memory=replace(memory, checkpointing=False),
        activation_checkpointing=memory.checkpointing)), grown


def _grown_batch(model, dev, batch_size: int, seq_len: int) -> dict | None:
    """On a GPU, `grow_batch`'s choice: grown until fp32's step is mostly arithmetic (a tiny model at the
    default batch is launch-bound there, and every precision then times the same). None elsewhere."""
    if dev.type != "cuda":
        return None
    budget = int(MEMORY_FRACTION * torch.cuda.get_device_properties(dev).total_memory)
    was_training = model.training
    model.to(dev).train()
    try:
        return grow_batch(batch_size, fp32_measure(adapt(model), seq_len), budget)
    finally:
        model.train(was_training)


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
