"""Two tiers that timed the same step: training's against the benchmark's, at the same model, precision, mode
and batch. The report page and the main job's summary both show these rows."""
from __future__ import annotations

from ...core.measure import Load, cpu_load
from ...core.results import Check
from ...training.history import TrainResult
from ..amp import BenchmarkResult
from ..config import CHECKPOINTED
from ..verdicts import step_agreement


def consistency(results: dict, load: Load | None = None) -> list[Check]:
    """Rows about two tiers that timed the same thing far apart: training's step against the benchmark's
    at the same model, precision, mode and batch (one rank, no accumulation)."""
    rows = []
    for train_result in (r for r in results.values() if isinstance(r, TrainResult)):
        s, c = train_result.summary, train_result.config
        if c is None:  # a result built without its run's settings: nothing to match a benchmark against
            continue
        # A checkpointed training run matches the benchmark's checkpointing rows (eager).
        mode = "compiled" if s.compiled else CHECKPOINTED if s.activation_checkpointing else "eager"
        for bench in (r for r in results.values() if isinstance(r, BenchmarkResult)):
            b = bench.config.settings
            rec = next((r for r in bench.records if (r.precision, r.mode) == (s.precision, mode) and r.speed), None)
            same = (s.model, c.batch_size, c.seq_len) == (bench.config.model, b.batch_size, b.seq_len)
            if rec is None or s.step_time_ms is None or s.world_size != 1 or c.grad_accum_steps != 1 or not same:
                continue
            row = step_agreement(s.step_time_ms, rec.speed.step_ms,
                                 f"{s.model}, {s.precision} {mode}, batch {b.batch_size} x {b.seq_len} tokens", load)
            rows += [row] if row else []
    return rows


def recorded_load(meta: dict) -> Load:
    """The load a run's metadata recorded (the main job's), else the load now."""
    return Load(meta["load_average_1m"], meta["cpu_count"]) if "load_average_1m" in meta else cpu_load()
