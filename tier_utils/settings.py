"""The settings dataclasses: each setting declared once, with its default, help text and bounds.

`TrainConfig` (train, search trials), `BenchConfig` and `Thresholds` (amp_benchmark), `SearchConfig`
(search). The CLI verbs are generated from these fields, the widgets and the main job read the same
defaults, and every config checks its fields on construction with one-line messages. The other tiers'
configs (SmokeConfig, AnalysisConfig, ExportConfig, FitConfig, InfoConfig) live beside their tier, built alike.
"""
from __future__ import annotations

import math
import operator
from dataclasses import MISSING, asdict, dataclass, field, fields, replace

import torch

from .compiling import COMPILE_CHOICES, COMPILE_MODES
from .loggers import logger_names
from .precision import Precision, canonical_precision, precision_setting


def setting(default=MISSING, help: str = "", *, flag: str | None = None, choices=None, low=None, above=None,
            below=None, high=None, factory=None):
    """A dataclass field carrying what the CLI and validation need: its help text, an option name when
    it is not the field's (`flag`), `choices`, and bounds (`low`/`high` inclusive, `above`/`below` exclusive)."""
    meta = {"help": help, "flag": flag, "choices": choices, "low": low, "above": above, "below": below, "high": high}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def check_fields(config) -> None:
    """Each field against its choices (str fields) and bounds: whole numbers for int fields (True and numpy
    ints refused here, where the message is clear, not deep inside torch later), finite numbers for float ones."""
    for f in fields(config):
        m, value = f.metadata, getattr(config, f.name)
        if m.get("choices") and f.type == "str" and value not in m["choices"]:
            raise ValueError(f"{f.name} must be one of {', '.join(m['choices'])}, got {value!r}")
        if (m.get("low") is None and m.get("above") is None) or (value is None and "None" in str(f.type)):
            continue
        whole = str(f.type).startswith("int")
        ok = not isinstance(value, bool) and isinstance(value, int if whole else (int, float)) and math.isfinite(value)
        bounds = {">=": m["low"], ">": m["above"], "<": m["below"], "<=": m["high"]}
        bounds = {op: bound for op, bound in bounds.items() if bound is not None}
        if not (ok and all(_OPERATORS[op](value, bound) for op, bound in bounds.items())):
            said = " and ".join(f"{op} {bound}" for op, bound in bounds.items())
            raise ValueError(f"{f.name} must be a {'whole number' if whole else 'number'} {said}, got {value!r}")


_OPERATORS = {">=": operator.ge, ">": operator.gt, "<": operator.lt, "<=": operator.le}

# The help of the settings most tiers share, so every verb says them alike.
PRECISION_HELP = "auto, fp32, bf16 or fp16 (Lightning/torch spellings accepted)"
DEVICE_HELP = "cpu, cuda or cuda:N (none: cuda if available)"
PROGRESS_HELP = "progress bars"


def merge(cls, config, overrides: dict, what: str):
    """`config` (an instance of `cls`, a dict of its fields or None: the defaults) with `overrides` applied;
    an unknown name is a ValueError naming `what` settings they are and listing the valid ones."""
    if isinstance(config, dict):
        config, overrides = None, {**config, **overrides}
    if config is not None and not isinstance(config, cls):
        raise ValueError(f"config must be a {cls.__name__} or a dict, got {type(config).__name__}")
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown {what} setting(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return replace(config or cls(), **overrides)


def precision_list(precisions) -> tuple[str, ...]:
    """Canonical names to benchmark, fp32 first (the baseline, added if missing), duplicates dropped."""
    if isinstance(precisions, str):
        precisions = [p for p in precisions.split(",") if p.strip()]
    if not precisions:
        raise ValueError("no precision to benchmark; list them, e.g. fp32,bf16,fp16")
    names = ["fp32"]
    for p in precisions:
        name = canonical_precision(p)
        if name == "auto":
            raise ValueError("'auto' is not a precision to benchmark; list them, e.g. fp32,bf16,fp16")
        if name not in names:
            names.append(name)
    return tuple(names)


def check_switch(config, name: str) -> None:
    if not isinstance(getattr(config, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}")


# Settings that shape the trajectory: a checkpoint only resumes a run that agrees on all of them.
TRAJECTORY_FIELDS = ("batch_size", "seq_len", "epochs", "max_steps", "lr", "weight_decay", "warmup_steps", "grad_clip",
                     "grad_accum_steps", "seed")
FINE_LOG_STEPS = 100  # log_every=None: runs this short get a history row per step (their warm-up shows)


@dataclass
class TrainConfig:
    """Every training setting. `max_steps`, when set, wins over `epochs`; counts are optimizer steps.

    A history row aggregates `log_every` steps (more on very long runs, to keep about 2000 rows).
    Checkpoints go to checkpoint_dir/last.pt every `checkpoint_every` steps and at the end of the run (an early
    stop included), and to checkpoint_dir/best.pt after each evaluation with the lowest val loss so far.
    """

    # A name, resolved for the device when the run starts, or a Precision a caller already decided (kept whole).
    precision: str | Precision = setting("auto", "auto, fp32, bf16 or fp16 (Lightning/torch spellings accepted)")
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
    progress: bool = setting(True, "progress bars")
    device: str | torch.device | None = setting(None, "cpu, cuda or cuda:N (none: cuda if available)")
    loggers: tuple = setting((), "experiment loggers, rank 0 only: tensorboard, wandb, mlflow", flag="log")
    log_dir: str | None = setting(None, "logger output (none: logs beside the checkpoint folder, else runs/logs)")
    log_project: str = setting("tier_utils", "W&B project / MLflow experiment")
    log_run_name: str | None = setting(None, "the logged run's name (none: model-precision-UTC time)")
    mlflow_uri: str | None = setting(None, "MLflow folder or tracking URI (none: the log folder's mlflow/)")
    # Evaluation stays eager; a model that can't be compiled runs eager with a warning. Not a trajectory
    # setting: checkpoints resume either way.
    compile: bool = setting(False, "torch.compile the training step (compile time reported apart)")
    compile_mode: str = setting("default", "torch.compile mode; reduce-overhead uses CUDA graphs",
                                choices=COMPILE_MODES)

    def __post_init__(self):
        self.precision = precision_setting(self.precision)
        self.loggers = logger_names(self.loggers)  # "a,b" or a list -> a checked tuple, before anything runs
        check_switch(self, "compile")
        check_switch(self, "restore_best")
        check_fields(self)
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume=True needs checkpoint_dir=DIR, the folder holding the run's checkpoint")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir=DIR to write checkpoints into")
        if self.restore_best and self.checkpoint_dir is None:
            raise ValueError("restore_best needs checkpoint_dir=DIR, where best.pt is kept")

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # asdict would unfold a decided Precision
        d["precision"] = canonical_precision(self.precision)  # what ran, where it was decided before the run
        for name in ("device", "checkpoint_dir", "log_dir", "save_hf"):
            d[name] = None if d[name] is None else str(d[name])
        return d


MEMORY_BASES = ("activations", "total", "peak_allocated")


@dataclass(frozen=True)
class Thresholds:
    """What a low precision must show against fp32 to PASS.

    memory: which memory the reduction threshold applies to: `activations` (bytes saved for
    backward in one training step), `total` (weights + gradients + optimizer state + activations)
    or `peak_allocated` (CUDA only). The other two are still reported in the row's detail.
    fp32's step is launch-bound (AMP speeds arithmetic, not launches) when a 1-sequence step, nearly
    all fixed per-step cost, takes more than `max_fixed_share` of it, or its matmul share of the peak
    is below `min_mfu`.
    """

    speedup: float = setting(1.5, "fp32 median step time / this precision's, to PASS", flag="min-speedup",
                             above=0)
    memory_reduction: float = setting(0.40, "1 - bytes / fp32's bytes, to PASS", flag="min-memory-reduction",
                                      low=0, below=1)
    memory: str = setting("activations", "which memory the reduction applies to", choices=MEMORY_BASES)
    accuracy_diff: float = setting(0.01, "|val accuracy - fp32's| allowed", flag="max-accuracy-diff", above=0)
    parity_tolerance: float = setting(0.05, "relative band around fp32's training-loss curve", above=0)
    min_repeats: int = setting(3, "repeats below which a speed PASS/FAIL becomes WARN (the IQR is no estimate)",
                               low=1)
    max_fixed_share: float = setting(0.5, "share of fp32's step above which it is launch-bound", above=0, below=1)
    min_mfu: float = setting(0.05, "fp32 MFU below which its step is launch-bound", above=0, below=1)

    def __post_init__(self):
        check_fields(self)


# BenchConfig's fields that say where a run goes and how it shows, not what it measures.
BENCH_RUN_ONLY = ("progress", "device", "loggers", "log_dir")


@dataclass
class BenchConfig:
    """What `amp_benchmark` measures, and how long. Every precision starts from the same weights and
    sees the same batches; speed repeats are interleaved across precisions."""

    precisions: tuple = setting(("fp32", "bf16", "fp16"), "precisions to compare; fp32, the baseline, is always "
                                                           "included")
    batch_size: int = setting(8, "sequences per step", low=1)
    seq_len: int = setting(64, "tokens per sequence (capped at the model's max length)", low=1)
    untimed_steps: int = setting(3, "untimed steps before each timed repeat", low=0)
    timed_steps: int = setting(10, "timed optimizer steps per repeat", low=1)
    repeats: int = setting(5, "repeats per precision, interleaved", low=1)
    accuracy_steps: int = setting(50, "training steps for accuracy parity (0: skip)", low=0)
    eval_batches: int = setting(20, "validation batches after each accuracy run", low=1)
    lr: float = setting(1e-3, "learning rate of every run", above=0)
    weight_decay: float = setting(0.1, "AdamW weight decay", low=0)
    grad_clip: float | None = setting(1.0, "max total grad norm (none or 0: off)", low=0)
    seed: int = setting(0, "data order and dropout masks, the same for every precision", low=0)
    force: bool = setting(False, "run precisions this device has no native support for")
    compile: str = setting("off", "torch.compile the steps: off, on, or both (eager and compiled, interleaved)",
                           choices=tuple(COMPILE_CHOICES))
    compile_mode: str = setting("default", "torch.compile mode; reduce-overhead uses CUDA graphs",
                                choices=COMPILE_MODES)
    thresholds: Thresholds = setting(factory=Thresholds)
    progress: bool = setting(True, "progress bars")
    device: str | torch.device | None = setting(None, "cpu, cuda or cuda:N (none: cuda if available)")
    loggers: tuple = setting((), "experiment loggers: tensorboard, wandb, mlflow (one run holding the table and "
                                 "the verdicts)", flag="log")
    log_dir: str | None = setting(None, "logger output (none: runs/logs)")

    def __post_init__(self):
        self.precisions = precision_list(self.precisions)
        if isinstance(self.compile, bool):  # train's spelling, compile=True/False, is accepted here too
            self.compile = "on" if self.compile else "off"
        self.loggers = logger_names(self.loggers)  # a missing package fails here, before minutes of measuring
        check_switch(self, "force")
        check_switch(self, "progress")
        if not isinstance(self.thresholds, Thresholds):
            raise ValueError(f"thresholds must be a Thresholds, got {type(self.thresholds).__name__}")
        check_fields(self)

    def to_dict(self) -> dict:
        """The settings a result records: what was measured and how, not where it ran (the result's metadata
        says), how it showed or where it logged."""
        return {k: v for k, v in asdict(self).items() if k not in BENCH_RUN_ONLY}


def _trial_defaults() -> TrainConfig:
    """A trial is a short run, evaluated often so the pruner can stop a bad one early; its bar stays off
    (the study has its own)."""
    return TrainConfig(max_steps=60, eval_every=10, progress=False)


@dataclass
class SearchConfig:
    """The Optuna study around `train`, and its trials' fixed training settings (`trial`, a TrainConfig)."""

    n_trials: int = setting(8, "finished trials the study should hold", flag="trials", low=1)
    timeout: float | None = setting(None, "stop starting trials after this many seconds", above=0)
    storage: str | None = setting(None, "e.g. sqlite:///study.db: persist the study; the same study name "
                                        "continues it")
    study_name: str = setting("tier_utils", "the study's name in its storage")
    sampler_seed: int = setting(0, "the TPE sampler's seed", low=0)
    progress: bool = setting(True, "the study's progress bar (a terminal's; Optuna's bar redraws)")
    trial: TrainConfig = setting(factory=_trial_defaults, help="each trial's settings, before the searched ones")

    def __post_init__(self):
        check_switch(self, "progress")
        if not isinstance(self.trial, TrainConfig):
            raise ValueError(f"trial must be a TrainConfig, got {type(self.trial).__name__}")
        self.trial = replace(self.trial, progress=False)
        check_fields(self)

    @classmethod
    def of(cls, config, overrides: dict) -> SearchConfig:
        """`config` (a SearchConfig, a dict of its fields or None) with `overrides`: names of its own fields,
        else of its trials' TrainConfig; a name that is neither is refused."""
        own = {f.name for f in fields(cls)}
        cfg = merge(cls, config, {k: v for k, v in overrides.items() if k in own}, "search")
        trial = merge(TrainConfig, cfg.trial, {k: v for k, v in overrides.items() if k not in own},
                      "search or trial training")
        return replace(cfg, trial=trial)
