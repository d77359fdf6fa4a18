"""The run's checkpoints (a mixin of train()'s `_Run`): what they hold, writing them, resuming from them.

One process and DDP: rank 0 writes last.pt / best.pt (models/checkpoint.py). FSDP: every rank writes its shard of
the sharded folders last/ and best/ (models/sharded.py), which a resume may read on another number of ranks when
the global batch is the same; `consolidate` adds an unsharded last.pt at the end.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..core.errors import CheckpointError
from ..core.hub import HUB_PREFIX
from ..core.seeding import rng_state, set_rng_state
from ..core.threads import resume_threads
from ..data.tokenizer import BYTES
from ..engine.lora import lora_record, model_state
from ..engine.strategies import saved_strategy
from ..models.checkpoint import CHECKPOINT_NAME, describe_data, save_checkpoint
from ..models.loading import source_of
from .config import TRAJECTORY_FIELDS


class RunCheckpoints:
    """Checkpoint methods of `_Run` (loop.py), which holds the state they read and restore."""

    def _resume(self) -> None:
        if not self.cfg.resume:
            return
        if self.ckpt_path.exists():
            self._load()
        elif self.env.is_main:
            warnings.warn(f"resume=True but {self.ckpt_path} does not exist; starting from step 0", stacklevel=4)

    def _save(self, last: bool = True, best: bool = False) -> None:
        """Write last and/or best (one state; best: this step has the lowest val loss so far): last.pt / best.pt
        from rank 0, or under FSDP the sharded folders last/ / best/ from every rank."""
        if not (last or best):
            return
        self._check(self.hist.sync())  # never write a diverged state
        trainer = self._trainer_state()
        paths = [self.ckpt_path] * last + [self.best_path] * best
        self.strategy.save(paths, self.adapter.model, self.optimizer, trainer)
        if last:
            self.last_saved = self.step

    def _trainer_state(self) -> dict:
        """Everything a checkpoint holds but the weights and optimizer state (every rank calls it)."""
        rng = self.env.gather(rng_state())  # every rank's RNG; rank r resumes with rng[r]
        return {"step": self.step, "epoch": self.step // self.steps_per_epoch,
                "batch_in_epoch": self.step % self.steps_per_epoch * self.cfg.grad_accum_steps,
                "world_size": self.env.world_size, "strategy": self.strategy.name,
                "global_batch": self.global_batch, "precision": self.precision.name,
                "scheduler": self.scheduler.state_dict(), "scaler": self.step_fn.stepper.state_dict(),
                "rng": rng, "loader_generator": self._epoch_start_generator(), "config": self.cfg.to_dict(),
                "history": self.hist.state_dict(), "data": self.data_info, "source": self._source(),
                "selection": self.selection.state_dict(), "threads": torch.get_num_threads()}

    @property
    def global_batch(self) -> int:
        return self.cfg.batch_size * self.cfg.grad_accum_steps * self.env.world_size

    def _source(self) -> dict | None:
        """How `load_model(checkpoint)` rebuilds the model: its spec and arguments, and the tokenizer this run
        fed it. None for a module built in Python, which no spec can rebuild."""
        source = source_of(self.adapter.model)
        if source is None or source.spec is None:
            return None
        tokenizer = self.adapter.tokenizer
        name = tokenizer.name
        if name != BYTES and not (name.startswith(HUB_PREFIX) or Path(name).is_dir()):
            # A tokenizer made in memory has no folder or hub id to load it from: keep its files beside the
            # checkpoints, so load_model(checkpoint) finds the same ids.
            folder = self.ckpt_path.parent / "tokenizer"
            if not folder.is_dir():
                tokenizer.save(folder)
            name = str(folder.resolve())
        return source.record(None if name == BYTES else name, lora_record(self.adapter.model))

    def _epoch_start_generator(self) -> torch.Tensor:
        """The loader generator's state at the start of the epoch a resume re-enters."""
        at_boundary = self.step % self.steps_per_epoch == 0
        return self.loader.generator.get_state() if at_boundary else self.epoch_gen

    def _consolidate(self, full: dict, weights: str) -> None:
        """A sharded run's last.pt: the unsharded weights (a LoRA run's adapters), in the single-file format
        load_model reads (no optimizer state: a resume reads the sharded last/)."""
        trainer = self._trainer_state()
        if self.env.is_main:
            self.consolidated = self.ckpt_path.with_name(CHECKPOINT_NAME)
            save_checkpoint(self.consolidated, {**trainer, "model": model_state(self.adapter.model, full),
                                                "optimizer": None, "consolidated": weights})

    def _differences(self, state: dict) -> list[str]:
        """The trajectory settings, precision and world size in which a checkpoint's run differs from this one."""
        saved, now = state["config"], self.cfg.to_dict()
        # A checkpoint that reshards on load resumes on another world size if the global batch is the same.
        fields = [k for k in TRAJECTORY_FIELDS if not (saved_strategy(state).sharded and k == "batch_size")]
        differ = [f"{k}={saved.get(k)!r}" for k in fields if saved.get(k) != now[k]]
        if state["precision"] != self.precision.name:
            differ.append(f"precision={state['precision']!r}")
        return differ + self.strategy.resume_differences(state, self.global_batch)

    def _load(self) -> None:
        state = self._read(self.ckpt_path)
        differ = self._differences(state)
        if differ:
            raise CheckpointError(f"{self.ckpt_path} is from a run with {', '.join(differ)}; resume with the same "
                                  "settings or use a new checkpoint_dir")
        if state.get("data") != self.data_info:
            raise CheckpointError(f"{self.ckpt_path} was trained on {describe_data(state.get('data'))}, this run has "
                                  f"{describe_data(self.data_info)}; resume with the same data or use a new "
                                  "checkpoint_dir")
        self.strategy.load(self.ckpt_path, state, self.adapter.model, self.optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_fn.stepper.load_state_dict(state["scaler"])
        self.hist.load_state_dict(state["history"])
        self.selection.load_state_dict(state.get("selection"))
        later = self._read(self.best_path, mmap=True) if self.best_path.exists() else None  # not its weights
        if later and not self._differences(later) and later["data"] == self.data_info:
            self.selection.adopt(later.get("selection"), state["step"])  # this run's, written past last.pt
        self._resume_gen = state["loader_generator"]
        self.step = self.last_saved = self.resumed_from = state["step"]
        set_rng_state(state["rng"][self.env.rank % len(state["rng"])])  # resharded onto more ranks: rank 0's
        if "threads" in state:  # a checkpoint from before the count was saved: the count chosen now
            resume_threads(state["threads"], state["step"])

    def _read(self, path: Path, mmap: bool = False) -> dict:
        """A checkpoint's state: last.pt / best.pt, or a sharded folder's trainer state (no weights)."""
        return self.strategy.read(path, mmap)
