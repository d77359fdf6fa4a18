"""The run's checkpoints: what they hold, writing them, resuming from them. `RunCheckpoints` is given everything it
reads and restores (the run's parts and its Progress), and the strategy writes and reads them.

One process and DDP: rank 0 writes last.pt / best.pt (models/checkpoint.py). FSDP: every rank writes its shard of
the sharded folders last/ and best/ (models/sharded_checkpoint.py), which a resume may read on another number of
ranks when the global batch is the same; `consolidate` adds an unsharded last.pt at the end.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ..adapter.adapter import ModelAdapter
from ..core.errors import CheckpointError, OutputError, one_line
from ..core.hub import HUB_PREFIX
from ..core.memory_settings import memory_setting
from ..core.paired import ExampleScores
from ..core.seeding import rng_state, set_rng_state
from ..core.threads import resume_threads
from ..data.tokenizer import BYTES
from ..engine.lora import lora_record, model_state
from ..engine.strategies import Strategy, other_format_checkpoint
from ..models.checkpoint import CHECKPOINT_NAME, describe_data, same_data, save_checkpoint
from .config import TRAJECTORY_FIELDS, TrainConfig
from .finetune import Selection
from .history import History
from .parts import Optimization, Progress, RunData


class RunCheckpoints:
    """The checkpoints of one run: last (and best) in cfg.checkpoint_dir, named by the strategy."""

    def __init__(self, cfg: TrainConfig, strategy: Strategy, precision: str, adapter: ModelAdapter, data: RunData,
                 optimization: Optimization, hist: History, selection: Selection, progress: Progress):
        self.cfg, self.strategy, self.precision, self.adapter = cfg, strategy, precision, adapter
        self.data, self.optimization, self.hist, self.selection, self.progress = (data, optimization, hist, selection,
                                                                                  progress)
        folder, (last, best) = cfg.checkpoint_dir, strategy.checkpoint_names
        self.last_path = Path(folder) / last if folder is not None else None
        self.best_path = Path(folder) / best if folder is not None else None

    def resume(self) -> None:
        """With cfg.resume: the run's state from last, or a warning that there is none (a fresh start)."""
        if not self.cfg.resume:
            return
        if self.last_path.exists():
            self._load()
            return
        other_format_checkpoint(self.strategy, self.last_path)  # never pass over a checkpoint written another way
        if self.strategy.env.is_main:
            warnings.warn(f"resume=True but {self.last_path} does not exist; starting from step 0", stacklevel=4)

    def save(self, last: bool = True, best: bool = False) -> None:
        """Write last and/or best (one state; best: this step has the lowest val loss so far): last.pt / best.pt
        from rank 0, or a sharded strategy's folders last/ / best/ from every rank (the run checks divergence first)."""
        if not (last or best):
            return
        paths = [self.last_path] * last + [self.best_path] * best
        try:
            self.strategy.save(paths, self.adapter.model, self.optimization.optimizer, self._trainer_state())
        except OSError as exc:  # a full disk, a quota, a folder gone: the writes are atomic, so the old files stand
            raise OutputError(self._unwritten(exc)) from exc
        if last:
            self.progress.last_saved = self.progress.step

    def _unwritten(self, exc: OSError) -> str:
        """The one line for a checkpoint that could not be written: what failed, and the last good one, intact."""
        kept = self.progress.last_saved
        good = f"the last good checkpoint {self.last_path} (step {kept}) is intact" if kept is not None else \
            "no checkpoint was written before it"
        return (f"could not write the step-{self.progress.step} checkpoint in {self.last_path.parent} "
                f"({exc.strerror or one_line(exc)}); {good}; free space there and rerun with resume (--resume)")

    def _trainer_state(self) -> dict:
        """Everything a checkpoint holds but the weights and optimizer state (every rank calls it)."""
        env, step, spe = self.strategy.env, self.progress.step, self.data.steps_per_epoch
        rng = env.gather(rng_state())  # every rank's RNG; rank r resumes with rng[r]
        return {"step": step, "epoch": step // spe, "batch_in_epoch": step % spe * self.cfg.grad_accum_steps,
                "world_size": env.world_size, "strategy": self.strategy.name,
                "global_batch": self.data.global_batch, "precision": self.precision,
                "scheduler": self.optimization.scheduler.state_dict(),
                "scaler": self.optimization.step.scaler.state_dict(), "rng": rng,
                "loader_generator": self._epoch_start_generator(), "config": self.cfg.to_dict(),
                "history": self.hist.state_dict(), "data": self.data.fingerprint, "source": self._source(),
                "selection": self.selection.state_dict(), "threads": torch.get_num_threads(),
                "base_scores": self.progress.base_scores and self.progress.base_scores.to_dict(),
                "base_answers": self.progress.base_answers}

    def _source(self) -> dict | None:
        """How `load_model(checkpoint)` rebuilds the model: its spec and arguments, and the tokenizer this run
        fed it. None for a module built in Python, which no spec can rebuild."""
        source = self.adapter.source
        if source is None or source.spec is None:
            return None
        tokenizer = self.adapter.tokenizer
        name = tokenizer.name
        if name != BYTES and not (name.startswith(HUB_PREFIX) or Path(name).is_dir()):
            # A tokenizer made in memory has no folder or hub id to load it from: keep its files beside the
            # checkpoints, so load_model(checkpoint) finds the same ids.
            folder = self.last_path.parent / "tokenizer"
            if not folder.is_dir():
                tokenizer.save(folder)
            name = str(folder.resolve())
        return source.record(None if name == BYTES else name, lora_record(self.adapter.model))

    def _epoch_start_generator(self) -> torch.Tensor:
        """The loader generator's state at the start of the epoch a resume re-enters."""
        at_boundary = self.progress.step % self.data.steps_per_epoch == 0
        return self.data.loader.generator.get_state() if at_boundary else self.progress.epoch_generator

    def consolidate(self, full: dict, weights: str) -> Path | None:
        """A sharded run's last.pt: the unsharded weights (a LoRA run's adapters), in the single-file format
        load_model reads (no optimizer state: a resume reads the sharded last/). Rank 0's path; None elsewhere."""
        trainer = self._trainer_state()
        if not self.strategy.env.is_main:
            return None
        path = self.last_path.with_name(CHECKPOINT_NAME)
        save_checkpoint(path, {**trainer, "model": model_state(self.adapter.model, full), "optimizer": None,
                               "consolidated": weights})
        return path

    def _differences(self, state: dict) -> list[str]:
        """The trajectory settings, precision and ranks in which a checkpoint's run differs from this one."""
        saved, now = state["config"], self.cfg.to_dict()
        # A setting a checkpoint predates (augment, the schedule, shuffle) ran at its default then.
        saved = {k: saved.get(k, TrainConfig.__dataclass_fields__[k].default) for k in TRAJECTORY_FIELDS}
        differ = [f"{k}={_readable(k, saved[k])} (this run: {_readable(k, now[k])})" for k in TRAJECTORY_FIELDS
                  if saved[k] != now[k]]
        if state["precision"] != self.precision:
            differ.append(f"precision={state['precision']!r} (this run: {self.precision!r})")
        return differ + self.strategy.resume_differences(state, self.cfg.batch_size, self.data.global_batch)

    def _load(self) -> None:
        state = self.strategy.read(self.last_path)
        differ = self._differences(state)
        if differ:
            raise CheckpointError(f"{self.last_path} is from a run with {', '.join(differ)}; resume with the same "
                                  "settings or use a new checkpoint_dir")
        if not same_data(state.get("data"), self.data.fingerprint):
            raise CheckpointError(f"{self.last_path} was trained on {describe_data(state.get('data'))}, this run has "
                                  f"{describe_data(self.data.fingerprint)}; resume with the same data or use a new "
                                  "checkpoint_dir")
        opt = self.optimization
        self.strategy.load(self.last_path, state, self.adapter.model, opt.optimizer)
        opt.scheduler.load_state_dict(state["scheduler"])
        opt.step.scaler.load_state_dict(state["scaler"])
        self.hist.load_state_dict(state["history"])
        self.selection.load_state_dict(state.get("selection"))
        later = self.strategy.read(self.best_path, mmap=True) if self.best_path.exists() else None  # not its weights
        if later and not self._differences(later) and same_data(later["data"], self.data.fingerprint):
            self.selection.adopt(later.get("selection"), state["step"])  # this run's, written past last.pt
        p = self.progress
        p.resume_generator = state["loader_generator"]
        p.step = p.last_saved = p.resumed_from = state["step"]
        p.base_answers = state.get("base_answers")
        if state.get("base_scores"):  # a full fine-tune's base, scored before its first step
            p.base_scores = ExampleScores.from_dict(state["base_scores"])
        env = self.strategy.env
        set_rng_state(state["rng"][env.rank % len(state["rng"])])  # resharded onto more ranks: rank 0's
        if "threads" in state:  # a checkpoint from before the count was saved: the count chosen now
            resume_threads(state["threads"], state["step"])


def _readable(name: str, value) -> str:
    """A trajectory setting as a resume-mismatch line shows it: the memory settings in words (not their dict), the
    rest as written in Python."""
    return repr(memory_setting(value).describe() if name == "memory" else value)
