"""Result building blocks: the PASS/WARN/FAIL/SKIP row, the Result base, run metadata, safe writes."""
from __future__ import annotations

import glob
import json
import math
import os
import re
import platform
import tempfile
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd
import torch

from .errors import OutputError, one_line

# mkstemp's random part: 8 characters from [a-z0-9_] (tempfile._RandomNameSequence).
_TEMP_SUFFIX = re.compile(r"[a-z0-9_]{8}")

STATUSES = ("PASS", "WARN", "FAIL", "SKIP")
CHECK_COLUMNS = ["check", "status", "value", "threshold", "detail"]


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
    return Check(name, "FAIL", None, None, f"raised {type(exc).__name__}: {one_line(exc)[:300]}")


def whole_number(value, name: str, minimum: int = 1) -> int:
    """`value` if it is an int >= minimum, else a ValueError naming `name`. Strict on purpose: True/False
    and numpy integers are refused here, where the message is clear, not deep inside torch later."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be a whole number >= {minimum}, got {value!r}")
    return int(value)


def select_names(requested, available, what: str) -> list[str]:
    """None: all of `available`. Otherwise the requested names (a list, or a comma-separated string) in
    `available`'s order, each once; an unknown or empty request is a ValueError listing the valid names."""
    available = list(available)
    if requested is None:
        return available
    items = requested.split(",") if isinstance(requested, str) else requested
    names = [str(n).strip() for n in items if str(n).strip()]
    unknown = [n for n in names if n not in available]
    if unknown or not names:
        problem = f"unknown {what} {', '.join(map(repr, unknown))}" if unknown else f"no {what} given"
        raise ValueError(f"{problem}; choose from: {', '.join(available)}")
    return [n for n in available if n in names]


def checks_table(checks: list[Check], extra_columns: tuple[str, ...] = ()) -> pd.DataFrame:
    columns = list(extra_columns) + CHECK_COLUMNS
    rows = [asdict(c) for c in checks]
    # Column by column as object dtype: pandas would turn ints mixed with None into floats (2 -> 2.0).
    return pd.DataFrame({col: pd.Series([r.get(col) for r in rows], dtype=object) for col in columns})


def worst_status(statuses) -> str:
    """FAIL beats WARN beats PASS; SKIP counts as nothing."""
    statuses = set(statuses)
    for s in ("FAIL", "WARN", "PASS"):
        if s in statuses:
            return s
    return "SKIP"


def run_metadata(device=None, dtype=None) -> dict:
    """What every measured figure is stamped with: device name, dtype, torch version, time."""
    from .precision import device_name, resolve_device

    dev = resolve_device(device)
    meta = {
        "device": str(dev),
        "device_name": device_name(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    if dtype is not None:
        meta["dtype"] = str(dtype).replace("torch.", "")
    return meta


def jsonable(obj):
    """Make results JSON-safe: DataFrames -> records, tensors -> lists, NaN/inf -> None, dtypes -> str."""
    if isinstance(obj, pd.DataFrame):
        return [jsonable(r) for r in obj.to_dict(orient="records")]
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return jsonable(obj.tolist())
    if isinstance(obj, (torch.dtype, torch.device, Path)):
        return str(obj).replace("torch.", "")
    if hasattr(obj, "item") and callable(obj.item):  # numpy scalars
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if hasattr(obj, "to_dict"):
        return jsonable(obj.to_dict())
    return str(obj)


def _umask() -> int:
    mask = os.umask(0)  # the only way to read it: set and put back
    os.umask(mask)
    return mask


def atomic_write_bytes(path, data: bytes) -> Path:
    """Write via a temp file in the same folder, fsync, then rename: never a half-written file.

    The file gets the user's umask (mkstemp alone would leave it 0600), and temp files an earlier
    write left behind when its process was killed are removed first, so they never pile up.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*"):
        if _TEMP_SUFFIX.fullmatch(stale.name[len(path.name) + 2:]):
            stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def writable_dir(path, what: str) -> Path:
    """Check, before any work, that folder `path` exists or can be created, and takes new files.

    Probed with a temp folder made and removed in the nearest existing ancestor, so a bad run
    leaves nothing behind; raises OutputError naming `what` (e.g. "--out") and the fix.
    """
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file; give a folder")
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise OutputError(f"{what} {path}: {existing} is a file, not a folder; give another folder")
    try:
        tempfile.TemporaryDirectory(prefix=".tier_utils_probe.", dir=existing).cleanup()
    except OSError as exc:
        raise OutputError(f"{what} {path} is not writable ({exc.strerror or one_line(exc)} in {existing}); "
                          "give a folder you can write to") from exc
    return path


def writable_file(path, what: str, folder_made_by_run: bool = False) -> Path:
    """Check, before any work, that file `path` can be written: its folder exists and takes files,
    and it is not a folder. The folder is not created (a typo must not make folders), unless
    `folder_made_by_run` (it lies in an output folder the run creates)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputError(f"{what} {path} is a folder; give a file path such as {path / 'summary.json'}")
    if not path.parent.is_dir() and not folder_made_by_run:
        raise OutputError(f"{what} {path}: folder {path.parent} does not exist; create it or give another path")
    writable_dir(path.parent, what)
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{what} {path} exists and is read-only; give another path")
    return path


def write_json(path, obj) -> Path:
    return atomic_write_bytes(path, (json.dumps(jsonable(obj), indent=2) + "\n").encode())


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

    def overview(self) -> pd.DataFrame:
        """The short table that printing the result shows; `.table` is the full one."""
        return self.table

    # print(result), a REPL and a notebook show the overview, rounded, reasons whole; never a dump of the fields.
    def __repr__(self) -> str:
        head = self.headline() if hasattr(self, "headline") else type(self).__name__
        return f"{head}\n{self.overview().to_string(index=False, float_format=_short, max_colwidth=200)}"

    def _repr_html_(self) -> str:
        return self.overview().to_html(index=False, float_format=_short)  # the row numbers carry nothing


def _short(value: float) -> str:
    return f"{value:.4g}"
