"""Safe writes: JSON-safe conversion and atomic file replacement."""
from __future__ import annotations

import glob
import json
import math
import os
import re
import tempfile
from pathlib import Path

import pandas as pd
import torch

# mkstemp's random part: 8 characters from [a-z0-9_] (tempfile._RandomNameSequence).
_TEMP_SUFFIX = re.compile(r"[a-z0-9_]{8}")


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
        mask = os.umask(0)  # the only way to read the umask: set it and put it back
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json(path, obj) -> Path:
    return atomic_write_bytes(path, (json.dumps(jsonable(obj), indent=2) + "\n").encode())
