"""The AMP benchmark's memory rows (BenchConfig.memory_rows): beside the precisions' rows, which train every weight,
one row per named memory setting (LoRA over a frozen base, QLoRA's 4-bit NF4 base, 8-bit AdamW), measured as the
precisions are (the same batches, timed repeats interleaved with theirs, static bytes, the CUDA peak, the accuracy
run) and judged against the fp32 baseline (verdicts.memory_row_check, parity, val accuracy). An adapter row trains a
small share of the weights, so its gap to the full fine-tune is a figure, WARN at most; a 4-bit row's loss curve is
judged against its 16-bit twin's where both ran (verdicts._judge_adapter_row).

Every row runs in the precision `auto` picks on the device, the one a user would train in here: the rows are timed
interleaved with the precisions, so the fastest precision this run measures is not known when they start.
A LoRA or QLoRA row trains its own copy of the model (models.loading.copied, then engine.quantization.apply_memory:
QLoRA quantises the copy, so the caller's model is never touched), from its own start: its adapters, initialised
from the run's seed. An 8-bit-optimizer row trains the run's model itself, its settings carried by the adapter it
runs with. A row that cannot run here (bitsandbytes or peft missing, no nn.Linear to quantise or adapt) is SKIPPED
with the reason. A 4-bit row's loss curve is compared with its 16-bit twin's where both ran (QLoRA with LoRA): what
the 4-bit base costs, apart from what training adapters instead of every weight costs.
"""
from __future__ import annotations

import copy
from dataclasses import replace

import torch

from ..core.budget import gib
from ..core.device import device_facts
from ..core.errors import LoraError, MemorySettingError, QuantizationError
from ..core.memory_settings import memory_setting, resolve_memory
from ..core.precision import resolve_precision
from ..engine.lora import model_state
from ..engine.quantization import apply_memory
from ..models.loading import copied
from .config import BenchConfig, memory_mode
from .measurements import AdapterStart, held_bytes
from .record import Plan, PrecisionRecord
from .verdicts import parity


def memory_row_plans(adapter, cfg: BenchConfig, dev: torch.device) -> list[tuple[Plan, str | None]]:
    """A Plan per name in `cfg.memory_rows`, eager in the precision `auto` picks on `dev`, each with the reason it
    cannot run here (None: it runs). The adapters' random start is drawn on a fork of the RNGs, from cfg.seed."""
    if not cfg.memory_rows:
        return []
    prec = resolve_precision("auto", dev, warn=False)
    cuda_rngs = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda_rngs):
        torch.manual_seed(cfg.seed)
        return [_row_plan(name, adapter, prec, dev) for name in cfg.memory_rows]


def _row_plan(name: str, adapter, prec, dev: torch.device) -> tuple[Plan, str | None]:
    """Row `name`'s Plan: its settings decided for `prec` here; a LoRA row with its own model copy and start."""
    plan = Plan(prec.name, memory_mode(name), prec, adapter, memory_row=name)
    settings = memory_setting(name)
    facts = device_facts(dev)
    try:
        settings.optimizer_class.require()  # missing: the reason names the extra
        if settings.lora is None:  # the run's model, with another optimizer
            return replace(plan, memory=resolve_memory(settings, prec, facts, adapter.stored_dtype)), None
        model = copied(adapter.model)
        held = resolve_memory(settings, prec, facts, adapter.stored_dtype, model)
        model = apply_memory(model, held, prec.compute_dtype, adapter.task)
    except (LoraError, QuantizationError, MemorySettingError) as exc:
        return plan, f"{settings.describe()}: {exc}"
    except torch.OutOfMemoryError:
        return plan, (f"{settings.describe()}: its copy of the model does not fit beside the run's "
                      f"({gib(held_bytes(adapter.model))} held); run it alone with memory={name!r}")
    own = replace(adapter, model=model, memory=held)
    return replace(plan, adapter=own, memory=held, start=AdapterStart(copy.deepcopy(model_state(model)))), None


def against_twin(records: list[PrecisionRecord], tolerance: float) -> None:
    """Each 4-bit memory row's loss curve against its twin's, the row whose settings differ only in the base's bits
    (QLoRA against LoRA), where both ran an accuracy run: in place, as its accuracy's "parity_vs_row"."""
    ran = [r for r in records if r.memory_row is not None and r.accuracy]
    for r in ran:
        asked = memory_setting(r.memory_row)
        sixteen = replace(asked, base_bits=16)
        twin = next((o for o in ran if memory_setting(o.memory_row) == sixteen), None) if sixteen != asked else None
        if twin is not None:
            r.accuracy["parity_vs_row"] = {"row": twin.memory_row, **parity(
                twin.accuracy["loss_curve"], r.accuracy["loss_curve"], tolerance)}
