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


BENCHMARK = "amp_benchmark"  # the result name whose verdicts judge the device's precisions, not the model


def verdict_line(statuses: dict) -> str:
    """"model checks: PASS · benchmark verdicts: FAIL": the model's own checks apart from the benchmark's, whose
    targets (a 1.5x bf16 speedup) a CPU seldom reaches; `statuses` by result name (None: no verdicts)."""
    model = [s for name, s in statuses.items() if s and name != BENCHMARK]
    return (f"model checks: {worst_status(model) if model else 'none run'} · "
            f"benchmark verdicts: {statuses.get(BENCHMARK) or 'not run'}")


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
    """Base for every tier's result: `.table` (DataFrame), `.plot()` (Figure), `.to_json()` (dict)."""

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

    def overview(self) -> pd.DataFrame:
        """The short table that printing the result shows; `.table` is the full one."""
        return self.table

    # print(result), a REPL and a notebook show the overview, rounded, reasons whole, at most 12 columns as the
    # HTML shows it (core/display.readable); never a dump of the fields.
    def __repr__(self) -> str:
        head = self.headline() if hasattr(self, "headline") else type(self).__name__
        shown, hidden = readable(self.overview())
        more = f"\n({hidden} more column{'s' * (hidden != 1)} in .table)" if hidden else ""
        return f"{head}\n{shown.to_string(index=False, float_format=_short, max_colwidth=200)}{more}"

    def _repr_html_(self) -> str:
        """A notebook shows the overview as a person reads it (core/display.py); `.table` is the full frame."""
        return html_table(self.overview(), self.headline() if hasattr(self, "headline") else None)


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

    def to_json(self) -> dict:
        return {"status": "FAIL", "tier": self.tier, "error": self.error}


def _short(value: float) -> str:
    return f"{value:.4g}"
