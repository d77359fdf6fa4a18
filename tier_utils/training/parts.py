"""The parts of one train() run, each made by one function that takes what it needs and returns a small frozen
record, in the order the run needs them: the config fitted to the model, the model (`BuiltModel`), the data
(`RunData`), the optimization (`Optimization`); and `Progress`, the one record the run moves as it goes.

train()'s run object (loop.py) is built complete from them; nothing is set on it afterwards.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace

import torch

from ..adapter.adapter import ModelAdapter, resolve_model
from ..core.device import device_facts
from ..core.errors import DataError
from ..core.memory_settings import DecidedMemory, resolve_memory
from ..core.precision import Precision
from ..core.seeding import seed_everything
from ..data.collate import longest_batch
from ..data.datasets import DataSplits, in_data_order, make_loader, to_device
from ..data.lengths import example_lengths, scored_in_length_order
from ..engine import distributed
from ..engine.activation_checkpointing import Checkpointing, enable_checkpointing, require_blocks
from ..engine.compiling import CompileInfo, CompileWatch, compile_for_training
from ..engine.quantization import apply_memory, load_quantized, require_adapters
from ..engine.step import TrainStep, make_optimizer
from ..engine.strategies import Strategy
from ..models.checkpoint import data_fingerprint
from .config import FINE_LOG_STEPS, TrainConfig
from .divergence import checked_weights
from .finetune import check_save_hf
from .history import MAX_STEP_ROWS


@dataclass(frozen=True)
class BuiltModel:
    """The model on the device in train mode, in the precision's weight dtype, placed on the strategy's ranks."""

    adapter: ModelAdapter
    name: str  # the model's own class name, read before the strategy placed it (fully_shard renames it FSDP<name>)
    checkpointing: Checkpointing | None  # activation checkpointing, on (None: off), undone as the run ends
    placement: str | None  # how the strategy holds the model on its ranks (None: one process)
    memory: DecidedMemory  # the memory settings decided for this run: LoRA's base dtype, the optimizer built
    nonfinite_at_load: tuple[str, ...]  # the weights that were NaN or inf as loaded: a non-finite loss's cause


def build_model(model, model_kwargs: dict, cfg: TrainConfig, precision: Precision, strategy: Strategy,
                device: torch.device) -> BuiltModel:
    """The model built (from the seed) and checked: trainable, and its forward runs; then the strategy places it
    (FSDP shards it in place, before the optimizer is built on its parameters)."""
    allocator = strategy.prepare_host()  # before the model is built
    seed_everything(cfg.seed)  # before building from a spec, so initial weights follow the seed
    if cfg.memory.quantized and not isinstance(model, (torch.nn.Module, ModelAdapter)):
        # A spec's 4-bit base is quantised as it loads (transformers' BitsAndBytesConfig for a folder or hub id)
        model, model_kwargs = load_quantized(model, precision.compute_dtype, **model_kwargs), {}
    adapter = resolve_model(model, **model_kwargs)
    at_load = checked_weights(adapter.model, precision)  # a weight fp16 makes inf: refused before anything else
    # Decided once, here: LoRA's base dtype (and fp16's range check on these weights), the optimizer built.
    memory = resolve_memory(cfg.memory, precision, device_facts(device), adapter.stored_dtype, adapter.model)
    if cfg.memory.checkpointing:
        require_blocks(adapter.model)  # before LoRA changes a caller's module
    adapter = with_lora(adapter, memory, precision)
    check_save_hf(adapter.model, cfg.save_hf, cfg.merge)  # no save_pretrained form: refused before any step
    # fp32 master weights for the mixed modes, whatever dtype the checkpoint was stored in; with LoRA the base in
    # the decided base dtype and the adapters in fp32 (a 4-bit base's packed weights stay as bitsandbytes holds them)
    precision.convert_module(adapter.model.to(device), memory).train()
    # The planner's checkpointing (engine/activation_checkpointing.py), so what `fit` predicted with it is what runs.
    checkpointing = enable_checkpointing(adapter.model) if cfg.memory.checkpointing else None
    adapter.require_trainable()
    adapter.check_forward()
    name = adapter.name
    return BuiltModel(adapter, name, checkpointing, strategy.setup_module(adapter.model, precision, allocator),
                      memory, at_load)


def with_lora(adapter: ModelAdapter, memory: DecidedMemory, precision: Precision) -> ModelAdapter:
    """The adapter with LoRA's adapters over its frozen base, where the memory settings ask for them: a 4-bit
    base (QLoRA) has its block Linear layers quantised first (a module passed in; a spec was quantised as it
    loaded), computing in the precision's compute dtype, and must then carry adapters."""
    if memory.lora is None:
        require_adapters(adapter.model)  # a 4-bit model given without LoRA: one line, before any step
        return adapter
    return replace(adapter, model=apply_memory(adapter.model, memory, precision.compute_dtype, adapter.task))


def fitted_config(cfg: TrainConfig, adapter: ModelAdapter) -> TrainConfig:
    """The config as the run uses it: seq_len (and an encoder-decoder's target_len) capped to the model's length,
    with a warning (the result says it); a target_len on a model with one length is one line."""
    seq_len = adapter.fit_length(cfg.seq_len) if cfg.seq_len > adapter.max_len else cfg.seq_len
    target_len = adapter.target_length(cfg.target_len)
    if (seq_len, target_len) == (cfg.seq_len, cfg.target_len):
        return cfg
    return replace(cfg, seq_len=seq_len, target_len=target_len)


@dataclass(frozen=True)
class RunData:
    """The splits at the run's length, this rank's order over them and its loaders, and the run's length."""

    splits: DataSplits
    description: object  # DataSplits.describe(): what every result records about its data
    fingerprint: dict | None  # what a resume must find again (None: no checkpoints)
    sampler: distributed.ShardedSampler
    loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    eval_forwards: int | None  # the evaluation forwards every rank runs, where the strategy needs them equal
    steps_per_epoch: int
    total_steps: int
    stride: int  # steps between history rows
    global_batch: int  # sequences per optimizer step over every rank


def prepare_data(adapter: ModelAdapter, data, cfg: TrainConfig, strategy: Strategy,
                 device: torch.device) -> RunData:
    env = strategy.env
    splits = adapter.datasets(data, cfg.seq_len, cfg.seed, cfg.held_out, cfg.target_len, cfg.augment, cfg.packing,
                              cfg.chat)
    if not cfg.shuffle:
        splits = replace(splits, train=in_data_order(splits.train))
    groups = grouped_by_length(adapter, cfg)
    sampler = distributed.ShardedSampler(splits.train, env.world_size, env.rank, cfg.seed, cfg.shuffle,
                                         example_lengths(splits.train) if groups else None,
                                         cfg.batch_size * env.world_size)
    global_batch = cfg.batch_size * cfg.grad_accum_steps * env.world_size
    steps_per_epoch = len(sampler) // cfg.batch_size // cfg.grad_accum_steps
    if steps_per_epoch < 1:
        raise DataError(f"the training set has {len(splits.train)} examples, fewer than one step's global batch "
                        f"of {global_batch}; lower batch_size or grad_accum_steps, or give more data")
    total_steps = cfg.max_steps or cfg.epochs * steps_per_epoch
    log_every = cfg.log_every or (1 if total_steps <= FINE_LOG_STEPS else 10)
    loader = make_loader(splits.train, cfg.batch_size, collate=splits.collate, device=device,
                         num_workers=cfg.num_workers, seed=cfg.seed, drop_last=True, sampler=sampler)
    val = distributed.eval_shard(splits.val, env)
    val_loader = make_loader(val, cfg.batch_size, collate=splits.collate, shuffle=False, device=device,
                             num_workers=cfg.num_workers, seed=cfg.seed,
                             sampler=scored_in_length_order(val, cfg.eval_batches, cfg.batch_size) if groups else None)
    eval_forwards = strategy.eval_forwards(min(len(val_loader), cfg.eval_batches or len(val_loader)))
    return RunData(splits, splits.describe(), data_fingerprint(splits) if cfg.checkpoint_dir is not None else None,
                   sampler, loader, val_loader, eval_forwards, steps_per_epoch, total_steps,
                   max(log_every, math.ceil(total_steps / MAX_STEP_ROWS)), global_batch)


def grouped_by_length(adapter: ModelAdapter, cfg: TrainConfig) -> bool:
    """Whether this run groups its batches by length: asked for, and its examples have lengths (an image model's
    are all one size: said in one line)."""
    if cfg.group_by_length and not adapter.task.reads_tokens:
        warnings.warn(f"group_by_length: a {adapter.task} model's examples are all one size; nothing to group",
                      stacklevel=3)
    return cfg.group_by_length and adapter.task.reads_tokens


@dataclass(frozen=True)
class Optimization:
    """AdamW, the LR schedule over the run's steps, and the step that uses them (compiled, where asked)."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: TrainStep
    compiled: CompileInfo | None  # None: compile off
    watch: CompileWatch | None = None  # compiled: the recompiles while training, and any fall back to eager

    def compile_reason(self) -> str:
        """How the step was compiled, its recompiles while training and any fall back to eager."""
        if self.compiled is None:
            return "off (compile=False)"
        said = self.watch and self.watch.describe()
        return f"{self.compiled.reason}; {said}" if said else self.compiled.reason


def make_optimization(built: BuiltModel, data: RunData, cfg: TrainConfig, precision: Precision,
                      strategy: Strategy) -> Optimization:
    """The optimizer and schedule, and the step on what the strategy wraps (DDP: its wrapper), with the strategy's
    GradScaler and clipping. compile: the step calls the compiled model; evaluation and checkpoints use the eager
    one (its warm-up puts back the RNG states and buffers it moved)."""
    optimizer = make_optimizer(built.adapter.model, cfg.lr, cfg.weight_decay, precision.adamw_eps,
                               built.memory.optimizer)
    scheduler = cfg.lr_schedule.scheduler(optimizer, data.total_steps)
    stepped, info = strategy.wrap(built.adapter), None
    if cfg.compile:
        device = built.adapter.device
        shaped = next(iter(make_loader(data.splits.train, cfg.batch_size, collate=data.splits.collate, shuffle=False,
                                       device=device)))
        stepped, info = compile_for_training(stepped, precision, to_device(shaped, device), cfg.compile_mode,
                                             cfg.progress and strategy.env.is_main, lengths_vary(built.adapter, data))
    step = TrainStep(stepped, precision, optimizer, scheduler, cfg.grad_clip, strategy=strategy)
    return Optimization(optimizer, scheduler, step, info, CompileWatch() if info and info.compiled else None)


def lengths_vary(adapter: ModelAdapter, data: RunData) -> bool:
    """Whether the run's batches come in more than one length: its examples are not all one length."""
    task, splits = adapter.task, data.splits
    return task.reads_tokens and not longest_batch(splits.train, splits.collate, "", task.input_key,
                                                   "labels" if task.own_target_length else None).same_length


@dataclass
class Progress:
    """Where the run is: the one record that changes as it goes (the loop, evaluation, checkpoints and a resume
    move it); every field is declared here."""

    step: int = 0
    resumed_from: int | None = None  # the checkpoint's step a resume started from
    last_saved: int | None = None  # the step of the last checkpoint written (or resumed from)
    resume_generator: torch.Tensor | None = None  # a resume's loader generator for the epoch it re-enters (once)
    epoch_generator: torch.Tensor | None = None  # the loader generator at this epoch's start (seeds its workers)
    val_targets: int | None = None  # how many targets the last evaluation scored: the n behind val loss/accuracy
    top5_accuracy: float | None = None  # the last evaluation's, for a classifier of more than 5 classes
    confusion: list | None = None  # the last evaluation's [true][predicted] counts (engine.evaluation)
    generated: object = None  # a generating task's last evaluation: engine.generation.Generated (None: none ran)
    # The base's per-example scores (core.paired.ExampleScores; training/versus_base.py): a full fine-tune's are
    # taken before the first step and kept in its checkpoints (None: not scored yet, or not compared).
    base_scores: object = None
    base_answers: list | None = None  # chat data: the model's answers before the first step (kept by a resume)
