"""The distributed strategy as an object, the way precision is one (core/precision.py): one class per strategy owns
every fact about itself, and nothing else in tier_utils tests a strategy's name (the idea of Lightning Fabric's
strategies/).

A strategy class holds how a run joins its ranks (`start`), how the model is placed on them before the optimizer is
built (`setup_module`: FSDP shards it in place) and wrapped for the step (`wrap`: DDP), the GradScaler the
step goes through, how accumulation micro-steps skip the gradient sync (`no_sync`), gradient clipping, its
checkpoints (one file from rank 0, or a DCP folder per checkpoint that reshards on load), what it refuses to run,
what a resume needs the same, smoke's per-rank checks and its description in results (the planner's per-rank bytes
are planning/ranks.py's, by strategy class). `resolve_strategy` turns a name into a decided instance once, at a
tier's boundary; adding a strategy is one subclass and `register_strategy`.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import ClassVar

import torch

from ..core.errors import CheckpointError, LaunchError
from ..core.registry import Registry
from ..models.checkpoint import BEST_NAME, CHECKPOINT_NAME, load_checkpoint, save_checkpoint
from ..models.sharded_checkpoint import METADATA_FILE, full_model_state, load_sharded, read_trainer, save_sharded
from . import distributed, sharding
from .distributed import DistEnv
from .lora import load_model_state, model_state


@dataclass(frozen=True)
class Strategy:
    """One process holding the whole model: the base every strategy refines. The class attributes are the
    strategy's facts; an instance is the strategy decided for this process (its ranks in `env`)."""

    env: DistEnv = field(default_factory=DistEnv)

    name = "single"
    aliases: ClassVar[tuple[str, ...]] = ()
    label = "one process"  # how tables and headlines name it
    launched = False  # runs on torchrun's ranks: `ranks` plans it and `bench --strategy` compares it
    # Each rank holds a shard of the weights: its checkpoints are DCP folders, which reshard on load (a resume on
    # another number of ranks with the same global batch), and `consolidate` writes them as one file.
    sharded = False
    # The grad mode of an evaluation before the first step (the base a fine-tune is judged against).
    first_eval_mode: ClassVar = torch.inference_mode
    checkpoint_names = (CHECKPOINT_NAME, BEST_NAME)  # last and best, in checkpoint_dir
    # smoke under this strategy (smoketest/across_ranks.py): the check groups that run on every rank, on the model as
    # this strategy placed it; None: smoke takes no such strategy (one holding the whole model on every rank would
    # only check it again on each).
    smoke_per_rank: ClassVar[tuple[str, ...] | None] = None

    @classmethod
    def start(cls, device=None, verb: str = "train", **options) -> Strategy:
        """This strategy decided for this process, its ranks joined: one process joins none."""
        return cls(DistEnv(), **cls._own(options))

    @classmethod
    def _own(cls, options: dict) -> dict:
        """The options this class takes (its dataclass fields beyond env): a setting of another strategy is not its."""
        names = {f.name for f in fields(cls)} - {"env"}
        return {k: v for k, v in options.items() if k in names}

    def close(self) -> None:
        self.env.close()

    @classmethod
    def placed(cls, module: torch.nn.Module) -> bool:
        """Whether `module` is held as this strategy places it across ranks (one process and DDP's wrapper leave a
        module whole, as it was)."""
        return False

    def held_bytes(self, module: torch.nn.Module) -> int:
        """The parameter bytes this rank holds of `module`."""
        return sum(p.nbytes for p in module.parameters())

    @classmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        """Whether `folder` holds a last checkpoint in this strategy's format."""
        return (folder / cls.checkpoint_names[0]).is_file()

    # -- setup and wrapping ----------------------------------------------------------------------------------
    def prepare_host(self) -> str | None:
        """Before the model is built: what the strategy did to this process's memory, for the summary."""
        return None

    def setup_module(self, model: torch.nn.Module, precision, allocator: str | None = None) -> str | None:
        """Place `model` on the ranks, in place, before the optimizer is built on its parameters; returns how it
        is held, for the results (None: one process, nothing to say)."""
        return None

    def wrap(self, adapter):
        """The adapter the training step calls (DDP: its wrapper around the model)."""
        return adapter

    def grad_scaler(self, device_type: str, enabled: bool) -> torch.amp.GradScaler:
        """The GradScaler the step goes through: scaling for fp16 mixed (`enabled`), a pass-through otherwise."""
        return torch.amp.GradScaler(device_type, enabled=enabled)

    def no_sync(self, model, accumulating: bool):
        """The context around one micro-step's backward; `accumulating`: not the last micro-batch of the step."""
        return contextlib.nullcontext()

    def eval_forwards(self, batches: int) -> int | None:
        """How many evaluation forwards every rank runs, where they must run as many (None: each its own share)."""
        return None

    def clip_gradients(self, params: list, max_norm: float | None) -> torch.Tensor:
        """Clip to `max_norm` (None: not at all) and return the total norm before clipping (inf still measures)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save(self, paths: list[Path], model, optimizer, trainer: dict) -> None:
        """Write one checkpoint state to each of `paths`: a single file from rank 0."""
        if paths and self.env.is_main:
            save_checkpoint(paths, {**trainer, "model": model_state(model), "optimizer": optimizer.state_dict()})

    def read(self, path: Path, mmap: bool = False) -> dict:
        """A checkpoint's state as `save` wrote it (a sharded one: its trainer state, no weights)."""
        return load_checkpoint(path, mmap=mmap)

    def load(self, path: Path, state: dict, model, optimizer=None) -> None:
        """The weights (and, given one, the optimizer state) of checkpoint `state`, read from `path`, into the run."""
        try:
            load_model_state(model, state["model"])
        except RuntimeError as exc:
            raise CheckpointError(f"{path} holds weights for a different model ({str(exc).splitlines()[0]}); use a "
                                  "new checkpoint_dir") from exc
        if optimizer is not None:
            optimizer.load_state_dict(state["optimizer"])

    def full_state(self, model) -> dict | None:
        """The whole model's weights gathered on rank 0 (every rank calls it); None where the module holds them."""
        return None

    def resume_differences(self, state: dict, batch_size: int, global_batch: int) -> list[str]:
        """How a checkpoint's ranks and batch differ from this run's (its `batch_size` per rank, `global_batch` over
        them), in what a resume needs the same: its format; then a single file the same world size and batch per
        rank, a sharded one (DCP reshards on load) the same global batch only."""
        saved = saved_strategy(state)
        if saved.sharded != self.sharded:
            return [f"strategy={state.get('strategy')!r}"]
        if self.sharded:
            return [f"global batch {state['global_batch']}"] if state["global_batch"] != global_batch else []
        per_rank = state["config"]["batch_size"]
        differ = [f"batch_size={per_rank!r} (this run: {batch_size!r})"] if per_rank != batch_size else []
        return differ + ([f"world size {state['world_size']}"] if state["world_size"] != self.env.world_size else [])

    @classmethod
    def refuse(cls, cfg) -> None:
        """A one-line ValueError where a training run's settings (`cfg`, a TrainConfig) ask what this strategy
        cannot do: a strategy holding the whole model has no sharded checkpoint to consolidate."""
        if cfg.consolidate:
            raise ValueError("consolidate turns a sharded run's checkpoint into one last.pt: it needs a sharded "
                             f"strategy ({', '.join(sharded_strategies())}) and checkpoint_dir=DIR")


class Single(Strategy):
    """One process without torchrun (and what a DDP run on one rank decides it is)."""

    @classmethod
    def start(cls, device=None, verb: str = "train", **options) -> Strategy:
        world = distributed.torchrun_world()
        if world > 1:
            raise LaunchError(f"strategy={cls.name!r} runs in one process, not on {world} torchrun ranks; launch it "
                              f"without torchrun, or pick one of {', '.join(launched_strategies())}")
        return cls(DistEnv(), **cls._own(options))


@dataclass(frozen=True)
class DDP(Strategy):
    """DistributedDataParallel: every rank holds the whole model and all-reduces its gradients in buckets."""

    name = "ddp"
    label = "DDP"
    launched = True
    # torch's default: the buckets are a copy of the gradients, not views of them (one more copy per rank).
    gradient_as_bucket_view = False

    @classmethod
    def start(cls, device=None, verb: str = "train", **options) -> Strategy:
        """On torchrun's ranks; one process (no torchrun, or one rank) is a single-process run."""
        if distributed.torchrun_world() == 1:
            return Single.start(device, verb, **options)
        return cls(distributed.join(device, verb, cls.name), **cls._own(options))

    def setup_module(self, model, precision, allocator=None) -> str:
        return (f"DDP over {self.env.world_size} rank(s): every rank holds the whole model and all-reduces its "
                "gradients")

    def wrap(self, adapter):
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.env.device.index] if self.env.device.type == "cuda" else None
        return replace(adapter, model=DistributedDataParallel(adapter.model, device_ids=ids,
                                                              gradient_as_bucket_view=self.gradient_as_bucket_view))

    def no_sync(self, model, accumulating: bool):
        """Skip the all-reduce on accumulation micro-steps (the last one reduces every micro-step's gradients)."""
        return model.no_sync() if accumulating else contextlib.nullcontext()


@dataclass(frozen=True)
class FSDP(Strategy):
    """FSDP2 (engine/sharding.py): each rank holds 1/N of every weight, gradient and AdamW state; a block's
    full weights exist only while it runs. Needs torchrun, even on one rank (its mesh is a process group)."""

    reshard_after_forward: bool = True

    name = "fsdp"
    label = "FSDP"
    launched = True
    sharded = True
    # FSDP2 makes its all-gather buffers in the first forward: made under inference_mode, they are inference
    # tensors that training's in-place copies into them then refuse.
    first_eval_mode: ClassVar = torch.no_grad
    checkpoint_names = ("last", "best")  # DCP folders
    # Each rank checks the gradients and the memory of its own shards; the checks reading the whole model at once
    # (shapes, stability, init, latency, determinism) run in one process.
    smoke_per_rank = ("gradients", "memory")

    @classmethod
    def start(cls, device=None, verb: str = "train", **options) -> Strategy:
        return cls(distributed.join(device, verb, cls.name), **cls._own(options))

    @classmethod
    def refuse(cls, cfg) -> None:
        """What FSDP2 cannot shard or write: QLoRA's 4-bit base (bitsandbytes' packed weights are no DTensors),
        save_hf of a LoRA run (peft saves the adapters each rank holds a shard of), consolidate with no folder."""
        if cfg.memory.quantized:
            raise ValueError(f"a 4-bit base (QLoRA) cannot be sharded by {cls.name}: use strategy='{DDP.name}' or "
                             "one process, or drop bits=4")
        if cfg.memory.lora is not None and cfg.save_hf is not None:
            raise ValueError(f"save_hf of a LoRA run under {cls.name} is not supported (its adapters are sharded); "
                             "drop save_hf and keep consolidate: load_model('<checkpoint_dir>/last.pt') gives the "
                             "model with its adapters")
        if cfg.consolidate and cfg.checkpoint_dir is None:
            raise ValueError("consolidate turns a sharded run's checkpoint into one last.pt: it needs "
                             "checkpoint_dir=DIR")

    @classmethod
    def placed(cls, module) -> bool:
        """`fully_shard` made its weights DTensors on a device mesh."""
        return any(hasattr(p, "device_mesh") for p in module.parameters())

    def held_bytes(self, module) -> int:
        return sharding.param_bytes(module)

    def prepare_host(self) -> str | None:
        return sharding.host_allocator(self.env)

    def setup_module(self, model, precision, allocator=None) -> str:
        return sharding.shard(model, self.env, precision, self.reshard_after_forward, allocator).describe()

    def grad_scaler(self, device_type: str, enabled: bool):
        """ShardedGradScaler: its inf check is agreed across the ranks, each of which sees only its shard."""
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device_type, enabled=enabled)

    def no_sync(self, model, accumulating: bool):
        """Accumulation micro-steps skip the reduce-scatter."""
        return sharding.gradient_sync(model, not accumulating)

    def eval_forwards(self, batches: int) -> int:
        """The most any rank has: every rank runs as many forwards (each gathers weights with the others)."""
        return self.env.all_max(batches)

    def clip_gradients(self, params, max_norm):
        """The sharded (DTensor) gradients clipped by their global norm, which comes back replicated."""
        norm = super().clip_gradients(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def save(self, paths, model, optimizer, trainer) -> None:
        """Every rank writes its shard of each folder; rank 0 adds the trainer state."""
        save_sharded(paths, model, optimizer, trainer, self.env)

    def read(self, path, mmap=False) -> dict:
        return read_trainer(path, mmap)

    @classmethod
    def holds_checkpoint(cls, folder: Path) -> bool:
        return (folder / cls.checkpoint_names[0] / METADATA_FILE).is_file()  # DCP's index marks a written folder

    def load(self, path, state, model, optimizer=None) -> None:
        load_sharded(path, model, optimizer)

    def full_state(self, model) -> dict:
        return full_model_state(model)


_REGISTRY = Registry("strategy", Strategy)


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Add a strategy: its name and aliases resolve to it from then on (usable as a class decorator)."""
    return _REGISTRY.add(cls)


for _cls in (Single, DDP, FSDP):
    register_strategy(_cls)
STRATEGIES = _REGISTRY.names()  # the strategies tier_utils ships


def launched_strategies() -> tuple[str, ...]:
    """The registered strategies that run on torchrun's ranks (what `ranks` plans and the benchmark compares)."""
    return tuple(cls.name for cls in _REGISTRY.entries() if cls.launched)


def sharded_strategies() -> tuple[str, ...]:
    return tuple(cls.name for cls in _REGISTRY.entries() if cls.sharded)


def smoke_strategies() -> tuple[str, ...]:
    """The registered strategies smoke runs under (each with its per-rank checks)."""
    return tuple(cls.name for cls in _REGISTRY.entries() if cls.smoke_per_rank is not None)


def placed_by(model) -> type[Strategy] | None:
    """The registered strategy that placed `model` (an adapter's module, or a module) across ranks; None: it is
    held whole, in one process."""
    module = getattr(model, "model", model)
    if not isinstance(module, torch.nn.Module):
        return None
    return next((cls for cls in _REGISTRY.entries() if cls.placed(module)), None)


def refuse_placed(model, verb: str) -> None:
    """One line for a tier that reads one whole model (analysis): not on several torchrun ranks, not on a module
    a strategy placed across them (FSDP's DTensor shards)."""
    placed, world = placed_by(model), distributed.torchrun_world()
    if placed is not None or world > 1:
        where = f"a model sharded by {placed.label}" if placed is not None else f"{world} torchrun ranks"
        raise LaunchError(f"{verb} does not run sharded ({where}); run it in one process on the consolidated "
                          f"model: python -m tier_utils {verb} --model RUN/checkpoints/last.pt (train with "
                          f"--strategy {sharded_strategies()[0]} --consolidate)")


def canonical_strategy(requested) -> str:
    """A strategy's name from any spelling of it (or from a Strategy, decided or not)."""
    return _REGISTRY.canonical(requested)


def strategy_class(name) -> type[Strategy]:
    """The class of a strategy, by any spelling of its name (a Strategy class comes back as it is)."""
    if isinstance(name, type) and issubclass(name, Strategy):
        return name
    return _REGISTRY[name]


def saved_strategy(state: dict) -> type[Strategy]:
    """The strategy a checkpoint's run had (one it doesn't name, or no longer registered: a single-file one)."""
    return _REGISTRY.get(state.get("strategy"), Single)


def other_format_checkpoint(strategy: Strategy, last: Path) -> None:
    """Where this run's last checkpoint `last` is missing: one written in the other format beside it (a single file
    for a sharded run, a sharded folder for one that is not) is one line naming how to resume it, where starting
    over would silently leave it behind."""
    folder = last.parent
    if strategy.sharded and (folder / CHECKPOINT_NAME).is_file():
        state = load_checkpoint(folder / CHECKPOINT_NAME, mmap=True)  # a look at its entries, not its weights
        if state.get("consolidated"):
            raise CheckpointError(f"{folder} holds a sharded run's consolidated {CHECKPOINT_NAME} but not its sharded "
                                  f"{last.name}/ folder (the optimizer state a resume needs); restore that folder, "
                                  f"load {CHECKPOINT_NAME} with load_model, or use a new checkpoint_dir")
        saved, ranks = saved_strategy(state), state.get("world_size", 1)
        how = (f"under {distributed.launch_hint('train', saved.name)} on {ranks} processes"
               if saved.launched and ranks > 1 else "without torchrun")
        raise CheckpointError(f"{folder} holds a single-file checkpoint ({CHECKPOINT_NAME}, from a {saved.label} run) "
                              f"and this run is sharded ({strategy.label}); resume it {how} with --resume, or use a "
                              "new checkpoint_dir")
    other = next((cls for cls in _REGISTRY.entries() if cls.sharded and cls.holds_checkpoint(folder)), None)
    if not strategy.sharded and other is not None:
        raise CheckpointError(f"{folder} holds a sharded ({other.label}) checkpoint, {other.checkpoint_names[0]}/, "
                              f"and this run is not sharded; resume it under "
                              f"{distributed.launch_hint('train', other.name)} with --resume, or use a new "
                              "checkpoint_dir")


def resolve_strategy(requested, device=None, verb: str = "train", **options) -> Strategy:
    """Decide what `requested` (a name, or a Strategy already decided, which comes back as is) means in this
    process: join torchrun's ranks where it runs on them, or a one-line LaunchError saying how to launch `verb`.
    `options`: settings of some strategies (e.g. reshard_after_forward); each class takes its own."""
    if isinstance(requested, Strategy):
        return requested
    return strategy_class(requested).start(device, verb, **options)
