"""The AMP benchmark's measurements of one precision's training step, each from the shared fp32 start with a
fresh optimizer: its memory, a timed repeat, the accuracy run; the same batches for every precision, and the
reason a non-finite loss stops one. amp.py's `BenchmarkRun` calls them in its steps."""
from __future__ import annotations

import contextlib
import gc

import torch
from torch.utils.data import RandomSampler, Subset

from ..core.errors import DataError
from ..core.measure import SavedTensorMeter, StepTimer, static_memory
from ..core.optimizers import DEFAULT_OPTIMIZER
from ..core.precision import dtype_name
from ..core.seeding import rng_state, set_rng_state
from ..data.datasets import make_loader, to_device
from ..data.lengths import example_lengths, in_length_order, scored_in_length_order
from ..engine.activation_checkpointing import checkpointing_on, kept_inputs
from ..engine.evaluation import evaluate
from ..engine.lora import load_model_state
from ..engine.schedules import Schedule
from ..engine.step import TrainStep, make_optimizer
from .config import BenchConfig

FLOOR_TOKENS = 8  # the floor step: one sequence this long, nearly all fixed per-step cost


def nonfinite(precision: str, loss: torch.Tensor, when: str) -> str | None:
    """The reason to stop a precision whose loss (a scalar, or the losses of a run) is NaN/inf; else None."""
    loss = loss.detach().reshape(-1)
    bad = loss[~torch.isfinite(loss)]
    return f"{precision} loss is {bad[0].item()} {when}" if bad.numel() else None


class AdapterStart(dict):
    """A LoRA model's start (a LoRA memory row's, or the run's under LoRA): its adapters only
    (engine.lora.model_state). Its frozen base (4-bit for QLoRA, which a whole state dict cannot load back) is built
    once, never trained or converted."""


def load_start(model: torch.nn.Module, start: dict) -> None:
    """`start` into `model`: the run's shared start (its whole state dict, cast to the weights' dtypes), or a LoRA
    row's AdapterStart."""
    if isinstance(start, AdapterStart):
        load_model_state(model, start)
    else:
        model.load_state_dict(start)


def held_bytes(model: torch.nn.Module) -> int:
    """What `model` holds on its device before a step: its state dict's tensors, each once (a 4-bit base's
    quantisation state too, which no parameter holds)."""
    tensors = {t.data_ptr(): t for t in model.state_dict(keep_vars=False).values() if torch.is_tensor(t)}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def same_batches(splits, n: int, cfg: BenchConfig, device, by_length: bool):
    """The same `n` training batches, in the same order, for every call, on `device`: rows drawn as training draws
    them (a seeded shuffle, each pass over the set a new one, whole batches only; a small set cycles), then, where
    examples have lengths (`by_length`), put longest first among themselves, so a batch holds rows of like length and
    pads little. Which rows are benched never depends on their length: sorting the whole set would bench only its
    shortest rows (issue 57). Longest first, the memory steps and the compile warm-up meet the largest batch."""
    train = splits.train
    if len(train) < cfg.batch_size:
        raise DataError(f"batch_size={cfg.batch_size} is larger than the dataset ({len(train)} examples); use a "
                        "smaller batch size")
    sampler = RandomSampler(train, generator=torch.Generator().manual_seed(cfg.seed))
    whole = len(train) // cfg.batch_size * cfg.batch_size  # drop_last: every batch full
    rows: list[int] = []
    while len(rows) < n * cfg.batch_size:
        rows += list(sampler)[:whole]
    rows = rows[:n * cfg.batch_size]
    if by_length:
        distinct = sorted(set(rows))
        rows = in_length_order(rows, dict(zip(distinct, example_lengths(Subset(train, distinct)))))
    for k in range(n):
        yield to_device(splits.collate([train[i] for i in rows[k * cfg.batch_size:(k + 1) * cfg.batch_size]]), device)


def fresh_step(adapter, prec, start, cfg: BenchConfig, total_steps: int = 0, track_scale: bool = True,
                step_adapter=None, count_rounding: bool = False) -> TrainStep:
    """The fp32 start weights loaded into the eager model, held in the precision's weight dtype; the step calls
    `step_adapter` (compiled) if given."""
    # The last run's gradients (and, should a reference cycle keep it, its optimizer state) go before this run
    # allocates its own, so the two are never held side by side.
    adapter.model.zero_grad(set_to_none=True)
    gc.collect()
    held = adapter.memory  # the memory settings decided for the run (none: AdamW)
    load_start(prec.convert_module(adapter.model, held), start)  # load_state_dict casts to the weights' dtype
    torch.manual_seed(cfg.seed)  # same dropout masks in every run
    opt = make_optimizer(adapter.model, cfg.lr, cfg.weight_decay, prec.adamw_eps,
                         held.optimizer if held else DEFAULT_OPTIMIZER)
    sched = Schedule(warmup_steps=max(1, total_steps // 10)).scheduler(opt, total_steps) if total_steps else None
    return TrainStep(step_adapter or adapter, prec, opt, sched, grad_clip=cfg.grad_clip, track_scale=track_scale,
                     count_rounding=count_rounding)


def measure_memory(adapter, prec, start, batches, cfg: BenchConfig, step_adapter=None) -> tuple[dict, torch.Tensor]:
    """Static split after one step (optimizer state exists), activations of the next step, CUDA peaks;
    and that step's loss. The CUDA peak is this row's own: the device's peak less what the run holds beside this
    model (the shared start, the memory rows' model copies), read before its first step; reserved is the
    process's."""
    dev = adapter.device
    step = fresh_step(adapter, prec, start, cfg, step_adapter=step_adapter)
    cuda = dev.type == "cuda"
    beside = torch.cuda.memory_allocated(dev) - held_bytes(adapter.model) if cuda else 0
    step([batches[0]])
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
        mem["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev) - beside
        mem["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    return mem, loss


def timed_repeat(adapter, prec, start, batches, cfg: BenchConfig, bar,
                 step_adapter=None) -> tuple[list[float], torch.Tensor]:
    """One repeat: fresh optimizer, `cfg.untimed_steps` steps untimed, then each optimizer step timed.
    Returns the timed steps' milliseconds and every step's loss, read after the timing.

    No scheduler here, so fp16 needs no skip decision: reading the loss scale (two host syncs per
    step that fp32/bf16 don't have) stays out of the timed region.
    """
    step = fresh_step(adapter, prec, start, cfg, track_scale=False, step_adapter=step_adapter)
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
    step = fresh_step(adapter, prec, start, cfg, total_steps=cfg.accuracy_steps, step_adapter=step_adapter,
                       count_rounding=True)
    curve, scales, skipped, attempts, diverged_at, why = [], [], 0, 0, None, None
    rounded = updated = 0
    for i, batch in enumerate(same_batches(splits, cfg.accuracy_steps, cfg, adapter.device,
                                            adapter.task.reads_tokens)):
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
    order = scored_in_length_order(splits.val, cfg.eval_batches, cfg.batch_size) if adapter.task.reads_tokens else None
    val = evaluate(adapter, make_loader(splits.val, cfg.batch_size, collate=splits.collate, shuffle=False,
                                        device=adapter.device, sampler=order), prec, cfg.eval_batches)
    return {"steps": len(curve), "attempts": attempts, "loss_curve": curve, "val_loss": val["val_loss"],
            "val_accuracy": val["accuracy"], "val_targets": val["targets"], "diverged_at": diverged_at,
            "diverged_reason": why, "loss_scale": scales if prec.needs_scaler else None,
            "skipped_steps": skipped if prec.needs_scaler else None,
            "rounded_away_share": float(rounded / updated) if torch.is_tensor(updated) and updated else None,
            "updates_counted": int(updated)}
