"""Tier 3 AMP benchmark: fp32 vs bf16 vs fp16 speed, MFU, memory and accuracy stability, with verdicts.

Every precision starts from the same weights and sees the same batches in the same order with a
fresh optimizer (and, for fp16, GradScaler) through the shared `TrainStep`. Speed repeats are
interleaved across precisions so drift on a shared machine hits all of them alike. `amp_benchmark` runs a
`BenchmarkRun`: named steps, and a log of what was skipped or stopped, where and why (the result's `outcomes`).
"""
from __future__ import annotations

import copy
from collections import Counter
from dataclasses import replace

import torch

from ..adapter.adapter import resolve_model
from ..core.budget import gib, out_of_memory_note, read_budget, without_oom
from ..core.device import device_facts
from ..core.dtype_contexts import kept_dtypes
from ..core.errors import LaunchError
from ..core.loggers import log_result_tables, run_stamp
from ..core.measure import count_flops, cpu_load, load_average, probe_ms, probe_size, summarize
from ..core.memory_settings import resolve_memory
from ..core.precision import BASELINE, dtype_name, resolve_device, resolve_precision
from ..core.progress import progress_bar
from ..core.results import run_metadata
from ..core.settings import merge
from ..core.threads import chooses_threads
from ..engine.activation_checkpointing import memory_context, require_blocks
from ..engine.compiling import compile_for_training
from ..engine.lora import describe_lora, is_lora, model_state, unload
from ..engine.quantization import apply_memory
from ..models.heads import sized_to_data
from ..planning.planner import device_room
from ..planning.planner import plan as plan_fits
from .config import CHECKPOINTED, COMPILE_CHOICES, BenchConfig
from .measurements import (
    FLOOR_TOKENS,
    AdapterStart,
    _accuracy_run,
    load_start,
    measure_memory,
    nonfinite,
    same_batches,
    timed_repeat,
)
from .memory_rows import against_twin, memory_row_plans
from .record import BatchFit, BenchRun, Loaded, Measured, OutcomeLog, Plan, Ready, Sized, Speed, Step, make_record
from .result import BenchmarkResult
from .verdicts import launch_bound, record_checks

_PROBE_REPS = 3  # probe matmuls per speed repeat


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
    memory_rows (e.g. ("lora", "qlora", "adamw8bit")): beside the precisions, one row per memory setting, in the
    precision auto picks here, judged against the fp32 baseline (memory_rows.py); LoRA and QLoRA rows train a copy.
    """
    cfg = merge(BenchConfig, config, overrides, "benchmark")
    if cfg.strategy is not None:  # one process here: across ranks is another benchmark, not a setting of this one
        raise LaunchError(f"amp_benchmark runs in one process; strategy={','.join(cfg.strategy)} is measured by "
                          "tier_utils.strategy_benchmark under torchrun (CLI: torchrun ... -m tier_utils bench "
                          "--strategy ...)")
    dev = resolve_device(cfg.device)
    adapter = resolve_model(model, **sized_to_data(model, model_kwargs or {}, data))  # a classifier: the data's head
    if cfg.activation_checkpointing:
        require_blocks(adapter.model)
    # LoRA freezes the base: which weights trained before is given back with the model (`all` trains it next).
    trainable = {p: p.requires_grad for p in adapter.model.parameters()}
    # Decided once, for the fp32 and mixed rows (a true mode holds its base in its own dtype): LoRA's base dtype,
    # the optimizer; the adapter carries it to each row's conversion and optimizer.
    held = resolve_memory(cfg.memory, resolve_precision(BASELINE, dev, warn=False), device_facts(dev),
                          adapter.stored_dtype, adapter.model)
    if cfg.memory.lora is not None:  # every row trains the adapters; peft's unload() gives the caller's model back
        adapter = replace(adapter, model=apply_memory(adapter.model, held, task=adapter.task))
    adapter = replace(adapter, memory=held)
    cfg = replace(cfg, thresholds=cfg.thresholds.for_task(adapter.task))
    try:
        with kept_dtypes(adapter.model.to(dev)):
            return BenchmarkRun(adapter, cfg, dev, data).run()
    finally:
        unload(adapter.model)
        for p, flag in trainable.items():
            p.requires_grad_(flag)


def _start(model: torch.nn.Module) -> dict:
    """The run's shared start: a LoRA or QLoRA model's adapters (its frozen base is never trained, and a 4-bit one's
    whole state dict, quantisation state included, cannot be loaded back), else the whole state dict."""
    return AdapterStart(copy.deepcopy(model_state(model))) if is_lora(model) else copy.deepcopy(model.state_dict())


class BenchmarkRun:
    """One `amp_benchmark` run, inside kept_dtypes (each precision converts the model to its own weight dtype),
    as named steps in order: plan, fit (the batch), load (the data), compile, flops, memory, time, accuracy,
    record. Each step takes what it needs and returns what it made (a frozen record: `Sized`, `Loaded`, `Ready`,
    `Measured`); the run itself holds only its inputs and its log, all set here.

    What was skipped or stopped, at which step and why, goes only to `log` (record.OutcomeLog, append-only):
    whether a plan still runs, and why not, is read from it, and the result carries it as `outcomes`.
    """

    def __init__(self, adapter, cfg: BenchConfig, dev: torch.device, data):
        self.adapter, self.cfg, self.dev, self.data = adapter, cfg, dev, data
        self.log = OutcomeLog()  # what was skipped or stopped, where and why: every step reads it

    def run(self) -> BenchmarkResult:
        """Every step in order; the model's weights (the fp32 start) and train/eval mode restored."""
        model = self.adapter.model
        was_training = model.training
        model.train()
        self.adapter.require_trainable()
        self.adapter.check_forward()
        seq_len = self.adapter.fit_length(self.cfg.seq_len)  # capped with a warning; config records it
        sized = self.fit_batch(self.plan(), replace(self.cfg, seq_len=seq_len))
        loaded = self.load(sized)
        ready = self.compile(sized, loaded)
        cfg = ready.cfg
        steps_per_repeat = cfg.untimed_steps + cfg.timed_steps
        total = (len(ready.measured) * (cfg.repeats * steps_per_repeat + cfg.accuracy_steps)
                 + cfg.repeats * steps_per_repeat)
        # Every run reseeds (same dropout masks per precision): on a fork, so the caller's streams go on untouched.
        cuda_rngs = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        try:
            with torch.random.fork_rng(devices=cuda_rngs), progress_bar(
                    total=total, desc="amp benchmark", unit="step", enabled=cfg.progress) as bar:
                flops = self.count_flops(ready)
                measured, floor_ms = self.time(ready, self.measure_memory(ready), bar)
                measured = self.accuracy(ready, measured, bar)
        finally:
            load_start(ready.base.precision.convert_module(model, self.adapter.memory), loaded.start)
            model.train(was_training)
        return self.record(ready, flops, measured, floor_ms)

    def plan(self) -> tuple[Plan, ...]:
        """Step "plan": a Plan per precision x mode (and each precision again, eager, with activation checkpointing
        when asked: its cost and saving), then the memory rows (memory_rows.py). A precision this device can't run
        natively is skipped, unless forced; a memory row that can't run here, with its reason."""
        cfg = self.cfg
        wanted = [(name, mode) for name in cfg.precisions for mode in COMPILE_CHOICES[cfg.compile]]
        if cfg.activation_checkpointing:
            wanted += [(name, CHECKPOINTED) for name in cfg.precisions]
        plans = []
        for name, mode in wanted:
            prec = resolve_precision(name, self.dev, warn=False)
            p = Plan(name, mode, prec, self.adapter, forced=cfg.force and not prec.native,
                     checkpointing=mode == CHECKPOINTED)
            plans.append(p)
            if not (prec.native or cfg.force):
                why = f"not native: {prec.native_support(self.dev)[1]}; force=True (CLI --force) runs it anyway"
                self.log.skip(p, "plan", why)
        for p, why in memory_row_plans(self.adapter, cfg, self.dev):
            plans.append(p)
            if why:
                self.log.skip(p, "plan", why)
        return tuple(plans)

    def fit_batch(self, planned: tuple[Plan, ...], cfg: BenchConfig) -> Sized:
        """Step "fit": the batch every compared precision fits here, by the fit planner (predicted): the one asked,
        or the largest all of them fit. A precision that fits not even batch 1 is skipped with the reason. When
        fp32 does not fit, the first mode in the order asked that fits (the closest to fp32: mixed modes, fp32
        master weights, come before the true ones) becomes the baseline, moved to the front, and fp32's reason
        says so; when none fits, none runs. The memory rows hold less than a full fine-tune and run at that batch
        (one out of memory is skipped when it runs), and only when a baseline fits."""
        seq_len, fp32, plans = cfg.seq_len, planned[0], list(planned)
        # Before the steps allocate anything; the memory rows' model copies are held already: the room is beside them.
        budget = read_budget(self.dev)
        running = [p for p in plans if self.log.runs(p) and p.memory_row is None]
        names = list(dict.fromkeys(p.name for p in running))
        room = device_room(budget)
        configs = {c.precision: c for c in plan_fits(self.adapter, names, seq_len)[0]}
        largest = {name: c.largest_batch(seq_len, room) for name, c in configs.items()}
        fitting = [p for p in running if largest[p.name] >= 1]
        if not fitting:  # no baseline runs: nothing to judge a memory row against
            for p in plans:
                if p.memory_row is not None and self.log.runs(p):
                    self.log.skip(p, "fit", "no precision fits here, so no baseline to judge this memory row against")
        rebased = ""
        if fitting and fp32 in running and fp32 not in fitting:
            plans.remove(fitting[0])
            plans.insert(0, fitting[0])
            rebased = f"; the modes that fit are compared with {fitting[0].name}, the best-fitting baseline"
        for p in running:
            if p not in fitting:
                self.log.skip(p, "fit", f"does not fit here: a training step at batch 1, T={seq_len} predicted "
                                        f"{gib(configs[p.name].step_bytes(1, seq_len))}, {gib(room)} usable "
                                        f"({budget.describe()})" + (rebased if p is fp32 else ""))
        batch = min([cfg.batch_size, *(largest[p.name] for p in fitting)])
        if batch == cfg.batch_size:
            return Sized(tuple(plans), cfg, BatchFit(cfg.batch_size, largest, room, budget, None))
        reason = (f"batch {cfg.batch_size} does not fit every compared precision here; run at {batch}, the largest "
                  "all of them fit (predicted: " + ", ".join(f"{n} {b}" for n, b in largest.items())
                  + f"; {budget.describe()})")
        return Sized(tuple(plans), replace(cfg, batch_size=batch), BatchFit(cfg.batch_size, largest, room, budget,
                                                                            reason))

    def load(self, sized: Sized) -> Loaded:
        """Step "load": the splits, the same speed batches for every plan, the floor step's (eager, baseline
        precision, one short sequence: almost all fixed per-step cost, i.e. launches), and the fp32 start."""
        cfg, base = sized.cfg, sized.plans[0]
        splits = self.adapter.datasets(self.data, cfg.seq_len, chat=cfg.chat)
        speed_batches = tuple(same_batches(splits, cfg.untimed_steps + cfg.timed_steps, cfg, self.dev,
                                           self.adapter.task.reads_tokens))
        start = _start(base.precision.convert_module(self.adapter.model, self.adapter.memory))
        short = tuple({k: v[:1, :FLOOR_TOKENS] if v.dim() > 1 else v[:1] for k, v in b.items()}
                      for b in speed_batches)
        floor = Plan(f"{base.name} floor", "eager", base.precision, self.adapter, batches=short)
        padding = self.adapter.task.padding_tally(cfg.seq_len)
        for batch in speed_batches:
            padding.add(self.adapter.task.positions(batch))
        # batches cut to the data hold different counts of real tokens: a repeat's throughput is the timed steps'
        # tokens over their time, so the mean over the timed batches, never one batch's count
        timed = speed_batches[cfg.untimed_steps:]
        return Loaded(splits, speed_batches, sum(self.adapter.task.units(b) for b in timed) / len(timed), start, floor,
                      padding.to_dict())

    def compile(self, sized: Sized, loaded: Loaded) -> Ready:
        """Step "compile": each compiled plan compiled for its precision's weight dtype (its warm-up under its
        autocast is timed as compile_s). One that can't compile is skipped when its eager twin is measured anyway,
        else runs eager. The plans still running then are the ones every later step measures."""
        eager_too = "eager" in COMPILE_CHOICES[sized.cfg.compile]
        # batches cut to the data come in several lengths: one graph over them all, none compiled mid-timing
        vary = len({b[self.adapter.task.input_key].shape for b in loaded.speed_batches}) > 1
        plans = []
        for p in sized.plans:
            if self.log.runs(p) and p.mode == "compiled":
                p.precision.convert_module(self.adapter.model, self.adapter.memory)
                step_adapter, info = compile_for_training(self.adapter, p.precision, loaded.speed_batches[0],
                                                          sized.cfg.compile_mode, sized.cfg.progress, vary)
                # Not compiled and measured eager anyway: skipped; else it runs eager, before any outcome names it
                # (its log entries all say eager).
                p = replace(p, adapter=step_adapter, compile=info,
                            mode="compiled" if info.compiled or eager_too else "eager")
                if not info.compiled and eager_too:
                    self.log.skip(p, "compile", "could not compile: see this precision's eager rows")
            plans.append(p)
        measured = tuple(p for p in plans if self.log.runs(p))
        return Ready(tuple(plans), measured, sized.cfg, sized.fit, loaded)

    def count_flops(self, ready: Ready) -> dict:
        """Step "flops": one forward + backward of the baseline (fp32 where it fits) on the first batch and on each
        batch shape the timed steps meet, counted once per shape: precision changes no FLOP count, and the baseline
        is what fits here. Batches cut to the data differ in length, so the step's figure (MFU's numerator) is the
        mean over the timed batches, never one batch's. Nothing is timed on a loss that is not finite (its speed
        would be a verdict on NaN): a non-finite first loss stops every plan."""
        base, adapter = ready.base, self.adapter
        batches = ready.data.speed_batches
        timed = batches[ready.cfg.untimed_steps:]
        first = []

        def forward_backward(batch):
            with base.precision.autocast():
                loss = adapter.forward_loss(batch)[0]
            loss.backward()
            first.append(loss.detach())

        # a compiled plan may have left it in another dtype
        base.precision.convert_module(adapter.model, adapter.memory)
        if not self.log.runs(base):
            return {"per_step": None, "by_op": {}}
        shapes = {}  # a batch of each shape, the first batch's first
        for batch in (batches[0], *timed):
            shapes.setdefault(_shape(batch), batch)
        counted = {key: count_flops(lambda b=batch: forward_backward(b)) for key, batch in shapes.items()}
        adapter.model.zero_grad(set_to_none=True)
        share = Counter(_shape(b) for b in timed)
        ops = {op for c in counted.values() for op in c["by_op"]}
        flops = {"per_step": sum(counted[k]["per_step"] * n for k, n in share.items()) / len(timed),
                 "by_op": {op: sum(counted[k]["by_op"].get(op, 0) * n for k, n in share.items()) / len(timed)
                           for op in ops}}
        if why := nonfinite(base.name, first[0], "on the first batch"):
            for p in ready.measured:
                self.log.stop(p, "flops", why)
        return flops

    def measure_memory(self, ready: Ready) -> tuple[Measured, ...]:
        """Step "memory": each plan's static split, activations and CUDA peaks (measurements.measure_memory); the
        loss of its second batch, non-finite, stops it. Not run when the first batch stopped every plan."""
        measured = []
        for p in ready.measured:
            # Not run after the first batch stopped the baseline; none for a plan out of memory.
            got = (self._measure(ready, p, "memory", measure_memory, ready.data.speed_batches)
                   if self.log.runs(p) and not self.log.stopped(ready.base) else None)
            if got is None:
                measured.append(Measured(p))
                continue
            memory, loss = got
            if why := nonfinite(p.name, loss, "on the second batch"):
                self.log.stop(p, "memory", why)
            measured.append(Measured(p, memory, probe_size(self.dev, p.precision.dtype)))
        return tuple(measured)

    def time(self, ready: Ready, measured: tuple[Measured, ...], bar) -> tuple[tuple[Measured, ...], tuple]:
        """Step "time": `repeats` timed repeats of every plan not stopped, interleaved (drift hits all alike),
        with the floor step beside a running baseline and the peak probe riding along with every repeat. A
        non-finite loss stops a plan; a stopped baseline, every plan (no baseline: no verdict). Gives each plan's
        repeats (and its speed, when it is still running) and the floor step's repeats."""
        base, cfg, floor = ready.base, ready.cfg, ready.data.floor
        live = [m.plan for m in measured if self.log.runs(m.plan) and not self.log.stopped(m.plan)]
        timed = live + [floor] if self.log.runs(base) and not self.log.stopped(base) else live
        samples, probes = {p: [] for p in timed}, {m.plan: [] for m in measured}
        sizes = {m.plan: m.probe_size for m in measured}
        for _, p in interleave(timed, cfg.repeats):
            if not self.log.runs(p):  # out of memory in an earlier repeat
                continue
            got = self._measure(ready, p, "time", timed_repeat, p.batches or ready.data.speed_batches, bar)
            if got is None:
                continue
            ms, losses = got
            samples[p].append(sum(ms) / len(ms))
            if p is floor:
                continue
            if not self.log.stopped(p) and (why := nonfinite(p.name, losses, "during the timed steps")):
                self.log.stop(p, "time", why)
            # The peak probe rides along with every repeat, so load drift hits it like the steps.
            probes[p] += probe_ms(self.dev, p.precision.dtype, sizes[p], _PROBE_REPS)
        last = self.log.last(base, "stopped")
        for m in measured:
            if last and self.log.stopped(m.plan) != last.why:
                self.log.stop(m.plan, last.step, last.why)
        return tuple(self._timed(m, tuple(samples.get(m.plan, ())), tuple(probes[m.plan]), ready.data.tokens_per_step,
                                 cfg.timed_steps) for m in measured), tuple(samples.get(floor, ()))

    def _timed(self, m: Measured, step_samples: tuple, probe: tuple, tokens: int, timed_steps: int) -> Measured:
        """`m` with its repeats, and its speed when its plan is still running."""
        speed = None
        if self.log.runs(m.plan) and not self.log.stopped(m.plan):
            speed = Speed(summarize(step_samples), summarize(tokens / (ms / 1e3) for ms in step_samples),
                          list(step_samples), timed_steps)
        return replace(m, step_samples=step_samples, probe_ms=probe, speed=speed)

    def accuracy(self, ready: Ready, measured: tuple[Measured, ...], bar) -> tuple[Measured, ...]:
        """Step "accuracy": each plan still running trains `accuracy_steps` applied updates from the shared start,
        then validates (measurements._accuracy_run)."""
        if not ready.cfg.accuracy_steps:
            return measured
        return tuple(replace(m, accuracy=self._measure(ready, m.plan, "accuracy", _accuracy_run, ready.data.splits,
                                                       bar))
                     if self.log.runs(m.plan) and not self.log.stopped(m.plan) else m for m in measured)

    def _measure(self, ready: Ready, p: Plan, step: Step, fn, data, *extra):
        """fn(adapter, precision, start, data, cfg, *extra, the adapter p's steps call), with activation
        checkpointing for a checkpointing plan. A CUDA out-of-memory instead skips `p` at `step` with the size
        and the free memory (every plan, when `p` is the baseline: nothing to compare with) and gives None, its
        memory released."""
        cfg = ready.cfg
        # A LoRA memory row trains its own model from its own start; every other plan the run's.
        adapter, start = (p.adapter, p.start) if p.start is not None else (self.adapter, ready.data.start)
        if p.memory is not None:  # a memory row's settings (its optimizer is built from them)
            adapter = replace(adapter, memory=p.memory)
        with memory_context(p.adapter.model, p.checkpointing):
            got, error = without_oom(fn, adapter, p.precision, start, data, cfg, *extra, p.adapter)
        if error is None:
            return got
        why = f"{out_of_memory_note(p.adapter.device, None, cfg.batch_size, cfg.seq_len, ready.fit.budget)} " \
              f"({error[:120]})"
        self.log.skip(p, step, why)
        if p is ready.base:
            for other in ready.plans[1:]:
                self.log.skip(other, step, f"{p.name}, the baseline, {why}")
        return None

    def record(self, ready: Ready, flops: dict, measured: tuple[Measured, ...], floor_ms: tuple) -> BenchmarkResult:
        """Step "record": each plan's record, derived from its measurements and the log; the overhead (the floor
        step against fp32's); the verdict rows; the result, logged to the experiment loggers asked."""
        cfg, adapter = ready.cfg, self.adapter
        of = {m.plan: m for m in measured}
        got = [of.get(p) or Measured(p) for p in ready.plans]
        eager = {m.plan.name: m for m in got if m.plan.mode == "eager" and self.log.runs(m.plan)}
        records = [make_record(m, got[0], flops, self.dev, cfg.thresholds, eager.get(m.plan.name),
                               ran=self.log.runs(m.plan), stopped=self.log.stopped(m.plan)) for m in got]
        against_twin(records, cfg.thresholds.parity_tolerance)
        overhead = None
        if records[0].speed is not None:
            floor = summarize(floor_ms)
            overhead = {"floor_step_ms": floor.to_dict(),
                        "floor_shape": list(ready.data.floor.batches[0][self.adapter.task.input_key].shape),
                        **launch_bound(records[0].speed.step_ms.median, floor.median, records[0].mfu["mfu"],
                                       cfg.batch_size, cfg.thresholds)}
        verdicts = [c for p, r in zip(ready.plans, records)
                    for c in record_checks(r, records[0], self.log.skip_reason(p), cfg.thresholds, cfg.accuracy_steps,
                                           overhead, cpu_load())]
        config = BenchRun(adapter.name, adapter.task.name, adapter.summary()["parameters"],
                          ready.data.splits.describe(),
                          settings=cfg, tokens_per_step=ready.data.tokens_per_step, fit=ready.fit,
                          lora=describe_lora(adapter.model), padding=ready.data.padding)
        metadata = {**run_metadata(self.dev), "float32_matmul_precision": torch.get_float32_matmul_precision(),
                    "load_average_1m": load_average(), "stored_dtype": dtype_name(adapter.stored_dtype)}
        result = BenchmarkResult(config, metadata, flops, records, verdicts, overhead, self.log.outcomes)
        if cfg.loggers:
            log_result_tables(cfg.loggers, cfg.log_dir, f"amp_benchmark-{adapter.name}-{run_stamp()}",
                              {"amp_benchmark": result.table, "verdicts": result.verdicts},
                              {**config.to_dict(), **metadata})
        return result


def interleave(items: list, repeats: int) -> list[tuple[int, object]]:
    """(repeat, item) in interleaved order: a, b, c, a, b, c, ... never all of a first."""
    return [(r, item) for r in range(repeats) for item in items]


def _shape(batch: dict) -> tuple:
    """A batch's tensors' shapes: what its FLOP count depends on."""
    return tuple((key, tuple(value.shape)) for key, value in batch.items())
