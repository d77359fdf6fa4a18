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
from dataclasses import dataclass

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


_NONE = object()  # a block with no forward of its own (the class's)


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing turned on for a model, and what `undo` puts back so the user's module runs as it
    came: each block's own `forward` attribute (none: the class's method), or the transformers switch and the
    configs' `use_cache`. Nothing is kept on the module."""

    model: nn.Module
    how: str  # for the result's words
    forwards: tuple = ()  # (block, the forward it held in its own attributes, or _NONE)
    use_cache: tuple = ()  # (config, its use_cache before) for each config turned off (transformers' switch only)

    def undo(self) -> None:
        if not self.forwards:
            _hf_switch(self.model, False)()
            for config, was in self.use_cache:
                config.use_cache = was
            return
        for block, own in self.forwards:
            if own is _NONE:
                vars(block).pop("forward", None)
            else:
                block.forward = own


def _caches_off(model: nn.Module) -> tuple:
    """Every config in `model` with use_cache on, turned off; (config, True) for each. transformers reads each
    module's own config (T5's and BART's decoder stacks hold a copy of the model's), and where one says use_cache
    while checkpointing it logs "`use_cache=True` is incompatible with gradient checkpointing", a red line in a
    notebook, and turns it off itself: the KV cache is for generation, and no training step reads it."""
    configs = {id(c): c for m in model.modules() if getattr(c := getattr(m, "config", None), "use_cache", False)}
    for config in configs.values():
        config.use_cache = False
    return tuple((c, True) for c in configs.values())


def enable_checkpointing(model: nn.Module) -> Checkpointing:
    """Turn activation checkpointing on for `model`'s repeated blocks (NoRepeatedBlocks if it has none); the
    record says how and turns it off again (`Checkpointing.undo`)."""
    n = require_blocks(model)
    switch = _hf_switch(model, True)
    if switch is not None:
        prefix = switch.__name__.split("_")[0]  # activation_checkpointing_kwargs or gradient_checkpointing_kwargs
        switch(**{f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}})
        return Checkpointing(model, f"{n} blocks, transformers' {switch.__name__} (non-reentrant)",
                             use_cache=_caches_off(model))  # the user's values back at undo
    forwards = []
    for block in repeated_blocks(model):
        forwards.append((block, vars(block).get("forward", _NONE)))

        def forward(*args, _forward=block.forward, **kwargs):
            return torch.utils.checkpoint.checkpoint(_forward, *args, use_reentrant=False, **kwargs)
        block.forward = forward  # an instance attribute over the block's forward, put back by undo
    return Checkpointing(model, f"{n} blocks, torch.utils.checkpoint (non-reentrant)", tuple(forwards))


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
    on = enable_checkpointing(model)
    try:
        with kept_inputs(model, meter) if meter is not None else contextlib.nullcontext():
            yield repeated_blocks(model)
    finally:
        on.undo()


def memory_context(model: nn.Module, on: bool):
    """Checkpointing for the block when `on`, else nothing: the one switch the tiers' steps run under."""
    return checkpointed(model) if on else contextlib.nullcontext()
