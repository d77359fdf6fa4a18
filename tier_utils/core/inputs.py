"""Input checks made before any work starts: whole numbers, name selections, spellings, writable outputs."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import OutputError, one_line


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
