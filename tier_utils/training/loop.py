"""Tier 3 training engine: `train()` around the shared precision-correct optimizer step (`TrainStep`, engine/step.py).

`train()` adds the loop around that step: data order from (seed, epoch), metrics
kept on the device between log points, evaluation, checkpoints with exact resume, torchrun (DDP or FSDP2).
History rows and `TrainResult` live in history.py, the distributed strategy in engine/distributed.py and
engine/sharding.py, checkpoint I/O in models/checkpoint.py (single files) and models/sharded.py (FSDP's folders).
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import replace
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..adapter.adapter import ModelAdapter, resolve_model
from ..core.device import device_facts
from ..core.errors import DataError, TrainingDiverged
from ..core.files import run_lock
from ..core.inputs import writable_dir
from ..core.memory_settings import resolve_memory
from ..core.precision import Precision, device_name, dtype_name, resolve_device, resolve_precision
from ..core.progress import progress_bar
from ..core.results import run_metadata
from ..core.seeding import seed_everything
from ..core.settings import merge
from ..core.threads import chooses_threads
from ..data.datasets import DataSplits, make_loader, to_device
from ..engine import distributed, sharding
from ..engine.compiling import compile_for_training
from ..engine.evaluation import evaluate
from ..engine.lora import apply_memory, convert_for, describe_lora
from ..engine.memory import disable_checkpointing, enable_checkpointing, require_blocks
from ..engine.step import TrainStep, make_optimizer, make_scheduler, optimizer_impl
from ..models.checkpoint import BEST_NAME, CHECKPOINT_NAME, data_fingerprint
from ..models.sharded import full_model_state
from .checkpointing import RunCheckpoints
from .config import FINE_LOG_STEPS, TrainConfig
from .finetune import Selection, check_save_hf, restore_best, save_hf
from .history import MAX_STEP_ROWS, History, TrainResult, TrainSummary, step_stats
from .tracking import open_train_run


@contextlib.contextmanager
def _deterministic_algorithms(on: bool, cuda: bool):
    """torch's deterministic mode for the run only; the caller's settings come back afterwards."""
    if not on:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for reproducible matmuls
    # warn_only: an op with no deterministic kernel warns instead of stopping the user's model.
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    # On CUDA the fused attention kernels' backward accumulates with atomics (run-to-run noise); the
    # math kernel does not. On the CPU the fused kernel is already deterministic and stays.
    attention = sdpa_kernel(SDPBackend.MATH) if cuda else contextlib.nullcontext()
    try:
        with attention:
            yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = before[2], before[3]


@chooses_threads  # the run's torch thread count, chosen as it starts
def train(model, data=None, config: TrainConfig | dict | None = None, *, model_kwargs: dict | None = None,
          on_eval=None, **overrides) -> TrainResult:
    """Train `model` and return a `TrainResult` (history, summary, the trained module in train mode).

    model: a spec string (see `load_model`; `model_kwargs` build it), an nn.Module (trained in place) or a
        ModelAdapter.
    data: None for the bundled corpus in the model's task, or anything `build_datasets` accepts.
    config / overrides: a TrainConfig (or dict) and/or TrainConfig field names as keywords; any other name is
        refused. A `precision` already decided for the device (a Precision, as run_all passes) is used as is.
    on_eval(step, metrics): called on rank 0 after every evaluation with `val_loss`, `perplexity`,
        `accuracy`, `targets` (how many were scored) and `epoch`; an exception it raises stops
        training and propagates (e.g. Optuna's TrialPruned), so it can prune a run.

    A NaN/inf loss or gradient norm that no GradScaler skipped raises `TrainingDiverged` (with
    `.step` and the partial `.result`), and so does an fp16 loss scale that falls below
    MIN_LOSS_SCALE = 1 (e.g. 17 overflowing steps in a row from the initial 65536): gradients
    that overflow even unscaled will not recover. The last checkpoint written is from before it.
    Ctrl-C returns the partial result with `.interrupted = True`. Under torchrun every rank calls
    train() and gets the same result; only rank 0 shows progress and writes checkpoints. A resume
    refuses a checkpoint written with other trajectory settings or other data.
    """
    cfg = merge(TrainConfig, config, overrides, "training")
    env = distributed.setup(cfg.device, cfg.strategy)  # fsdp without torchrun: refused before anything is written
    try:
        if cfg.checkpoint_dir is not None:
            writable_dir(cfg.checkpoint_dir, "checkpoint_dir")  # before the run, not after it
        if cfg.save_hf is not None:
            writable_dir(cfg.save_hf, "save_hf")
        device = env.device or resolve_device(cfg.device)
        # Rank 0 alone writes checkpoints, so it alone holds the folder: a second run on it is refused.
        locked = run_lock(cfg.checkpoint_dir, "checkpoint_dir") if cfg.checkpoint_dir is not None and env.is_main \
            else contextlib.nullcontext()
        with locked, _deterministic_algorithms(cfg.deterministic, device.type == "cuda"):
            return _Run(model, model_kwargs or {}, data, cfg, on_eval, env, device).run()
    finally:
        env.close()


class _Run(RunCheckpoints):
    """One call of train(): the state the loop, evaluation and checkpoints share, set up in the order below."""

    def __init__(self, model, model_kwargs: dict, data, cfg: TrainConfig, on_eval, env: distributed.DistEnv,
                 device: torch.device):
        self.cfg, self.on_eval, self.env, self.device = cfg, on_eval, env, device
        # Resolved here, once: a Precision already decided for this device comes back as is, reason included.
        self.precision: Precision = resolve_precision(cfg.precision, device)
        self.precision.check_runnable()  # e.g. bf16-true where bf16 is only emulated: one line, before any work
        allocator = sharding.host_allocator(env) if env.sharded else None  # before the model is built
        self.adapter = self._build(model, model_kwargs)
        self.model_name = self.adapter.name  # the model's own class: fully_shard subclasses it as FSDP<name>
        # FSDP shards the weights in place before the optimizer is built on them.
        self.sharding = sharding.shard(self.adapter.model, env, self.precision, cfg.reshard_after_forward,
                                       allocator) if env.sharded else None
        splits = self._datasets(data)
        self._loaders(splits)
        self._optimization()
        self.step, self.last_saved, self.resumed_from, self._resume_gen = 0, None, None, None
        self.val_targets = None  # how many targets the last evaluation scored: the n behind val loss/accuracy
        self.selection = Selection(cfg.early_stop_patience, cfg.early_stop_min_delta)
        self.weights = self.saved_hf = self.consolidated = None  # the model's weights, what save_hf wrote (at the end)
        self.step_fn = self._step()
        self._resume()  # it restores the RNG states: only the compile below (which puts them back) follows
        self.compile_info = self._compile(splits) if cfg.compile else None
        self.log = open_train_run(self.cfg, env.is_main, self.resumed_from is not None, {
            "model": self.model_name, "precision": self.precision.name, "precision_reason": self.precision.reason,
            "weights": self.precision.describe_weights(self.adapter.stored_dtype),
            **run_metadata(self.device, self.precision.dtype)})

    def _build(self, model, model_kwargs: dict) -> ModelAdapter:
        """The model on the device in train mode, in the precision's weight dtype (fp32 master weights for the
        mixed modes, whatever dtype the checkpoint was stored in), checked: trainable, and its forward runs."""
        seed_everything(self.cfg.seed)  # before building from a spec, so initial weights follow the seed
        adapter = resolve_model(model, **model_kwargs)
        cfg = self.cfg
        # Decided once, here: LoRA's base dtype (and fp16's range check on these weights), the optimizer built.
        self.memory = resolve_memory(cfg.memory, self.precision, device_facts(self.device), adapter.stored_dtype,
                                     adapter.model)
        if cfg.memory.checkpointing:
            require_blocks(adapter.model)  # before LoRA changes a caller's module
        if cfg.memory.lora is not None:
            adapter = replace(adapter, model=apply_memory(adapter.model, self.memory, self.precision.compute_dtype))
        check_save_hf(adapter.model, cfg.save_hf, cfg.merge)  # no save_pretrained form: refused before any step
        convert_for(self.precision, adapter.model.to(self.device), self.memory).train()
        # The planner's checkpointing (engine/memory.py), so what `fit` predicted with it is what runs.
        self.checkpointing = enable_checkpointing(adapter.model) if cfg.memory.checkpointing else None
        adapter.require_trainable()
        adapter.check_forward()
        return adapter

    def _datasets(self, data) -> DataSplits:
        """The splits at the run's length, this rank's sampler over them, and the run's length in steps."""
        cfg = self.cfg
        if cfg.seq_len > self.adapter.max_len:  # capped with a warning; the result's config says what ran
            self.cfg = cfg = replace(cfg, seq_len=self.adapter.fit_length(cfg.seq_len))
        splits = self.adapter.datasets(data, cfg.seq_len, cfg.seed)
        self.data = splits.describe()
        self.sampler = distributed.ShardedSampler(splits.train, self.env.world_size, self.env.rank, cfg.seed)
        self.steps_per_epoch = len(self.sampler) // cfg.batch_size // cfg.grad_accum_steps
        if self.steps_per_epoch < 1:
            need = cfg.batch_size * cfg.grad_accum_steps * self.env.world_size
            raise DataError(f"the training set has {len(splits.train)} examples, fewer than one step's global batch "
                            f"of {need}; lower batch_size or grad_accum_steps, or give more data")
        self.total_steps = cfg.max_steps or cfg.epochs * self.steps_per_epoch
        log_every = cfg.log_every or (1 if self.total_steps <= FINE_LOG_STEPS else 10)
        self.stride = max(log_every, math.ceil(self.total_steps / MAX_STEP_ROWS))
        names = (CHECKPOINT_NAME, BEST_NAME) if not self.env.sharded else ("last", "best")  # FSDP: DCP folders
        self.ckpt_path = Path(cfg.checkpoint_dir) / names[0] if cfg.checkpoint_dir is not None else None
        self.best_path = self.ckpt_path.with_name(names[1]) if self.ckpt_path is not None else None
        self.data_info = data_fingerprint(splits) if self.ckpt_path is not None else None
        return splits

    def _loaders(self, splits: DataSplits) -> None:
        cfg = self.cfg
        self.loader = make_loader(splits.train, cfg.batch_size, device=self.device, num_workers=cfg.num_workers,
                                  seed=cfg.seed, drop_last=True, sampler=self.sampler)
        self.val_loader = make_loader(distributed.eval_shard(splits.val, self.env), cfg.batch_size, shuffle=False,
                                      device=self.device, num_workers=cfg.num_workers, seed=cfg.seed)
        # FSDP: every rank runs the same number of evaluation forwards (each gathers weights with the others).
        self.eval_forwards = self.env.all_max(min(len(self.val_loader), cfg.eval_batches or len(self.val_loader))) \
            if self.env.sharded else None

    def _optimization(self) -> None:
        """AdamW, the LR schedule over the run's steps, and the history that records them."""
        cfg = self.cfg
        self.optimizer = make_optimizer(self.adapter.model, cfg.lr, cfg.weight_decay, self.precision.adamw_eps,
                                        self.memory.optimizer)
        self.scheduler = make_scheduler(self.optimizer, cfg.warmup_steps, self.total_steps)
        self.hist = History(self.device, self.env.all_mean if self.env.active else None)

    def _step(self) -> TrainStep:
        """The optimizer step, on the DDP wrapper under torchrun (which skips the all-reduce on accumulation), or
        on the FSDP-sharded model."""
        if self.sharding is not None:
            return sharding.train_step(self.adapter, self.precision, self.optimizer, self.scheduler, self.cfg.grad_clip)
        ddp = distributed.wrap(self.adapter.model, self.env)
        return TrainStep(replace(self.adapter, model=ddp) if ddp else self.adapter, self.precision, self.optimizer,
                         self.scheduler, self.cfg.grad_clip, no_sync=distributed.no_sync_for(ddp))

    def _compile(self, splits: DataSplits):
        """The step calls the compiled model; evaluation and checkpoints use the eager one."""
        shaped = next(iter(make_loader(splits.train, self.cfg.batch_size, shuffle=False, device=self.device)))
        self.step_fn.adapter, info = compile_for_training(self.step_fn.adapter, self.precision,
                                                          to_device(shaped, self.device), self.cfg.compile_mode,
                                                          self.cfg.progress and self.env.is_main)
        return info

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        self.bar = progress_bar(total=self.total_steps, initial=self.step, desc="train", unit="step",
                                enabled=self.cfg.progress and self.env.is_main)
        interrupted = False
        try:
            self._loop()
            self._finish()
        except KeyboardInterrupt:
            interrupted = True
            # Keep the finished steps (a half-done one is lost). Under torchrun the other ranks may
            # never reach another collective, so only what is already on the host is kept there.
            if self.env.active or self.hist.sync() is None:
                self.hist.emit(self.step, self.step / self.steps_per_epoch)
        except TrainingDiverged as exc:
            exc.result = self._logged(self.result(diverged_at=exc.step), "FAILED")
            raise
        except BaseException:  # e.g. on_eval's TrialPruned: the logged run ends too
            self.log.close("KILLED")
            raise
        finally:
            self.bar.close()
            self.adapter.model.train()
            if self.checkpointing:
                disable_checkpointing(self.adapter.model)  # the returned model runs as it came
        return self._logged(self.result(interrupted=interrupted), "KILLED" if interrupted else "FINISHED")

    def _logged(self, result: TrainResult, status: str) -> TrainResult:
        self.log.rows(self.hist.rows)  # the rows emitted on the way out (interrupt, divergence)
        self.log.finish(result.summary.to_dict(), self.step, status)
        return result

    def _loop(self) -> None:
        cfg, spe, accum = self.cfg, self.steps_per_epoch, self.cfg.grad_accum_steps
        while self.step < self.total_steps and not self.selection.stop:  # a resumed early stop stays stopped
            epoch, pos = divmod(self.step, spe)
            self.sampler.set_epoch(epoch)  # the order is a function of (seed, epoch) alone
            self.sampler.start = pos * accum * cfg.batch_size
            if self._resume_gen is not None:
                self.loader.generator.set_state(self._resume_gen)
                self._resume_gen = None
            self.epoch_gen = self.loader.generator.get_state()  # seeds this epoch's workers
            batches = iter(self.loader)
            for _ in range(pos, spe):
                with self.hist.timer.region():
                    micro = [to_device(next(batches), self.device) for _ in range(accum)]
                    lr = self.optimizer.param_groups[0]["lr"]
                    out = self.step_fn(micro)
                    self.step += 1
                    tokens = sum(b["input_ids"].numel() for b in micro) * self.env.world_size
                    self.hist.record(self.step, out, lr, tokens)
                    self.bar.update()
                self._after_step()
                self.log.rows(self.hist.rows)  # new rows exist only at log points: no sync of its own
                if self.step >= self.total_steps or self.selection.stop:
                    break

    def _after_step(self) -> None:
        cfg, s = self.cfg, self.step
        epoch_end = s % self.steps_per_epoch == 0 or s == self.total_steps
        if s % self.stride == 0 or epoch_end:
            self._check(self.hist.sync())
            row = self.hist.emit(s, s / self.steps_per_epoch)
            if row is not None:
                self.bar.set_postfix(loss=f"{row['train_loss']:.4f}", refresh=False)
        if cfg.eval_every and s % cfg.eval_every == 0 and not epoch_end:
            metrics = self._evaluate()
            self.hist.eval_row(s, s / self.steps_per_epoch, metrics, self.optimizer.param_groups[0]["lr"])
            self._report(metrics)
        if epoch_end:
            metrics = self._evaluate()
            self.hist.epoch_row(s, s / self.steps_per_epoch, metrics)
            self._report(metrics)
        stopping = self.selection.stop
        if stopping:  # the steps since the last row become one, as on Ctrl-C
            self.hist.emit(s, s / self.steps_per_epoch)
        if self.ckpt_path is not None:
            last = (cfg.checkpoint_every and s % cfg.checkpoint_every == 0) or s == self.total_steps or stopping
            self._save(last=bool(last), best=self.selection.best_step == s)

    def _check(self, bad) -> None:
        """Stop at the first diverged step, keeping the good steps before it as a row."""
        if bad is None:
            return
        step, value, quantity = bad
        self.hist.emit(step - 1, (step - 1) / self.steps_per_epoch)
        raise TrainingDiverged(step, self.precision.name, value, quantity=quantity)

    def _report(self, metrics: dict) -> None:
        if self.on_eval is not None and self.env.is_main:
            self.on_eval(self.step, dict(metrics))

    def _evaluate(self) -> dict:
        self._check(self.hist.sync())  # a diverged model is neither evaluated nor checkpointed
        self.hist.close_training_peak()
        metrics = evaluate(self.adapter, self.val_loader, self.precision, self.cfg.eval_batches, self.env.all_sum,
                           self.eval_forwards)
        self.val_targets = metrics["targets"]
        self.selection.update(self.step, metrics["val_loss"])  # every rank sees the same all-reduced loss
        return {**metrics, "epoch": self.step / self.steps_per_epoch}

    def _finish(self) -> None:
        """At a run's end (finished or stopped early): the best weights back if restore_best, then save_hf."""
        weights = f"final weights (step {self.step})"
        if self.cfg.restore_best:
            self.env.gather(None)  # rank 0 wrote best.pt: every rank waits for it before reading it
            self.weights = weights = restore_best(self.adapter.model, self.selection, self.step, self.best_path,
                                                  self.env.sharded)
        full = full_model_state(self.adapter.model) if self.env.sharded and (
            self.cfg.save_hf or self.cfg.consolidate) else None  # gathered by every rank, onto rank 0
        if self.cfg.consolidate:
            self._consolidate(full, weights)
        if self.cfg.save_hf is not None and self.env.is_main:
            self.saved_hf = save_hf(self.adapter.model, self.adapter.tokenizer, self.cfg.save_hf, weights,
                                    self.cfg.merge, full)

    # -- the result -----------------------------------------------------------------------------------
    def result(self, interrupted: bool = False, diverged_at: int | None = None) -> TrainResult:
        history = self.hist.frame()
        last_step = self.hist.last("step") or {}
        last_eval = next((r for r in reversed(self.hist.rows) if r["kind"] in ("eval", "epoch")), {})
        cfg, env, info = self.cfg, self.env, self.compile_info
        unsaved = "the run was interrupted" if interrupted else "the run diverged" if diverged_at else None
        summary = TrainSummary(
            model=self.model_name, task=self.adapter.task,
            parameters=sum(p.numel() for p in self.adapter.model.parameters()), data=self.data.data,
            tokenizer=self.data.tokenizer, validation=self.data.validation,
            steps=self.step, total_steps=self.total_steps, epochs=round(self.step / self.steps_per_epoch, 3),
            train_loss=last_step.get("train_loss"), val_loss=last_eval.get("val_loss"),
            perplexity=last_eval.get("perplexity"), accuracy=last_eval.get("accuracy"), val_targets=self.val_targets,
            skipped_steps=self.hist.skipped_total if self.precision.needs_scaler else None,
            precision=self.precision.name,
            precision_reason=self.precision.reason, device=str(self.device), device_name=device_name(self.device),
            tokens_per_s=step_stats(history, "tokens_per_s"), step_time_ms=step_stats(history, "step_time_ms"),
            optimizer=f"{self.memory.settings.optimizer_name()} ({optimizer_impl(self.optimizer)})",
            memory=self.memory.to_dict(),
            compiled=bool(info and info.compiled), compile_s=info.compile_s if info else None,
            compile_reason=info.reason if info else "off (compile=False)",
            global_batch=self.global_batch, world_size=env.world_size, strategy=env.strategy,
            sharding=self.sharding and self.sharding.describe(), param_bytes_per_rank=sharding.param_bytes(
                self.adapter.model), consolidated=self.consolidated and str(self.consolidated),
            rank=env.rank, resumed_from_step=self.resumed_from,
            checkpoint=str(self.ckpt_path) if self.last_saved is not None else None,
            interrupted=interrupted, diverged_at_step=diverged_at,
            run_metadata=run_metadata(self.device, self.precision.dtype),
            **self.selection.summary(self.step, self.total_steps, self.best_path), weights=self.weights,
            hf_folder=cfg.save_hf if self.saved_hf else None,
            hf_detail=self.saved_hf or (f"not written: {unsaved}" if cfg.save_hf and unsaved else None),
            stored_dtype=dtype_name(self.adapter.stored_dtype), master_dtype=dtype_name(self.adapter.weights_dtype),
            weights_detail=self.precision.describe_weights(self.adapter.stored_dtype),
            activation_checkpointing=self.checkpointing, lora=describe_lora(self.adapter.model),
        )
        return TrainResult(history, summary, self.adapter.model, self.hist.skipped_total,
                           list(self.hist.loss_scale_trace), interrupted, cfg)
