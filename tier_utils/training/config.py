"""`TrainConfig`: every training setting, declared once (train, search trials, the main job, the notebooks)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property

import torch

from ..core.loggers import logger_names
from ..core.memory_settings import MemorySettings, memory_setting
from ..core.precision import Precision, canonical_precision, precision_setting
from ..core.settings import check_fields, check_switch, device_field, precision_field, progress_field, setting
from ..data.chat_formats import DATA_FORMATS, LOSS_ON, ChatOptions
from ..data.datasets import DEFAULT_VAL_FRACTION
from ..engine.compiling import compile_mode_setting
from ..engine.schedules import DEFAULT_DECAY_FRACTION, DEFAULT_FINAL_FRACTION, SCHEDULES, Schedule
from ..engine.strategies import DDP, canonical_strategy, strategy_class

# A resume needs these the same; the batch per rank is the strategy's to compare (Strategy.resume_differences: a
# sharded checkpoint reshards onto another one with the same global batch).
TRAJECTORY_FIELDS = ("seq_len", "target_len", "epochs", "max_steps", "lr", "weight_decay", "warmup_steps", "grad_clip",
                     "grad_accum_steps", "seed", "memory", "schedule", "final_lr_fraction", "decay_fraction",
                     "shuffle", "val_fraction", "augment", "group_by_length", "packing",
                     "data_format", "loss_on", "chat_template")
NEVER = "never"  # eval_every's spelling for a run with no evaluation (0 and None keep their documented meaning)
FINE_LOG_STEPS = 100  # log_every=None: runs this short get a history row per step (their warm-up shows)


# What `train --out DIR` writes beside DIR/checkpoints/ (the CLI's files; `all` refuses a folder holding them).
METRICS_FILE, PLOT_FILE, CHECKPOINTS_FOLDER = "metrics.csv", "training.png", "checkpoints"


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
    target_len: int | None = setting(None, "an encoder-decoder's target tokens per pair, cut apart from its source's "
                                           "length (none: as many as the source)", low=1)
    epochs: int = setting(1, "passes over the training set", low=1)
    max_steps: int | None = setting(None, "optimizer steps (wins over epochs)", low=1)
    lr: float = setting(3e-4, "peak learning rate", above=0)
    weight_decay: float = setting(0.1, "AdamW weight decay", low=0)
    warmup_steps: int = setting(10, "linear LR warm-up steps, before the schedule", low=0)
    schedule: str = setting("cosine", "the LR after warm-up: constant, a linear or cosine decay to the final "
                                      "fraction, or wsd (stable, then a linear decay over the last steps)",
                            choices=SCHEDULES)
    final_lr_fraction: float | None = setting(
        None, f"the LR at the last step as a share of lr: linear, cosine, wsd (none: {DEFAULT_FINAL_FRACTION})",
        low=0, high=1)
    decay_fraction: float | None = setting(
        None, f"wsd: the share of the steps after warm-up that the decay takes (none: {DEFAULT_DECAY_FRACTION})",
        above=0, high=1)
    shuffle: bool = setting(True, "a new order of the training rows each epoch, drawn from the seed (off: the "
                                  "data's own order)")
    group_by_length: bool = setting(False, "each batch drawn from rows of similar length (megabatches of 50 "
                                           "batches sorted by length, in an order drawn from the seed): less "
                                           "padding; off: batches of any lengths")
    packing: bool = setting(False, "a causal LM's examples fitted best-fit-decreasing into rows of the sequence "
                                   "length, each example attending only to itself (a table's texts become one "
                                   "example per row); a model that can't take per-example positions runs padded, "
                                   "said in one line")
    grad_clip: float | None = setting(1.0, "max total grad norm (none or 0: off)", low=0)
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", flag="grad-accum", low=1)
    seed: int = setting(0, "initial weights (models built from a spec), data order and dropout", low=0)
    deterministic: bool = setting(False, "bitwise-equal reruns on the same machine, torch build and thread count")
    num_workers: int = setting(0, "DataLoader worker processes", low=0)
    augment: bool = setting(False, "an image model's training images randomly cropped (a quarter to all of the "
                                   "image, resized back) and flipped left-right, drawn anew each time one is read "
                                   "(validation images stay as they are)")
    data_format: str = setting("auto", "how table or dataset rows are read: auto (from the columns), messages, "
                                       "sharegpt, prompt-completion, alpaca, or text (running text)",
                               choices=DATA_FORMATS)
    loss_on: str = setting("answer", "chat and instruction data: the tokens the loss scores: answer (the assistant "
                                     "turns or the completion) or all", choices=LOSS_ON)
    chat_template: str | None = setting(None, "a Jinja chat template file for chat data (none: the tokenizer's "
                                              "own); the saved transformers folder keeps it")
    eval_every: int | str | None = setting(50, "steps between evaluations (none or 0: epoch ends and the run's "
                                               f"end; {NEVER}: no evaluation, and no validation split)", low=0,
                                           words=(NEVER,))
    val_fraction: float | None = setting(
        None, "the share of the data held out for validation where it has no split of its own (none: "
              f"{DEFAULT_VAL_FRACTION}); 0: no validation and no evaluation", low=0, below=1)
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
    compare_base: bool = setting(True, "score the model the run started from and the fine-tune on the same "
                                       "validation examples, each example apart, and judge the difference (a "
                                       "paired bootstrap); off saves its time (two more evaluations)")
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
        check_switch(self, "compare_base")
        check_switch(self, "augment")
        check_switch(self, "group_by_length")
        check_switch(self, "packing")
        check_switch(self, "reshard_after_forward")
        check_switch(self, "consolidate")
        check_fields(self)
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir=DIR, the folder holding the run's checkpoint")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir=DIR to write checkpoints into")
        self.strategy = canonical_strategy(self.strategy)
        strategy_class(self.strategy).refuse(self)  # what it cannot shard or write: its own one line
        if self.restore_best and self.checkpoint_dir is None:
            raise ValueError("restore_best needs checkpoint_dir=DIR, where best.pt is kept")
        self._check_validation()
        _ = self.chat  # ChatOptions checks the three (a file that is no template): one line, before anything is written
        _ = self.lr_schedule  # decided here, once: a setting its shape has no use for is refused before the run

    @property
    def evaluates(self) -> bool:
        """Whether the run holds out validation data and evaluates on it."""
        return self.eval_every != NEVER and self.val_fraction != 0

    @property
    def eval_interval(self) -> int | None:
        """Steps between the evaluations inside an epoch (None: only at epoch ends and the run's end, or never)."""
        return self.eval_every if self.evaluates and self.eval_every else None

    @property
    def held_out(self) -> float:
        """The share the data reader holds out for validation where the data has no split of its own."""
        return (DEFAULT_VAL_FRACTION if self.val_fraction is None else self.val_fraction) if self.evaluates else 0.0

    @property
    def chat(self) -> ChatOptions:
        """How chat and instruction rows are read."""
        return ChatOptions(self.data_format, self.loss_on, self.chat_template)

    @cached_property
    def lr_schedule(self) -> Schedule:
        return Schedule.decide(self.schedule, self.warmup_steps, self.final_lr_fraction, self.decay_fraction)

    def _check_validation(self) -> None:
        """What needs validation, refused in one line where the run has none."""
        if self.eval_every == NEVER and self.val_fraction:
            raise ValueError(f"eval_every={NEVER} never uses a validation split: drop val_fraction, or evaluate")
        if self.evaluates:
            return
        why = f"eval_every={NEVER}" if self.eval_every == NEVER else "val_fraction=0"
        needs = [name for name, given in (("early_stop_patience", self.early_stop_patience is not None),
                                          ("restore_best", self.restore_best)) if given]
        if needs:
            named = " and ".join(needs)
            raise ValueError(f"{named} {'need' if len(needs) > 1 else 'needs'} the validation loss, which a run with "
                             f"{why} never measures: drop {named}, or keep validation")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # asdict would unfold a decided Precision
        d["precision"] = canonical_precision(self.precision)  # what ran, where it was decided before the run
        d["memory"] = {k: v for k, v in self.memory.to_dict().items() if k != "checkpointing"}
        d["activation_checkpointing"] = self.memory.checkpointing
        for name in ("device", "checkpoint_dir", "log_dir", "save_hf"):
            d[name] = None if d[name] is None else str(d[name])
        return d
