"""Host memory before it is too late: a training run predicted to need more host RAM than is available is refused
in one line (`HostMemoryShort`) before it loads the weights or trains. A Colab CPU runtime (12.7 GB) ends the
kernel without a word otherwise, and everything the notebook held goes with it.

The prediction needs no weights in memory: the parameter count comes from the caller's own module, from the
safetensors headers of a save_pretrained folder, or from the model built on the meta device (built-ins,
file.py:Name, package.module:Name, hf:<ModelClass>: shapes only, nothing allocated). Specs it cannot size that
way (hub ids, checkpoint files, a build that fails on the meta device) are not refused here. What it predicts:
- training on the CPU: the mode's static bytes, the planner's count (planning/memory_rows.py mode_static_bytes:
  weights, gradients and the optimizer state per trainable parameter, a frozen one's weight with LoRA); activations come
  on top, so it is a lower bound;
- training on a GPU: the weights as stored, which pass through host RAM on their way to the card.
Less what the caller's module already holds in host RAM. Available RAM is psutil's (TIER_UTILS_FREE_MEMORY
overrides it, core/budget.py).
"""
from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from ..adapter.adapter import ModelAdapter
from ..core.budget import gib, read_budget
from ..core.device import device_facts
from ..core.errors import HostMemoryShort
from ..core.hub import HUB_PREFIX
from ..core.memory_settings import resolve_memory
from ..core.precision import Precision, resolve_precision
from ..models.loading import load_model
from ..models.stored_dtype import safetensors_counts
from ..planning.memory_rows import mode_static_bytes, quantized_bytes
from .config import TrainConfig


@dataclass(frozen=True)
class Weights:
    """A model's weights as host memory sees them, known without loading them."""

    name: str
    parameters: int
    stored_bytes: int  # in host RAM once loaded: in the dtype stored, or built (the caller's module: what it holds)
    module: nn.Module | None  # the caller's module or a meta-device build, for the planner's count (None: headers)
    resident: int = 0  # bytes the caller's module already holds in host RAM


def refuse_past_host_memory(model, model_kwargs: dict, cfg: TrainConfig, device: torch.device) -> None:
    """Raise HostMemoryShort when the run's predicted host RAM (above) is over what is available now."""
    weights = weights_of(model, model_kwargs)
    if weights is None:
        return
    precision = resolve_precision(cfg.precision, device, warn=False)
    peak, what = _peak(weights, precision, cfg, device)
    need = peak - weights.resident
    budget = read_budget("cpu")
    if need > budget.free_bytes:
        fix = "a GPU runtime, LoRA (--lora r=8) or a smaller model" if device.type == "cpu" else \
            "a machine with more RAM, or a smaller model"
        raise HostMemoryShort(f"{what} needs at least {_size(need)} more host RAM (predicted from its "
                              f"{weights.parameters:,} parameters), over the {_size(budget.free_bytes)} available "
                              f"({budget.source}); refused before loading, since running out of host RAM ends the "
                              f"process (a Colab kernel) without a word: use {fix}")


def _peak(weights: Weights, precision: Precision, cfg: TrainConfig, device: torch.device) -> tuple[int, str]:
    """The run's predicted peak host RAM and what takes it, in words."""
    if device.type != "cpu":
        return weights.stored_bytes, f"loading {weights.name} on its way to {device}"
    if weights.module is not None:
        stored = next((p.dtype for p in weights.module.parameters() if p.is_floating_point()), None)
        memory = resolve_memory(cfg.memory, precision, device_facts(device), stored)  # LoRA's base dtype, as run
        static = mode_static_bytes(weights.module, precision, memory, quantized_bytes() if memory.quantized else None)
    else:  # headers only: every parameter trains, or with LoRA none does (its adapters are small)
        per = precision.param_dtype.itemsize if cfg.memory.lora else sum(precision.static_bytes_per_param().values())
        static = weights.parameters * per
    return max(static, weights.stored_bytes), (f"training {weights.name} on the CPU in {precision.name} (weights, "
                                               "gradients and AdamW state; activations come on top)")


def weights_of(model, model_kwargs: dict) -> Weights | None:
    """`model`'s weights without loading them (see the module's docstring); None where they cannot be sized so."""
    if isinstance(model, ModelAdapter):
        model = model.model
    if isinstance(model, nn.Module):  # loaded already: in host RAM only what sits on the CPU (a GPU's adds none)
        on_host = _bytes([t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"])
        return Weights(type(model).__name__, sum(p.numel() for p in model.parameters()), on_host, model, on_host)
    if not isinstance(model, (str, Path)):
        return None
    spec, path = str(model).strip(), Path(str(model).strip()).expanduser()
    if path.is_dir():
        counts = sum((safetensors_counts(f) for f in sorted(path.glob("*.safetensors"))), Counter())
        return Weights(spec, sum(counts.values()), sum(n * d.itemsize for d, n in counts.items()), None) \
            if counts else None
    hub_id = spec.startswith(HUB_PREFIX) and not _is_class_name(spec[len(HUB_PREFIX):])
    if path.is_file() or hub_id:  # a checkpoint file; a download
        return None
    try:  # shapes only: the meta device allocates nothing
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # the real build says them
            built = load_model(spec, **model_kwargs)
    except Exception:  # a model that cannot be built on the meta device, or a bad spec (the real build says so)
        return None
    return Weights(spec, sum(p.numel() for p in built.parameters()), _bytes([*built.parameters(), *built.buffers()]),
                   built)


def _is_class_name(name: str) -> bool:
    """hf:<ModelClass> (built from a config, nothing downloaded), not a hub id (load_model's rule)."""
    return bool(name) and name[0].isupper() and "/" not in name


def _size(n: int) -> str:
    """Bytes in words: as the tiers print them, in KiB below a MiB (a small budget still reads as a number)."""
    return gib(n) if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
