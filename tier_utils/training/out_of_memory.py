"""Out of memory in training, as an answer: one line, with the memory given back.

A CUDA out-of-memory error in a training run (torch.cuda.OutOfMemoryError, which a test can raise on a CPU too)
becomes `TrainingOutOfMemory`, whose one line says:
- the device and its memory in use out of its total, read as the error came (torch.cuda on a real card, else
  the budget reading: available RAM or TIER_UTILS_FREE_MEMORY);
- what ran out: the batch x length, the precision and the memory settings (MemorySettings.describe: LoRA or
  QLoRA, the optimizer's state, activation checkpointing);
- what fits here: the largest batch in that mode and the cheapest mode that fits the batch asked, from the fit
  planner's prediction (planning/planner.py: activations measured at batch 1 and 2), not a bisection;
- the checkpoint a `--resume` continues from, when a checkpoint folder is set (it is written whole or not at all:
  models/checkpoint.py's temp file + rename, so the last one is intact).

Before it is raised the run, its optimizer state and the failing step's tensors are dropped: the error is raised
outside the except block, `from None`, so neither it nor IPython's sys.last_traceback holds the failed frames;
then gc and the CUDA cache. A retry with the suggested batch runs in the same kernel.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import psutil
import torch

from ..core.budget import gib, read_budget, release_memory, without_oom
from ..core.device import device_facts
from ..core.errors import TrainingOutOfMemory
from ..core.memory_settings import DecidedMemory, LoraSettings, MemorySettings
from ..core.optimizers import DEFAULT_OPTIMIZER
from ..core.precision import PRECISIONS, canonical_precision
from ..core.results import run_metadata
from ..data.collate import LongestBatch, longest_batch
from ..planning.planner import FitResult, ModeRow, device_room, plan
from .config import TrainConfig


@dataclass(frozen=True)
class RanOut:
    """What ran out of memory, read from the run before it is dropped (plain values: nothing that holds memory)."""

    memory: str  # the device and its memory in use out of its total, as the error came
    batch: int
    length: int
    target_len: int | None  # an encoder-decoder's target length apart (None: the source's)
    grad_accum: int
    precision: str
    memory_settings: MemorySettings  # the run's memory settings (LoRA, the optimizer's state, checkpointing)
    memory_words: str  # them in words, as decided for the run where it was built (its base dtype named)
    steps: int | None  # steps finished before it (None: before the first, while setting up)
    total_steps: int | None
    checkpoint: str | None  # the last checkpoint's path (None: no checkpoint folder)
    saved_step: int | None  # the step it holds (None: none written)
    # The longest batch the run's training data makes (None: not read, before the data was): what the prediction
    # plans at, since each batch is padded to its own longest row, not to seq_len
    from_data: LongestBatch | None = None

    def planned(self) -> tuple[int, int | None]:
        """(length, target length) the prediction plans at: the data's longest batch where it was read."""
        if self.from_data is None:
            return self.length, self.target_len
        target = self.target_len if self.from_data.target is None else self.from_data.target
        return self.from_data.length, target

    def settings(self) -> str:
        accum = f" (x{self.grad_accum} accumulated)" if self.grad_accum > 1 else ""
        target = f", target {self.target_len}" if self.target_len else ""
        return f"B={self.batch}, T={self.length}{target}{accum}, {self.precision}, {self.memory_words}"


def answered(make_run, cfg: TrainConfig, device: torch.device):
    """`make_run().run()`, or, when the device runs out of memory, `TrainingOutOfMemory` in one line (above),
    with the run's memory released first."""
    run = None
    try:
        run = make_run()
        return run.run()
    except torch.cuda.OutOfMemoryError:
        ran = _ran_out(run, cfg, device)
    # Outside the except block: the error's traceback, and the tensors its frames held, are gone. The run goes
    # too (its optimizer state, gradients, loaders); the model stays for the prediction, without gradients.
    adapter = run.adapter if run is not None else None
    del run
    if adapter is not None:
        adapter.model.zero_grad(set_to_none=True)
    release_memory(device)
    predicted, again = without_oom(what_fits, adapter, ran, device) if adapter is not None else (None, None)
    if predicted is None:  # no step ran, or the prediction's own small forwards found no room (another process)
        why = "the prediction's small forwards ran out of memory too" if again else "no step ran"
        predicted = (f"{why}: fit (tier_utils.fit, python -m tier_utils fit) predicts what fits once memory is free",
                     None)
    del adapter
    release_memory(device)
    fits, cheapest = predicted
    raise TrainingOutOfMemory(answer_line(ran, fits) + _resume(ran, cheapest)) from None


def _ran_out(run, cfg: TrainConfig, device: torch.device) -> RanOut:
    if run is None:  # building the model on the device, or compiling
        return RanOut(memory_in_use(device), cfg.batch_size, cfg.seq_len, cfg.target_len, cfg.grad_accum_steps,
                      canonical_precision(cfg.precision), cfg.memory, cfg.memory.describe(), None, None, None, None)
    c, task, splits = run.cfg, run.adapter.task, run.data.splits  # the run's (its length capped at the model's)
    last = run.checkpoints.last_path
    longest = longest_batch(splits.train, splits.collate, run.data.description.data, task.input_key,
                            "labels" if task.own_target_length else None) if task.reads_tokens else None
    return RanOut(memory_in_use(device), c.batch_size, c.seq_len, c.target_len, c.grad_accum_steps,
                  run.precision.name, c.memory, run.built.memory.describe(), run.progress.step, run.data.total_steps,
                  str(last) if last is not None else None, run.progress.last_saved, longest)


def memory_in_use(device: torch.device) -> str:
    """The device and its memory in use out of its total, now: torch.cuda's reading on a real card, else the
    budget's (available RAM, or TIER_UTILS_FREE_MEMORY) out of the profile's card or the machine's RAM."""
    facts = device_facts(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info(device)
        source = "torch.cuda.mem_get_info"
    else:
        budget = read_budget(device)
        free, total, source = budget.free_bytes, facts.total_bytes or psutil.virtual_memory().total, budget.source
    return f"{facts.describe()} with {gib(max(0, total - free))} of {gib(total)} in use ({source})"


def what_fits(adapter, ran: RanOut, device: torch.device) -> tuple[str, ModeRow | None]:
    """The planner's prediction for this model at the length that ran, in words: the largest batch in the mode
    that ran out, and the cheapest mode that fits the batch asked (cost_rank's order, as `fit` says it); and that
    mode (None: none fits)."""
    budget = read_budget(device)
    room = device_room(budget)  # what `fit` says a training step may use here
    # A LoRA run's model already has its adapters: planned as it is, its trainable parameters are theirs.
    lora = ran.memory_settings.lora
    optimizers = tuple(dict.fromkeys((DEFAULT_OPTIMIZER.name, ran.memory_settings.optimizer)))  # and the run's
    length, target = ran.planned()
    configs, blocks = plan(adapter, PRECISIONS, length, checkpointing=True,
                           lora=None if lora else LoraSettings(), budget=budget, optimizers=optimizers,
                           target_len=target)
    if lora:  # planned as the model holds them: its base in the dtype it has, its adapters trained
        base = next((p.dtype for p in adapter.model.parameters() if not p.requires_grad and p.is_floating_point()),
                    torch.float32)
        configs = [replace(c, memory=DecidedMemory(replace(ran.memory_settings, checkpointing=c.checkpointing,
                                                           optimizer=c.optimizer.name), base, "the run's"))
                   for c in configs]
    fit = FitResult(configs, length, adapter.summary(), budget, run_metadata(device), blocks=blocks,
                    batch_size=ran.batch, target_len=target)
    same = _same_mode(configs, ran)
    at = f" at {ran.from_data.describe()}" if ran.from_data is not None else ""
    parts = [f"fits here (predicted{at}, {gib(room)} usable of {gib(budget.free_bytes)} free per {budget.source})"]
    if same is not None:
        largest = same.largest_batch(length, room)
        parts.append(f"{same.name} up to B={largest}" if largest else f"not even B=1 in {same.name}")
        if largest >= ran.batch:
            parts.append(f"the prediction has B={ran.batch} fitting, so something else holds this memory (another "
                         "process or notebook, fragmentation): free it, or take a smaller batch")
    cheapest = fit.cheapest()["this_device"]
    parts.append(f"at B={ran.batch} the cheapest mode that fits is {cheapest.name}" if cheapest is not None else
                 f"no mode fits B={ran.batch}" + _most(configs, length, room))
    return "; ".join(parts[:1]) + ": " + "; ".join(parts[1:]), cheapest


def _most(configs: list[ModeRow], length: int, room: float) -> str:
    """Where no mode fits the batch asked: the mode that fits the most (a mode the device cannot run left out)."""
    runs = [c for c in configs if c.mode.runs_here()]
    best = max(runs, key=lambda c: c.largest_batch(length, room), default=None)
    largest = best.largest_batch(length, room) if best is not None else 0
    return f"; the most is B={largest} in {best.name}" if largest else "; not even B=1 in any mode"


def _same_mode(configs: list[ModeRow], ran: RanOut) -> ModeRow | None:
    settings = ran.memory_settings
    return next((c for c in configs if c.precision == ran.precision and c.checkpointing == settings.checkpointing
                 and (c.lora is None) == (settings.lora is None) and c.optimizer is settings.optimizer_class), None)


def _resume(ran: RanOut, cheapest: ModeRow | None) -> str:
    """Where a rerun continues. A resume keeps the batch and the precision (its trajectory); activation
    checkpointing changes neither, so it may be switched on for it."""
    if ran.checkpoint is None:
        return ""
    if ran.saved_step is None:
        return "; no checkpoint was written before it (checkpoint_every sets how often), so a rerun starts over"
    settings = ran.memory_settings
    same_run = cheapest is not None and cheapest.precision == ran.precision and cheapest.lora == settings.lora
    how = "--resume --checkpointing (resume=True, the memory settings with checkpointing=True)" if (
        same_run and cheapest.checkpointing and not settings.checkpointing) else \
        "--resume (resume=True) with the same batch and precision"
    return (f"; {ran.checkpoint} is intact at step {ran.saved_step}: {how} continues from step {ran.saved_step} "
            "(another batch or precision starts over in a new checkpoint folder)")


def answer_line(ran: RanOut, fits: str) -> str:
    when = "before the first step" if ran.steps is None else f"after {ran.steps} of {ran.total_steps} steps"
    return f"out of memory {when} at {ran.settings()} on {ran.memory}; {fits}"
