"""LoRA through peft: low-rank adapters in fp32 over a frozen base, for train, the benchmark, search and `fit`.

`LoraSettings` (core/memory_settings.py, the memory settings' `lora`) is the one declaration; `apply_lora` wraps a
model with `peft.get_peft_model` (peft keeps the adapters in fp32 over a bf16/fp16 base: autocast_adapter_dtype);
`Precision.convert_module` then holds the frozen base in the decided memory's base dtype and the adapters in fp32,
and the result names both. Targets default to the linear
layers inside the repeated blocks (attention and MLP), named as peft matches them: the module names' endings,
e.g. `self_attn.q_proj` or, for the built-in TinyGPT, `attn.qkv`. A training checkpoint holds the adapters
only (`model_state`); `save_pretrained` on the wrapped model writes peft's adapter folder, `merged_copy` a plain
model with the adapters folded in.

A transformers model is wrapped as its task's peft model (`Task.peft_task_type`: CAUSAL_LM, SEQ_CLS, SEQ_2_SEQ_LM),
which the adapter record keeps, so a checkpoint or adapter folder reloads as it trained; any other module as peft's
plain PeftModel (the task types' forwards call transformers' keyword arguments and `config`). Modules trained whole
beside the adapters (peft's modules_to_save, saved with them): those the loader started new or resized (a base
folder's new classifier head: `ModelSource.new_modules`), and the head peft's SEQ_CLS model adds itself. Each is
held twice, its frozen original in the base dtype and its trained copy in fp32; the byte counts count both.
"""
from __future__ import annotations

import contextlib
import copy
import logging
import sys
import warnings

import torch
import torch.nn as nn

from ..core.errors import LoraError
from ..core.memory_settings import DecidedMemory, LoraSettings, lora_setting
from ..core.precision import carries_adapters as is_lora  # the one test of peft's mark, by its name here
from ..models.loading import source_of
from ..tasks import Task
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


# The heads peft's PeftModelForSequenceClassification adds to modules_to_save itself (its own list in
# peft/peft_model.py), so what is counted before wrapping is what peft trains.
_PEFT_HEADS = {"SEQ_CLS": ("classifier", "score")}


def peft_task_type(model: nn.Module, task: Task | None) -> str | None:
    """The peft task type `model` is wrapped as: its task's for a transformers model, None (peft's plain PeftModel)
    for any other module or no task."""
    transformers = sys.modules.get("transformers")  # not imported: the model cannot be one of its classes
    hf = transformers is not None and isinstance(model, transformers.PreTrainedModel)
    return task.peft_task_type if hf and task is not None else None


def trained_in_full(model: nn.Module, task: Task | None) -> tuple[str, ...]:
    """The modules LoRA trains whole beside its adapters, as peft matches names: those the loader started new or
    resized, and the head peft's task type trains (only those `model` has)."""
    source = source_of(model)
    return _present(model, (*(source.new_modules if source is not None else ()),
                            *_PEFT_HEADS.get(peft_task_type(model, task), ())))


def _present(model: nn.Module, names) -> tuple[str, ...]:
    """`names` that match a module of `model` (peft's rule), each once."""
    full = [n for n, _ in model.named_modules()]
    return tuple(dict.fromkeys(t for t in names if any(_matches(f, t) for f in full)))


def apply_lora(model: nn.Module, settings: LoraSettings, task: Task | None = None) -> nn.Module:
    """`model` wrapped by peft's get_peft_model as `task`'s peft model (None: a module outside a run, peft's plain
    one): the base frozen in the dtype it has, the adapters and the modules trained in full (`trained_in_full`)
    trainable in fp32. The base module is changed in place (peft swaps its target layers for LoRA layers)."""
    if is_lora(model):
        raise LoraError(f"{type(model).__name__} already carries LoRA adapters (an adapter folder); drop lora "
                        "(--lora) to train those, or load the base model")
    peft = _peft()
    targets = resolve_targets(model, settings)
    if not targets:
        raise LoraError(f"{type(model).__name__} has no linear layer to adapt; LoRA needs nn.Linear layers")
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=list(targets), task_type=peft_task_type(model, task),
                             modules_to_save=list(trained_in_full(model, task)) or None)
    source = source_of(model)
    with quiet_peft():
        wrapped = peft.get_peft_model(model, config)
    for m in wrapped.modules():
        if hasattr(m, "original_module") and hasattr(m, "modules_to_save"):  # peft's ModulesToSaveWrapper
            m.register_forward_pre_hook(_to_trained_dtype)
            m.register_forward_hook(_to_base_dtype)
    if source is not None and source.spec and not source.kwargs:
        # What load_model(adapter folder) rebuilds the base from: the spec it was loaded by (a folder's absolute
        # path, a built-in's name), where peft would record a relative path or nothing.
        wrapped.peft_config["default"].base_model_name_or_path = source.spec
    return wrapped


def _to_trained_dtype(wrapper: nn.Module, args: tuple) -> tuple:
    """A module trained in full computes in its fp32 copy's dtype, as peft's adapters do: its input may come from a
    base held in bf16 or fp16 without autocast (an fp32 run over a bf16 base). With the adapters off
    (disable_adapter: the base scored against the fine-tune) its original runs, in the base's dtype."""
    held = wrapper.original_module if wrapper.disable_adapters else wrapper.modules_to_save
    dtype = next(held.parameters()).dtype
    return tuple(a.to(dtype) if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def _to_base_dtype(wrapper: nn.Module, args: tuple, output):
    """Its output in the frozen base's dtype, as the module it stands for gives it."""
    dtype = next(wrapper.original_module.parameters()).dtype
    return output.to(dtype) if torch.is_tensor(output) and output.is_floating_point() else output


def lora_static_bytes(model: nn.Module, memory: DecidedMemory, quantized: float | None = None,
                      task: Task | None = None) -> dict:
    """What a LoRA training step holds before activations, without wrapping `model`: the frozen base's weights in
    the decided base dtype (4-bit: the targeted linear layers' weights at `quantized` bytes each, NF4 with its
    quantisation state, the rest in the base dtype), the fp32 adapters and the fp32 copies of the modules trained in
    full (`trained_in_full` for `task`), their fp32 gradients and the optimizer's state per trained tensor (the keys
    of measure.static_memory)."""
    size = memory.base_dtype.itemsize
    layers = _targeted(model, resolve_targets(model, memory.lora))
    base = sum(p.numel() for p in model.parameters()) * size
    if memory.quantized:
        quantized_weights = sum(m.weight.numel() for m in layers)
        base -= quantized_weights * size - int(quantized_weights * quantized)
    full = trained_in_full(model, task)
    tensors = [memory.lora.r * n for m in layers for n in m.weight.shape[::-1]]  # A: r x in, B: out x r
    tensors += [p.numel() for f, m in model.named_modules() if any(_matches(f, t) for t in full)
                for p in m.parameters()]
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
    full = sorted(_present(model, config.modules_to_save or ()))
    return {"r": config.r, "alpha": config.lora_alpha, "dropout": config.lora_dropout,
            "targets": sorted(config.target_modules), "trainable_parameters": trainable, "parameters": total,
            "trainable_share": trainable / total, "base_dtype": ",".join(sorted(frozen)),
            "adapter_dtype": ",".join(sorted(adapters)), "trained_in_full": full,
            "task_type": config.task_type,
            "detail": f"LoRA r={config.r}, alpha={config.lora_alpha:g}: {trainable:,} of {total:,} parameters "
                      f"trainable ({trainable / total:.2%}), base frozen in {','.join(sorted(frozen))}, adapters in "
                      f"{','.join(sorted(adapters))}" + (f", {', '.join(full)} trained in full" if full else "")}




def lora_record(model: nn.Module) -> dict | None:
    """The peft LoraConfig fields that wrap the base again as in training (load_model of a LoRA checkpoint)."""
    if not is_lora(model):
        return None
    c = model.peft_config["default"]
    return {"r": c.r, "lora_alpha": c.lora_alpha, "lora_dropout": c.lora_dropout,
            "target_modules": sorted(c.target_modules), "task_type": c.task_type,
            "modules_to_save": sorted(c.modules_to_save) if c.modules_to_save else None}


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
