"""LoRA through peft: low-rank adapters in fp32 over a frozen base, for train, the benchmark, search and `fit`.

`LoraSettings` (core/memory_settings.py, the memory settings' `lora`) is the one declaration; `apply_lora` wraps a
model with `peft.get_peft_model` (peft keeps the adapters in fp32 over a bf16/fp16 base: autocast_adapter_dtype);
`convert_for` then holds the frozen base in the decided memory's base dtype and the adapters in fp32, and the
result names both. Targets default to the linear
layers inside the repeated blocks (attention and MLP), named as peft matches them: the module names' endings,
e.g. `self_attn.q_proj` or, for the built-in TinyGPT, `attn.qkv`. A training checkpoint holds the adapters
only (`model_state`); `save_pretrained` on the wrapped model writes peft's adapter folder, `merged_copy` a plain
model with the adapters folded in.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import warnings

import torch
import torch.nn as nn

from ..core.errors import LoraError
from ..core.memory_settings import DecidedMemory, LoraSettings, lora_setting
from .activation_checkpointing import repeated_blocks

__all__ = ["LoraSettings", "lora_setting"]  # declared in core.memory_settings, beside the memory settings


@contextlib.contextmanager
def quiet_peft():
    """peft (and bitsandbytes, which peft imports) without two lines that tell the user nothing to act on, the one
    place that silences them (the CLI runs every verb inside it): transformers' FutureWarning for the deprecated
    `is_gradient_checkpointing` that peft reads as it wraps or loads an adapter folder (peft's to change), and
    bitsandbytes' hint, logged as it is first imported, that an optional `kernels` package would speed its CPU 4-bit
    path (it was often the last line on stderr, where the answer is read). Both come back afterwards: the
    warnings filters, and the bitsandbytes CPU logger's level (ERROR and above still show)."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


def _peft():
    try:
        with quiet_peft():
            import peft
    except ImportError as exc:
        raise LoraError("LoRA needs the peft package; pip install 'tier_utils[lora]' (or peft)") from exc
    return peft


def _is_linear(m: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's linear layers, weight stored transposed), which peft adapts too."""
    return isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"


def linear_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every linear layer by its full name."""
    return {name: m for name, m in model.named_modules() if _is_linear(m)}


def _layer_names(model: nn.Module) -> list[str]:
    """The linear layers as a user names them: within a block (`attn.qkv`), else in full; each once."""
    inside = {id(m): name for b in repeated_blocks(model) for name, m in b.named_modules() if _is_linear(m)}
    return list(dict.fromkeys(inside.get(id(m), name) for name, m in linear_layers(model).items()))


def _matches(full: str, target: str) -> bool:
    return full == target or full.endswith("." + target)  # peft's rule for a list of target_modules


def resolve_targets(model: nn.Module, settings: LoraSettings) -> tuple[str, ...]:
    """The target names: the settings' (each must match a linear layer), else every linear layer inside the
    repeated blocks (every linear layer when there are none)."""
    layers = linear_layers(model)
    if settings.targets is None:
        blocks = repeated_blocks(model)
        if not blocks:
            return tuple(layers)
        return tuple(dict.fromkeys(n for b in blocks for n, m in b.named_modules() if _is_linear(m)))
    missing = [t for t in settings.targets if not any(_matches(f, t) for f in layers)]
    if missing:
        raise LoraError(f"LoRA target {', '.join(missing)} matches no linear layer of {type(model).__name__}; its "
                        f"linear layers: {', '.join(_layer_names(model)) or 'none'}")
    return settings.targets


def _targeted(model: nn.Module, targets) -> list[nn.Linear]:
    return [m for f, m in linear_layers(model).items() if any(_matches(f, t) for t in targets)]


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config")


def apply_lora(model: nn.Module, settings: LoraSettings) -> nn.Module:
    """`model` wrapped by peft's get_peft_model: the base frozen in the dtype it has, the adapters trainable in
    fp32. The base module is changed in place (peft swaps its target layers for LoRA layers)."""
    if is_lora(model):
        raise LoraError(f"{type(model).__name__} already carries LoRA adapters (an adapter folder); drop lora "
                        "(--lora) to train those, or load the base model")
    peft = _peft()
    targets = resolve_targets(model, settings)
    if not targets:
        raise LoraError(f"{type(model).__name__} has no linear layer to adapt; LoRA needs nn.Linear layers")
    # A head the load started at random (models/pretrained.py: a classifier fine-tuned on the user's classes) is
    # trained whole beside the adapters: frozen, it would stay random.
    new_head = list(getattr(model, "tier_utils_new_head", ())) or None
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=list(targets), modules_to_save=new_head)
    source = getattr(model, "tier_utils_source", None)
    with quiet_peft():
        wrapped = peft.get_peft_model(model, config)
    if source is not None and source.spec and not source.kwargs:
        # What load_model(adapter folder) rebuilds the base from: the spec it was loaded by (a folder's absolute
        # path, a built-in's name), where peft would record a relative path or nothing.
        wrapped.peft_config["default"].base_model_name_or_path = source.spec
    return wrapped


def lora_static_bytes(model: nn.Module, memory: DecidedMemory, quantized: float | None = None) -> dict:
    """What a LoRA training step holds before activations, without wrapping `model`: the frozen base's weights in
    the decided base dtype (4-bit: the targeted linear layers' weights at `quantized` bytes each, NF4 with its
    quantisation state, the rest in the base dtype), the fp32 adapters, their fp32 gradients and the optimizer's
    state per adapter tensor (the keys of measure.static_memory)."""
    size = memory.base_dtype.itemsize
    layers = _targeted(model, resolve_targets(model, memory.lora))
    base = sum(p.numel() for p in model.parameters()) * size
    if memory.quantized:
        quantized_weights = sum(m.weight.numel() for m in layers)
        base -= quantized_weights * size - int(quantized_weights * quantized)
    tensors = [memory.lora.r * n for m in layers for n in m.weight.shape[::-1]]  # A: r x in, B: out x r
    adapter = sum(tensors)
    return {"weights_bytes": base + 4 * adapter, "grads_bytes": 4 * adapter,
            "optimizer_state_bytes": memory.optimizer.state_bytes(tensors)}


def describe_lora(model: nn.Module) -> dict | None:
    """What a LoRA run holds: settings, targets, trainable and total parameters, the base's dtype; None
    without LoRA."""
    if not is_lora(model):
        return None
    config = model.peft_config["default"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    frozen = {str(p.dtype).replace("torch.", "") for p in model.parameters() if not p.requires_grad}
    adapters = {str(p.dtype).replace("torch.", "") for p in model.parameters() if p.requires_grad}
    return {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
            "targets": sorted(config.target_modules), "trainable_parameters": trainable, "parameters": total,
            "trainable_share": trainable / total, "base_dtype": ",".join(sorted(frozen)),
            "adapter_dtype": ",".join(sorted(adapters)),
            "detail": f"LoRA r={config.r}, alpha={config.lora_alpha:g}: {trainable:,} of {total:,} parameters "
                      f"trainable ({trainable / total:.2%}), base frozen in {','.join(sorted(frozen))}, adapters in "
                      f"{','.join(sorted(adapters))}"}


def hold(model: nn.Module, memory: DecidedMemory | None) -> None:
    """Let `model` carry its decided memory settings (None: drop them), for a run that converts it per precision
    (the benchmark's rows): `convert_for` and `held_memory` read them."""
    if memory is None:
        vars(model).pop("tier_utils_memory", None)
    else:
        model.tier_utils_memory = memory


def held_memory(model: nn.Module) -> DecidedMemory | None:
    return getattr(model, "tier_utils_memory", None)


def convert_for(precision, model: nn.Module, memory: DecidedMemory | None = None) -> nn.Module:
    """`model` in the run's dtypes, in place: without LoRA the precision's (`convert_module`); with LoRA the frozen
    base in the decided base dtype (`memory`, else what the model holds: `hold`; a true mode's: its own) and the
    adapters in fp32 (peft casts their input to fp32 and their output back; autocast runs the base's compute in
    the mixed modes)."""
    if not is_lora(model):
        return precision.convert_module(model)
    memory = memory or held_memory(model)
    fp32_weights = precision.param_dtype == torch.float32
    base = memory.base_dtype if memory is not None and fp32_weights else precision.param_dtype
    for p in model.parameters():
        if p.is_floating_point():  # a 4-bit base's packed weights stay as bitsandbytes holds them
            p.data = p.data.float() if p.requires_grad else p.data.to(base)
    for m in model.modules():
        for name, b in m.named_buffers(recurse=False):
            # Under fp32 weights the buffers no checkpoint holds (rotary frequencies, computed at build) keep their
            # dtype, as from_pretrained leaves them at any dtype: so the trained model computes what its adapter
            # folder over a fresh load of the base computes. A true mode holds everything in its dtype.
            derived = name in m._non_persistent_buffers_set and fp32_weights
            if b.is_floating_point() and not derived:
                b.data = b.data.to(base)
    return model


def lora_record(model: nn.Module) -> dict | None:
    """The peft LoraConfig fields that wrap the base again as in training (load_model of a LoRA checkpoint)."""
    if not is_lora(model):
        return None
    c = model.peft_config["default"]
    return {"r": c.r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
            "target_modules": sorted(c.target_modules),
            **({"modules_to_save": sorted(c.modules_to_save)} if c.modules_to_save else {})}


def model_state(model: nn.Module, state: dict | None = None) -> dict:
    """What a training checkpoint keeps of `model` (or of `state`, its whole state dict gathered from FSDP's
    shards): with LoRA its adapters only, else the whole state dict."""
    if is_lora(model):
        return _peft().get_peft_model_state_dict(model, state_dict=state)
    return model.state_dict() if state is None else state


def load_model_state(model: nn.Module, state: dict) -> None:
    """`model_state`'s inverse; a state that does not fit raises RuntimeError (as load_state_dict does)."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    own = _peft().get_peft_model_state_dict(model)
    if set(own) != set(state):
        raise RuntimeError(f"adapter keys differ: {len(set(own) ^ set(state))} of them, e.g. "
                           f"{sorted(set(own) ^ set(state))[0]}")
    _peft().set_peft_model_state_dict(model, state)


def merged_copy(model: nn.Module) -> nn.Module:
    """A copy of a LoRA model with the adapters folded into the base weights: a plain model again."""
    return copy.deepcopy(model).merge_and_unload()


def unload(model: nn.Module) -> nn.Module:
    """The base model without its LoRA layers (peft's unload), as before apply_lora."""
    return model.unload() if is_lora(model) else model
