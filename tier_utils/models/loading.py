"""`load_model`, which turns any supported spec into an nn.Module."""
from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import pickle
import sys
import typing
import warnings
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn as nn

from ..core.errors import CheckpointError, ModelSpecError, describe, one_line
from ..core.hub import HUB_PREFIX, from_hub
from ..data.tokenizer import is_tokenizer_folder
from ..tasks import CAUSAL_LM, Task, recognized_task, task_named, unsupported_encoder_decoder
from .builtins import BUILTIN_MODELS, DEFAULT_MODEL, DEMO_MODEL
from .checkpoint import blocked_global, load_checkpoint
from .demo_model import load_demo
from .pretrained import from_pretrained
from .stored_dtype import config_dtype, folder_dtype, parameters_dtype, tensors_dtype
from .weights import load_weights


@dataclass(frozen=True)
class ModelSource:
    """Where a model came from, kept beside the module (`source_of`; the adapter carries it into every tier): its
    tokenizer follows it into every tier, and a training checkpoint records it so `load_model(checkpoint)` can
    rebuild the model."""

    spec: str | None  # None: a module built in Python, which no spec rebuilds
    kwargs: dict = field(default_factory=dict)
    tokenizer: object = None  # the tokenizer that goes with the weights (a load_tokenizer spec); None: bytes
    weights: str | None = None
    # The dtype the weights are stored in (stored_dtype.py): the config's or the safetensors header's for a folder,
    # the tensors' for a checkpoint or --weights file, the parameters' for a module built here. The model is
    # loaded in it; a training run's precision decides its master weights. A checkpoint does not keep it: its
    # own tensors say it.
    stored_dtype: torch.dtype | None = None
    lora: dict | None = None  # a LoRA run's peft LoraConfig fields: its checkpoint holds the adapters only
    # A 4-bit NF4 base's settings ({"compute_dtype": "bfloat16"}; engine/quantization.py), None for a plain one.
    quantized: dict | None = None
    # The modules whose weights the loader started new or resized (a base folder's new classifier head:
    # models/pretrained.py): LoRA trains them in full beside its adapters (peft's modules_to_save).
    new_modules: tuple[str, ...] = ()

    def record(self, tokenizer: str | None, lora: dict | None = None) -> dict:
        """What a checkpoint keeps (plain values, so weights_only reads it), with the tokenizer as a loadable spec."""
        return {"spec": self.spec, "kwargs": self.kwargs, "tokenizer": tokenizer, "weights": self.weights,
                "lora": lora, "quantized": self.quantized}


# What tier_utils knows of each module it loaded, kept beside the module for as long as it lives, never as an
# attribute of it: the user's module comes back as it was given.
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def source_of(model: nn.Module) -> ModelSource | None:
    """The record `load_model` keeps beside `model` (a peft wrapper's: beside the model it wraps); None: a module
    built in Python and never loaded through load_model."""
    found = _SOURCES.get(model)
    base = getattr(model, "get_base_model", None)
    return found if found is not None or base is None else _SOURCES.get(base())


def record_source(model: nn.Module, source: ModelSource) -> nn.Module:
    """`source` kept beside `model` (replacing any before); returns the model."""
    _SOURCES[model] = source
    return model


def copied(model: nn.Module) -> nn.Module:
    """A deep copy of `model` with its record beside the copy too: a copy trains, saves and reloads as the original
    (its tokenizer, spec and the modules its loader started new)."""
    twin = copy.deepcopy(model)
    source = source_of(model)
    return twin if source is None else record_source(twin, source)


def load_model(spec=DEFAULT_MODEL, weights=None, tokenizer=None, **kwargs) -> nn.Module:
    """Turn a spec into an nn.Module.

    Accepted specs: an nn.Module (returned as is, HF models included); a built-in name
    (`tiny-gpt`, `tiny-encoder`; kwargs set sizes); `tiny-gpt-trained` (the shipped trained demo
    model, tier_utils/models/demo_model.py; no kwargs); `path/to/file.py:Name` or
    `package.module:Name` (a class or factory, called with kwargs; the file's folder is importable
    while it loads); a folder written by `save_pretrained` (transformers' Auto class for the task its
    config names; `task=` overrides, other kwargs go to from_pretrained); `hf:ORG/NAME` (the same from
    the hub; needs network); `hf:<ModelClass>` (a transformers model built from a config made of
    kwargs, random weights); a training checkpoint tier_utils wrote (`runs/x/checkpoints/last.pt`,
    rebuilt from the spec it records, then its weights loaded).
    weights: a safetensors file or a torch state dict loaded into the model (missing or unexpected
    keys are refused in one line).
    tokenizer: the tokenizer every tier feeds this model (`load_tokenizer` spec or object); None keeps
    the model's own (its folder's or hub id's; bytes for the rest). It travels with the module.
    The dtype the weights are stored in is recorded (`source_of(model).stored_dtype`) and a folder or hub
    model is loaded in it (`dtype=` in kwargs overrides); a training run's precision decides its master weights.
    """
    model = _build(spec, kwargs)
    stored = load_weights(model, weights) if weights is not None else None
    if weights is not None or tokenizer is not None:
        source = source_of(model) or ModelSource(None, stored_dtype=parameters_dtype(model))
        record_source(model, replace(source, weights=str(weights) if weights is not None else source.weights,
                                     tokenizer=tokenizer if tokenizer is not None else source.tokenizer,
                                     stored_dtype=stored or source.stored_dtype))
    return model


def is_pretrained_spec(spec) -> bool:
    """Does `spec` load through transformers' from_pretrained (a save_pretrained or peft adapter folder, a hub id),
    which can quantise the weights as they load? `hf:<ModelClass>` builds random weights from a config instead."""
    if not isinstance(spec, (str, Path)):
        return False
    text = str(spec).strip()
    if text.startswith(HUB_PREFIX):
        return _model_class(_transformers(), text[len(HUB_PREFIX):]) is None
    path = Path(text).expanduser()
    return path.is_dir() and any((path / name).is_file() for name in ("config.json", "adapter_config.json"))


def _model_class(transformers, name: str):
    """transformers' model class called `name` (one with a config class), else None."""
    cls = getattr(transformers, name, None)
    return cls if inspect.isclass(cls) and getattr(cls, "config_class", None) is not None else None


def _quantization(kwargs: dict) -> tuple[dict, dict | None]:
    """from_pretrained's kwargs less its quantization_config (an object, not a value a checkpoint can record), and
    what the source records of it."""
    config = kwargs.get("quantization_config")
    if config is None:
        return kwargs, None
    rest = {k: v for k, v in kwargs.items() if k != "quantization_config"}
    return rest, {"compute_dtype": str(config.bnb_4bit_compute_dtype).removeprefix("torch.")}


def _build(spec, kwargs: dict) -> nn.Module:
    if isinstance(spec, nn.Module):
        if kwargs:
            raise ModelSpecError("keyword arguments are only used when building a model from a spec, not for an "
                                 "instance; for task, vocab_size, max_len or num_classes use adapt(model, max_len=N)")
        return spec
    if isinstance(spec, Path):
        spec = str(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ModelSpecError(f"model spec must be a string or an nn.Module, got {type(spec).__name__}")
    spec = spec.strip()
    if spec == DEMO_MODEL:
        return _sourced(load_demo(**kwargs), spec, kwargs)
    if spec in BUILTIN_MODELS:
        _check_types(BUILTIN_MODELS[spec], kwargs, spec)
        return _sourced(_construct(BUILTIN_MODELS[spec], kwargs, spec), spec, kwargs)
    if spec.startswith(HUB_PREFIX):
        return _load_hf(spec[len(HUB_PREFIX):], kwargs)
    path = Path(spec).expanduser()
    if path.is_dir():
        return _load_folder(path, spec, kwargs)
    if path.is_file():
        return _load_checkpoint_file(path, kwargs)
    if ":" not in spec:
        hint = f"; a hub model is written hf:{spec}" if "/" in spec or spec.islower() else ""
        raise ModelSpecError(f"unknown model {spec!r} (no such built-in, folder or file{hint}); use a built-in "
                             f"({', '.join([*BUILTIN_MODELS, DEMO_MODEL])}), a save_pretrained folder, hf:ORG/NAME, "
                             "path/file.py:Name, package.module:Name or a tier_utils checkpoint")
    where, _, name = spec.rpartition(":")
    module = _import_file(where) if where.endswith(".py") else _import_module(where)
    if not hasattr(module, name):
        raise ModelSpecError(f"{where} has no attribute {name!r}; check the name after ':'")
    # Recorded with an absolute path: a checkpoint rebuilds it from any working directory.
    recorded = f"{Path(where).expanduser().resolve()}:{name}" if where.endswith(".py") else spec
    return _sourced(_construct(getattr(module, name), kwargs, spec), recorded, kwargs)


def _sourced(model: nn.Module, spec: str, kwargs: dict, tokenizer: str | None = None,
             stored: torch.dtype | None = None, quantized: dict | None = None, new: tuple[str, ...] = ()) -> nn.Module:
    """`stored`: what the spec's files say the weights are stored in; None: the parameters' dtype as built."""
    return record_source(model, ModelSource(spec, dict(kwargs), tokenizer, quantized=quantized, new_modules=new,
                                            stored_dtype=stored or parameters_dtype(model)))


def _import_file(path: str):
    file = Path(path).expanduser()
    if not file.is_file():
        raise ModelSpecError(f"model file {path!r} not found; give a path to an existing .py file")
    mod_name = f"tier_utils_user_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses and pickling look the module up here
    folder = str(file.resolve().parent)
    # The file imports its neighbours (`from model import GPT`) as it would when run from its folder.
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[mod_name]
        raise ModelSpecError(f"importing {path} raised {describe(exc, limit=None)}; fix the file") from exc
    finally:
        sys.path.remove(folder)
    return module


def _import_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ModelSpecError(f"cannot import module {name!r} ({one_line(exc)}); check it is installed or on "
                             "PYTHONPATH") from exc


_TYPE_NAMES = {int: "an int", float: "a number", bool: "True or False", str: "a string"}


def _check_types(cls, kwargs: dict, spec: str) -> None:
    """A built-in's arguments against its annotations, so `d_model='abc'` says "d_model takes an int", not what
    torch says deep inside the constructor."""
    hints = typing.get_type_hints(cls.__init__)
    for name, value in kwargs.items():
        kind = hints.get(name)
        if kind not in _TYPE_NAMES:
            continue
        if kind is bool:
            ok = isinstance(value, bool)
        else:  # True is an int to Python, not to a user
            ok = isinstance(value, (int, float) if kind is float else kind) and not isinstance(value, bool)
        if not ok:
            raise ModelSpecError(f"{spec}: {name} takes {_TYPE_NAMES[kind]}, got {value!r}; check its arguments")


def _construct(factory, kwargs: dict, spec: str) -> nn.Module:
    if isinstance(factory, nn.Module):
        if kwargs:
            raise ModelSpecError(f"{spec} is a module instance; it takes no keyword arguments")
        return factory
    if not callable(factory):
        raise ModelSpecError(f"{spec} is a {type(factory).__name__}, not a model class or factory")
    try:
        model = factory(**kwargs)
    except ModelSpecError:
        raise
    except Exception as exc:
        raise ModelSpecError(f"building {spec} raised {describe(exc, limit=None)}; check its arguments") from exc
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"{spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ModelSpecError("Hugging Face models need the transformers package; pip install 'tier_utils[hf]' "
                             "(or transformers)") from exc
    return transformers


def _load_hf(name: str, kwargs: dict) -> nn.Module:
    """`hf:<ModelClass>` builds random weights from a config; anything else is a hub id."""
    transformers = _transformers()
    cls = _model_class(transformers, name)
    if cls is not None:
        try:
            model = cls(cls.config_class(**kwargs))
        except Exception as exc:
            raise ModelSpecError(f"building hf:{name} raised {describe(exc, limit=None)}; check the config") from exc
        return _sourced(model, HUB_PREFIX + name, kwargs)
    if not name or name[0].isupper() and "/" not in name:
        raise ModelSpecError(f"transformers has no model class {name!r}; e.g. hf:GPT2LMHeadModel, or a hub id "
                             "such as hf:gpt2")
    task = kwargs.pop("task", None)
    config = from_hub(transformers.AutoConfig.from_pretrained, name, "model config")
    chosen = _hf_task(config, task, HUB_PREFIX + name)
    stored = config_dtype(config)  # the header would need the weights' download: the config says it
    model, new = from_pretrained(transformers, chosen, config, HUB_PREFIX + name,
                                 lambda load, **kw: from_hub(load, name, "model", **kw), **_load_dtype(kwargs, stored))
    kwargs, quantized = _quantization(kwargs)
    return _sourced(model, HUB_PREFIX + name, {**kwargs, **({"task": task} if task else {})}, HUB_PREFIX + name,
                    stored, quantized, new)


@contextmanager
def _no_loading_bar(transformers):
    """transformers' "Loading weights" bar off while a local folder loads (it takes no time, and in a notebook
    each bar is a widget left behind in the cell); its setting is the user's again afterwards."""
    logging = transformers.utils.logging
    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()


def _load_folder(path: Path, spec: str, kwargs: dict) -> nn.Module:
    """A folder save_pretrained wrote: its config names the architecture, its tokenizer files (if any) the
    tokenizer. A peft adapter folder gives its base (which its adapter_config.json names) with the adapter."""
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        return _load_adapter_folder(path, spec, kwargs)
    if not (path / "config.json").is_file():
        raise ModelSpecError(f"{spec} is a folder with no config.json, so not a save_pretrained model folder; "
                             "give the folder transformers wrote, or a built-in / file.py:Name spec")
    transformers = _transformers()
    task = kwargs.pop("task", None)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
        chosen = _hf_task(config, task, spec)
        stored = folder_dtype(path, config)
        with _no_loading_bar(transformers):
            model, new = from_pretrained(transformers, chosen, config, spec, lambda load, **kw: load(path, **kw),
                                         **_load_dtype(kwargs, stored))
    except ModelSpecError:
        raise
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ModelSpecError(f"loading the model folder {spec} raised {describe(exc, limit=200)}; check the folder "
                             "(config.json and model.safetensors or pytorch_model.bin)") from exc
    path = path.resolve()  # recorded absolute: a checkpoint finds it from any working directory
    tokenizer = str(path) if chosen.preprocessor_in(path) else None
    if tokenizer is None:
        warnings.warn(f"{spec} holds no {chosen.preprocessor_what} files: {chosen.without_preprocessor}",
                      stacklevel=4)
    kwargs, quantized = _quantization(kwargs)
    return _sourced(model, str(path), {**kwargs, **({"task": task} if task else {})}, tokenizer, stored, quantized,
                    new)


def _load_dtype(kwargs: dict, stored: torch.dtype | None) -> dict:
    """from_pretrained's arguments with the load dtype decided here: as stored (smoke and analysis run the model as
    loaded; a training run's precision upcasts it to its master weights). "auto" where no config or header says
    (transformers then reads the weights'); a dtype the user passed wins."""
    if "dtype" in kwargs or "torch_dtype" in kwargs:
        return kwargs
    return {**kwargs, "dtype": stored or "auto"}


def _load_adapter_folder(path: Path, spec: str, kwargs: dict) -> nn.Module:
    """peft's adapter folder: the base model its adapter_config.json names (any load_model spec), with the
    adapter loaded by PeftModel.from_pretrained, trainable; the folder's tokenizer, else the base's."""
    try:
        import peft
    except ImportError as exc:
        raise ModelSpecError(f"{spec} is a LoRA adapter folder; reading it needs peft: pip install "
                             "'tier_utils[lora]' (or peft)") from exc
    base_spec = peft.PeftConfig.from_pretrained(path).base_model_name_or_path
    if not base_spec:
        raise ModelSpecError(f"{spec}/adapter_config.json names no base model (base_model_name_or_path); set it to "
                             "the base's folder or spec")
    base = _build(base_spec, kwargs)
    from safetensors import SafetensorError  # installed with peft

    try:  # peft reads adapter_model.safetensors, else a pickled adapter_model.bin with torch.load(weights_only=True)
        model = peft.PeftModel.from_pretrained(base, path, is_trainable=True, autocast_adapter_dtype=True)  # fp32
    except pickle.UnpicklingError as exc:  # torch's message suggests weights_only=False: never for a foreign file
        what = f"it references {blocked_global(exc)}" if blocked_global(exc) else "it holds pickle instructions"
        raise ModelSpecError(f"refused to load the adapter in {spec}: {what}, which no adapter's weights hold "
                             "(loading it could run code); use adapter folders from a source you trust, saved as "
                             "safetensors") from exc
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, SafetensorError) as exc:
        raise ModelSpecError(f"cannot read the adapter in {spec} ({describe(exc, limit=160)}); check the folder "
                             "(adapter_config.json and adapter_model.safetensors or .bin)") from exc
    path = path.resolve()
    tokenizer = str(path) if is_tokenizer_folder(path) else getattr(source_of(base), "tokenizer", None)
    return _sourced(model, str(path), {}, tokenizer, quantized=getattr(source_of(base), "quantized", None))


def pretrained_task(config, task: str | None, spec: str) -> Task:
    """The task a folder's or hub id's model is built as (`task` overrides). The host-RAM pre-flight counts what
    LoRA trains for that task."""
    return _hf_task(config, task, spec)


def auto_class(config, task: str | None, spec: str):
    """transformers' Auto class a folder's or hub id's model is built with: its task's (`task` overrides). The
    host-RAM pre-flight builds the same on the meta device."""
    return getattr(_transformers(), pretrained_task(config, task, spec).auto_class)


def _hf_task(config, task: str | None, spec: str) -> Task:
    """The task a folder or hub model loads as: `task=` if given, else the one its config declares (its
    architecture's name, an encoder-decoder's flag; a causal LM where it declares none). `_pretrained` refuses a
    head that would drop the checkpoint's weights."""
    unsupported = unsupported_encoder_decoder(config)
    if unsupported:
        raise ModelSpecError(f"{spec}: {unsupported}")
    architecture = (getattr(config, "architectures", None) or [""])[0]
    declared = recognized_task(architecture, config)
    chosen = declared or CAUSAL_LM
    if task is not None:
        try:
            asked = task_named(task)
        except ValueError as exc:
            raise ModelSpecError(f"{one_line(exc)} (for {spec})") from exc
        chosen = asked
    if chosen.auto_class is None:
        raise ModelSpecError(f"the {chosen.name} task has no transformers Auto class, so {spec} cannot load as it; "
                             "build the model in Python and pass the module")
    return chosen


def _load_checkpoint_file(path: Path, kwargs: dict) -> nn.Module:
    """A training checkpoint tier_utils wrote: rebuilt from the spec it records, its weights loaded."""
    if path.suffix == ".py":
        raise ModelSpecError(f"{path} is a Python file; name the model in it: {path}:ClassName")
    if path.suffix == ".safetensors":
        raise ModelSpecError(f"{path} holds weights only; give the model's spec and weights={str(path)!r} "
                             "(--weights)")
    try:
        state = load_checkpoint(path)
    except CheckpointError as exc:
        raise ModelSpecError(f"{path} is not a tier_utils training checkpoint ({one_line(exc)[:120]}); for a plain "
                             "state dict give the model's spec and --weights FILE") from exc
    if kwargs:
        raise ModelSpecError(f"{path} records the arguments its model was built with; give no model arguments")
    recorded = state.get("source")
    if not recorded:
        raise ModelSpecError(f"{path} records no model spec (it was trained from a module built in Python); "
                             "build that module and load the checkpoint's 'model' weights into it, or give the "
                             "spec and --weights")
    # As trained: its spec, arguments and tokenizer; stored in the dtype its tensors are (fp32 master weights).
    source = ModelSource(**{**recorded, "quantized": None}, stored_dtype=tensors_dtype(state["model"].values()))
    if recorded.get("quantized"):  # its adapters fit the full-precision base too, which is what load_model builds
        warnings.warn(f"{path} was trained over a 4-bit NF4 base; its adapters are loaded over the base in its stored "
                      "dtype, whose outputs differ by the quantisation error", stacklevel=4)
    model = _build(recorded["spec"], dict(recorded["kwargs"]))
    _held_as_saved(model, state["model"])
    try:
        if source.lora:  # the adapters over the base the spec rebuilds, as peft wrapped it in training
            import peft

            if not hasattr(model, "peft_config"):  # a spec that is an adapter folder carries them already
                model = peft.get_peft_model(model, peft.LoraConfig(**source.lora))
            unfit = peft.set_peft_model_state_dict(model, state["model"]).unexpected_keys
            if unfit:
                raise RuntimeError(f"unexpected adapter keys {', '.join(unfit[:3])}")
        else:
            model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise ModelSpecError(f"{path}'s weights do not fit {recorded['spec']} ({one_line(exc)[:160]})") from exc
    return record_source(model, source)


def _held_as_saved(model: nn.Module, state: dict) -> None:
    """Each parameter in the dtype the checkpoint holds it in, before its values are copied in: fp32 master
    weights trained from a bf16-stored folder must not be rounded back to the folder's bf16."""
    for name, param in model.named_parameters():
        saved = state.get(name)
        if isinstance(saved, torch.Tensor) and saved.is_floating_point() and saved.dtype != param.dtype:
            param.data = param.data.to(saved.dtype)
