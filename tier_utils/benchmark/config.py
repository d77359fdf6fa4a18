"""`BenchConfig` (what `amp_benchmark` measures, and how long) and `Thresholds` (what a precision must show to
PASS), each setting declared once."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Literal

import torch

from ..core.inputs import select_names
from ..core.loggers import logger_names
from ..core.memory_settings import MEMORY_CHOICES, MemorySettings, memory_setting
from ..core.optimizers import OPTIMIZERS
from ..core.precision import PRECISIONS
from ..core.settings import check_fields, check_switch, device_field, precision_list, progress_field, setting
from ..data.chat_formats import ChatOptions
from ..engine.compiling import compile_mode_setting
from ..engine.strategies import launched_strategies

Mode = Literal["eager", "compiled", "eager+checkpointing"]  # how a benchmarked step runs (memory rows: memory_mode)
CHECKPOINTED: Mode = "eager+checkpointing"  # activation_checkpointing's rows: eager, compared with eager
# The `compile` setting: the modes each precision runs in, eager first.
COMPILE_CHOICES: dict[str, list[Mode]] = {"off": ["eager"], "on": ["compiled"], "both": ["eager", "compiled"]}

MEMORY_BASES = ("activations", "total", "peak_allocated")
# The memory_rows names: each memory setting's name (core.memory_settings.memory_setting) that is not the full
# fine-tune with AdamW the precision rows already are.
MEMORY_ROWS = tuple(n for n in dict.fromkeys((*MEMORY_CHOICES, *OPTIMIZERS)) if memory_setting(n) != MemorySettings())


def memory_mode(row: str) -> str:
    """A memory row's mode (e.g. "eager+qlora"): eager, under that memory setting, as checkpointing's rows are
    "eager+checkpointing"."""
    return f"eager+{row}"


def memory_rows_setting(value) -> tuple[str, ...]:
    """What `memory_rows` may be given as: names (a tuple, or 'lora,qlora'), or none (no rows)."""
    if isinstance(value, str):
        value = [] if value.strip().lower() == "none" else value.split(",")
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"memory_rows must be names such as {','.join(MEMORY_ROWS)}, got {value!r}")
    names = [str(n).strip() for n in value if str(n).strip()]
    return tuple(select_names(names, MEMORY_ROWS, "memory_rows")) if names else ()


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
    memory_reduction: float | None = setting(None, "1 - bytes / fp32's bytes, to PASS (none: the task's own, "
                                             "0.40 for a language model)", flag="min-memory-reduction", low=0,
                                             below=1)
    memory: str = setting("activations", "which memory the reduction applies to", choices=MEMORY_BASES)
    accuracy_diff: float = setting(0.01, "|val accuracy - fp32's| allowed", flag="max-accuracy-diff", above=0)
    parity_tolerance: float = setting(0.05, "relative band around fp32's training-loss curve", above=0)
    min_repeats: int = setting(3, "repeats below which a speed PASS/FAIL becomes WARN (the IQR is no estimate)",
                               low=1)
    max_fixed_share: float = setting(0.5, "share of fp32's step above which it is launch-bound", above=0, below=1)
    min_mfu: float = setting(0.05, "fp32 MFU below which its step is launch-bound", above=0, below=1)

    def __post_init__(self):
        check_fields(self)

    def for_task(self, task) -> Thresholds:
        """With the task's memory threshold where none was given (Task.amp_memory_reduction: what autocast can
        save on that kind of model)."""
        return self if self.memory_reduction is not None else replace(self,
                                                                      memory_reduction=task.amp_memory_reduction)


# BenchConfig's fields that say where a run goes and how it shows, not what it measures.
BENCH_RUN_ONLY = ("progress", "device", "loggers", "log_dir")


@dataclass
class BenchConfig:
    """What `amp_benchmark` measures, and how long. Every precision starts from the same weights and
    sees the same batches; speed repeats are interleaved across precisions."""

    precisions: tuple = setting(PRECISIONS, "precisions to compare; fp32, the baseline, is always "
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
    compile_mode: str = compile_mode_setting()
    activation_checkpointing: bool = setting(False, "also run each precision with activation checkpointing: its "
                                                    "step time and activation bytes against the same precision "
                                                    "without it")
    # Every row trains under these (LoRA and its base, QLoRA, the optimizer's state); checkpointing is the
    # activation_checkpointing rows' (each precision again with it).
    memory: MemorySettings = setting(factory=MemorySettings)
    chat: ChatOptions = setting(factory=ChatOptions)  # how chat rows are read (TrainConfig's, where a job decided it)
    # benchmark/memory_rows.py: the precision auto picks here, because the rows are timed interleaved with the
    # precisions' (a precision measured faster in this run is not known before they run).
    memory_rows: tuple = setting((), "memory settings to measure beside the full fine-tune, one row each in the "
                                     "precision auto picks here, judged against the fp32 baseline: "
                                     f"{','.join(MEMORY_ROWS)} (default: none, the precisions only)")
    # Under torchrun (benchmark/strategies.py): which of these apply is said in that module.
    strategy: tuple | None = setting(None, "under torchrun: ddp, fsdp or ddp,fsdp side by side: each rank's step "
                                           "time, peak memory and tokens/s, gathered to rank 0 (none: the "
                                           "single-process AMP benchmark)")
    thresholds: Thresholds = setting(factory=Thresholds)
    progress: bool = progress_field()
    device: str | torch.device | None = device_field()
    loggers: tuple = setting((), "experiment loggers: tensorboard, wandb, mlflow (one run holding the table and "
                                 "the verdicts)", flag="log")
    log_dir: str | None = setting(None, "logger output (none: runs/logs)")

    def __post_init__(self):
        self.precisions = precision_list(self.precisions)
        if isinstance(self.compile, bool):  # train's spelling, compile=True/False, is accepted here too
            self.compile = "on" if self.compile else "off"
        self.loggers = logger_names(self.loggers)  # a missing package fails here, before minutes of measuring
        self.memory = memory_setting(self.memory)
        self.memory.optimizer_class.require()  # a missing package: one line naming it, before any work
        if self.memory.checkpointing:
            raise ValueError("the benchmark runs each precision with and without checkpointing as rows: use "
                             "activation_checkpointing=True (--activation-checkpointing), not memory's checkpointing")
        if self.strategy is not None:
            self.strategy = tuple(select_names(self.strategy, launched_strategies(), "strategy"))
        self.memory_rows = memory_rows_setting(self.memory_rows)
        self._check_memory_rows()
        check_switch(self, "activation_checkpointing")
        check_switch(self, "force")
        check_switch(self, "progress")
        if not isinstance(self.thresholds, Thresholds):
            raise ValueError(f"thresholds must be a Thresholds, got {type(self.thresholds).__name__}")
        check_fields(self)

    def _check_memory_rows(self) -> None:
        """Memory rows are judged against the full fine-tune, run eager, in one process: each contradiction is one
        line."""
        if not self.memory_rows:
            return
        if self.memory != MemorySettings():
            raise ValueError(f"memory_rows are judged against the full fine-tune: leave memory at its default (it "
                             f"is {self.memory.describe()}), or drop memory_rows")
        if self.compile == "on":
            raise ValueError("memory_rows run eager and are judged against the eager fp32 baseline: use "
                             "compile='off' or 'both' (--compile off|both), or drop memory_rows")
        if self.strategy is not None:
            raise ValueError("memory_rows are measured by the single-process benchmark: drop strategy or memory_rows")

    def to_dict(self) -> dict:
        """The settings a result records: what was measured and how, not where it ran (the result's metadata
        says), how it showed or where it logged."""
        return {**{k: v for k, v in asdict(self).items() if k not in BENCH_RUN_ONLY}, "memory": self.memory.to_dict()}
