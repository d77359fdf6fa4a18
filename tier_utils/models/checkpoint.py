"""Training checkpoints: plain tensors and containers only, written atomically, read with weights_only=True.

A checkpoint never runs code when loaded: everything in it (RNG states included) is a tensor,
a number, a string or a list/dict of those, so `torch.load(weights_only=True)` accepts it and
refuses anything else.
"""
from __future__ import annotations

import hashlib
import io
import pickle
import re
from pathlib import Path

import torch

from ..core.errors import CheckpointError
from ..core.files import atomic_write_bytes

CHECKPOINT_NAME = "last.pt"
BEST_NAME = "best.pt"  # beside last.pt: the lowest val loss so far, in the same format
FORMAT = 1


def data_fingerprint(splits) -> dict:
    """What a resume must find again: the data's kind, both split sizes and a hash of three training
    examples (first, middle, last): cheap for any Dataset, and a changed file or tensor shows; and the validation
    split's identity, `val_sha1`: a hash of every validation example (what `compare` pairs two runs on)."""
    digest, n = hashlib.sha1(), len(splits.train)
    # An augmented example is drawn from torch's RNG as it is read: reading these must not move the run's RNG (a
    # run with checkpoints would train on other draws than one without).
    with torch.random.fork_rng(devices=[]):
        for i in sorted({0, n // 2, n - 1}):
            for key, value in sorted(splits.train[i].items()):
                digest.update(f"{key}={torch.as_tensor(value).flatten().tolist()};".encode())
        val = hashlib.sha1()
        for i in range(len(splits.val)):
            for key, value in sorted(splits.val[i].items()):
                tensor = torch.as_tensor(value).contiguous()
                val.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)};".encode() + tensor.numpy().tobytes())
    return {"source": splits.source, "train_examples": n, "val_examples": len(splits.val),
            "sample_sha1": digest.hexdigest(), "val_sha1": val.hexdigest()}


def same_data(saved: dict | None, now: dict | None) -> bool:
    """Whether a checkpoint's data fingerprint is this run's; one written before the validation hash was kept is
    judged on the rest."""
    if saved is None or now is None:
        return saved == now
    return saved == {k: v for k, v in now.items() if k in saved or k != "val_sha1"}


def describe_data(info: dict | None) -> str:
    if not info:
        return "data it did not record"
    return (f"{info['source']} data ({info['train_examples']} train / {info['val_examples']} val examples, "
            f"sample hash {info['sample_sha1'][:8]})")


def save_checkpoint(path, state: dict) -> Path:
    """torch.save into memory, then temp file + fsync + rename: a crash never leaves half a checkpoint.
    `path` may be a list: each gets the same bytes (last.pt and best.pt at once, serialised once)."""
    buf = io.BytesIO()
    torch.save({"format": FORMAT, **state}, buf)
    paths = path if isinstance(path, (list, tuple)) else [path]
    return [atomic_write_bytes(p, buf.getbuffer()) for p in paths][0]


def load_checkpoint(path, mmap: bool = False, meta: bool = False) -> dict:
    """Load a checkpoint on the CPU, refusing anything that is not plain tensors and containers. `mmap`: its
    tensors stay in the file until read, for a look at its other entries that costs no copy of the weights. `meta`:
    its tensors on the meta device, shapes and dtypes with none of their bytes read (the host-RAM pre-flight)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r} not found; check checkpoint_dir or drop resume")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty; delete it to start over")
    try:
        state = torch.load(path, map_location="meta" if meta else "cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        blocked = blocked_global(exc)
        if blocked is None:  # e.g. a raw pickle, or random bytes that happen to parse as one
            raise CheckpointError(f"refused to load {path}: it holds pickle instructions no tier_utils checkpoint "
                                  "uses (damaged, or not a tier_utils checkpoint); delete it to start over") from exc
        # torch's own message suggests weights_only=False: never repeat that for a file that may run code.
        raise CheckpointError(f"refused to load {path}: it references {blocked}, which no tier_utils checkpoint "
                              "holds (loading it could run code); only resume from checkpoints tier_utils "
                              "wrote") from exc
    except (RuntimeError, EOFError, OSError, ValueError, KeyError) as exc:  # torch's many ways to say "not mine"
        raise CheckpointError(f"cannot read checkpoint {path}: not a torch checkpoint or damaged "
                              f"({type(exc).__name__}); delete it to start over") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a tier_utils training checkpoint (format {FORMAT}); "
                              "point checkpoint_dir at a tier_utils run")
    return state


def blocked_global(exc: Exception) -> str | None:
    """The global torch's weights-only unpickler refused, e.g. 'posix.system'; None if it names none."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    return found.group(1) if found else None
