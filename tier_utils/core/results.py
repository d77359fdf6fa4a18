"""Result building blocks: the PASS/WARN/FAIL/SKIP row, the Result base, run metadata."""
from __future__ import annotations

import platform
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

from .display import html_table, readable
from .errors import describe
from .files import write_json
from .status import CHECK_COLUMNS, STATUSES


@dataclass
class Check:
    """One verdict row: every status carries a value, a threshold where one applies, and a one-line detail."""

    check: str
    status: str
    value: object = None
    threshold: object = None
    detail: str = ""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


def failed_check(name: str, exc: BaseException) -> Check:
    """An exception as its FAIL row. One line, capped: a multi-line message would break the table."""
    return Check(name, "FAIL", None, None, f"raised {describe(exc)}")


def checks_table(checks: list[Check], extra_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    columns = list(extra_columns) + CHECK_COLUMNS
    rows = [asdict(c) for c in checks]
    # Column by column as object dtype: pandas would turn ints mixed with None into floats (2 -> 2.0).
    return pd.DataFrame({col: pd.Series([r.get(col) for r in rows], dtype=object) for col in columns})


def worst_status(statuses) -> str:
    """FAIL beats WARN beats PASS; SKIP counts as nothing."""
    statuses = set(statuses)
    return next((s for s in ("FAIL", "WARN", "PASS") if s in statuses), "SKIP")


def verdict_line(results: dict) -> str:
    """"bf16 here: 1.45× fp32, ... · model checks: PASS · benchmark verdicts: FAIL": each result's answer first
    (`answer()`, where it has one), then the model's own checks apart from those that judge the device (the
    benchmark's, whose targets, a 1.5x bf16 speedup, a CPU seldom reaches); `results` by name, each asked its
    `verdict` (None: no verdicts) and what it `judges`. The main job's last line, the report's first, the
    notebooks' summary."""
    # The device's answer (the benchmark's mode to use) leads; then the model's (training's fine-tune vs its base).
    answers = [a for r in sorted(results.values(), key=lambda r: r.judges != "device") if (a := r.answer())]
    model = [r.verdict for r in results.values() if r.verdict and r.judges == "model"]
    device = [r.verdict for r in results.values() if r.verdict and r.judges == "device"]
    return " · ".join([*answers, f"model checks: {worst_status(model) if model else 'none run'}",
                       f"benchmark verdicts: {worst_status(device) if device else 'not run'}"])


def status_counts(statuses) -> str:
    """"9 PASS, 1 FAIL": each status counted, in STATUSES' order."""
    counts = pd.Series(list(statuses), dtype=object).value_counts()
    return ", ".join(f"{counts[s]} {s}" for s in STATUSES if s in counts)


def problem_rows(table: pd.DataFrame, columns: list[str], statuses=("WARN", "FAIL", "SKIP")) -> pd.DataFrame:
    """`table`'s rows with one of `statuses`, in `columns` (those it has): what a summary shows under its line."""
    rows = table[table["status"].isin(statuses)] if "status" in table.columns else table.iloc[:0]
    return rows[[c for c in columns if c in rows.columns]]


def run_metadata(device=None, dtype=None) -> dict:
    """What every measured figure is stamped with: device name, dtype, torch version, time."""
    from .device import device_facts
    from .precision import resolve_device
    from .threads import threads_note

    dev = resolve_device(device)
    facts = device_facts(dev)
    meta = {"device": str(dev), "device_name": facts.measured_on, "torch": torch.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "threads_reason": threads_note(),
            "utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if facts.profiled:  # measured here, decided for the profile's card: both are said
        meta["gpu_profile"] = facts.to_dict()["gpu_profile"]
    if dtype is not None:
        meta["dtype"] = str(dtype).replace("torch.", "")
    return meta


class Result(ABC):
    """Base for every tier's result: `.table` (DataFrame), `.plot()` (Figure), `.to_json()` (dict), and what it
    says in a summary: `headline()`, `verdict`, `summary_line()`, the rows behind it (`problems()`), its tables
    (`full_table()`, `verdict_table()`, `tables()`, `more_tables()`) and, where it answers a question, `answer()`.
    Each has a default here, so the main job, the report page and the notebooks' summary just ask; none looks
    inside or probes for a method."""

    # What the verdicts judge: "model" (the model's own checks) or "device" (how this device runs the precisions,
    # against targets a CPU seldom reaches): the main job's exit code follows the model's only.
    judges = "model"

    @property
    @abstractmethod
    def table(self) -> pd.DataFrame: ...

    @abstractmethod
    def plot(self): ...

    @abstractmethod
    def to_json(self) -> dict: ...

    def save_json(self, path) -> Path:
        return write_json(path, self.to_json())

    @property
    def status(self) -> str | None:
        """The worst PASS/WARN/FAIL/SKIP of the table's verdicts; None for a table without any."""
        table = self.table
        return worst_status(table["status"]) if "status" in table.columns else None

    @property
    def verdict(self) -> str | None:
        """The result's verdict: its worst PASS/WARN/FAIL/SKIP (`status`); None for a result without verdicts."""
        return self.status

    def headline(self) -> str:
        """What the result is, in a few words: a title for its figure and its printed table (its class's name by
        default)."""
        return type(self).__name__

    def summary_line(self) -> str:
        """One line for a summary (the main job's, the report's, a notebook's): its headline and verdict, with each
        status counted. A result with more to say in one line overrides it."""
        table = self.table
        head = self.headline()
        return f"{head}: {self.verdict} ({status_counts(table['status'])})" if "status" in table.columns else head

    def full_table(self) -> pd.DataFrame:
        """Every column, where `.table` is cut for reading (fit's: at most 12); `.table` by default."""
        return self.table

    def verdict_table(self) -> pd.DataFrame:
        """The table a reader judges the result by (the report page shows it): `.table` by default; the benchmark's
        verdicts, apart from its measurements."""
        return self.table

    def tables(self) -> dict[str, pd.DataFrame]:
        """What the report writes as CSV, by the suffix after the result's name: the full table under "", and a
        verdict table kept apart from it (the benchmark's, under "_verdicts")."""
        return {"": self.full_table()}

    def problems(self) -> pd.DataFrame:
        """The rows behind a verdict other than PASS, for a summary to show under the line (none by default)."""
        return pd.DataFrame()

    def more_tables(self) -> dict[str, pd.DataFrame]:
        """Tables worth reading beside the main one, by a short name (an encoder-decoder's samples: what it
        wrote); the report writes and shows each. None by default."""
        return {}

    def more_plots(self) -> dict:
        """Figures worth seeing beside the main plot, by a short name (an image model's predictions and what it
        looked at); the report writes and shows each. None by default."""
        return {}

    def answer(self) -> str | None:
        """The result's answer to its question in one line, where it answers one (the benchmark: the mode to use);
        the main job's last line leads with it. None: no question of its own."""
        return None

    def speedup_measurements(self) -> tuple[dict, str] | None:
        """The precisions' speedups over fp32 as this result measured them on this device, and how they were
        measured (in words), for fit's fastest mode here; None: it measured none (only the benchmark does)."""
        return None

    def overview(self) -> pd.DataFrame:
        """The short table that printing the result shows; `.table` is the full one."""
        return self.table

    # print(result), a REPL and a notebook show the overview, rounded, reasons whole, at most 12 columns as the
    # HTML shows it (core/display.readable); never a dump of the fields.
    def __repr__(self) -> str:
        shown, hidden = readable(self.overview())
        more = f"\n({hidden} more column{'s' * (hidden != 1)} in .table)" if hidden else ""
        return f"{self.headline()}\n{shown.to_string(index=False, float_format=_short, max_colwidth=200)}{more}"

    def _repr_html_(self) -> str:
        """A notebook shows the overview as a person reads it (core/display.py); `.table` is the full frame."""
        return html_table(self.overview(), self.headline())


@dataclass(repr=False)
class TierFailure(Result):
    """A tier that raised on this model, as a result: one FAIL row naming the exception, so a job running
    several tiers reports it and goes on."""

    tier: str
    error: str

    @classmethod
    def of(cls, tier: str, exc: BaseException) -> TierFailure:
        return cls(tier, describe(exc))

    @property
    def table(self) -> pd.DataFrame:
        return checks_table([Check("run", "FAIL", None, None, f"{self.tier} raised {self.error}")])

    def plot(self):
        return None

    def summary_line(self) -> str:
        return f"{self.tier}: FAIL, it raised {self.error}"

    def to_json(self) -> dict:
        return {"status": "FAIL", "tier": self.tier, "error": self.error}


def _short(value: float) -> str:
    return f"{value:.4g}"
