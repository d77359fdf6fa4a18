"""Tier 3 training engine: `train()` around the shared precision-correct optimizer step (`TrainStep`, engine/step.py).

`train()` adds the loop around that step: data order from (seed, epoch), metrics
kept on the device between log points, evaluation, checkpoints with exact resume, torchrun (DDP or FSDP2).
The run's parts are made in parts.py (each a function returning a frozen record) and the run object is built
complete from them; its checkpoints are checkpointing.py's RunCheckpoints. History rows and `TrainResult` live in
history.py, the distributed strategy in engine/strategies.py (which writes and reads the checkpoints).
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..core.device import device_name
from ..core.errors import TrainingDiverged, one_line
from ..core.files import run_lock
from ..core.inputs import writable_dir
from ..core.precision import Precision, dtype_name, resolve_device, resolve_precision
from ..core.progress import progress_bar
from ..core.results import run_metadata
from ..core.settings import merge
from ..core.threads import chooses_threads
from ..data.datasets import to_device
from ..data.packing import PackedRows
from ..engine import sharding
from ..engine.distributed import answering_for_ranks
from ..engine.evaluation import evaluate
from ..engine.generation import Generated, generate_and_score
from ..engine.lora import describe_lora
from ..engine.quantization import describe_quantized
from ..engine.strategies import Strategy, resolve_strategy
from ..models.heads import sized_to_data
from .chat_run import base_answers, chat_generation, start_chat
from .checkpointing import RunCheckpoints
from .config import TrainConfig
from .divergence import divergence_error, ended_nonfinite
from .finetune import Selection, describe_new_head, name_classes, restore_best, save_hf
from .history import History, TrainResult, TrainSummary, step_stats
from .host_memory import refuse_past_host_memory
from .out_of_memory import answered
from .parts import (
    BuiltModel,
    Optimization,
    Progress,
    RunData,
    build_model,
    fitted_config,
    make_optimization,
    prepare_data,
)
from .stopping import StopSignal, Terminated, interrupts_deferred
from .tracking import open_train_run
from .versus_base import VersusBase


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
    Ctrl-C returns the partial result with `.interrupted = True`; so does SIGTERM (stopping.py), after it finishes
    the step it is in and saves it to checkpoint_dir (a second SIGTERM stops at once). Under torchrun every rank calls
    train() and gets the same result; only rank 0 shows progress and writes checkpoints. A resume
    refuses a checkpoint written with other trajectory settings or other data.
    """
    cfg = merge(TrainConfig, config, overrides, "training")
    # Decided once, here: a strategy that needs torchrun is refused without it before anything is written.
    strategy = resolve_strategy(cfg.strategy, cfg.device, "train", reshard_after_forward=cfg.reshard_after_forward)
    env = strategy.env
    try:
        device = env.device or resolve_device(cfg.device)
        model_kwargs = sized_to_data(model, model_kwargs or {}, data)  # a pretrained classifier's head: the data's
        refuse_past_host_memory(model, model_kwargs, cfg, device)  # one line, before anything loads or is written
        if cfg.checkpoint_dir is not None:
            writable_dir(cfg.checkpoint_dir, "checkpoint_dir")  # before the run, not after it
        if cfg.save_hf is not None:
            writable_dir(cfg.save_hf, "save_hf")
        # Rank 0 alone writes checkpoints, so it alone holds the folder: a second run on it is refused.
        locked = run_lock(cfg.checkpoint_dir, "checkpoint_dir") if cfg.checkpoint_dir is not None and env.is_main \
            else contextlib.nullcontext()
        # Under torchrun a rank's one-line error reaches the others as one line naming it (engine/distributed.py).
        with locked, answering_for_ranks(env), _deterministic_algorithms(cfg.deterministic, device.type == "cuda"):
            # Out of memory: one line with what fits, the memory given back (out_of_memory.py).
            return answered(lambda: _start(model, model_kwargs, data, cfg, on_eval, strategy, device), cfg,
                            device)
    finally:
        strategy.close()


def _start(model, model_kwargs: dict, data, cfg: TrainConfig, on_eval, strategy: Strategy,
           device: torch.device) -> _Run:
    """The run built complete from its parts, each made in the order it needs (training/parts.py)."""
    # Resolved here, once: a Precision already decided for this device comes back as is, reason included.
    precision = resolve_precision(cfg.precision, device)
    precision.check_runnable()  # e.g. bf16-true where bf16 is only emulated: one line, before any work
    built = build_model(model, model_kwargs, cfg, precision, strategy, device)
    cfg = fitted_config(cfg, built.adapter)
    run_data = prepare_data(built.adapter, data, cfg, strategy, device)
    if run_data.splits.chat is not None:  # checked and shown before anything is written
        start_chat(built.adapter, run_data.splits, cfg.progress and strategy.env.is_main)
    return _Run(cfg, precision, strategy, built, run_data, make_optimization(built, run_data, cfg, precision, strategy),
                on_eval)


class _Run:
    """One call of train(): the parts the loop, evaluation and checkpoints share, all given to it; `progress` is
    the one record that moves."""

    def __init__(self, cfg: TrainConfig, precision: Precision, strategy: Strategy, built: BuiltModel, data: RunData,
                 optimization: Optimization, on_eval):
        self.cfg, self.precision, self.strategy, self.env = cfg, precision, strategy, strategy.env
        self.built, self.adapter, self.device = built, built.adapter, built.adapter.device
        self.data, self.optimization, self.on_eval = data, optimization, on_eval
        self.hist = History(self.device, self.env.all_mean if self.env.active else None)
        self.selection = Selection(cfg.early_stop_patience, cfg.early_stop_min_delta)
        self.progress = Progress()
        # This call's batches: the share of their positions that was padding (the batching helper's real-token
        # throughput, Task.units, may count from the same masks once it lands)
        self.padding = self.adapter.task.padding_tally(cfg.seq_len, cfg.target_len)
        self.stop = StopSignal(self.env)
        self.checkpoints = RunCheckpoints(cfg, strategy, precision.name, self.adapter, data, optimization, self.hist,
                                          self.selection, self.progress)
        self.checkpoints.resume()  # it restores the RNG states: nothing after it draws from them
        self.versus = VersusBase.decide(self, describe_new_head(self.adapter.model, data.splits.classes))
        if data.splits.chat is not None and cfg.evaluates and self.progress.base_answers is None:
            # the base's answers, once: a resume keeps the checkpoint's
            self.progress.base_answers = base_answers(self.adapter, data.splits, precision, strategy.sharded)
        self.log = open_train_run(cfg, self.env.is_main, self.progress.resumed_from is not None, {
            "model": built.name, "precision": precision.name, "precision_reason": precision.reason,
            "weights": precision.describe_weights(self.adapter.stored_dtype),
            **run_metadata(self.device, precision.dtype)})

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> TrainResult:
        bar = progress_bar(total=self.data.total_steps, initial=self.progress.step, desc="train", unit="step",
                           enabled=self.cfg.progress and self.env.is_main)
        interrupted, finished = False, None
        held = contextlib.ExitStack()  # from a Ctrl-C on: a second one waits until the partial result is made
        try:
            with self.stop.listening(), self.optimization.watch or contextlib.nullcontext():
                self.versus.at_start()  # a full fine-tune's base: its initial weights, before the first step
                self._loop(bar)
            self._check_ended()
            finished = self._finish()
        except Terminated:
            interrupted = True
            self._save_stopped()
        except KeyboardInterrupt:
            interrupted = True
            # Keep the finished steps (a half-done one is lost). Under torchrun the other ranks may
            # never reach another collective, so only what is already on the host is kept there.
            held.enter_context(interrupts_deferred())
            if self.env.active or self.hist.sync() is None:
                self._emit(self.progress.step)
        except TrainingDiverged as exc:
            exc.result = self._logged(self.result(diverged=exc), "FAILED")
            raise
        except BaseException:  # e.g. on_eval's TrialPruned: the logged run ends too
            self.log.close("KILLED")
            raise
        finally:
            bar.close()
            self.adapter.model.train()
            if self.built.checkpointing:
                self.built.checkpointing.undo()  # the returned model runs as it came
        with held:
            return self._logged(self.result(finished, interrupted=interrupted),
                                "KILLED" if interrupted else "FINISHED")

    def _logged(self, result: TrainResult, status: str) -> TrainResult:
        self.log.rows(self.hist.rows)  # the rows emitted on the way out (interrupt, divergence)
        self.log.finish(result.summary.to_dict(), self.progress.step, status)
        return result

    def _emit(self, step: int) -> dict | None:
        return self.hist.emit(step, step / self.data.steps_per_epoch)

    def _loop(self, bar) -> None:
        cfg, data, p, accum = self.cfg, self.data, self.progress, self.cfg.grad_accum_steps
        loader, step_fn = data.loader, self.optimization.step
        while p.step < data.total_steps and not self.selection.stop:  # a resumed early stop stays stopped
            epoch, pos = divmod(p.step, data.steps_per_epoch)
            data.sampler.set_epoch(epoch)  # the order is a function of (seed, epoch) alone
            data.sampler.start = pos * accum * cfg.batch_size
            if p.resume_generator is not None:
                loader.generator.set_state(p.resume_generator)
                p.resume_generator = None
            p.epoch_generator = loader.generator.get_state()  # seeds this epoch's workers
            batches = iter(loader)
            for _ in range(pos, data.steps_per_epoch):
                with self.hist.timer.region():
                    micro = [self._counted(next(batches)) for _ in range(accum)]
                    lr = self.optimization.optimizer.param_groups[0]["lr"]
                    out = step_fn(micro)
                    p.step += 1
                    tokens = sum(self.adapter.task.units(b) for b in micro) * self.env.world_size
                    self.hist.record(p.step, out, lr, tokens)
                    bar.update()
                self._after_step(bar)
                self.log.rows(self.hist.rows)  # new rows exist only at log points: no sync of its own
                if p.step >= data.total_steps or self.selection.stop:
                    break
                # SIGTERM during this step (on any rank): save and stop after it, or under torchrun after the next
                # step where _after_step synced the history
                self.stop.check(p.step % data.stride == 0 or p.step % data.steps_per_epoch == 0)

    def _counted(self, batch: dict) -> dict:
        """The batch on the device, its padding counted first on the host (no device sync)."""
        self.padding.add(self.adapter.task.positions(batch))
        return to_device(batch, self.device)

    def _after_step(self, bar) -> None:
        cfg, s, spe = self.cfg, self.progress.step, self.data.steps_per_epoch
        epoch_end = s % spe == 0 or s == self.data.total_steps
        if s % self.data.stride == 0 or epoch_end:
            self._check(self.hist.sync())
            row = self._emit(s)
            if row is not None:
                bar.set_postfix(loss=f"{row['train_loss']:.4f}", refresh=False)
        if cfg.eval_interval and s % cfg.eval_interval == 0 and not epoch_end:
            metrics = self._evaluate()
            self.hist.eval_row(s, s / spe, metrics, self.optimization.optimizer.param_groups[0]["lr"])
            self._report(metrics)
        if epoch_end and cfg.evaluates:
            metrics = self._evaluate()
            self.hist.epoch_row(s, s / spe, metrics)
            self._report(metrics)
        stopping = self.selection.stop
        if stopping:  # the steps since the last row become one, as on Ctrl-C
            self._emit(s)
        if self.checkpoints.last_path is not None:
            last = (cfg.checkpoint_every and s % cfg.checkpoint_every == 0) or s == self.data.total_steps or stopping
            self._check(self.hist.sync())  # never write a diverged state
            self.checkpoints.save(last=bool(last), best=self.selection.best_step == s)

    def _save_stopped(self) -> None:
        """After SIGTERM: the finished steps as a row, this step's checkpoint (unless just written), and where it is."""
        step, path = self.progress.step, self.checkpoints.last_path
        self._check(self.hist.sync())  # never write a diverged state
        self._emit(step)
        if path is not None and self.progress.last_saved != step:
            self.checkpoints.save(last=True)
        saved = f"saved {path}; rerun with --resume (resume=True) to continue" if path is not None else \
            "nothing saved (no checkpoint_dir)"
        if self.env.is_main:
            print(f"SIGTERM: stopped after step {step}; {saved}", file=sys.stderr)

    def _check(self, bad) -> None:
        """Stop at the first diverged step, keeping the good steps before it as a row."""
        if bad is None:
            return
        step, value, quantity = bad
        self._emit(step - 1)
        raise divergence_error(step, value, quantity, self.precision, self.built.nonfinite_at_load,
                               self.hist.skipped_total)

    def _check_ended(self) -> None:
        """A run that ran its steps but ends with a non-finite train or validation loss fails as a diverged one
        would (its save_hf is not written)."""
        error = ended_nonfinite(self.hist, self.precision, self.built.nonfinite_at_load, self.progress.step)
        if error is not None:
            raise error

    def _report(self, metrics: dict) -> None:
        if self.on_eval is not None and self.env.is_main:
            self.on_eval(self.progress.step, dict(metrics))

    def _evaluate(self) -> dict:
        self._check(self.hist.sync())  # a diverged model is neither evaluated nor checkpointed
        self.hist.close_training_peak()
        metrics = evaluate(self.adapter, self.data.val_loader, self.precision, self.cfg.eval_batches,
                           self.env.all_sum, self.data.eval_forwards, self.versus.example_ids, self.env.gather)
        self.progress.val_targets = metrics["targets"]
        # Not history columns: the summary's, from the last evaluation.
        self.progress.top5_accuracy, self.progress.confusion = metrics.get("top5_accuracy"), metrics.get("confusion")
        if self.generates:
            self.progress.generated = self.generation()
        self.versus.evaluated(self.progress.step, metrics, self.progress.generated)
        metrics.pop("examples", None)  # kept there; on_eval and the history rows get the totals
        self.selection.update(self.progress.step, metrics["val_loss"])  # every rank sees the same all-reduced loss
        return {**metrics, "epoch": self.progress.step / self.data.steps_per_epoch}

    @property
    def generates(self) -> bool:
        """Whether each evaluation writes answers: a generating task's (seq2seq), or a causal LM's on chat data."""
        return self.adapter.task.generates or self.data.splits.chat is not None

    def generation(self) -> Generated | str:
        """What the model writes for a few validation sources, scored, on every rank alike: under DDP each rank
        writes the same answers from its own copy; a sharded model's (FSDP) ranks generate in step, since each
        forward needs them all."""
        synced = self.strategy.sharded
        if self.data.splits.chat is not None:
            return chat_generation(self.adapter, self.data.splits, self.precision, self.progress.base_answers, synced)
        return generate_and_score(self.adapter, self.data.splits, self.precision, synced=synced)

    def _finish(self) -> Finished:
        """At a run's end (finished or stopped early): the best weights back if restore_best, then save_hf."""
        cfg, step, model = self.cfg, self.progress.step, self.adapter.model
        weights, restored = f"final weights (step {step})", None
        if cfg.restore_best:
            self.env.gather(None)  # rank 0 wrote best: every rank waits for it before reading it
            weights = restored = restore_best(model, self.selection, step, self.checkpoints.best_path, self.strategy)
        self.versus.at_end(self.selection.best_step if restored else step)  # the weights returned, before a merge
        self.versus.save(cfg.checkpoint_dir, self.data.fingerprint)
        full = self.strategy.full_state(model) if (cfg.save_hf or cfg.consolidate) else None  # sharded: gathered
        consolidated = self.checkpoints.consolidate(full, weights) if cfg.consolidate else None
        name_classes(model, self.data.splits.classes)
        saved_hf = save_hf(model, self.adapter.tokenizer, cfg.save_hf, weights, cfg.merge, full,
                           self.adapter.stored_dtype, cfg.chat_template) \
            if cfg.save_hf is not None and self.env.is_main else None
        return Finished(restored, saved_hf, consolidated)

    # -- the result -----------------------------------------------------------------------------------
    def result(self, finished: Finished | None = None, interrupted: bool = False,
               diverged: TrainingDiverged | None = None) -> TrainResult:
        history, hist, prec, step = self.hist.frame(), self.hist, self.precision, self.progress.step
        last_step = hist.last("step") or {}
        last_eval = next((r for r in reversed(hist.rows) if r["kind"] in ("eval", "epoch")), {})
        cfg, env, info, adapter, data = self.cfg, self.env, self.optimization.compiled, self.adapter, self.data
        finished = finished or Finished()
        unsaved = "the run was interrupted" if interrupted else "the run diverged" if diverged else None
        best = self.checkpoints.best_path
        summary = TrainSummary(
            model=self.built.name, task=adapter.task.name,
            parameters=sum(p.numel() for p in adapter.model.parameters()),
            data=data.description.data, tokenizer=data.description.tokenizer,
            validation=data.description.validation, steps=step, total_steps=data.total_steps,
            epochs=round(step / data.steps_per_epoch, 3), train_loss=last_step.get("train_loss"),
            val_loss=last_eval.get("val_loss"), perplexity=last_eval.get("perplexity"),
            accuracy=last_eval.get("accuracy"), val_targets=self.progress.val_targets, unit=adapter.task.unit,
            top5_accuracy=self.progress.top5_accuracy, confusion=self.progress.confusion,
            classes=data.splits.classes,
            skipped_steps=hist.skipped_total if prec.needs_scaler else None, precision=prec.name,
            precision_reason=prec.reason, device=str(self.device), device_name=device_name(self.device),
            tokens_per_s=step_stats(history, "tokens_per_s"), step_time_ms=step_stats(history, "step_time_ms"),
            optimizer=self.built.memory.optimizer.describe(self.optimization.optimizer),
            memory=self.built.memory.to_dict(),
            compiled=bool(info and info.compiled), compile_s=info.compile_s if info else None,
            compile_reason=self.optimization.compile_reason(), padding=self.padding.to_dict(),
            recompiles=self.optimization.watch and self.optimization.watch.recompiles,
            global_batch=data.global_batch, world_size=env.world_size, strategy=self.strategy.name,
            sharding=self.built.placement, param_bytes_per_rank=sharding.param_bytes(adapter.model),
            consolidated=finished.consolidated and str(finished.consolidated), rank=env.rank,
            resumed_from_step=self.progress.resumed_from,
            checkpoint=str(self.checkpoints.last_path) if self.progress.last_saved is not None else None,
            interrupted=interrupted, diverged_at_step=diverged and diverged.step,
            diverged=diverged and one_line(diverged), run_metadata=run_metadata(self.device, prec.dtype),
            **self.selection.summary(step, data.total_steps, best), weights=finished.weights,
            hf_folder=cfg.save_hf if finished.saved_hf else None,
            hf_detail=finished.saved_hf or (f"not written: {unsaved}" if cfg.save_hf and unsaved else None),
            stored_dtype=dtype_name(adapter.stored_dtype), master_dtype=dtype_name(adapter.weights_dtype),
            weights_detail=prec.describe_weights(adapter.stored_dtype),
            activation_checkpointing=self.built.checkpointing and self.built.checkpointing.how,
            lora=describe_lora(adapter.model),
            quantized=describe_quantized(adapter.model),
            generation=_generation(self.progress.generated), chat=data.splits.chat and data.splits.chat.to_dict(),
            lr_schedule=cfg.lr_schedule.describe(),
            order=(f"shuffled each epoch from seed {cfg.seed}" if cfg.shuffle else "the data's own order, every epoch")
            + ("; batches grouped by length" if data.sampler.lengths is not None else "")
            + (f"; examples packed into {len(data.splits.train)} rows" if isinstance(data.splits.train, PackedRows)
               else ""),
            new_head=describe_new_head(adapter.model, data.splits.classes), versus_base=self.versus.summary(),
        )
        return TrainResult(history, summary, adapter.model, hist.skipped_total, list(hist.loss_scale_trace),
                           interrupted, cfg)


def _generation(generated) -> dict | None:
    """The summary's record of the last evaluation's generation (a reason where it was skipped)."""
    if generated is None:
        return None
    return {"skipped": generated} if isinstance(generated, str) else generated.to_dict()


@dataclass(frozen=True)
class Finished:
    """What a run's end did: the weights restore_best put back (None: the final ones), what save_hf wrote, the
    consolidated last.pt (None: not asked, or another rank)."""

    weights: str | None = None
    saved_hf: str | None = None
    consolidated: Path | None = None
