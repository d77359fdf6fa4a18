"""Run lengths for the main job (`all`) and the notebooks, as the tiers' own config objects.

A preset is one batch shape (`batch_size` x `seq_len`) that every tier runs at, plus each tier's lengths at
that shape: a TrainConfig (steps, evaluations, and how chat rows are read, which the analysis, the benchmark and
fit read the data with too), a BenchConfig (repeats, accuracy steps), how many batches the
analysis reads and, for the notebooks, the size of a built-in model. The shape (and, where a notebook's RunConfig
decided them, the precision and device) is declared once, here, and stamped into each tier's config by
`smoke_config()`, `analysis_config()`, `train_config()`, `bench_config()`, `fit_config()` and `ranks_config()`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .analysis import AnalysisConfig
from .benchmark.config import BenchConfig
from .core.device import device_facts
from .core.settings import check_fields, setting
from .planning.planner import FitConfig
from .planning.ranks import RanksConfig
from .smoketest.suite import SmokeConfig
from .training.config import TrainConfig


@dataclass(frozen=True)
class Preset:
    """One batch shape and each tier's lengths at it. `train` and `bench` hold the lengths; their own batch
    size and length are replaced by the preset's shape when a config is made from them."""

    batch_size: int = setting(BenchConfig.batch_size, "sequences per step in every tier", low=1)
    seq_len: int = setting(TrainConfig.seq_len, "tokens per sequence in every tier", low=1)
    analysis_batches: int = setting(2, "validation batches tier 2 analyses", low=1)
    train: TrainConfig = field(default_factory=TrainConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    # Sizes for the built-in models (None: their own defaults): a notebook sizes its fresh model to the device.
    model_kwargs: dict | None = None
    # The run's precision and device, where a notebook's RunConfig decided them; None: each tier's own default.
    precision: str | None = None
    device: str | None = None

    def __post_init__(self):
        check_fields(self)

    def smoke_config(self, **given) -> SmokeConfig:
        """Smoke's memory and latency grid at one sequence and at the preset's shape; `given` on top."""
        return SmokeConfig(**{"batch_sizes": (1, self.batch_size), "seq_lens": (self.seq_len,),
                              **self._decided("precision", "device"), **given})

    def analysis_config(self, **given) -> AnalysisConfig:
        """The analysis over `analysis_batches` batches of the preset's shape; `given` on top."""
        return AnalysisConfig(**{"batch_size": self.batch_size, "seq_len": self.seq_len,
                                 "n_batches": self.analysis_batches, "chat": self.train.chat,
                                 **self._decided("precision", "device"), **given})

    def train_config(self, **given) -> TrainConfig:
        """The preset's training settings at its shape, with `given` TrainConfig fields on top."""
        return replace(self.train, **{"batch_size": self.batch_size, "seq_len": self.seq_len,
                                      **self._decided("precision", "device"), **given})

    def bench_config(self, **given) -> BenchConfig:
        """The preset's benchmark settings at its shape, with `given` BenchConfig fields on top."""
        return replace(self.bench, **{"batch_size": self.batch_size, "seq_len": self.seq_len,
                                      "chat": self.train.chat, **self._decided("device"), **given})

    def fit_config(self, **given) -> FitConfig:
        """The fit planner at the preset's shape, reading the data's chat rows as training does; `given` on top."""
        return FitConfig(**{"batch_size": self.batch_size, "seq_len": self.seq_len, "chat": self.train.chat,
                            **self._decided("device"), **given})

    def ranks_config(self, **given) -> RanksConfig:
        """The per-rank planner (DDP and FSDP over 1, 2, 4, 8 ranks) at the preset's length; `given` on top."""
        return RanksConfig(**{"seq_len": self.seq_len, **self._decided("precision", "device"), **given})

    def _decided(self, *names: str) -> dict:
        """Those of `names` (precision, device) the preset decided: the others stay each tier's default."""
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


# FAST: CI, tests, a notebook on a CPU (`all --fast`): seconds per tier.
FAST = Preset(batch_size=4, seq_len=32, analysis_batches=1,
              train=TrainConfig(max_steps=20, eval_every=10, eval_batches=2),
              bench=BenchConfig(untimed_steps=1, timed_steps=3, repeats=3, accuracy_steps=10, eval_batches=2))
# JOB: the main job's default, a few minutes on a 2-core CPU; the benchmark at its own defaults.
JOB = Preset(train=TrainConfig(max_steps=60, eval_every=20, eval_batches=10),
             bench=BenchConfig(eval_batches=10))

# The notebooks' lengths: FAST's training and analysis; the benchmark keeps its default warm-up (untimed steps,
# which a GPU needs before its timings settle) and validation batches, with FAST's short repeats.
_NOTEBOOK = replace(FAST, bench=BenchConfig(timed_steps=3, repeats=3, accuracy_steps=10))
# The notebooks' sizes for a fresh built-in model, by the hardware decided for (core.device: a
# TIER_UTILS_GPU_PROFILE card too, its tensors still on the CPU). On a CPU, small enough for seconds. On a GPU, small
# too: CI runs the notebooks under TIER_UTILS_GPU_PROFILE=T4 with every step on a CPU (fp16 emulated), and these
# sizes keep that within minutes (measured 2026-11-27 on a 2-core CPU under load 20: the three notebooks 157 s, 115 s
# at the CPU's sizes). A step arithmetic-bound on a T4 needs about 100 GFLOP (estimated: eager kernels launch for
# ~4 ms a step, fp16 runs ~25 TFLOP/s), minutes a step on such a CPU: so a T4 runs these in seconds, launch-bound,
# and the benchmark's verdicts say so; BATCH_SIZE / MODEL_KWARGS buy the card's arithmetic.
NOTEBOOK = {
    "cuda": replace(_NOTEBOOK, batch_size=8, seq_len=64,
                    model_kwargs={"d_model": 64, "n_layer": 2, "n_head": 2, "max_len": 64}),
    "cpu": replace(_NOTEBOOK, model_kwargs={"d_model": 32, "n_layer": 1, "n_head": 2, "max_len": FAST.seq_len}),
}


def notebook_preset(device) -> Preset:
    """The notebooks' preset for the hardware `device` (a device, or its DeviceFacts) is decided for: a GPU's
    (a TIER_UTILS_GPU_PROFILE card's too) or the CPU's (any other device's)."""
    return NOTEBOOK["cuda" if device_facts(device).is_gpu else "cpu"]
