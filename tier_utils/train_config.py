"""`TrainConfig`: every training setting, validated on construction with one-line messages."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from .compiling import check_compile_mode
from .loggers import logger_names
from .precision import canonical_precision
from .validation import whole_number

# Settings that shape the trajectory: a checkpoint only resumes a run that agrees on all of them.
TRAJECTORY_FIELDS = ("batch_size", "seq_len", "epochs", "max_steps", "lr", "weight_decay", "warmup_steps", "grad_clip",
                     "grad_accum_steps", "seed")
FINE_LOG_STEPS = 100  # log_every=None: runs this short get a history row per step (their warm-up shows)


@dataclass
class TrainConfig:
    """Every training setting. `max_steps`, when set, wins over `epochs`.

    Counts are optimizer steps. Evaluation runs every `eval_every` steps and at the end of every
    epoch and of the run (None or 0: only there), on at most `eval_batches` validation batches
    (None: all). A step row of the history aggregates `log_every` steps (more on very long runs,
    to keep about 2000 rows); None logs every step on runs of up to FINE_LOG_STEPS steps, so a short
    run's warm-up shows, and every 10 steps on longer ones. Checkpoints go to
    checkpoint_dir/last.pt every `checkpoint_every` steps and at the end of the run (None: only at
    the end).
    """

    precision: str = "auto"
    batch_size: int = 16  # per rank under torchrun; global batch = batch_size x world size x grad_accum_steps
    seq_len: int = 64
    epochs: int = 1
    max_steps: int | None = None
    lr: float = 3e-4
    weight_decay: float = 0.1
    warmup_steps: int = 10  # linear warm-up, then cosine decay to 10% of lr (make_scheduler)
    grad_clip: float | None = 1.0  # max total grad norm; None or 0 turns clipping off
    grad_accum_steps: int = 1
    seed: int = 0
    deterministic: bool = False  # bitwise-equal reruns on the same machine, torch build and thread count (README)
    num_workers: int = 0
    eval_every: int | None = 50
    eval_batches: int | None = 20
    log_every: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    resume: bool = False  # continue from checkpoint_dir/last.pt when it exists
    progress: bool = True
    device: str | None = None
    # Experiment loggers (loggers.py): any of "tensorboard", "wandb", "mlflow"; rank 0 only.
    loggers: tuple = ()
    log_dir: str | None = None  # None: "logs" beside checkpoint_dir, else runs/logs
    log_project: str = "tier_utils"  # W&B project / MLflow experiment
    log_run_name: str | None = None  # None: model-precision-UTC time
    mlflow_uri: str | None = None  # a folder or a tracking URI (sqlite:///runs/mlflow.db, http://...); None: log_dir/mlflow
    # torch.compile the model for the training step (evaluation stays eager); a model that can't be
    # compiled runs eager with a warning. Not a trajectory setting: checkpoints resume either way.
    compile: bool = False
    compile_mode: str = "default"  # torch's: default, reduce-overhead (CUDA graphs), max-autotune

    def __post_init__(self):
        self.loggers = logger_names(self.loggers)  # "a,b" or a list -> a checked tuple, before anything runs
        _validate(self)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["device"] = None if self.device is None else str(self.device)
        d["checkpoint_dir"] = None if self.checkpoint_dir is None else str(self.checkpoint_dir)
        d["log_dir"] = None if self.log_dir is None else str(self.log_dir)
        return d


def _validate(c: TrainConfig) -> None:
    def whole(name, low, optional=False):
        v = getattr(c, name)
        if not (v is None and optional):
            whole_number(v, name, low)

    def number(name, low, optional=False, strict=False):
        v = getattr(c, name)
        if v is None and optional:
            return
        ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
        if not ok or v < low or (strict and v == low):
            raise ValueError(f"{name} must be a number {'>' if strict else '>='} {low}, got {v!r}")

    canonical_precision(c.precision)
    if not isinstance(c.compile, bool):
        raise ValueError(f"compile must be True or False, got {c.compile!r}")
    check_compile_mode(c.compile_mode)
    for name in ("batch_size", "seq_len", "epochs", "grad_accum_steps"):
        whole(name, 1)
    for name in ("warmup_steps", "seed", "num_workers"):
        whole(name, 0)
    whole("max_steps", 1, optional=True)
    whole("eval_every", 0, optional=True)
    whole("eval_batches", 1, optional=True)
    whole("checkpoint_every", 1, optional=True)
    whole("log_every", 1, optional=True)
    number("lr", 0, strict=True)
    number("weight_decay", 0)
    number("grad_clip", 0, optional=True)
    if c.resume and c.checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir=DIR, the folder holding the run's checkpoint")
    if c.checkpoint_every is not None and c.checkpoint_dir is None:
        raise ValueError("checkpoint_every needs checkpoint_dir=DIR to write checkpoints into")


def make_config(config, overrides: dict) -> TrainConfig:
    if isinstance(config, dict):
        config, overrides = None, {**config, **overrides}
    if config is not None and not isinstance(config, TrainConfig):
        raise ValueError(f"config must be a TrainConfig or a dict, got {type(config).__name__}")
    valid = [f.name for f in fields(TrainConfig)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown training setting(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return replace(config or TrainConfig(), **overrides)
