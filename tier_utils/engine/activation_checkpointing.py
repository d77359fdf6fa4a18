"""Activation checkpointing, the one implementation train, the benchmark, search and the fit planner share, so
what `fit` predicts with checkpointing is what `train` runs.

The repeated blocks (the longest nn.ModuleList of one module type: a transformer's layers) each run under
non-reentrant `torch.utils.checkpoint`: a block keeps only its inputs for backward and recomputes its
activations there. A transformers model that has `gradient_checkpointing_enable()` gets it (with
use_reentrant=False): transformers then also turns off the KV cache a recompute would fill twice. Either
way the same blocks are checkpointed; the planner's meter is told about each block's inputs, which
checkpointing keeps outside autograd's saved tensors.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..core.errors import NoRepeatedBlocks


def _block_list(model: nn.Module) -> nn.ModuleList | None:
    best = None
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > max(1, len(best or ())) and len({type(c) for c in m}) == 1:
            best = m
    return best


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer's blocks: the longest nn.ModuleList whose children all have one type."""
    return list(_block_list(model) or ())


@contextlib.contextmanager
def fewer_blocks(model: nn.Module, n: int):
    """`model` with only its first `n` repeated blocks for the block (a smaller probe of the same model: the
    forward loops over the shorter list), yielding them; all of them back after. Nothing is copied."""
    blocks = _block_list(model)
    whole = blocks._modules
    blocks._modules = dict(list(whole.items())[:n])
    try:
        yield list(blocks)
    finally:
        blocks._modules = whole


def require_blocks(model: nn.Module) -> int:
    """How many blocks checkpointing wraps; none is a one-line error naming the fix."""
    blocks = repeated_blocks(model)
    if not blocks:
        raise NoRepeatedBlocks(f"activation checkpointing needs repeated blocks (an nn.ModuleList of one layer "
                               f"type) and {type(model).__name__} has none; drop activation_checkpointing "
                               "(--checkpointing; bench's --activation-checkpointing)")
    return len(blocks)


def _hf_switch(model: nn.Module, on: bool):
    """The transformers model's own switch (a peft wrapper's base included): activation_checkpointing_enable
    (transformers 5) or gradient_checkpointing_enable (before it), or its disable; None if it has none."""
    found = getattr(model, "get_base_model", lambda: model)()
    if not getattr(found, "supports_gradient_checkpointing", False):
        return None
    verb = "enable" if on else "disable"
    return getattr(found, f"activation_checkpointing_{verb}", None) or getattr(found, f"gradient_checkpointing_{verb}",
                                                                              None)


def _use_cache(model: nn.Module, restore: bool) -> None:
    """transformers fills a KV cache no training step reads, and warns that it is incompatible with checkpointing,
    while its config's use_cache is on: off while checkpointing, the user's value back after."""
    config = getattr(getattr(model, "get_base_model", lambda: model)(), "config", None)
    if config is None:
        return
    if restore:
        if "tier_utils_use_cache" in vars(model):  # a config with no use_cache (an image model's) had none to turn off
            config.use_cache = vars(model).pop("tier_utils_use_cache")
    elif getattr(config, "use_cache", False):
        model.tier_utils_use_cache, config.use_cache = True, False


def enable_checkpointing(model: nn.Module) -> str:
    """Turn activation checkpointing on for `model`'s repeated blocks (NoRepeatedBlocks if it has none);
    returns how, for the result's words. `disable_checkpointing` turns it off."""
    n = require_blocks(model)
    switch = _hf_switch(model, True)
    if switch is not None:
        prefix = switch.__name__.split("_")[0]  # activation_checkpointing_kwargs or gradient_checkpointing_kwargs
        switch(**{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
        _use_cache(model, False)
        return f"{n} blocks, transformers' {switch.__name__} (non-reentrant)"
    blocks = repeated_blocks(model)
    for block in blocks:
        def forward(*args, _forward=block.forward, **kwargs):
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)
        block.forward = forward  # an instance attribute over the class's method, removed by disable
    return f"{n} blocks, torch.utils.checkpoint (non-reentrant)"


def disable_checkpointing(model: nn.Module) -> None:
    switch = _hf_switch(model, False)
    if switch is not None:
        switch()
        _use_cache(model, True)
        return
    for block in repeated_blocks(model):
        block.__dict__.pop("forward", None)


def checkpointing_on(model: nn.Module) -> bool:
    """Whether `model`'s blocks are checkpointed now (by enable_checkpointing)."""
    switch = _hf_switch(model, True)
    if switch is not None:
        base = getattr(model, "get_base_model", lambda: model)()
        flag = getattr(base, "is_activation_checkpointing", None)  # transformers 5's name
        return bool(base.is_gradient_checkpointing if flag is None else flag)
    return any("forward" in vars(b) for b in repeated_blocks(model))


@contextlib.contextmanager
def kept_inputs(model: nn.Module, meter):
    """For the block, `meter` (a SavedTensorMeter) is told about each block's floating-point inputs, which
    checkpointing keeps for the recompute outside autograd's saved tensors."""
    def keep(_module, args, kwargs):
        for a in (*args, *kwargs.values()):
            if torch.is_tensor(a) and a.is_floating_point():
                meter.add(a)
    hooks = [b.register_forward_pre_hook(keep, with_kwargs=True) for b in repeated_blocks(model)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def checkpointed(model: nn.Module, meter=None):
    """Activation checkpointing on `model`'s repeated blocks for the block; `meter`, if given, counts what it
    keeps (kept_inputs)."""
    enable_checkpointing(model)
    try:
        with kept_inputs(model, meter) if meter is not None else contextlib.nullcontext():
            yield repeated_blocks(model)
    finally:
        disable_checkpointing(model)


def memory_context(model: nn.Module, on: bool):
    """Checkpointing for the block when `on`, else nothing: the one switch the tiers' steps run under."""
    return checkpointed(model) if on else contextlib.nullcontext()
