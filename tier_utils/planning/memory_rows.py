"""fit's rows over the memory settings: which (precision, memory) pairs it plans (full fine-tunes, 8-bit optimizer
state, LoRA over an fp32, fp16 or bf16 base, QLoRA's 4-bit base) and what each holds before activations."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..core.errors import TierError
from ..core.memory_settings import DecidedMemory, LoraSettings, MemorySettings
from ..core.precision import Precision
from ..engine.lora import lora_static_bytes, resolve_targets
from ..engine.quantization import quantized_bytes_per_param
from ..tasks import Task


def memory_rows(model: nn.Module, decided: list[Precision], lora: LoraSettings | None,
                optimizers: tuple) -> list[tuple[Precision, DecidedMemory | None]]:
    """(precision, decided memory) per row: each precision as a full fine-tune (None: AdamW); the fp32-weight ones
    again with each other optimizer; with `lora` (and a linear layer to adapt), LoRA over an fp32, fp16 and bf16
    base and QLoRA's 4-bit base, each under the precision computing in it, with each optimizer."""
    rows = [(prec, None) for prec in decided]
    fp32_weights = [prec for prec in decided if prec.param_dtype == torch.float32]
    rows += [(prec, _planned(MemorySettings(optimizer=o), None)) for prec in fp32_weights for o in optimizers
             if MemorySettings(optimizer=o) != MemorySettings()]  # the full fine-tune with AdamW is the row above
    if lora is None or not resolve_targets(model, lora):  # a model with no nn.Linear has nothing to adapt
        return rows
    for prec in fp32_weights:  # the base in what the mode computes in (BASE_DTYPES: by the mode's name)
        base = prec.compute_dtype
        rows += [(prec, _planned(MemorySettings(lora=lora, base_dtype=prec.name, optimizer=o), base))
                 for o in optimizers]
        if base.itemsize < 4 and quantized_bytes() is not None:  # QLoRA computes in a 2-byte dtype
            rows += [(prec, _planned(MemorySettings.qlora(lora, optimizer=o), base)) for o in optimizers]
    return rows


def _planned(settings: MemorySettings, base_dtype) -> DecidedMemory:
    return DecidedMemory(settings, base_dtype, "planned by fit")


def quantized_bytes() -> float | None:
    """NF4's bytes per quantised weight, quantisation state included, as bitsandbytes' Linear4bit holds them
    (engine.quantization measures it); None where QLoRA cannot be planned (bitsandbytes missing)."""
    try:
        return quantized_bytes_per_param()
    except TierError:  # bitsandbytes missing: its rows are left out
        return None


def mode_static_bytes(model: nn.Module, precision: Precision, memory: DecidedMemory | None = None,
                      quantized: float | None = None, task: Task | None = None) -> int:
    """What a mode holds before activations: per trainable parameter its weight and gradient in the precision's
    dtype and the optimizer's state (AdamW's two moments, or bitsandbytes' 8-bit ones: `memory`), a frozen one its
    weight; with LoRA, the frozen base, the adapters and the modules `task`'s LoRA trains in full (engine.lora's
    count; a 4-bit base: `quantized`)."""
    if memory is not None and memory.lora is not None:
        return sum(lora_static_bytes(model, memory, quantized, task).values())
    size = precision.param_dtype.itemsize
    trained = [p.numel() for p in model.parameters() if p.requires_grad]
    state = (memory.settings if memory is not None else MemorySettings()).optimizer_class.state_bytes(trained, size)
    return sum(p.numel() * size * (2 if p.requires_grad else 1) for p in model.parameters()) + state
