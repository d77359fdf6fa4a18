"""`load_weights`: a safetensors file or a torch state dict into a built model (load_model's `weights=`)."""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

from ..core.errors import ModelSpecError, describe, one_line
from .stored_dtype import safetensors_dtype, tensors_dtype

# The keys a wrapper puts in front of a state dict's names: torch.compile's module and DDP's.
_WRAPPER_PREFIXES = ("_orig_mod.", "module.")


def load_weights(model: nn.Module, path) -> torch.dtype | None:
    """Load a safetensors file or a torch state dict (or a training checkpoint's 'model'/'state_dict' entry)
    into `model`; names a compiled or DDP module gave its weights are matched too. The values are copied into
    the model's parameters, which keep their dtype. Returns the dtype the file stores them in (a safetensors
    file's header says it)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelSpecError(f"weights file {str(path)!r} not found; give a .safetensors file or a torch state dict")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(file)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelSpecError(f"cannot read weights from {path} ({describe(exc, limit=160)}); give a .safetensors "
                             "file or a torch state dict saved with torch.save") from exc
    if isinstance(state, dict):
        state = next((state[k] for k in ("model", "state_dict") if isinstance(state.get(k), dict)), state)
    if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelSpecError(f"{path} holds no state dict (a mapping of names to tensors)")
    state = {_unwrapped(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shapes that differ: torch lists every one, the first says enough
        detail = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), one_line(exc))
        raise ModelSpecError(f"{path} does not fit {type(model).__name__} ({detail[:200]}); give the weights of "
                             "this architecture (and its arguments)") from exc
    missing = _untied(model, missing, state)
    if missing or unexpected:
        parts = [f"{label} {len(keys)} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})"
                 for label, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
        raise ModelSpecError(f"{path} does not fit {type(model).__name__}: {'; '.join(parts)}; give the weights of "
                             "this architecture (and its arguments)")
    return safetensors_dtype(file) if file.suffix == ".safetensors" else tensors_dtype(state.values())


def _unwrapped(key: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        key = key.removeprefix(prefix)
    return key


def _untied(model: nn.Module, missing: list[str], loaded: dict) -> list[str]:
    """Missing keys less those tied to a loaded tensor (an LM head sharing the embedding is saved once)."""
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in loaded if k in own}
    return [k for k in missing if own[k].data_ptr() not in loaded_ptrs]
