"""transformers' from_pretrained through a task's Auto class, refusing any load that would not be the checkpoint's
own model: a config that Auto class has no head for, and a head that drops trained weights (transformers' UNEXPECTED
keys: a BART folder loaded as `BartForCausalLM` loses its encoder). Weights the checkpoint lacks (MISSING keys) are a
new head: allowed where the task takes one (a base folder fine-tuned as a classifier), said, and refused elsewhere
(a causal LM whose lm_head would start at random is not the user's model). A head resized to another shape
(transformers' mismatched keys, with `ignore_mismatched_sizes=True`) is new the same way. The modules holding the new
weights are returned with the model: the loader records them (`ModelSource.new_modules`) and LoRA trains them in full
(engine/lora.py)."""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn

from ..core.errors import ModelSpecError
from ..tasks import Task


def from_pretrained(transformers, task: Task, config, spec: str, load, **kwargs) -> tuple[nn.Module, tuple[str, ...]]:
    """`load(auto_class.from_pretrained, **kwargs)` for `task`'s Auto class, checked against the checkpoint, and the
    names of the modules whose weights start new (missing or resized)."""
    auto = getattr(transformers, task.auto_class)
    held = (getattr(config, "architectures", None) or [type(config).__name__.removesuffix("Config")])[0]
    logging = transformers.utils.logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # its load report: what it says is checked below and said in one line
    if task.takes_new_head and "num_labels" in kwargs:  # the user's classes: a head of another size starts anew
        kwargs = {"ignore_mismatched_sizes": True, **kwargs}
    if kwargs.get("quantization_config") is not None:
        kwargs = {**kwargs, "quantization_config": _heads_kept_whole(kwargs["quantization_config"], auto, config,
                                                                     task)}
    try:
        model, info = load(auto.from_pretrained, output_loading_info=True, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" not in str(exc):
            raise
        raise ModelSpecError(f"{spec} holds a {held}, which has no {task.name} head ({task.auto_class} does not "
                             f"take {type(config).__name__}); drop task= (--model-arg task=...) to load it as its "
                             "own architecture") from exc
    finally:
        logging.set_verbosity(verbosity)
    name = type(model).__name__
    dropped = sorted(info.get("unexpected_keys") or ())
    if dropped:
        raise ModelSpecError(f"loading {spec} as {name} would drop {len(dropped)} trained tensors ({_few(dropped)}): "
                             f"the folder holds a {held}; drop task= (--model-arg task=...) to load it as that")
    new = sorted({*(info.get("missing_keys") or ()), *(key for key, *_ in info.get("mismatched_keys") or ())})
    if new and not task.takes_new_head:
        raise ModelSpecError(f"loading {spec} as {name} would start {len(new)} tensors at random ({_few(new)}), so "
                             f"it would not be the model in the folder (a {held}); load it as that (drop task=)")
    if new:
        warnings.warn(f"{spec} holds no weights that fit {_few(new)}: {name}'s new head starts at random and is "
                      "trained (the base's weights are the folder's)", stacklevel=4)
    return model, tuple(dict.fromkeys(key.rpartition(".")[0] for key in new))


def _heads_kept_whole(quantization, auto, config, task: Task):
    """bitsandbytes' config with the head kept out of 4-bit (`llm_int8_skip_modules`): transformers' own rule
    keeps the output embeddings and the module of the model's last parameter *key*, which for a head with a bias is
    `classifier.bias`, matching no module, so BERT's classifier weight would be quantised and LoRA could not train it
    ("only Tensors of floating point dtype can require gradients"). Here: the output embeddings, the last parameter's
    module, and the task's head modules, read off the architecture built on the meta device (no weights)."""
    if quantization.llm_int8_skip_modules is not None:  # the caller's own choice
        return quantization
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        skeleton = auto.from_config(config)
    output = skeleton.get_output_embeddings()
    names = {name for name, m in skeleton.named_modules() if output is not None and m is output}
    names.add(list(skeleton.named_parameters())[-1][0].rpartition(".")[0])
    names |= {head for head in task.head_modules if any(n == head or n.startswith(head + ".")
                                                        for n, _ in skeleton.named_modules())}
    kept = copy.deepcopy(quantization)
    kept.llm_int8_skip_modules = sorted(names)
    return kept


def _few(names: list[str], k: int = 3) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")
