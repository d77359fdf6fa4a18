"""`all`'s plan as data, decided before any tier runs: the batch shape, each tier's lengths, what a probe may hold
and how far the benchmark's batch may grow.

Work the user didn't ask for has a cap that doesn't grow with the card (DESIGN.md): the probes
(core/budget.GPU_PROBE_BYTES), the benchmark's batch growth (benchmark/mainjob/batch_size.GROWTH_MAX_BATCH,
GROWTH_BUDGET_BYTES) and fit's validation (off in `all`). So under TIER_UTILS_GPU_PROFILE=T4 and =H200 the plan is
the same, unless the user asks for more (a bigger batch: growth then starts, and may end, there).
"""
from __future__ import annotations

from dataclasses import dataclass

from .benchmark.mainjob.batch_size import GROWTH_MAX_BATCH, growth_budget
from .core.budget import read_budget
from .core.device import device_facts
from .presets import Preset


@dataclass(frozen=True)
class Growth:
    """How far the benchmark's batch may grow on a GPU: from the preset's batch, doubling, to at most
    `max_batch` sequences and `budget_bytes` of fp32's step (the same on every card)."""

    from_batch: int
    max_batch: int
    budget_bytes: int


@dataclass(frozen=True)
class JobPlan:
    """What `all` will run: the preset (shape and lengths), the probes' cap here, the benchmark's growth (None:
    no GPU, the preset's batch) and fit's validation (off: `all` asks fit for predictions only)."""

    preset: Preset
    probe_limit_bytes: int
    growth: Growth | None
    fit_validate: str = "off"

    def to_dict(self) -> dict:
        """The plan's figures (batches, steps, probes), as the report's JSON records them and a test compares."""
        p = self.preset
        return {"batch_size": p.batch_size, "seq_len": p.seq_len, "smoke_batch_sizes": [1, p.batch_size],
                "analysis_batches": p.analysis_batches, "train_steps": p.train.max_steps,
                "train_eval_every": p.train.eval_every, "train_eval_batches": p.train.eval_batches,
                "bench_untimed_steps": p.bench.untimed_steps, "bench_timed_steps": p.bench.timed_steps,
                "bench_repeats": p.bench.repeats, "bench_accuracy_steps": p.bench.accuracy_steps,
                "bench_eval_batches": p.bench.eval_batches, "probe_limit_bytes": self.probe_limit_bytes,
                "growth": None if self.growth is None else vars(self.growth), "fit_validate": self.fit_validate}


def job_plan(preset: Preset, device) -> JobPlan:
    """`all`'s plan for `preset` on `device` (its card: device_facts, so a GPU profile stands in for one)."""
    facts = device_facts(device)
    growth = None
    if facts.is_gpu:
        growth = Growth(preset.batch_size, max(GROWTH_MAX_BATCH, preset.batch_size), growth_budget(facts.total_bytes))
    return JobPlan(preset, read_budget(device).probe_limit, growth)
