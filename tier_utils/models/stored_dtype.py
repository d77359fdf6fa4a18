"""The dtype a model's weights are stored in, read where each kind of spec keeps it, and an fp32 view of them.

transformers 5 loads a checkpoint in the dtype it was saved in, and modern checkpoints are saved in bf16
(OPT-style ones in fp16). tier_utils loads them as stored (smoke and analysis run the model as loaded), records
the stored dtype on the model's `ModelSource`, and lets the precision strategy decide the master weights of a
training run (`Precision.convert_module`). Every result names both.
"""
from __future__ import annotations

import contextlib
import json
import math
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

from ..core.dtype_contexts import kept_dtypes
from ..core.errors import ModelSpecError
from ..core.precision import BASELINE, dtype_name

# safetensors' header names of the floating dtypes (its integer and bool tensors say nothing of the weights).
_SAFETENSORS = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
                "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_HEADER_LIMIT = 100_000_000  # safetensors' own cap on a header's length


def _dominant(counts: Counter) -> torch.dtype | None:
    """The floating dtype holding the most elements (a checkpoint that keeps its norms in fp32 is still bf16)."""
    return counts.most_common(1)[0][0] if counts else None


def tensors_dtype(tensors) -> torch.dtype | None:
    """The dtype most of the floating elements of `tensors` (parameters, a state dict's values) are held in."""
    counts = Counter()
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            counts[t.dtype] += t.numel()
    return _dominant(counts)


def parameters_dtype(model: nn.Module) -> torch.dtype | None:
    """What the model's parameters are held in now (tied ones counted once)."""
    return tensors_dtype(model.parameters())


def config_dtype(config) -> torch.dtype | None:
    """A transformers config's `dtype` (`torch_dtype` before transformers 5): what `save_pretrained` wrote."""
    value = getattr(config, "dtype", None)
    if value is None and "torch_dtype" in getattr(config, "__dict__", {}):
        value = config.__dict__["torch_dtype"]
    if isinstance(value, str):
        value = getattr(torch, value.removeprefix("torch."), None)
    return value if isinstance(value, torch.dtype) and value.is_floating_point else None


def safetensors_header(path) -> dict:
    """A .safetensors file's tensors as its header lists them ({name: {dtype, shape, data_offsets}}), read with
    plain reads: the 8-byte little-endian length, then that many bytes of JSON. Never mapped: safetensors' own
    reader maps the whole file, which fails as a traceback for a file past RAM + swap under strict overcommit. A
    damaged or short file is one line naming it (ModelSpecError)."""
    path = Path(path)

    def damaged(why: str) -> ModelSpecError:
        return ModelSpecError(f"{path} is not a readable safetensors file ({why}); save or download it again")

    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise damaged(f"{size} bytes, shorter than its 8-byte header length")
        length = int.from_bytes(head, "little")
        if length > _HEADER_LIMIT:  # read whole below: a corrupt length must not read gigabytes
            raise damaged(f"its header length {length:,} is over safetensors' 100 MB limit")
        if 8 + length > size:
            raise damaged(f"its header length {length:,} runs past the file's end at {size:,} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:  # bad JSON or bad UTF-8
            raise damaged(f"its header is not JSON: {exc}") from exc
    if isinstance(header, dict):
        header.pop("__metadata__", None)
    if not isinstance(header, dict) or not all(_is_entry(entry) for entry in header.values()):
        raise damaged("its header is not a table of tensors, each with a dtype, a shape and its data offsets")
    end = max((entry["data_offsets"][1] for entry in header.values()), default=0)
    if 8 + length + end > size:
        raise damaged(f"cut short: its header places {end:,} bytes of tensors, the file holds "
                      f"{size - 8 - length:,}")
    return header


def _is_entry(entry) -> bool:
    def ints(value) -> bool:
        return isinstance(value, list) and all(isinstance(n, int) and n >= 0 for n in value)

    return isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and ints(entry.get("shape")) \
        and ints(entry.get("data_offsets")) and len(entry["data_offsets"]) == 2


def safetensors_counts(path) -> Counter:
    """How many floating elements a .safetensors file holds in each dtype, from its header alone (no tensor is
    read)."""
    counts = Counter()
    for entry in safetensors_header(path).values():
        dtype = _SAFETENSORS.get(entry["dtype"])
        if dtype is not None:
            counts[dtype] += math.prod(entry["shape"])
    return counts


def safetensors_dtype(path) -> torch.dtype | None:
    """The dominant floating dtype of a .safetensors file, from its header alone."""
    return _dominant(safetensors_counts(path))


def folder_dtype(folder: Path, config) -> torch.dtype | None:
    """A save_pretrained folder's stored dtype: its config's, else its safetensors files' headers (None: neither
    says, e.g. pytorch_model.bin only)."""
    found = config_dtype(config)
    if found is not None:
        return found
    counts = Counter()
    for file in sorted(Path(folder).glob("*.safetensors")):
        dtype = safetensors_dtype(file)
        if dtype is not None:
            counts[dtype] += file.stat().st_size
    return _dominant(counts)


@contextlib.contextmanager
def fp32_copy(model: nn.Module):
    """The model with every floating parameter and buffer in fp32 for the block: the comparison rows' fp32
    reference for weights stored in bf16/fp16. Each tensor is back in its own dtype afterwards, bit for bit
    (bf16/fp16 -> fp32 -> back is exact; an fp32 buffer such as a rotary table never leaves fp32). Tensor by
    tensor, not module.float(): a 4-bit base's packed integer weights stay as they are (transformers refuses
    .float() on such a model), and its quantised layers keep computing in their own dtype."""
    with kept_dtypes(model):
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point():
                tensor.data = tensor.data.float()
        yield model


def fp32_reference(model: nn.Module, stored: torch.dtype | None) -> str:
    """How a comparison row names its fp32 reference: the model itself when it runs in fp32, else the copy."""
    held = parameters_dtype(model)
    packed = sum(not p.is_floating_point() for p in model.parameters())  # a quantised base's integer weights
    rest = f", its {packed} quantised weight tensors as loaded" if packed else ""
    if held in (None, torch.float32):
        return BASELINE + rest
    origin = f"{dtype_name(stored)}-stored" if stored == held else f"{dtype_name(held)}"
    return f"an fp32 copy of the {origin} weights{rest}"


def as_loaded(stored: torch.dtype | None, held: torch.dtype | None) -> str:
    """What smoke and analysis say of the weights they run: stored, and held as loaded (no master copy)."""
    stored_s = dtype_name(stored) if stored is not None else "in an unrecorded dtype"
    if held is None or stored == held:
        return f"weights stored {stored_s}, run as loaded ({dtype_name(held) if held is not None else stored_s})"
    held_s = dtype_name(held)
    return f"weights stored {stored_s}, held {held_s} (loaded into {held_s} parameters), run as held"
