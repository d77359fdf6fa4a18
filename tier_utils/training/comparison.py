"""One run against another: `compare(a, b)` pairs two training runs' per-example scores on the same validation split
(the `scores.json` a run writes beside its checkpoints, training/versus_base.py) and judges run B against run A per
metric (core/paired.py), naming the settings in which the runs differ.

Runs of different architectures, tokenizers or validation splits are refused in one line. A measurable regression of
the loss on at least MIN_PAIRS examples is what `python -m tier_utils compare` exits 1 on: a CI job's check after a
model change.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from ..core.errors import CompareError
from ..core.files import jsonable
from ..core.paired import MIN_PAIRS, ExampleScores, Pairing
from ..core.results import Result
from .versus_base import SCORES_FILE


@dataclass(frozen=True)
class RunScores:
    """A run's scores.json as compare reads it, and where it was found."""

    path: Path
    record: dict

    @classmethod
    def read(cls, where, label: str) -> RunScores:
        """`where`: a train --out folder, a checkpoint folder or the scores.json file itself."""
        where = Path(where)
        found = next((p for p in (where, where / SCORES_FILE, where / "checkpoints" / SCORES_FILE) if p.is_file()),
                     None)
        if found is None:
            raise CompareError(f"{label} {where} holds no {SCORES_FILE}: point compare at a train --out folder or a "
                               "checkpoint_dir whose run finished with a held-out split")
        try:
            record = json.loads(found.read_text())
        except (OSError, ValueError) as exc:
            raise CompareError(f"{label} {found} is not readable JSON ({type(exc).__name__}); rerun that "
                               "training run") from exc
        if not isinstance(record, dict) or "tuned" not in record:
            raise CompareError(f"{label} {found} is not a tier_utils run's {SCORES_FILE}; rerun that training run")
        return cls(found, record)


def _refuse_unpaired(a: RunScores, b: RunScores) -> None:
    """One line for the first thing that makes two runs' examples incomparable."""
    ra, rb = a.record, b.record
    for key, what in (("model", "architectures"), ("tokenizer", "tokenizers")):
        if ra.get(key) != rb.get(key):
            raise CompareError(f"the runs are of different {what} ({ra.get(key)!r} in {a.path}, {rb.get(key)!r} in "
                               f"{b.path}): compare two runs of one model and tokenizer")
    va, vb = ra.get("validation") or {}, rb.get("validation") or {}
    if va.get("sha1") is None or va.get("sha1") != vb.get("sha1"):
        raise CompareError(f"the runs were validated on different data (validation hash {str(va.get('sha1'))[:8]} "
                           f"with {va.get('examples')} examples, against {str(vb.get('sha1'))[:8]} with "
                           f"{vb.get('examples')}): train both on the same data and validation split")


@dataclass(repr=False)
class CompareResult(Result):
    """Run B against run A on the same validation examples: each metric's paired verdict (`.table`), the settings
    that differ (`.differences`), the examples that got worse most (`.regressed_examples`), and `.plot()`."""

    a: str
    b: str
    pairing: Pairing
    differences: pd.DataFrame = field(default_factory=pd.DataFrame)

    @property
    def table(self) -> pd.DataFrame:
        return self.pairing.table()

    @property
    def regressed_examples(self) -> pd.DataFrame:
        return self.pairing.worst_table()

    @property
    def regressed(self) -> bool:
        """Whether B's loss is measurably worse than A's on at least MIN_PAIRS examples (the CLI exits 1)."""
        return self.pairing.regressed()

    @property
    def exit_code(self) -> int:
        return 1 if self.regressed else 0

    def headline(self) -> str:
        return f"compare: run B {self.b} against run A {self.a}"

    def more_tables(self) -> dict[str, pd.DataFrame]:
        return {"differences": self.differences, "regressed": self.regressed_examples}

    def answer(self) -> str | None:
        return self.summary_line()

    def summary_line(self) -> str:
        v = self.pairing.headline
        differ = ", ".join(f"{r.setting} {r.a} -> {r.b}" for r in self.differences.itertuples()) or "none"
        return f"run B vs run A: val {v.describe()} · settings that differ: {differ}"

    def plot(self):
        return self.pairing.plot(f"run B ({self.b}) against run A ({self.a}), per example", "run A", "run B")

    def to_json(self) -> dict:
        return jsonable({"a": self.a, "b": self.b, "regressed": self.regressed, "summary": self.summary_line(),
                         "min_pairs": MIN_PAIRS, "verdicts": self.table, "differences": self.differences,
                         "pairing": self.pairing.to_dict()})


def compare(a, b, seed: int = 0) -> CompareResult:
    """Run B (`b`) against run A (`a`): each a train --out folder, a checkpoint folder, or its scores.json. The
    fine-tunes' per-example scores are paired on the examples both scored; `seed` seeds the bootstrap."""
    ra, rb = RunScores.read(a, "RUN_A"), RunScores.read(b, "RUN_B")
    _refuse_unpaired(ra, rb)
    pairing = Pairing.of(ExampleScores.from_dict(ra.record["tuned"]), ExampleScores.from_dict(rb.record["tuned"]),
                         seed)
    sa, sb = ra.record.get("settings") or {}, rb.record.get("settings") or {}
    rows = [(k, sa.get(k), sb.get(k)) for k in dict.fromkeys([*sa, *sb]) if sa.get(k) != sb.get(k)]
    return CompareResult(str(a), str(b), pairing, pd.DataFrame(rows, columns=["setting", "a", "b"]))
