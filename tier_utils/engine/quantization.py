"""QLoRA's 4-bit base through bitsandbytes: the block Linear layers in NF4, everything else in the base dtype.

A transformers model is quantised while it loads, by transformers' `BitsAndBytesConfig` (`hf_quantization_config`,
passed to from_pretrained by `load_quantized`): the full-precision weights are never all in memory at once. Any
other module (a hand-written GPT, a built-in) has its block `nn.Linear` layers swapped for bitsandbytes'
`Linear4bit` in place (`quantize_linears`). Either way the embeddings and the output head stay in the base dtype,
as transformers and peft leave them by default (a tied head is the embedding; the head's logits are where 4-bit
costs the most accuracy); a classifier's head is named to transformers at load (`llm_int8_skip_modules`, filled
by models/pretrained.py from the task's head modules), since its own rule misses a head with a bias. The compute
dtype follows the precision decision (`Precision.compute_dtype`). NF4 without double quantisation, transformers'
default, so both paths hold the same bytes per weight.

`merge_to_plain` undoes it for `--merge`: the 4-bit weights dequantised, the LoRA adapters merged into them by
peft's merge_and_unload, the whole model in the base's stored dtype.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import replace

import torch
import torch.nn as nn

from ..core.errors import QuantizationError
from ..core.memory_settings import DecidedMemory
from ..core.optimizers import require_bitsandbytes
from ..models.loading import is_pretrained_spec, load_model, record_source, source_of
from ..tasks import Task
from .activation_checkpointing import repeated_blocks
from .lora import apply_lora, is_lora

QUANT_TYPE = "nf4"


def hf_quantization_config(compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for a 4-bit NF4 load (from_pretrained's quantization_config)."""
    require_bitsandbytes("a 4-bit base (QLoRA)")
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=QUANT_TYPE, bnb_4bit_compute_dtype=compute_dtype)


def quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The model's Linear4bit layers by full name (none: not quantised)."""
    bnb = sys.modules.get("bitsandbytes")  # not imported: nothing can be quantised, and the import costs seconds
    if bnb is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}


def _head_names(model: nn.Module, linears: dict[str, nn.Linear]) -> set[str]:
    """The output head: a Linear tied to an embedding, transformers' output embeddings, or the last Linear when it
    produces one logit per token of an embedding's vocabulary."""
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    tied = {e.weight.data_ptr() for e in embeddings}
    head = {n for n, m in linears.items() if m.weight.data_ptr() in tied}
    output = getattr(model, "get_output_embeddings", lambda: None)()
    head |= {n for n, m in linears.items() if m is output}
    vocab = {e.num_embeddings for e in embeddings} | {getattr(model, "vocab_size", None)}
    if linears:
        last, layer = list(linears.items())[-1]
        head |= {last} if layer.out_features in vocab else set()
    return head


def _targets(model: nn.Module) -> dict[str, nn.Linear]:
    """The Linear layers to quantise: those inside the repeated blocks (all of them without blocks), not the head."""
    linears = {n: m for n, m in model.named_modules() if type(m) is nn.Linear}
    inside = {id(m) for b in repeated_blocks(model) for m in b.modules()}
    head = _head_names(model, linears)
    return {n: m for n, m in linears.items() if n not in head and (not inside or id(m) in inside)}


def quantize_linears(model: nn.Module, compute_dtype: torch.dtype) -> list[str]:
    """`model`'s block nn.Linear layers swapped for bitsandbytes' Linear4bit (NF4, computing in `compute_dtype`),
    in place, each quantised on the device its weight is on; returns their names. Already quantised: those."""
    done = quantized_layers(model)
    if done:
        return list(done)
    bnb = require_bitsandbytes("a 4-bit base (QLoRA)")
    targets = _targets(model)
    if not targets:
        raise QuantizationError(f"{type(model).__name__} has no nn.Linear layer to quantise to 4 bits; drop bits=4 "
                                "(QLoRA) and train LoRA on its base as it is")
    for name, linear in targets.items():
        layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                           compute_dtype=compute_dtype, compress_statistics=False, quant_type=QUANT_TYPE,
                           device="meta")
        layer.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, compress_statistics=False,
                                         quant_type=QUANT_TYPE, module=layer)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
        model.set_submodule(name, layer.to(linear.weight.device))  # bitsandbytes quantises as it reaches a device
    trainable_layout(model)
    return list(targets)


@functools.lru_cache(maxsize=1)
def quantized_bytes_per_param() -> float:
    """NF4's bytes per weight with its quantisation state (the absmax per block, the code), measured on a
    Linear4bit layer quantised as quantize_linears does it: what its state dict holds, over its weight count."""
    probe = nn.Sequential(nn.ModuleList([nn.Sequential(nn.Linear(1024, 1024, bias=False)) for _ in range(2)]))
    quantize_linears(probe, torch.bfloat16)
    state = probe.state_dict()
    return sum(t.numel() * t.element_size() for t in state.values()) / (2 * 1024 * 1024)


def describe_quantized(model: nn.Module) -> str | None:
    """What a 4-bit base holds, for a result: "NF4 4-bit base (14 Linear4bit): block Linear layers in NF4,
    embeddings and head in bfloat16, compute in bfloat16"; None when nothing is quantised."""
    layers = quantized_layers(model)
    if not layers:
        return None
    rest = sorted({str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()
                   if n.rpartition(".")[0] not in layers and "lora_" not in n})  # not the adapters either
    compute = sorted({str(m.compute_dtype).removeprefix("torch.") for m in layers.values()})
    return (f"NF4 4-bit base ({len(layers)} Linear4bit): block Linear layers in NF4, embeddings and head in "
            f"{','.join(rest) or 'none'}, compute in {','.join(compute)}")


def require_adapters(model: nn.Module) -> None:
    """A 4-bit base trains through LoRA adapters only: its packed weights take no gradient, and a checkpoint of the
    whole model would hold them; a 4-bit model without adapters is one line, before any step."""
    if quantized_layers(model) and not is_lora(model):
        raise QuantizationError(f"{type(model).__name__} has a 4-bit base and no LoRA adapters to train; give lora "
                                "with bits=4 (QLoRA), or load the base without bits=4 for a full fine-tune")


def quantized_summary(model: nn.Module) -> dict:
    """What a result's model summary adds for a 4-bit base ({"quantized": describe_quantized}); {} for any other."""
    text = describe_quantized(model)
    return {"quantized": text} if text else {}


def load_quantized(spec, compute_dtype: torch.dtype, **kwargs) -> nn.Module:
    """load_model(spec, **kwargs) with a 4-bit NF4 base: a transformers folder or hub id quantised as it loads
    (BitsAndBytesConfig), any other spec built, then its block Linear layers quantised."""
    if is_pretrained_spec(spec):
        return trainable_layout(load_model(spec, quantization_config=hf_quantization_config(compute_dtype), **kwargs))
    model = load_model(spec, **kwargs)
    quantize_linears(model, compute_dtype)
    source = source_of(model)
    if source is not None:
        record_source(model, replace(source, quantized={"compute_dtype": str(compute_dtype).removeprefix("torch.")}))
    return model


def trainable_layout(model: nn.Module) -> nn.Module:
    """`model`'s Linear4bit layers kept in bitsandbytes' usual layout, in place. On a CPU with AVX512-BF16 a
    Linear4bit's forward in eval mode without gradients (the adapter's probe, smoke, analysis, evaluation) repacks
    its weight for an inference kernel, for good; that kernel has no backward, so the training steps after it get no
    gradient through the layer (torch only warns), and dequantize_4bit cannot read the packed bytes. Any layer
    already packed is unpacked, and none repacks. load_quantized calls it; call it on a 4-bit model built elsewhere
    before training it. Each layer's output also follows autocast as a linear layer's does (`_as_autocast`)."""
    from bitsandbytes.nn.modules import _convert_weight_packed_for_cpu_inverse  # what its state_dict() calls

    for layer in quantized_layers(model).values():
        layer.support_avx512bf16_for_cpu = False  # the switch its forward reads before repacking
        if _as_autocast not in layer._forward_hooks.values():
            layer.register_forward_hook(_as_autocast)
        if getattr(layer.weight.quant_state, "packing_format_for_cpu", False):
            layer.weight.data, layer.weight.quant_state = _convert_weight_packed_for_cpu_inverse(
                layer.weight.data, layer.weight.quant_state)
    return model


def _as_autocast(layer: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
    """A Linear4bit's output in autocast's dtype, as autocast gives an nn.Linear's: bitsandbytes returns its
    input's dtype, and a bf16 base's activations meeting fp16 autocast stop it ("Unexpected floating ScalarType in
    at::autocast::prioritize": a QLoRA benchmark's fp16 row, train --qlora --precision fp16 over a bf16 base)."""
    device = output.device.type
    if torch.is_autocast_enabled(device) and output.is_floating_point():
        return output.to(torch.get_autocast_dtype(device))
    return None


def _dequantize(model: nn.Module, dtype: torch.dtype) -> None:
    """Every Linear4bit back to an nn.Linear holding its weights dequantised, in `dtype`, in place."""
    import bitsandbytes as bnb

    trainable_layout(model)
    for name, layer in quantized_layers(model).items():
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        weight = bnb.functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)
        plain.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
        if layer.bias is not None:
            plain.bias = nn.Parameter(layer.bias.data.to(dtype), requires_grad=False)
        model.set_submodule(name, plain)
    hf = getattr(model, "hf_quantizer", None)
    if hf is not None:  # transformers' record of the quantisation goes with it: save_pretrained writes a plain model
        hf.remove_quantization_config(model)


def merge_to_plain(model: nn.Module, stored_dtype: torch.dtype) -> nn.Module:
    """A QLoRA model (or a bare 4-bit base) as a plain model in `stored_dtype`, for `--merge`: the base without its
    LoRA layers (peft's unload), its 4-bit weights dequantised straight into `stored_dtype`, the same adapters put
    back over it and folded in by peft's merge_and_unload (their product computed in fp32; peft's merge into a 4-bit
    layer would round the sum back to 4 bits), then every parameter in `stored_dtype`. Never the whole base in fp32:
    a 3 B model's would be 12.8 GB, past a T4 beside the trained model (a half-precision base: 6.4 GB). In place:
    `model` is spent."""
    wrapped = is_lora(model) and hasattr(model, "merge_and_unload")  # peft marks the base it wraps with LoRA too
    if wrapped:
        import peft

        config, adapters = model.peft_config["default"], peft.get_peft_model_state_dict(model)
        model = model.unload()
    _dequantize(model, stored_dtype)
    if wrapped:
        model = peft.get_peft_model(model, config)
        peft.set_peft_model_state_dict(model, adapters)
        model = model.merge_and_unload()
    for p in model.parameters():  # the weights only: buffers such as rotary frequencies keep their own dtype
        p.data = p.data.to(stored_dtype)
    return model


def apply_memory(model: nn.Module, memory: DecidedMemory, compute_dtype: torch.dtype | None = None,
                 task: Task | None = None) -> nn.Module:
    """`model` as `memory` trains it: with a 4-bit base (QLoRA) its block linear layers quantised to NF4
    (quantize_linears, computing in `compute_dtype`: the precision's), then LoRA's adapters over it, wrapped as
    `task`'s peft model (engine/lora.py)."""
    if memory.quantized:
        quantize_linears(model, compute_dtype or memory.base_dtype)  # already quantised (loaded so): kept as is
        trainable_layout(model)
    wrapped = apply_lora(model, memory.lora, task)
    require_adapters(wrapped)
    return wrapped
