"""LoRA through peft: low-rank adapters in fp32 over a frozen base, for train, the benchmark, search and `fit`.

`LoraSettings` is the one declaration (train's, the benchmark's and the panel's `lora`); `apply_lora` wraps a
model with `peft.get_peft_model` (peft keeps the adapters in fp32 over a bf16/fp16 base: autocast_adapter_dtype);
the base stays in the dtype it was loaded in, frozen, and the result names it. Targets default to the linear
layers inside the repeated blocks (attention and MLP), named as peft matches them: the module names' endings,
e.g. `self_attn.q_proj` or, for the built-in TinyGPT, `attn.qkv`. A training checkpoint holds the adapters
only (`model_state`); `save_pretrained` on the wrapped model writes peft's adapter folder, `merged_copy` a plain
model with the adapters folded in.
"""
from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch.nn as nn

from ..core.errors import LoraError
from ..core.settings import check_fields, setting
from .memory import repeated_blocks


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's settings (peft's LoraConfig: r, lora_alpha, lora_dropout, target_modules)."""

    r: int = setting(8, "adapter rank", low=1)
    alpha: float = setting(16, "adapter scale numerator: updates are scaled by alpha / r", above=0)
    dropout: float = setting(0.0, "dropout on the adapters' input", low=0, below=1)
    targets: tuple | None = setting(None, "linear layers to adapt, by name ending (none: the attention and MLP "
                                          "linear layers)")

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t for t in self.targets.split(",") if t.strip()))
        if self.targets is not None:
            object.__setattr__(self, "targets", tuple(str(t).strip() for t in self.targets) or None)
        try:
            check_fields(self)
        except ValueError as exc:
            raise LoraError(f"lora: {exc}; e.g. lora=LoraSettings(r=8, alpha=16) (--lora r=8,alpha=16)") from None

    @classmethod
    def parse(cls, text: str) -> LoraSettings:
        """'r=8,alpha=16,targets=q_proj,v_proj': names after targets= are all targets."""
        values, targets, key = {}, [], None
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, value = part.partition("=") if "=" in part else (key, "=", part)
            if key == "targets":
                targets.append(value)
                continue
            if not sep or key not in ("r", "alpha", "dropout"):
                raise LoraError(f"--lora {text!r}: expected r=N,alpha=X[,dropout=X][,targets=NAME,NAME], e.g. "
                                "r=8,alpha=16")
            try:
                values[key] = int(value) if key == "r" else float(value)
            except ValueError:
                raise LoraError(f"--lora {text!r}: {key}={value!r} is not a number") from None
        return cls(**values, targets=tuple(targets) or None)

    def describe(self) -> str:
        return f"LoRA r={self.r}, alpha={self.alpha:g}" + (f", targets {','.join(self.targets)}" if self.targets
                                                             else "")

    def to_dict(self) -> dict:
        return asdict(self)


def lora_setting(value) -> LoraSettings | None:
    """What a `lora` setting may be given as: None, 0 or 'off' (no LoRA), a rank (alpha = 2 x rank, peft's usual
    ratio), 'r=8,alpha=16,...', a dict of LoraSettings' fields, or LoraSettings."""
    if value is None or isinstance(value, LoraSettings):
        return value
    if isinstance(value, bool):
        raise LoraError(f"lora must be a rank, 'r=8,alpha=16' or LoraSettings, got {value!r}")
    if isinstance(value, int):
        return None if value == 0 else LoraSettings(r=value, alpha=2 * value)
    if isinstance(value, dict):
        return LoraSettings(**value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "0", "off", "none"):
            return None
        return lora_setting(int(text)) if text.isdigit() else LoraSettings.parse(value)
    raise LoraError(f"lora must be a rank, 'r=8,alpha=16' or LoraSettings, got {type(value).__name__}")


def _peft():
    try:
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
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=list(targets))
    source = getattr(model, "tier_utils_source", None)
    wrapped = peft.get_peft_model(model, config)
    if source is not None and source.spec and not source.kwargs:
        # What load_model(adapter folder) rebuilds the base from: the spec it was loaded by (a folder's absolute
        # path, a built-in's name), where peft would record a relative path or nothing.
        wrapped.peft_config["default"].base_model_name_or_path = source.spec
    return wrapped


def lora_static_bytes(model: nn.Module, settings: LoraSettings) -> dict:
    """What a LoRA training step holds before activations, without wrapping `model`: the frozen base's weights
    as they are, the fp32 adapters, their fp32 gradients and AdamW's two fp32 states and step count per adapter
    tensor (the keys of measure.static_memory)."""
    base = sum(p.numel() * p.element_size() for p in model.parameters())
    layers = _targeted(model, resolve_targets(model, settings))
    adapter = sum(settings.r * sum(m.weight.shape) for m in layers)  # r x (in + out), either weight layout
    return {"weights_bytes": base + 4 * adapter, "grads_bytes": 4 * adapter,
            "optimizer_state_bytes": 8 * adapter + 4 * 2 * len(layers)}


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


def convert_for(precision, model: nn.Module) -> nn.Module:
    """`precision.convert_module(model)`, except that a LoRA model's adapters stay in fp32: over a true mode's
    bf16/fp16 base too (peft casts their input to fp32 and their output back)."""
    precision.convert_module(model)
    if is_lora(model):
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.float()
    return model


def lora_record(model: nn.Module) -> dict | None:
    """The peft LoraConfig fields that wrap the base again as in training (load_model of a LoRA checkpoint)."""
    if not is_lora(model):
        return None
    c = model.peft_config["default"]
    return {"r": c.r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
            "target_modules": sorted(c.target_modules)}


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
