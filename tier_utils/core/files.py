"""Safe writes: JSON-safe conversion, atomic file replacement, and the lock that keeps one run per folder."""
from __future__ import annotations

import contextlib
import functools
import glob
import inspect
import json
import math
import os
import re
import tempfile
import warnings
from pathlib import Path

import pandas as pd
import psutil
import torch

from .errors import RunFolderBusy
from .inputs import writable_dir

# A temp file's name: .<target>.<writer's pid>.<mkstemp's 8 characters from [a-z0-9_]>. The pid says
# whose it is: only a dead writer's temp is stale; a live one's may be in flight in another run.
_TEMP_SUFFIX = re.compile(r"(\d+)\.[a-z0-9_]{8}")
LOCK_NAME = ".tier_utils.lock"


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
    if obj is pd.NA:  # a nullable column's missing value (whole-number batches with a SKIP row)
        return None
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

    The file gets the user's umask (mkstemp alone would leave it 0600), and temp files that a killed
    process left behind are removed first, so they never pile up; a live process's are left alone.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{glob.escape(path.name)}.*"):
        found = _TEMP_SUFFIX.fullmatch(stale.name[len(path.name) + 2:])
        if found and not psutil.pid_exists(int(found.group(1))):
            stale.unlink(missing_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.{os.getpid()}.", dir=path.parent)
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


@contextlib.contextmanager
def run_lock(folder, what: str = "run folder"):
    """Hold `folder`'s lock file (it holds this process's pid) for the block: a second run on the same folder
    raises RunFolderBusy naming the holder's pid, before it writes anything. The lock is an exclusive
    flock, which the OS drops when its holder dies, so a killed run's lock is taken over (with a warning).
    Unix only: where fcntl is missing (Windows) the folder is not locked."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    folder = writable_dir(folder, what)
    made = [f for f in (folder, *folder.parents) if not f.exists()]  # removed again if the run writes nothing
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_NAME
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderBusy(f"{what} {folder} is in use by another run (pid {holder}, lock file {lock}); wait "
                                "for it to finish or give another folder") from None
        # The holder before us may have removed the file between our open and our flock: lock the file
        # that is at the path now, not an unlinked one.
        if lock.exists() and os.stat(lock).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)
    try:
        before = os.read(fd, 32).decode(errors="replace").strip()
        if before:  # a holder that ended normally removed the file: this one was killed
            warnings.warn(f"took over {lock} from pid {before}, which is no longer running", stacklevel=3)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield lock
    finally:
        lock.unlink(missing_ok=True)
        os.close(fd)  # closing drops the flock
        for empty in made:  # deepest first; a folder the run wrote into stays
            try:
                empty.rmdir()
            except OSError:
                break


def holds_lock(param: str):
    """Decorator: the call holds `run_lock` on the folder its argument `param` names."""
    def decorate(func):
        signature = inspect.signature(func)

        @functools.wraps(func)
        def locked(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            with run_lock(bound.arguments[param], param):
                return func(*args, **kwargs)
        return locked
    return decorate
