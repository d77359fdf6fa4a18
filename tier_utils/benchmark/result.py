"""What `amp_benchmark` returns: `BenchmarkResult`, one record per precision x mode (and memory row), the verdict
rows, its one-line summary and answer, its plot and JSON (schema bench/1)."""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ..core.files import jsonable
from ..core.precision import BASELINE
from ..core.results import Result, checks_table, problem_rows, status_counts, worst_status
from ..tasks import task_named
from .answer import answer_line
from .record import BenchRun, Outcome, PrecisionRecord
from .verdicts import Speedup

SCHEMA = "tier_utils.bench/1"


@dataclass(repr=False)
class BenchmarkResult(Result):
    """What `amp_benchmark` measured: one record per precision, the verdict rows, config and metadata."""

    config: BenchRun
    metadata: dict
    flops: dict  # {"per_step": FLOPs, "by_op": {op: FLOPs}} of one fp32 forward + backward, mean over the timed batches
    records: list[PrecisionRecord]
    checks: list
    overhead: dict | None  # fp32's floor step and launch_bound()'s diagnosis; None when fp32 was not timed
    # The run's log: what was skipped or stopped, at which step and why, in the order it happened. The JSON has
    # what it decided (each record's ran and stopped, the SKIP rows' detail); schema bench/1 keeps its keys.
    outcomes: tuple[Outcome, ...] = field(default=())

    @property
    def status(self) -> str:
        return worst_status(c.status for c in self.checks)

    @property
    def table(self) -> pd.DataFrame:
        return pd.DataFrame([r.table_row() for r in self.records])

    @property
    def verdicts(self) -> pd.DataFrame:
        return checks_table(self.checks, ("precision", "mode"))

    def overview(self) -> pd.DataFrame:
        return self.verdicts  # the answer per precision; the measurements are in .table

    def verdict_table(self) -> pd.DataFrame:
        return self.verdicts  # what to read; the measurements stay one click away

    def tables(self) -> dict[str, pd.DataFrame]:
        return {"": self.table, "_verdicts": self.verdicts}

    judges = "device"  # its verdicts judge how this device runs each precision, not the model

    def speedups(self) -> dict[str, Speedup | None]:
        """Precision -> its eager step's Speedup over fp32 as measured here (fp32: None, the baseline); only the
        precisions that ran without checkpointing, and none where the baseline was not fp32 (fp32 did not fit)."""
        ran = [r for r in self.records if r.mode == "eager" and not r.checkpointing and r.speed is not None]
        if not any(r.precision == BASELINE and r.speed.speedup is None for r in ran):
            return {}
        return {r.precision: r.speed.speedup for r in ran}

    def speedup_measurements(self) -> tuple[dict, str] | None:
        """`speedups()` and how they were measured: the batch, and the memory setting the rows trained where it is
        not the full fine-tune fit's modes stand for; None where none was measured against fp32."""
        s = self.config.settings
        speedups = self.speedups()
        if not speedups:
            return None
        trained = s.memory.describe(self.config.lora and self.config.lora["base_dtype"])
        plain = trained == type(s.memory)().describe(None)
        return speedups, (f"by this run's benchmark at batch {s.batch_size} x {s.seq_len}"
                          + ("" if plain else f", training {trained}"))

    def summary_line(self) -> str:
        """"benchmark TinyGPT: FAIL (9 PASS, 1 FAIL) at batch 8 x 64 tokens on ...; weights stored float32, ..."."""
        run, s = self.config, self.config.settings
        held = ", ".join(f"{r.precision} {r.mode}: {r.memory['weights_dtype']}" for r in self.records
                         if r.memory and r.memory_row is None)
        rows = [r for r in self.records if r.memory_row is not None]
        return (f"benchmark {run.model}: {self.verdict} ({status_counts(self.verdicts['status'])})"
                f" at {task_named(run.task).batch_words(s.batch_size, s.seq_len)} on {self.metadata['device_name']}"
                + (f" ({run.padding['describe']})" if run.padding and run.padding["describe"] else "")
                + (f"; {run.fit.reason}" if run.fit.reason else "")
                + f"; weights stored {self.metadata['stored_dtype']}, held in the runs as {held or 'none ran'}"
                + f"; the precision rows train {s.memory.describe(run.lora and run.lora['base_dtype'])}"
                + (f"; memory rows in {rows[0].precision}: " + ", ".join(
                    f"{r.memory_row} ({r.memory_settings['describe']}{'' if r.ran else ', skipped'})" for r in rows)
                   if rows else ""))

    def problems(self) -> pd.DataFrame:
        # Not the SKIP rows: the baseline's own, and the modes this device doesn't run (the answer names them).
        return problem_rows(self.verdicts, ["precision", "mode", "check", "status", "value", "detail"],
                            ("WARN", "FAIL"))

    def answer(self) -> str:
        """The mode to train in here and what it buys, the faster one's cost, the failed verdicts (answer.py)."""
        return answer_line(self.records, self.checks)

    def plot(self):
        from .amp_plot import plot_benchmark

        return plot_benchmark(self)

    def to_json(self) -> dict:
        return jsonable({"schema": SCHEMA, "status": self.status, "config": self.config, "metadata": self.metadata,
                         "flops": self.flops, "overhead": self.overhead, "precisions": self.records,
                         "verdicts": self.verdicts, "outcomes": self.outcomes})
