"""What a spec is before it loads: the task it will run as (the panel says it as the model is typed in), and its
head sized to the data.

The head follows the data: a pretrained classifier (a save_pretrained folder or a hub id) fine-tuned on the
user's classes is loaded with `num_labels` set to the data's class count, so transformers starts a head of that
size (`ignore_mismatched_sizes`: models/pretrained.py), the loader records it as new (`ModelSource.new_modules`)
and training trains it, under LoRA too. Decided before the model loads: loading the checkpoint's head and then
replacing it would load the weights twice. Only a spec can follow the data; a module passed in keeps its head, and
data with classes outside it is refused (data/images.py)."""
from __future__ import annotations

from pathlib import Path

from ..core.hub import HUB_PREFIX, from_hub
from ..tasks import Task, task_named
from .builtins import BUILTIN_MODELS
from .loading import is_pretrained_spec, pretrained_task


def spec_task(spec) -> Task | None:
    """The task `spec` loads as, read without building it: a built-in's declared task, a save_pretrained folder's
    config's architecture; None where only loading it tells (a file's class, a hub id: no download for this)."""
    spec = str(spec).strip()
    if spec in BUILTIN_MODELS:
        return task_named(BUILTIN_MODELS[spec].task)
    config = _config(spec) if not spec.startswith(HUB_PREFIX) and is_pretrained_spec(spec) else None
    return pretrained_task(config, None, spec) if config is not None else None


def sized_to_data(spec, kwargs: dict, data) -> dict:
    """`kwargs` for load_model(spec), with num_labels from the data where the spec is a pretrained model whose task
    takes a new head and the data's classes (two or more) differ from its head's count; else as given."""
    if "num_labels" in kwargs or not is_pretrained_spec(spec):
        return kwargs
    config = _config(str(spec).strip())
    if config is None:
        return kwargs
    task = pretrained_task(config, kwargs.get("task"), str(spec))
    classes = task.data_classes(data) if task.has_classes and task.takes_new_head else None
    if not classes or len(classes) < 2 or len(classes) == getattr(config, "num_labels", None):
        return kwargs
    return {**kwargs, "num_labels": len(classes)}


def _config(spec: str):
    """The model's config (a hub id's: a small download); None for a LoRA adapter folder (its base decides)."""
    import transformers

    if spec.startswith(HUB_PREFIX):
        return from_hub(transformers.AutoConfig.from_pretrained, spec[len(HUB_PREFIX):], "model config")
    path = Path(spec).expanduser()
    try:
        return transformers.AutoConfig.from_pretrained(path) if (path / "config.json").is_file() else None
    except (OSError, ValueError, KeyError):  # a config it can't read: load_model says so in its one line
        return None
