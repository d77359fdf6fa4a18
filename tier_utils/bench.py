"""Tier 3 AMP benchmark: fp32 vs bf16 vs fp16 speed, MFU, memory and accuracy stability, with verdicts.

Every precision starts from the same weights and sees the same batches in the same order with a
fresh optimizer (and, for fp16, GradScaler) through the shared `TrainStep`. Speed repeats are
interleaved across precisions so drift on a shared machine hits all of them alike.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import pandas as pd
import torch

from .adapter import resolve_model
from .compiling import check_compile_mode, compile_for_training, compile_modes
from .data import build_datasets, make_loader, to_device
from .files import jsonable
from .loggers import log_result_tables, logger_names, run_stamp
from .measure import (
    SavedTensorMeter,
    StepTimer,
    count_flops,
    load_average,
    probe_ms,
    probe_size,
    probe_summary,
    static_memory,
    summarize,
)
from .metrics import evaluate
from .precision import canonical_precision, native_support, resolve_device, resolve_precision
from .progress import progress_bar
from .results import Result, checks_table, run_metadata, worst_status
from .seeding import rng_state, set_rng_state
from .train import TrainStep, make_optimizer, make_scheduler
from .validation import whole_number
from .verdicts import (
    PrecisionCheck,
    Thresholds,
    accuracy_check,
    compile_check,
    launch_bound,
    memory_check,
    nonfinite_checks,
    parity,
    parity_check,
    reduction,
    skip_checks,
    speed_check,
    speedup,
)

SCHEMA = "tier_utils.bench/1"
_SEED = 0
_WEIGHT_DECAY = 0.1
_PROBE_REPS = 3  # probe matmuls per speed repeat
_FLOOR_TOKENS = 8  # the floor step: one sequence this long, nearly all fixed per-step cost
_MIB = 2**20


@dataclass(repr=False)
class BenchmarkResult(Result):
    """What `amp_benchmark` measured: one record per precision, the verdict rows, config and metadata."""

    config: dict
    metadata: dict
    flops: dict  # {"per_step": int, "by_op": {op: flops}} of one fp32 forward + backward
    records: list[dict]
    checks: list
    overhead: dict | None  # fp32's floor step and launch_bound()'s diagnosis; None when fp32 was not timed

    @property
    def status(self) -> str:
        return worst_status(c.status for c in self.checks)

    @property
    def table(self) -> pd.DataFrame:
        return pd.DataFrame([_table_row(r) for r in self.records])

    @property
    def verdicts(self) -> pd.DataFrame:
        return checks_table(self.checks, ("precision", "mode"))

    def overview(self) -> pd.DataFrame:
        return self.verdicts  # the answer per precision; the measurements are in .table

    def plot(self):
        from .bench_plot import plot_benchmark

        return plot_benchmark(self)

    def to_json(self) -> dict:
        return jsonable({"schema": SCHEMA, "status": self.status, "config": self.config, "metadata": self.metadata,
                         "flops": self.flops, "overhead": self.overhead, "precisions": self.records,
                         "verdicts": self.verdicts})


def amp_benchmark(model, data=None, precisions=("fp32", "bf16", "fp16"), batch_size: int = 8, seq_len: int = 64,
                  warmup_steps: int = 3, timed_steps: int = 10, repeats: int = 5, accuracy_steps: int = 50,
                  thresholds: Thresholds = Thresholds(), force: bool = False, device=None, progress: bool = True,
                  lr: float = 1e-3, val_batches: int = 20, loggers=(), log_dir=None, compile=False,
                  compile_mode: str = "default") -> BenchmarkResult:
    """Benchmark mixed precision against fp32 on `model` (an nn.Module, adapter or load_model spec).

    fp32 is always run: it is the baseline every ratio is taken against. A precision the device
    cannot run natively is SKIPPED with the reason unless `force=True`. The model is moved to
    `device`; its weights and train/eval mode, and the caller's RNG states, are restored on return.
    `loggers` (e.g. ("mlflow",)): one run under `log_dir` (None: runs/logs) holding the table and the verdicts.
    compile: False (eager), True (every step torch.compiled) or "both": each precision eager and
    compiled, repeats interleaved, compiled rows also judged against the same precision eager.
    A model that can't be compiled gets a WARN row and is measured eager.
    """
    for name, value in dict(batch_size=batch_size, seq_len=seq_len, timed_steps=timed_steps, repeats=repeats,
                            val_batches=val_batches).items():
        whole_number(value, name)
    whole_number(warmup_steps, "warmup_steps", minimum=0)
    whole_number(accuracy_steps, "accuracy_steps", minimum=0)
    loggers = logger_names(loggers)  # a missing package fails here, before minutes of measuring
    dev = resolve_device(device)
    adapter = resolve_model(model)
    was_training = adapter.model.training
    adapter.model.to(dev).train()
    adapter.require_trainable()
    adapter.check_forward()
    seq_len = adapter.fit_length(seq_len)  # capped with a warning; config records the length used
    modes = compile_modes(compile)
    check_compile_mode(compile_mode)
    plans = [_plan(name, mode, dev, force) for name in precision_list(precisions) for mode in modes]
    splits = build_datasets(data, adapter.task, seq_len, adapter.vocab_size, adapter.num_classes,
                            max_len=adapter.max_len)
    speed_batches = list(_batches(splits.train, warmup_steps + timed_steps, batch_size, dev))
    tokens_per_step = speed_batches[0]["input_ids"].numel()
    start = copy.deepcopy(adapter.model.state_dict())
    for p in plans:
        p["adapter"] = adapter  # what the steps call: the compiled model where compiling worked
        if p["ran"] and p["mode"] == "compiled":
            _compile_plan(p, adapter, speed_batches[0], compile_mode, eager_too="eager" in modes)
    ran = [p for p in plans if p["ran"]]
    # The floor: eager fp32 on one short sequence, almost all fixed per-step cost (launches, dispatch).
    floor = {"precision": "fp32 floor", "prec": plans[0]["prec"], "adapter": adapter,
             "batches": [_one_short(b) for b in speed_batches], "step_samples": []}
    total = len(ran) * (repeats * (warmup_steps + timed_steps) + accuracy_steps)
    total += repeats * (warmup_steps + timed_steps)  # the floor
    # Every run reseeds (same dropout masks per precision): on a fork, so the caller's streams go on untouched.
    cuda_rngs = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=cuda_rngs), progress_bar(total=total, desc="amp benchmark",
                                                                     unit="step", enabled=progress) as bar:
            # One fp32 forward + backward, counted once: precision changes no FLOP count.
            first = []

            def forward_backward():
                first.append(adapter.forward_loss(speed_batches[0])[0])
                first[0].backward()

            flops = count_flops(forward_backward)
            adapter.model.zero_grad(set_to_none=True)
            # Nothing is timed on a loss that is not finite: its speed would be a verdict on NaN.
            stopped = _nonfinite("fp32", first[0], "on the first batch")
            for p in ran:
                p["stopped"] = stopped
                if not stopped:
                    p["memory"], loss = _memory(adapter, p["prec"], start, speed_batches, lr, p["adapter"])
                    p["stopped"] = _nonfinite(p["precision"], loss, "on the second batch")
                    p["probe_size"], p["probe_ms"], p["step_samples"] = probe_size(dev, p["prec"].dtype), [], []
            live = [p for p in ran if not p["stopped"]]
            timed = live if plans[0]["stopped"] else live + [floor]  # the floor only means something next to fp32
            for _, p in schedule(timed, repeats):
                ms, worst = _timed_run(adapter, p["prec"], start, p.get("batches", speed_batches), warmup_steps, lr,
                                       bar, p["adapter"])
                p["step_samples"].append(sum(ms) / len(ms))
                if p is not floor:
                    p["stopped"] = p["stopped"] or _nonfinite(p["precision"], worst, "during the timed steps")
                    # The peak probe rides along with every repeat, so load drift hits it like the steps.
                    p["probe_ms"] += probe_ms(dev, p["prec"].dtype, p["probe_size"], _PROBE_REPS)
            for p in ran:
                if plans[0]["stopped"]:  # no baseline: no precision gets a verdict
                    p["stopped"] = plans[0]["stopped"]
                if p["stopped"]:
                    continue
                p["speed"] = _speed(p["step_samples"], tokens_per_step, timed_steps)
                p["probe"] = probe_summary(p["prec"].dtype, p["probe_size"], p["probe_ms"])
                if accuracy_steps:
                    p["accuracy"] = _accuracy_run(adapter, p["prec"], start, splits, accuracy_steps, batch_size,
                                                  val_batches, lr, bar, p["adapter"])
    finally:
        adapter.model.load_state_dict(start)
        adapter.model.train(was_training)
    eager = {p["precision"]: p for p in plans if p["mode"] == "eager" and p["ran"]}
    records = [_record(p, plans[0], flops, dev, thresholds, eager.get(p["precision"])) for p in plans]
    overhead = None
    if records[0]["speed"] is not None:
        floor_ms = summarize(floor["step_samples"])
        overhead = {"floor_step_ms": floor_ms.to_dict(), "floor_shape": list(floor["batches"][0]["input_ids"].shape),
                    **launch_bound(records[0]["speed"]["step_ms"]["median"], floor_ms.median,
                                   records[0]["mfu"]["mfu"], batch_size, thresholds)}
    checks = [c for p, r in zip(plans, records)
              for c in _checks(p, r, records[0], thresholds, accuracy_steps, overhead)]
    config = {"model": adapter.name, "task": adapter.task, "parameters": adapter.summary()["parameters"],
              "data": splits.source, "precisions": [p["precision"] for p in plans], "batch_size": batch_size,
              "seq_len": seq_len, "tokens_per_step": tokens_per_step, "warmup_steps": warmup_steps,
              "timed_steps": timed_steps, "repeats": repeats, "accuracy_steps": accuracy_steps,
              "val_batches": val_batches, "lr": lr, "weight_decay": _WEIGHT_DECAY, "force": force,
              "compile": compile, "compile_mode": compile_mode, "thresholds": asdict(thresholds)}
    metadata = {**run_metadata(dev), "float32_matmul_precision": torch.get_float32_matmul_precision(),
                "load_average_1m": load_average()}
    result = BenchmarkResult(config, metadata, flops, records, checks, overhead)
    if loggers:
        log_result_tables(loggers, log_dir, f"amp_benchmark-{adapter.name}-{run_stamp()}",
                          {"amp_benchmark": result.table, "verdicts": result.verdicts}, {**config, **metadata})
    return result


def precision_list(precisions) -> list[str]:
    """Canonical names, fp32 first (the baseline, added if missing), duplicates dropped."""
    if isinstance(precisions, str):
        precisions = [p for p in precisions.split(",") if p.strip()]
    if not precisions:
        raise ValueError("no precision to benchmark; list them, e.g. fp32,bf16,fp16")
    names = ["fp32"]
    for p in precisions:
        name = canonical_precision(p)
        if name == "auto":
            raise ValueError("'auto' is not a precision to benchmark; list them, e.g. fp32,bf16,fp16")
        if name not in names:
            names.append(name)
    return names


def schedule(items: list, repeats: int) -> list[tuple[int, object]]:
    """(repeat, item) in interleaved order: a, b, c, a, b, c, ... never all of a first."""
    return [(r, item) for r in range(repeats) for item in items]


def _plan(name: str, mode: str, dev: torch.device, force: bool) -> dict:
    prec = resolve_precision(name, dev, warn=False)
    why = f"not native: {native_support(name, dev)[1]}; force=True (CLI --force) runs it anyway"
    return {"precision": name, "mode": mode, "prec": prec, "ran": prec.native or force,
            "forced": force and not prec.native, "reason": prec.reason, "why": why, "compile": None, "stopped": None}


def _nonfinite(precision: str, loss: torch.Tensor, when: str) -> str | None:
    """The reason to stop a precision whose loss (a scalar, or the losses of a run) is NaN/inf; else None."""
    loss = loss.detach().reshape(-1)
    bad = loss[~torch.isfinite(loss)]
    return f"{precision} loss is {bad[0].item()} {when}" if bad.numel() else None


def _one_short(batch: dict) -> dict:
    """One sequence of _FLOOR_TOKENS tokens from `batch` (labels of a classifier stay one per sequence)."""
    return {k: v[:1, :_FLOOR_TOKENS] if v.dim() > 1 else v[:1] for k, v in batch.items()}


def _compile_plan(p: dict, adapter, batch: dict, mode: str, eager_too: bool) -> None:
    """Compile for this precision (its warm-up under its autocast is timed as compile_s). If it can't
    compile, the plan is dropped when its eager twin is measured anyway, else it runs eager."""
    p["adapter"], info = compile_for_training(adapter, p["prec"], batch, mode)
    p["compile"] = info.to_dict()
    if info.compiled:
        return
    if eager_too:
        p["ran"], p["why"] = False, "could not compile: see this precision's eager rows"
    else:
        p["mode"] = "eager"


def _batches(dataset, n: int, batch_size: int, device):
    """The same `n` batches, in the same order, for every call; cycles a small dataset; on `device`."""
    loader = make_loader(dataset, batch_size, shuffle=True, seed=_SEED, drop_last=True, device=device)
    produced = 0
    while produced < n:
        for batch in loader:
            yield to_device(batch, device)
            produced += 1
            if produced == n:
                return


def _fresh_step(adapter, prec, start, lr, total_steps: int = 0, track_scale: bool = True,
                step_adapter=None) -> TrainStep:
    """Start weights loaded into the eager model; the step calls `step_adapter` (compiled) if given."""
    adapter.model.load_state_dict(start)
    torch.manual_seed(_SEED)  # same dropout masks in every run
    opt = make_optimizer(adapter.model, lr, _WEIGHT_DECAY)
    sched = make_scheduler(opt, max(1, total_steps // 10), total_steps) if total_steps else None
    return TrainStep(step_adapter or adapter, prec, opt, sched, grad_clip=1.0, track_scale=track_scale)


def _memory(adapter, prec, start, batches, lr, step_adapter=None) -> tuple[dict, torch.Tensor]:
    """Static split after one step (optimizer state exists), activations of the next step, CUDA peaks;
    and that step's loss."""
    dev = adapter.device
    step = _fresh_step(adapter, prec, start, lr, step_adapter=step_adapter)
    step([batches[0]])
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    with SavedTensorMeter(adapter.model) as meter:
        loss = step([batches[1 % len(batches)]]).loss
    mem = static_memory(adapter.model, step.optimizer)
    mem["activation_bytes"] = meter.bytes
    mem["total_bytes"] = sum(mem.values())
    mem["steps_measured"] = 1  # saved-tensor accounting is an exact count, not a sample
    mem["peak_allocated_bytes"] = mem["peak_reserved_bytes"] = None
    if cuda:
        torch.cuda.synchronize(dev)
        mem["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        mem["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    return mem, loss


def _timed_run(adapter, prec, start, batches, warmup: int, lr, bar,
               step_adapter=None) -> tuple[list[float], torch.Tensor]:
    """One repeat: fresh optimizer, warm-up steps untimed, then each optimizer step timed.
    Returns the timed steps' milliseconds and every step's loss, read after the timing.

    No scheduler here, so fp16 needs no skip decision: reading the loss scale (two host syncs per
    step that fp32/bf16 don't have) stays out of the timed region.
    """
    step = _fresh_step(adapter, prec, start, lr, track_scale=False, step_adapter=step_adapter)
    losses = []
    for batch in batches[:warmup]:
        losses.append(step([batch]).loss)
        bar.update()
    timer = StepTimer(adapter.device)
    for batch in batches[warmup:]:
        with timer.region():
            losses.append(step([batch]).loss)
        bar.update()
    return timer.milliseconds(), torch.stack(losses)


def _speed(step_ms: list[float], tokens_per_step: int, timed_steps: int) -> dict:
    return {"step_ms": summarize(step_ms),
            "tokens_per_s": summarize(tokens_per_step / (ms / 1e3) for ms in step_ms).to_dict(),
            "samples_ms": step_ms, "timed_steps": timed_steps, "speedup": None}


def _accuracy_run(adapter, prec, start, splits, steps, batch_size, val_batches, lr, bar, step_adapter=None) -> dict:
    """Train `steps` applied updates from the shared start, then validate (eager) in the same precision.

    An fp16 step whose gradients overflowed changes no weight: it is retried on the same batch from the
    same random state, so update k of every precision sees batch k and the curves compare applied
    updates. Skipped steps are counted and the loss scale of every attempt is traced.
    """
    step = _fresh_step(adapter, prec, start, lr, total_steps=steps, step_adapter=step_adapter)
    curve, scales, skipped, attempts, diverged_at, why = [], [], 0, 0, None, None
    for i, batch in enumerate(_batches(splits.train, steps, batch_size, adapter.device)):
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
        # No scaler to absorb a non-finite loss, or fp16's scale collapsed (train()'s rule): the run is over.
        if (out.skipped is None and not torch.isfinite(out.loss)) or out.scale_collapsed:
            diverged_at = attempts - 1
            skipped += bool(out.skipped)
            why = "fp16 loss scale fell below 1" if out.scale_collapsed else f"loss became {out.loss.item()}"
            if out.skipped is None:
                curve.append(out.loss.item())
            bar.update(steps - i - 1)
            break
        curve.append(out.loss.item())  # not timed: a sync per step is fine here
    val = evaluate(adapter, make_loader(splits.val, batch_size, shuffle=False, device=adapter.device), prec,
                   val_batches)
    return {"steps": len(curve), "attempts": attempts, "loss_curve": curve, "val_loss": val["val_loss"],
            "val_accuracy": val["accuracy"],
            "val_targets": val["targets"], "diverged_at": diverged_at, "diverged_reason": why,
            "loss_scale": scales if prec.needs_scaler else None, "skipped_steps": skipped if prec.needs_scaler else None}


def _record(p: dict, base: dict, flops: dict, dev, t: Thresholds, eager: dict | None = None) -> dict:
    """One precision x mode's JSON record: measurements, comparisons with the baseline (fp32 in the
    first mode) and, compiled, with the same precision eager; metadata."""
    prec = p["prec"]
    rec = {"precision": p["precision"], "mode": p["mode"], "dtype": str(prec.dtype).replace("torch.", ""),
           "native": prec.native, "ran": p["ran"], "forced": p["forced"], "reason": p["reason"],
           "compile": p["compile"], "metadata": run_metadata(dev, prec.dtype), "speed": None, "mfu": None,
           "memory": None, "accuracy": None, "stopped": p["stopped"]}
    if not p["ran"] or p["stopped"]:
        return rec
    step_ms = p["speed"]["step_ms"]
    speed = rec["speed"] = {**p["speed"], "step_ms": step_ms.to_dict(), "speedup_vs_eager": None}
    if p is not base:
        speed["speedup"] = speedup(base["speed"]["step_ms"], step_ms)
    if p["mode"] == "compiled" and eager is not None:
        speed["speedup_vs_eager"] = speedup(eager["speed"]["step_ms"], step_ms)
    achieved = flops["per_step"] / (step_ms.median / 1e3) / 1e12
    # The best probe matmul: a peak is what the device reached, and other load only slows it.
    peak = p["probe"]["tflops"]["max"]
    rec["mfu"] = {"achieved_tflops": achieved, "peak_tflops": peak, "mfu": achieved / peak, "probe": p["probe"]}
    mem = rec["memory"] = dict(p["memory"])
    bmem = base["memory"]
    mem["reduction"] = {"activations": reduction(bmem["activation_bytes"], mem["activation_bytes"]),
                        "total": reduction(bmem["total_bytes"], mem["total_bytes"]),
                        "peak_allocated": reduction(bmem["peak_allocated_bytes"], mem["peak_allocated_bytes"])}
    acc = p.get("accuracy")
    if acc is not None:
        acc = rec["accuracy"] = dict(acc)
        bacc = base["accuracy"]
        acc["val_loss_diff"] = acc["val_loss"] - bacc["val_loss"]
        acc["val_accuracy_diff"] = acc["val_accuracy"] - bacc["val_accuracy"]
        acc["parity"] = parity(bacc["loss_curve"], acc["loss_curve"], t.parity_tolerance)
    return rec


def _checks(p: dict, rec: dict, base: dict, t: Thresholds, accuracy_steps: int, overhead: dict | None) -> list:
    rows = _precision_checks(p, rec, base, t, accuracy_steps, overhead)
    info, vs_eager = p["compile"], (rec["speed"] or {}).get("speedup_vs_eager")
    if info is not None and not info["compiled"]:
        rows.insert(0, PrecisionCheck("compile", "WARN", None, None, info["reason"], p["precision"]))
    elif vs_eager is not None:
        eager_ms = vs_eager["median"] * rec["speed"]["step_ms"]["median"]
        rows.insert(0, compile_check(p["precision"], vs_eager, rec["speed"]["step_ms"]["n"], info["compile_s"],
                                     eager_ms - rec["speed"]["step_ms"]["median"], t))
    for row in rows:
        row.mode = p["mode"]
    return rows


def _precision_checks(p: dict, rec: dict, base: dict, t: Thresholds, accuracy_steps: int,
                      overhead: dict | None) -> list:
    name = p["precision"]
    if p["stopped"]:
        return nonfinite_checks(name, p["stopped"], t)
    if rec is base:
        return skip_checks(name, "fp32 is the baseline the others are compared with", t)
    if not p["ran"]:
        return skip_checks(name, p["why"], t)
    forced = " [forced: not native on this device]" if p["forced"] else ""
    rows = []
    if name != "fp32":  # compiled fp32 against eager fp32: no AMP speed or memory claim, only correctness
        rows += [speed_check(name, rec["speed"]["speedup"], rec["speed"]["step_ms"]["n"], t, overhead),
                 memory_check(name, rec["memory"]["reduction"], t)]
    base_acc = base["accuracy"]
    if not accuracy_steps:
        rows += skip_checks(name, "accuracy_steps=0: no accuracy run", t, ("accuracy", "parity"))
    elif base_acc["diverged_at"] is not None:
        rows += skip_checks(name, f"fp32 baseline diverged at step {base_acc['diverged_at']}; lower lr", t,
                            ("accuracy", "parity"))
    else:
        acc = rec["accuracy"]
        diverged = None if acc["diverged_at"] is None else f"at step {acc['diverged_at']}: {acc['diverged_reason']}"
        rows += [accuracy_check(name, acc["val_accuracy_diff"], diverged, t),
                 parity_check(name, acc["parity"], diverged, t, acc["skipped_steps"], acc["loss_scale"])]
    for row in rows:
        row.detail += forced
    return rows


def _table_row(rec: dict) -> dict:
    row = {"precision": rec["precision"], "mode": rec["mode"], "dtype": rec["dtype"], "ran": rec["ran"]}
    speed, mfu, mem, acc = rec["speed"] or {}, rec["mfu"] or {}, rec["memory"] or {}, rec["accuracy"] or {}
    step, tps, sp = speed.get("step_ms", {}), speed.get("tokens_per_s", {}), speed.get("speedup") or {}
    red, par = mem.get("reduction", {}), acc.get("parity") or {}
    mib = (lambda key: mem[key] / _MIB if mem.get(key) is not None else None)
    row.update({
        "n_repeats": step.get("n"), "step_ms_median": step.get("median"), "step_ms_iqr": step.get("iqr"),
        "tokens_per_s_median": tps.get("median"), "tokens_per_s_iqr": tps.get("iqr"),
        "speedup": sp.get("median", 1.0 if rec["ran"] else None),  # ran with no speedup: the baseline
        "speedup_low": sp.get("low"), "speedup_high": sp.get("high"),
        "speedup_vs_eager": (speed.get("speedup_vs_eager") or {}).get("median"),
        "compile_s": (rec["compile"] or {}).get("compile_s"),
        "achieved_tflops": mfu.get("achieved_tflops"), "peak_tflops": mfu.get("peak_tflops"), "mfu": mfu.get("mfu"),
        "weights_mib": mib("weights_bytes"), "grads_mib": mib("grads_bytes"),
        "optimizer_state_mib": mib("optimizer_state_bytes"), "activations_mib": mib("activation_bytes"),
        "total_mib": mib("total_bytes"), "peak_allocated_mib": mib("peak_allocated_bytes"),
        "peak_reserved_mib": mib("peak_reserved_bytes"),
        "activation_reduction": red.get("activations"), "total_reduction": red.get("total"),
        "peak_allocated_reduction": red.get("peak_allocated"),
        "val_loss": acc.get("val_loss"), "val_accuracy": acc.get("val_accuracy"),
        "val_accuracy_diff": acc.get("val_accuracy_diff"), "parity_max_rel_dev": par.get("max_rel_dev"),
        "parity_first_step_out": par.get("first_step_out"), "skipped_steps": acc.get("skipped_steps"),
        "reason": rec["reason"],
    })
    return row

