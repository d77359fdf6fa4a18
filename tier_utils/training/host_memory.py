"""Host memory before it is too late: a training run predicted to need more host RAM than is available is refused
in one line (`HostMemoryShort`) before it loads the weights or trains. A Colab CPU runtime (12.7 GB) ends the
kernel without a word otherwise, and everything the notebook held goes with it.

The prediction sizes the model that will be built, with no weights in memory: the caller's own module; the model
built on the meta device (shapes only, nothing allocated: a refused 70 B Llama's process stays under 1 GiB,
tested) from what the real load builds from: a save_pretrained folder's config.json (transformers builds the whole
model from it, whatever weights the folder holds: a partial download, .bin files only), a hub id's config (a small
download; offline and not cached, load_model's one line), a peft adapter folder's base, a training checkpoint's
recorded spec (its tensors, read whole beside the model as it loads, count too; read on the meta device here),
built-ins, file.py:Name, package.module:Name and hf:<ModelClass>. A folder's safetensors headers (read without
mapping the files; only those from_pretrained reads) size it where they hold more than its config builds, or where
no model builds; a checkpoint's tensors; else nothing is refused here. What it predicts:
- training on the CPU: the mode's static bytes, the planner's count (planning/memory_rows.py mode_static_bytes:
  weights, gradients and the optimizer state per trainable parameter, a frozen one's weight with LoRA); activations come
  on top, so it is a lower bound;
- training on a GPU: the weights as stored, which pass through host RAM on their way to the card.
Less what the caller's module already holds in host RAM. Available RAM is psutil's (TIER_UTILS_FREE_MEMORY
overrides it, core/budget.py).
"""
from __future__ import annotations

import json
import warnings
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn

from ..adapter.adapter import ModelAdapter
from ..core.budget import gib, read_budget
from ..core.device import device_facts
from ..core.errors import CheckpointError, HostMemoryShort
from ..core.hub import HUB_PREFIX, from_hub
from ..core.memory_settings import resolve_memory
from ..core.precision import Precision, resolve_precision
from ..models.checkpoint import load_checkpoint
from ..models.loading import auto_class, load_model, pretrained_task
from ..models.stored_dtype import config_dtype, folder_dtype, safetensors_counts
from ..planning.memory_rows import mode_static_bytes, quantized_bytes
from ..tasks import Task
from .config import TrainConfig


@dataclass(frozen=True)
class Weights:
    """A model's weights as host memory sees them, known without loading them."""

    name: str
    parameters: int
    stored_bytes: int  # in host RAM once loaded: in the dtype stored, or built (the caller's module: what it holds)
    module: nn.Module | None  # the caller's module or a meta-device build, for the planner's count (None: headers)
    resident: int = 0  # bytes the caller's module already holds in host RAM
    task: Task | None = None  # the task it is built as, where known: what LoRA trains in full follows it


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
        static = mode_static_bytes(weights.module, precision, memory, quantized_bytes() if memory.quantized else None,
                                   weights.task)
    else:  # headers only: every parameter trains, or with LoRA none does (its adapters are small)
        per = precision.param_dtype.itemsize if cfg.memory.lora else sum(precision.static_bytes_per_param().values())
        static = weights.parameters * per
    return max(static, weights.stored_bytes), (f"training {weights.name} on the CPU in {precision.name} (weights, "
                                               "gradients and AdamW state; activations come on top)")


def weights_of(model, model_kwargs: dict) -> Weights | None:
    """`model`'s weights as they will be built, without loading them (see the module's docstring); None where they
    cannot be sized so."""
    task = model.task if isinstance(model, ModelAdapter) else None
    if isinstance(model, ModelAdapter):
        model = model.model
    if isinstance(model, nn.Module):  # loaded already: in host RAM only what sits on the CPU (a GPU's adds none)
        on_host = _bytes([t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"])
        return Weights(type(model).__name__, sum(p.numel() for p in model.parameters()), on_host, model, on_host,
                       task)
    if not isinstance(model, (str, Path)):
        return None
    spec, path = str(model).strip(), Path(str(model).strip()).expanduser()
    if path.is_dir():
        return _folder(path, spec, model_kwargs)
    if path.is_file():
        return _checkpoint(path, spec)
    if spec.startswith(HUB_PREFIX) and not _is_class_name(spec[len(HUB_PREFIX):]):
        return _hub(spec, model_kwargs)
    try:  # shapes only: the meta device allocates nothing
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # the real build says them
            built = load_model(spec, **model_kwargs)
    except Exception:  # a model that cannot be built on the meta device, or a bad spec (the real build says so)
        return None
    return _built(spec, built)


def _folder(path: Path, spec: str, kwargs: dict) -> Weights | None:
    """A save_pretrained folder: the model its config builds, which from_pretrained builds whole whatever weights
    the folder holds (a partial download, .bin files only); its safetensors headers where no config builds one. A
    peft adapter folder: its base."""
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        try:
            base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        except (ValueError, AttributeError):  # not a JSON object: load_model says so
            return None
        return weights_of(base, kwargs) if base else None
    # Read for every folder: a damaged file is one line naming it here, not a traceback once loading has begun.
    counts = sum((safetensors_counts(f) for f in _loaded_files(path)), Counter())
    headers = Weights(spec, sum(counts.values()), sum(n * d.itemsize for d, n in counts.items()), None)
    built = None
    if (path / "config.json").is_file():
        try:
            import transformers

            config = transformers.AutoConfig.from_pretrained(path)
        except Exception:  # an architecture transformers doesn't know, a bad config: load_model says so
            config = None
        built = _from_config(config, spec, kwargs, folder_dtype(path, config)) if config is not None else None
    if built is None:
        return headers if counts else None
    # The larger: a file holding more than its config builds is mapped whole as it loads (a 128 GiB header beside a
    # tiny config was "unable to mmap", a traceback past the pre-flight).
    return replace(headers, task=built.task) if headers.stored_bytes > built.stored_bytes else built


def _loaded_files(path: Path) -> list[Path]:
    """The safetensors files from_pretrained reads: those its index names (stale shards and a peft adapter's file
    beside them are not), else model.safetensors; every .safetensors in a folder with neither."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            named = set(json.loads(index.read_text()).get("weight_map", {}).values())
        except (ValueError, AttributeError):  # not a JSON object: from_pretrained says so
            named = set()
        return sorted(path / name for name in named if (path / name).is_file())
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(f for f in path.glob("*.safetensors") if f.name != "adapter_model.safetensors")


def _hub(spec: str, kwargs: dict) -> Weights | None:
    """A hub id: the model its config builds (the config is a small download; offline and not cached, the one line
    load_model gives, said before anything loads)."""
    try:
        import transformers
    except ImportError:  # load_model says how to install it
        return None
    config = from_hub(transformers.AutoConfig.from_pretrained, spec[len(HUB_PREFIX):], "model config")
    return _from_config(config, spec, kwargs, config_dtype(config))


def _from_config(config, spec: str, kwargs: dict, stored: torch.dtype | None) -> Weights | None:
    """What load_model builds from a folder's or hub id's `config`, built on the meta device: model arguments that
    name config fields set them (as from_pretrained's do), in the dtype it loads in (the one asked, else as stored;
    where neither the config nor a header says, bf16, the smallest it could be: the prediction stays a lower
    bound). None where it cannot be built so."""
    for key, value in kwargs.items():
        if key not in ("dtype", "torch_dtype") and hasattr(config, key):
            setattr(config, key, value)
    asked = kwargs.get("dtype", kwargs.get("torch_dtype"))
    asked = getattr(torch, asked, None) if isinstance(asked, str) else asked  # "auto": as stored
    dtype = asked if isinstance(asked, torch.dtype) else stored or torch.bfloat16
    try:
        task, auto = pretrained_task(config, kwargs.get("task"), spec), auto_class(config, kwargs.get("task"), spec)
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # the real build says them
            built = auto.from_config(config, dtype=dtype)
    except Exception:  # e.g. a model only its own code builds: not sized
        return None
    return replace(_built(spec, built), task=task)


def _checkpoint(path: Path, spec: str) -> Weights | None:
    """A tier_utils training checkpoint: the model rebuilt from the spec it records, and its tensors, read whole
    into host RAM beside it as it loads; its tensors alone where the spec no longer builds (not a LoRA run's:
    those are its adapters only). None for any other file (load_model says what it is)."""
    try:
        state = load_checkpoint(path, meta=True)  # shapes and dtypes: none of the weights' bytes read
    except CheckpointError:
        return None
    recorded, saved = state.get("source") or {}, state.get("model")
    tensors = [t for t in saved.values() if isinstance(t, torch.Tensor)] if isinstance(saved, dict) else []
    # Tied tensors share one storage, in the file and in RAM: each storage counted once.
    unique = list({t.untyped_storage()._cdata: t for t in tensors}.values())
    held = sum(t.untyped_storage().nbytes() for t in unique)
    rebuilt = weights_of(recorded["spec"], dict(recorded.get("kwargs") or {})) if recorded.get("spec") else None
    if rebuilt is not None:
        return replace(rebuilt, name=spec, stored_bytes=rebuilt.stored_bytes + held)
    if recorded.get("lora") or not unique:
        return None
    return Weights(spec, sum(t.numel() for t in unique), held, None)


def _built(spec: str, built: nn.Module) -> Weights:
    """A model built on the meta device, as the planner counts it."""
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
