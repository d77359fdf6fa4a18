"""`TrainConfig`: every training setting, declared once (train, search trials, the main job, the notebooks)."""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..core.loggers import logger_names
from ..core.memory_settings import MemorySettings, memory_setting
from ..core.precision import Precision, canonical_precision, precision_setting
from ..core.settings import check_fields, check_switch, device_field, precision_field, progress_field, setting
from ..engine.compiling import compile_mode_setting
from ..engine.strategies import DDP, canonical_strategy, sharded_strategies, strategy_class

TRAJECTORY_FIELDS = ("batch_size", "seq_len", "epochs", "max_steps", "lr", "weight_decay", "warmup_steps", "grad_clip",
                     "grad_accum_steps", "seed", "memory", "augment")
FINE_LOG_STEPS = 100  # log_every=None: runs this short get a history row per step (their warm-up shows)


@dataclass
class TrainConfig:
    """Every training setting. `max_steps`, when set, wins over `epochs`; counts are optimizer steps.

    A history row aggregates `log_every` steps (more on very long runs, to keep about 2000 rows).
    Checkpoints go to checkpoint_dir/last.pt every `checkpoint_every` steps and at the end of the run (an early
    stop included), and to checkpoint_dir/best.pt after each evaluation with the lowest val loss so far.
    """

    # A name, resolved for the device when the run starts, or a Precision a caller already decided (kept whole).
    precision: str | Precision = precision_field()
    batch_size: int = setting(16, "sequences per step per rank; global batch = batch size x ranks x grad accum",
                              low=1)
    seq_len: int = setting(64, "tokens per sequence (capped at the model's max length)", low=1)
    epochs: int = setting(1, "passes over the training set", low=1)
    max_steps: int | None = setting(None, "optimizer steps (wins over epochs)", low=1)
    lr: float = setting(3e-4, "peak learning rate", above=0)
    weight_decay: float = setting(0.1, "AdamW weight decay", low=0)
    warmup_steps: int = setting(10, "linear LR warm-up steps, then cosine decay to a tenth of lr", low=0)
    grad_clip: float | None = setting(1.0, "max total grad norm (none or 0: off)", low=0)
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", flag="grad-accum", low=1)
    seed: int = setting(0, "initial weights (models built from a spec), data order and dropout", low=0)
    deterministic: bool = setting(False, "bitwise-equal reruns on the same machine, torch build and thread count")
    num_workers: int = setting(0, "DataLoader worker processes", low=0)
    augment: bool = setting(False, "an image model's training images randomly cropped (a quarter to all of the "
                                   "image, resized back) and flipped left-right, drawn anew each time one is read "
                                   "(validation images stay as they are)")
    eval_every: int | None = setting(50, "steps between evaluations (none or 0: epoch ends and the run's end)",
                                     low=0)
    eval_batches: int | None = setting(20, "validation batches per evaluation (none: all)", low=1)
    log_every: int | None = setting(None, "steps per history row (none: every step on short runs, else 10)", low=1)
    checkpoint_dir: str | None = setting(None, "folder for last.pt, and best.pt (the lowest val loss so far)")
    checkpoint_every: int | None = setting(None, "steps between checkpoints (none: only at the end)", low=1)
    resume: bool = setting(False, "continue from the checkpoint folder's last.pt when it exists")
    early_stop_patience: int | None = setting(None, "stop after this many evaluations in a row without val loss "
                                                    "improving (none: off)", low=1)
    early_stop_min_delta: float = setting(0.0, "the least fall in val loss that counts as an improvement for "
                                               "early stopping", low=0)
    restore_best: bool = setting(False, "end with the weights of the lowest val loss (best.pt), not the last "
                                        "step's")
    save_hf: str | None = setting(None, "after training, write a transformers model and its tokenizer to this "
                                        "folder with save_pretrained")
    progress: bool = progress_field()
    device: str | torch.device | None = device_field()
    loggers: tuple = setting((), "experiment loggers, rank 0 only: tensorboard, wandb, mlflow", flag="log")
    log_dir: str | None = setting(None, "logger output (none: logs beside the checkpoint folder, else runs/logs)")
    log_project: str = setting("tier_utils", "W&B project / MLflow experiment")
    log_run_name: str | None = setting(None, "the logged run's name (none: model-precision-UTC time)")
    mlflow_uri: str | None = setting(None, "MLflow folder or tracking URI (none: the log folder's mlflow/)")
    # Evaluation stays eager; a model that can't be compiled runs eager with a warning. Not a trajectory
    # setting: checkpoints resume either way.
    compile: bool = setting(False, "torch.compile the training step (compile time reported apart)")
    compile_mode: str = compile_mode_setting()
    # Memory modes (docs/precision.md): LoRA and its base, QLoRA, the optimizer's state, checkpointing. A resume
    # checks them, but checkpointing (the recompute gives the same values; to_dict records it apart).
    memory: MemorySettings = setting(factory=MemorySettings)
    merge: bool = setting(False, "with LoRA and a transformers folder to save: write the merged model (adapters "
                                 "folded in, plain transformers loads it), not peft's adapter folder")
    # Under torchrun. Not trajectory settings: ddp and fsdp take the same steps (to float rounding); a resume
    # keeps the checkpoint's form (last.pt or the sharded last/) all the same.
    strategy: str = setting(DDP.name, "under torchrun: ddp (each rank holds the whole model) or fsdp (FSDP2: "
                                      "weights, gradients and AdamW state sharded over the ranks; needs torchrun); "
                                      "ddp on one process is a single-process run")
    reshard_after_forward: bool = setting(True, "fsdp: free each block's gathered weights after its forward (less "
                                                "memory; backward gathers them again)")
    consolidate: bool = setting(False, "fsdp: at the end, also write one unsharded last.pt (rank 0) that --model "
                                       "and every tier read")

    def __post_init__(self):
        self.precision = precision_setting(self.precision)
        self.memory = memory_setting(self.memory)
        self.memory.optimizer_class.require()  # a missing package: one line naming it, before any work
        check_switch(self, "merge")
        if self.merge and (self.memory.lora is None or self.save_hf is None):
            raise ValueError("merge writes a LoRA run's merged model to save_hf; give lora and save_hf too, or "
                             "drop merge")
        self.loggers = logger_names(self.loggers)  # "a,b" or a list -> a checked tuple, before anything runs
        check_switch(self, "compile")
        check_switch(self, "restore_best")
        check_switch(self, "augment")
        check_switch(self, "reshard_after_forward")
        check_switch(self, "consolidate")
        check_fields(self)
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir=DIR, the folder holding the run's checkpoint")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir=DIR to write checkpoints into")
        self.strategy = canonical_strategy(self.strategy)
        sharded = strategy_class(self.strategy).sharded
        if sharded and self.memory.quantized:
            raise ValueError(f"a 4-bit base (QLoRA) cannot be sharded by {self.strategy}: use strategy='{DDP.name}' "
                             "or one process, or drop bits=4")
        if sharded and self.memory.lora is not None and self.save_hf is not None:
            raise ValueError(f"save_hf of a LoRA run under {self.strategy} is not supported (its adapters are "
                             "sharded); drop save_hf and keep consolidate: load_model('<checkpoint_dir>/last.pt') "
                             "gives the model with its adapters")
        if self.consolidate and (not sharded or self.checkpoint_dir is None):
            raise ValueError("consolidate turns a sharded run's checkpoint into one last.pt: it needs a sharded "
                             f"strategy ({', '.join(sharded_strategies())}) and checkpoint_dir=DIR")
        if self.restore_best and self.checkpoint_dir is None:
            raise ValueError("restore_best needs checkpoint_dir=DIR, where best.pt is kept")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # asdict would unfold a decided Precision
        d["precision"] = canonical_precision(self.precision)  # what ran, where it was decided before the run
        d["memory"] = {k: v for k, v in self.memory.to_dict().items() if k != "checkpointing"}
        d["activation_checkpointing"] = self.memory.checkpointing
        for name in ("device", "checkpoint_dir", "log_dir", "save_hf"):
            d[name] = None if d[name] is None else str(d[name])
        return d
