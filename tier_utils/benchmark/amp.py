"""Tier 3 AMP benchmark: fp32 vs bf16 vs fp16 speed, MFU, memory and accuracy stability, with verdicts.

Every precision starts from the same weights and sees the same batches in the same order with a
fresh optimizer (and, for fp16, GradScaler) through the shared `TrainStep`. Speed repeats are
interleaved across precisions so drift on a shared machine hits all of them alike.
"""
from __future__ import annotations

import contextlib
import copy
import gc
from dataclasses import dataclass, replace

import pandas as pd
import torch

from ..adapter.adapter import resolve_model
from ..core.budget import gib, out_of_memory_note, read_budget, without_oom
from ..core.files import jsonable
from ..core.loggers import log_result_tables, run_stamp
from ..core.measure import (
    SavedTensorMeter,
    StepTimer,
    count_flops,
    cpu_load,
    load_average,
    probe_ms,
    probe_size,
    static_memory,
    summarize,
)
from ..core.precision import dtype_name, kept_dtypes, resolve_device, resolve_precision
from ..core.progress import progress_bar
from ..core.results import Result, checks_table, run_metadata, worst_status
from ..core.seeding import rng_state, set_rng_state
from ..core.settings import merge
from ..core.threads import chooses_threads
from ..data.datasets import make_loader, to_device
from ..engine.compiling import compile_for_training
from ..engine.evaluation import evaluate
from ..engine.lora import apply_lora, convert_for, describe_lora, unload
from ..engine.memory import checkpointing_on, kept_inputs, memory_context, require_blocks
from ..engine.step import TrainStep, make_optimizer, make_scheduler
from ..planning.planner import device_room, plan
from .config import CHECKPOINTED, COMPILE_CHOICES, BenchConfig, Mode
from .record import BatchFit, BenchRun, Plan, PrecisionRecord, Speed, make_record
from .verdicts import launch_bound, record_checks

SCHEMA = "tier_utils.bench/1"
_PROBE_REPS = 3  # probe matmuls per speed repeat
FLOOR_TOKENS = 8  # the floor step: one sequence this long, nearly all fixed per-step cost


@dataclass(repr=False)
class BenchmarkResult(Result):
    """What `amp_benchmark` measured: one record per precision, the verdict rows, config and metadata."""

    config: BenchRun
    metadata: dict
    flops: dict  # {"per_step": int, "by_op": {op: flops}} of one fp32 forward + backward
    records: list[PrecisionRecord]
    checks: list
    overhead: dict | None  # fp32's floor step and launch_bound()'s diagnosis; None when fp32 was not timed

    @property
    def status(self) -> str:
        return worst_status(c.status for c in self.checks)

    @property
    def table(self) -> pd.DataFrame:
        return pd.DataFrame([r.table_row() for r in self.records])

    @property
    def verdicts(self) -> pd.DataFrame:
        return checks_table(self.checks, ("precision", "mode"))

    def overview(self) -> pd.DataFrame:
        return self.verdicts  # the answer per precision; the measurements are in .table

    def plot(self):
        from .plot import plot_benchmark

        return plot_benchmark(self)

    def to_json(self) -> dict:
        return jsonable({"schema": SCHEMA, "status": self.status, "config": self.config, "metadata": self.metadata,
                         "flops": self.flops, "overhead": self.overhead, "precisions": self.records,
                         "verdicts": self.verdicts})


@chooses_threads  # the run's torch thread count, chosen as it starts
def amp_benchmark(model, data=None, config: BenchConfig | dict | None = None, *, model_kwargs: dict | None = None,
                  **overrides) -> BenchmarkResult:
    """Benchmark mixed precision against fp32 on `model` (an nn.Module, adapter or load_model spec).

    Settings: `config` (a BenchConfig, a dict of its fields or None: the defaults), then `overrides` by field name.
    `model_kwargs`: load_model's keywords, building a spec's model (e.g. {"d_model": 256}).
    fp32 is always run: it is the baseline every ratio is taken against. A precision the device
    cannot run natively is SKIPPED with the reason unless `force=True`. The model is moved to
    `device`; each precision runs it in its own weight dtype (`convert_module`: fp32 master weights for fp32
    and the mixed modes, bf16/fp16 for the true ones), all from the same fp32 start; its weights, their
    dtypes and train/eval mode, and the caller's RNG states, are restored on return.
    `loggers` (e.g. ("mlflow",)): one run under `log_dir` (None: runs/logs) holding the table and the verdicts.
    compile: "off" (eager), "on" (every step torch.compiled; True/False are read as on/off) or "both": each
    precision eager and compiled, repeats interleaved, compiled rows also judged against the same precision eager.
    A model that can't be compiled gets a WARN row and is measured eager.
    """
    cfg = merge(BenchConfig, config, overrides, "benchmark")
    dev = resolve_device(cfg.device)
    adapter = resolve_model(model, **(model_kwargs or {}))
    if cfg.activation_checkpointing:
        require_blocks(adapter.model)
    # LoRA freezes the base: which weights trained before is given back with the model (`all` trains it next).
    trainable = {p: p.requires_grad for p in adapter.model.parameters()}
    if cfg.lora is not None:  # every row trains the adapters; peft's unload() gives the caller's model back
        adapter = replace(adapter, model=apply_lora(adapter.model, cfg.lora))
    try:
        with kept_dtypes(adapter.model.to(dev)):
            return _benchmark(adapter, cfg, dev, data)
    finally:
        unload(adapter.model)
        for p, flag in trainable.items():
            p.requires_grad_(flag)


def _benchmark(adapter, cfg: BenchConfig, dev: torch.device, data) -> BenchmarkResult:
    """amp_benchmark's run, inside kept_dtypes: each precision converts the model to its own weight dtype."""
    was_training = adapter.model.training
    adapter.model.train()
    adapter.require_trainable()
    adapter.check_forward()
    seq_len = adapter.fit_length(cfg.seq_len)  # capped with a warning; config records the length used
    modes = COMPILE_CHOICES[cfg.compile]  # the config checked it is one of them
    plans = [_plan(name, mode, dev, cfg.force, adapter) for name in cfg.precisions for mode in modes]
    if cfg.activation_checkpointing:  # each precision again, eager, with checkpointing: its cost and saving
        plans += [replace(_plan(name, CHECKPOINTED, dev, cfg.force, adapter), checkpointing=True)
                  for name in cfg.precisions]
    budget = read_budget(dev)  # before anything of ours is allocated
    cfg, sizing = _fit_batch(adapter, plans, cfg, seq_len, budget)
    splits = adapter.datasets(data, seq_len)
    steps_per_repeat = cfg.untimed_steps + cfg.timed_steps
    speed_batches = list(_batches(splits.train, steps_per_repeat, cfg, dev))
    tokens_per_step = speed_batches[0]["input_ids"].numel()
    base = plans[0]
    start = copy.deepcopy(convert_for(base.precision, adapter.model).state_dict())  # fp32: every run's start
    for p in plans:
        if p.ran and p.mode == "compiled":
            _compile_plan(p, adapter, speed_batches[0], cfg.compile_mode, eager_too="eager" in modes,
                          progress=cfg.progress)
    ran = [p for p in plans if p.ran]
    # The floor: eager fp32 on one short sequence (one label each), almost all fixed per-step cost (launches).
    short = [{k: v[:1, :FLOOR_TOKENS] if v.dim() > 1 else v[:1] for k, v in b.items()} for b in speed_batches]
    floor = Plan(f"{base.name} floor", "eager", base.precision, adapter, batches=short)
    total = len(ran) * (cfg.repeats * steps_per_repeat + cfg.accuracy_steps) + cfg.repeats * steps_per_repeat
    # Every run reseeds (same dropout masks per precision): on a fork, so the caller's streams go on untouched.
    cuda_rngs = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda_rngs), progress_bar(total=total, desc="amp benchmark",
                                                                     unit="step", enabled=cfg.progress) as bar:
            # One forward + backward of the baseline (fp32 where it fits), counted once: precision changes no
            # FLOP count, and the baseline is what fits here.
            first = []

            def forward_backward():
                with base.precision.autocast():
                    first.append(adapter.forward_loss(speed_batches[0])[0])
                first[0].backward()

            convert_for(base.precision, adapter.model)  # a compiled plan may have left it in another dtype

            flops = count_flops(forward_backward) if base.ran else {"per_step": None, "by_op": {}}
            adapter.model.zero_grad(set_to_none=True)
            # Nothing is timed on a loss that is not finite: its speed would be a verdict on NaN.
            stopped = _nonfinite(base.name, first[0], "on the first batch") if base.ran else None
            for p in ran:
                p.stopped = stopped
                if not stopped and p.ran:
                    got = _unless_oom(p, plans, budget, cfg, seq_len, _measure_memory, adapter, p.precision, start,
                                      speed_batches, cfg, p.adapter)
                    if got is None:
                        continue
                    p.memory, loss = got
                    p.stopped = _nonfinite(p.name, loss, "on the second batch")
                    p.probe_size = probe_size(dev, p.precision.dtype)
            live = [p for p in ran if p.ran and not p.stopped]
            timed = live if base.stopped or not base.ran else live + [floor]  # the floor needs fp32 beside it
            for _, p in interleave(timed, cfg.repeats):
                if not p.ran:  # out of memory in an earlier repeat
                    continue
                got = _unless_oom(p, plans, budget, cfg, seq_len, timed_repeat, adapter, p.precision, start,
                                  p.batches or speed_batches, cfg, bar, p.adapter)
                if got is None:
                    continue
                ms, losses = got
                p.step_samples.append(sum(ms) / len(ms))
                if p is not floor:
                    p.stopped = p.stopped or _nonfinite(p.name, losses, "during the timed steps")
                    # The peak probe rides along with every repeat, so load drift hits it like the steps.
                    p.probe_ms += probe_ms(dev, p.precision.dtype, p.probe_size, _PROBE_REPS)
            for p in ran:
                p.stopped = base.stopped or p.stopped  # no baseline: no precision gets a verdict
                if p.stopped or not p.ran:
                    continue
                p.speed = Speed(summarize(p.step_samples),
                                summarize(tokens_per_step / (ms / 1e3) for ms in p.step_samples), p.step_samples,
                                cfg.timed_steps)
                if cfg.accuracy_steps:
                    p.accuracy = _unless_oom(p, plans, budget, cfg, seq_len, _accuracy_run, adapter, p.precision,
                                             start, splits, cfg, bar, p.adapter)
    finally:
        convert_for(base.precision, adapter.model).load_state_dict(start)
        adapter.model.train(was_training)
    eager = {p.name: p for p in plans if p.mode == "eager" and p.ran}
    records = [make_record(p, base, flops, dev, cfg.thresholds, eager.get(p.name)) for p in plans]
    overhead = None
    if records[0].speed is not None:
        floor_ms = summarize(floor.step_samples)
        overhead = {"floor_step_ms": floor_ms.to_dict(), "floor_shape": list(floor.batches[0]["input_ids"].shape),
                    **launch_bound(records[0].speed.step_ms.median, floor_ms.median, records[0].mfu["mfu"],
                                   cfg.batch_size, cfg.thresholds)}
    verdicts = [c for p, r in zip(plans, records)
                for c in record_checks(r, records[0], p.skip_reason, cfg.thresholds, cfg.accuracy_steps, overhead,
                                     cpu_load())]
    config = BenchRun(adapter.name, adapter.task, adapter.summary()["parameters"], splits.describe(),
                      settings=replace(cfg, seq_len=seq_len), tokens_per_step=tokens_per_step, fit=sizing,
                      lora=describe_lora(adapter.model))
    metadata = {**run_metadata(dev), "float32_matmul_precision": torch.get_float32_matmul_precision(),
                "load_average_1m": load_average(), "stored_dtype": dtype_name(adapter.stored_dtype)}
    result = BenchmarkResult(config, metadata, flops, records, verdicts, overhead)
    if cfg.loggers:
        log_result_tables(cfg.loggers, cfg.log_dir, f"amp_benchmark-{adapter.name}-{run_stamp()}",
                          {"amp_benchmark": result.table, "verdicts": result.verdicts},
                          {**config.to_dict(), **metadata})
    return result


def interleave(items: list, repeats: int) -> list[tuple[int, object]]:
    """(repeat, item) in interleaved order: a, b, c, a, b, c, ... never all of a first."""
    return [(r, item) for r in range(repeats) for item in items]


def _plan(name: str, mode: Mode, dev: torch.device, force: bool, adapter) -> Plan:
    prec = resolve_precision(name, dev, warn=False)
    if prec.native or force:
        return Plan(name, mode, prec, adapter, forced=not prec.native)
    why = f"not native: {prec.native_support(dev)[1]}; force=True (CLI --force) runs it anyway"
    return Plan(name, mode, prec, adapter, ran=False, skip_reason=why)


def _fit_batch(adapter, plans: list[Plan], cfg: BenchConfig, seq_len: int,
               budget) -> tuple[BenchConfig, BatchFit]:
    """The batch every compared precision fits here, by the fit planner (predicted): the one asked, or the
    largest all of them fit. A precision that fits not even batch 1 is SKIPped with the reason; all of them
    are when fp32, the baseline, does not fit."""
    names = list(dict.fromkeys(p.name for p in plans if p.ran))
    room = device_room(budget)
    configs = {c.precision: c for c in plan(adapter, names, seq_len)[0]}
    largest = {name: c.largest_batch(seq_len, room) for name, c in configs.items()}
    for p in plans:
        if p.ran and largest[p.name] < 1:
            p.ran, p.skip_reason = False, (f"does not fit here: a training step at batch 1, T={seq_len} predicted "
                                           f"{gib(configs[p.name].step_bytes(1, seq_len))}, {gib(room)} usable "
                                           f"({budget.describe()})")
    if not plans[0].ran and plans[0].name in largest:
        _best_fitting_baseline(plans)
    fitting = [largest[p.name] for p in plans if p.ran]
    batch = min([cfg.batch_size, *fitting])
    if batch == cfg.batch_size:
        return cfg, BatchFit(cfg.batch_size, largest, room, budget, None)
    reason = (f"batch {cfg.batch_size} does not fit every compared precision here; run at {batch}, the largest all "
              "of them fit (predicted: " + ", ".join(f"{n} {b}" for n, b in largest.items())
              + f"; {budget.describe()})")
    return replace(cfg, batch_size=batch), BatchFit(cfg.batch_size, largest, room, budget, reason)


def _best_fitting_baseline(plans: list[Plan]) -> None:
    """fp32 does not fit here: the first mode in the order asked that fits (the closest to fp32: mixed modes,
    fp32 master weights, come before the true ones) becomes the baseline, moved to the front, and fp32's row
    says so. When none fits, none runs."""
    fp32 = plans[0]
    fitting = [p for p in plans[1:] if p.ran]
    if not fitting:
        return
    base = fitting[0]
    plans.remove(base)
    plans.insert(0, base)
    fp32.skip_reason += f"; the modes that fit are compared with {base.name}, the best-fitting baseline"


def _unless_oom(p: Plan, plans: list[Plan], budget, cfg: BenchConfig, seq_len: int, fn, *args):
    """fn(*args), with activation checkpointing for a checkpointing plan; a CUDA out-of-memory instead SKIPs plan
    `p` with the size and the free memory (every plan, when `p` is fp32's: no baseline) and returns None, its
    memory released."""
    with memory_context(p.adapter.model, p.checkpointing):
        got, error = without_oom(fn, *args)
    if error is None:
        return got
    why = f"{out_of_memory_note(p.adapter.device, None, cfg.batch_size, seq_len, budget)} ({error[:120]})"
    p.ran, p.skip_reason = False, why
    if p is plans[0]:
        for other in plans[1:]:
            other.ran, other.skip_reason = False, f"{p.name}, the baseline, {why}"
    return None


def _nonfinite(precision: str, loss: torch.Tensor, when: str) -> str | None:
    """The reason to stop a precision whose loss (a scalar, or the losses of a run) is NaN/inf; else None."""
    loss = loss.detach().reshape(-1)
    bad = loss[~torch.isfinite(loss)]
    return f"{precision} loss is {bad[0].item()} {when}" if bad.numel() else None


def _compile_plan(p: Plan, adapter, batch: dict, mode: str, eager_too: bool, progress: bool) -> None:
    """Compile for this precision (its warm-up under its autocast is timed as compile_s). If it can't
    compile, the plan is dropped when its eager twin is measured anyway, else it runs eager."""
    convert_for(p.precision, adapter.model)  # compiled for the weight dtype it will run with
    p.adapter, info = compile_for_training(adapter, p.precision, batch, mode, progress)
    p.compile = info
    if info.compiled:
        return
    if eager_too:
        p.ran, p.skip_reason = False, "could not compile: see this precision's eager rows"
    else:
        p.mode = "eager"


def _batches(dataset, n: int, cfg: BenchConfig, device):
    """The same `n` batches, in the same order, for every call; cycles a small dataset; on `device`."""
    loader = make_loader(dataset, cfg.batch_size, shuffle=True, seed=cfg.seed, drop_last=True, device=device)
    produced = 0
    while produced < n:
        for batch in loader:
            yield to_device(batch, device)
            produced += 1
            if produced == n:
                return


def _fresh_step(adapter, prec, start, cfg: BenchConfig, total_steps: int = 0, track_scale: bool = True,
                step_adapter=None, count_rounding: bool = False) -> TrainStep:
    """The fp32 start weights loaded into the eager model, held in the precision's weight dtype; the step calls
    `step_adapter` (compiled) if given."""
    # The last run's gradients (and, should a reference cycle keep it, its optimizer state) go before this run
    # allocates its own, so the two are never held side by side.
    adapter.model.zero_grad(set_to_none=True)
    gc.collect()
    convert_for(prec, adapter.model).load_state_dict(start)  # load_state_dict casts to the weights' dtype
    torch.manual_seed(cfg.seed)  # same dropout masks in every run
    opt = make_optimizer(adapter.model, cfg.lr, cfg.weight_decay, prec.adamw_eps)
    sched = make_scheduler(opt, max(1, total_steps // 10), total_steps) if total_steps else None
    return TrainStep(step_adapter or adapter, prec, opt, sched, grad_clip=cfg.grad_clip, track_scale=track_scale,
                     count_rounding=count_rounding)


def _measure_memory(adapter, prec, start, batches, cfg: BenchConfig, step_adapter=None) -> tuple[dict, torch.Tensor]:
    """Static split after one step (optimizer state exists), activations of the next step, CUDA peaks;
    and that step's loss."""
    dev = adapter.device
    step = _fresh_step(adapter, prec, start, cfg, step_adapter=step_adapter)
    step([batches[0]])
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    # Checkpointing keeps each block's inputs outside autograd's saved tensors: counted too.
    with SavedTensorMeter(adapter.model) as meter, kept_inputs(adapter.model, meter) if checkpointing_on(
            adapter.model) else contextlib.nullcontext():
        loss = step([batches[1 % len(batches)]]).loss
    mem = static_memory(adapter.model, step.optimizer)
    mem["activation_bytes"] = meter.bytes
    mem["total_bytes"] = sum(mem.values())
    mem["steps_measured"] = 1  # saved-tensor accounting is an exact count, not a sample
    mem["weights_dtype"] = dtype_name(adapter.weights_dtype)  # what this precision's steps held the weights in
    mem["peak_allocated_bytes"] = mem["peak_reserved_bytes"] = None
    if cuda:
        torch.cuda.synchronize(dev)
        mem["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        mem["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    return mem, loss


def timed_repeat(adapter, prec, start, batches, cfg: BenchConfig, bar,
                 step_adapter=None) -> tuple[list[float], torch.Tensor]:
    """One repeat: fresh optimizer, `cfg.untimed_steps` steps untimed, then each optimizer step timed.
    Returns the timed steps' milliseconds and every step's loss, read after the timing.

    No scheduler here, so fp16 needs no skip decision: reading the loss scale (two host syncs per
    step that fp32/bf16 don't have) stays out of the timed region.
    """
    step = _fresh_step(adapter, prec, start, cfg, track_scale=False, step_adapter=step_adapter)
    losses = []
    for batch in batches[:cfg.untimed_steps]:
        losses.append(step([batch]).loss)
        bar.update()
    timer = StepTimer(adapter.device)
    for batch in batches[cfg.untimed_steps:]:
        with timer.region():
            losses.append(step([batch]).loss)
        bar.update()
    return timer.milliseconds(), torch.stack(losses)


def _accuracy_run(adapter, prec, start, splits, cfg: BenchConfig, bar, step_adapter=None) -> dict:
    """Train `cfg.accuracy_steps` applied updates from the shared start, then validate (eager) in the same
    precision.

    An fp16 step whose gradients overflowed changes no weight: it is retried on the same batch from the
    same random state, so update k of every precision sees batch k and the curves compare applied
    updates. Skipped steps are counted and the loss scale of every attempt is traced. Each applied update is
    also compared with the weights before it: the share of non-zero AdamW updates the stored dtype rounded away.
    """
    step = _fresh_step(adapter, prec, start, cfg, total_steps=cfg.accuracy_steps, step_adapter=step_adapter,
                       count_rounding=True)
    curve, scales, skipped, attempts, diverged_at, why = [], [], 0, 0, None, None
    rounded = updated = 0
    for i, batch in enumerate(_batches(splits.train, cfg.accuracy_steps, cfg, adapter.device)):
        while True:
            rng = rng_state() if prec.needs_scaler else None
            out = step([batch])
            attempts += 1
            if out.skipped is not None:
                scales.append(out.scale_before)
            if not out.skipped or out.scale_collapsed:
                break
            skipped += 1
            set_rng_state(rng)  # the retry draws the same dropout masks
        bar.update()
        if out.rounding is not None:
            rounded, updated = rounded + out.rounding[0], updated + out.rounding[1]
        # No scaler to absorb a non-finite loss, or fp16's scale collapsed (train()'s rule): the run is over.
        if (out.skipped is None and not torch.isfinite(out.loss)) or out.scale_collapsed:
            diverged_at = attempts - 1
            skipped += bool(out.skipped)
            why = "fp16 loss scale fell below 1" if out.scale_collapsed else f"loss became {out.loss.item()}"
            if out.skipped is None:
                curve.append(out.loss.item())
            bar.update(cfg.accuracy_steps - i - 1)
            break
        curve.append(out.loss.item())  # not timed: a sync per step is fine here
    val = evaluate(adapter, make_loader(splits.val, cfg.batch_size, shuffle=False, device=adapter.device), prec,
                   cfg.eval_batches)
    return {"steps": len(curve), "attempts": attempts, "loss_curve": curve, "val_loss": val["val_loss"],
            "val_accuracy": val["accuracy"], "val_targets": val["targets"], "diverged_at": diverged_at,
            "diverged_reason": why, "loss_scale": scales if prec.needs_scaler else None,
            "skipped_steps": skipped if prec.needs_scaler else None,
            "rounded_away_share": float(rounded / updated) if torch.is_tensor(updated) and updated else None,
            "updates_counted": int(updated)}
