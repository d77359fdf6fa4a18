"""The one place that knows how to call a model and read it: calling convention, logits,
task kind, vocab size, max length, number of classes.

Batches everywhere in tier_utils are dicts: `input_ids` (B, T) long, `labels` ((B, T) next
tokens for a causal LM, (B,) class ids for classification), optional `attention_mask` (B, T).
"""
from __future__ import annotations

import inspect
import math
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.nn as nn

from ..core.errors import AdapterError, ModelForwardError, ModelSpecError, describe
from ..core.memory_settings import DecidedMemory
from ..core.precision import dtype_name
from ..data.collate import LongestBatch, longest_batch
from ..data.datasets import DEFAULT_VAL_FRACTION, DataSplits
from ..data.images import has_image_processor
from ..data.packing import POSITIONS
from ..data.tokenizer import BYTES, ByteTokenizer, Tokenizer, is_tokenizer_folder, load_tokenizer
from ..models.loading import ModelSource, copied, load_model, source_of
from ..models.stored_dtype import parameters_dtype
from ..tasks import (
    CAUSAL_LM,
    Task,
    build_datasets,
    marked_task,
    recognized_task,
    task_named,
    task_of_output,
    unsupported_encoder_decoder,
)

_MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_len", "block_size")
_VOCAB_KEYS = ("vocab_size", "n_vocab")
_PROBE_LEN = 8
# The length tested when a model has no position table and declares no limit (ALiBi, state-space
# models): twice the default training window, cheap enough for a smoke test.
DEFAULT_MAX_LEN = 128
PACKING_NEEDS = "packing needs a transformers model whose forward takes position_ids"
ADAPTER_KEYWORDS = ("task", "vocab_size", "max_len", "num_classes", "tokenizer")
# How a forward in the convention of popular GPT training code names its targets: it returns (logits, loss)
# when given them, and often only the last position's logits without them.
TARGET_KEYWORDS = ("targets", "labels")


@dataclass
class ModelAdapter:
    model: nn.Module
    task: Task | None  # what the model predicts, and every fact that follows (tier_utils.tasks); set by adapt()
    # The range of the input's ids and the length axis: a language model's vocabulary and max length; a task that
    # reads no tokens says what they are (an image classifier: its channels and its image side).
    vocab_size: int
    max_len: int
    num_classes: int | None
    takes_input_ids_kwarg: bool
    takes_attention_mask: bool
    takes_inputs_embeds: bool
    takes_position_ids: bool = False
    padding_side: str = "right"  # where a padded batch puts its padding: left for decoder LMs
    max_len_note: str | None = None  # set when max_len is tier_utils' default, not the model's own limit
    # What turns raw data into the ids every tier feeds: the model's own tokenizer, or bytes (an image model: its
    # image processing, the task's `preprocessor_what`).
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    # Set when the forward returns every position's logits only when given targets (the keyword to pass).
    targets_keyword: str | None = None
    # What the weights are stored in (the loader's record; a module built in Python: its parameters' dtype when
    # adapted). Every tier reads it here; `weights_dtype` is what they are held in now.
    stored_dtype: torch.dtype | None = None
    # transformers warns about possible padding on every unmasked call; our windows are unpadded, so such a model
    # gets the mask we know (all ones) instead of a warning its user can't act on.
    fills_mask: bool = False
    # Whether packed rows can run: a transformers model that takes position_ids builds a block-diagonal causal mask
    # from per-example positions when given no mask and no cache (transformers' padding-free path, TRL's), so no
    # example attends to another. Any other forward would let them see each other, silently: those run padded.
    packs: bool = False
    # What tier_utils knows of the model, carried here into every tier, never on the module: where it came from
    # (the loader's record: spec, tokenizer, the modules it started new), and the memory settings decided for a run
    # that converts it per precision (the benchmark's rows; None: none decided).
    source: ModelSource | None = None
    memory: DecidedMemory | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def name(self) -> str:
        if hasattr(self.model, "peft_config"):  # peft's wrapper: named by the model it adapts
            return f"{type(self.model.get_base_model()).__name__}+LoRA"
        return type(self.model).__name__

    @property
    def weights_dtype(self) -> torch.dtype | None:
        return parameters_dtype(self.model)

    def copied(self) -> ModelAdapter:
        """This adapter over a deep copy of its model (the loader's record kept beside the copy too): a run that
        changes weights (training) starts from the same ones as every other."""
        return replace(self, model=copied(self.model))

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None, position_ids=None,
                **given):
        """Call the model the way it expects; returns its raw output. `labels` (next tokens) are passed only
        to a model that needs targets to return every position; any id works there, zeros are used if none.
        `position_ids`: a packed batch's per-example positions (data.packing), passed with no mask and no cache, so
        the model keeps its examples apart. `given`: the task's other inputs, given rather than made here (an exported
        program's decoder inputs)."""
        kwargs = {}
        if self.targets_keyword is not None:
            shape = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
            kwargs[self.targets_keyword] = (labels if labels is not None
                                            else torch.zeros(shape, dtype=torch.long, device=self.device))
        if position_ids is not None:
            if not self.packs:
                raise AdapterError(f"{self.name} can't keep packed examples apart ({PACKING_NEEDS}); run it padded "
                                   "(drop packing)")
            kwargs.update(position_ids=position_ids, use_cache=False)  # a mask or a cache would undo the blocks
        elif attention_mask is None and self.fills_mask and input_ids is not None:
            kwargs["attention_mask"] = torch.ones_like(input_ids)  # default positions: no position_ids needed
        elif attention_mask is not None and self.takes_attention_mask:
            kwargs["attention_mask"] = attention_mask
            if self.takes_position_ids and self.task.positions_from_mask:
                # Left padding shifts the real tokens; count positions from the first real one, as HF's
                # generate() does (an all-ones mask gives the default 0..T-1).
                kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
        if given:
            kwargs.update(given)
        elif self.task is not None and (input_ids is not None or labels is not None):
            kwargs.update(self.task.model_inputs(self, input_ids, labels))  # an encoder-decoder's decoder inputs
        if inputs_embeds is not None:
            if not self.takes_inputs_embeds:
                raise AdapterError(f"{self.name}.forward takes no inputs_embeds argument")
            return self.model(inputs_embeds=inputs_embeds, **kwargs)
        if self.takes_input_ids_kwarg:  # the task's input (token ids, or an image model's pixel_values) by name
            return self.model(**{self.task.input_key if self.task else "input_ids": input_ids}, **kwargs)
        return self.model(input_ids, **kwargs)

    def logits(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None) -> torch.Tensor:
        return extract_logits(self.forward(input_ids, attention_mask, inputs_embeds, labels), self.name)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The task's mean cross-entropy (a per-position task: over every scored position)."""
        return self.task.loss(logits, labels)

    def batch_forward(self, batch: dict):
        """The model's raw output for a batch dict of this task: its targets go in where the task feeds them (a
        seq2seq decoder's teacher-forced inputs; the GPT convention's targets keyword)."""
        labels = batch.get("labels") if self.task.feeds_targets else None
        return self.forward(batch[self.task.input_key], batch.get("attention_mask"), labels=labels,
                            position_ids=batch.get(POSITIONS))

    def batch_logits(self, batch: dict) -> torch.Tensor:
        return extract_logits(self.batch_forward(batch), self.name)

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, logits) for a batch dict; call it inside the precision's autocast."""
        logits = self.batch_logits(batch)
        return self.loss(logits, batch["labels"]), logits

    def datasets(self, data, seq_len: int, seed: int = 0, val_fraction: float = DEFAULT_VAL_FRACTION,
                 target_len: int | None = None, augment: bool = False, packing: bool = False,
                 chat=None) -> DataSplits:
        """`data` (anything build_datasets takes) as this model's task, vocabulary, tokenizer and length; `target_len`:
        an encoder-decoder's target length (None: seq_len); `augment`: an image model's training images augmented;
        `packing`: a causal LM's training examples packed, where this model can keep them apart (else padded, said
        in one line); `chat`: how chat and instruction rows are read (data.chat_formats.ChatOptions)."""
        return build_datasets(data, self.task, seq_len, self.vocab_size, self.num_classes, val_fraction, seed,
                              max_len=self.max_len, tokenizer=self.tokenizer, target_len=target_len, augment=augment,
                              packing=packing and self._can_pack(), chat=chat)

    def _can_pack(self) -> bool:
        """Packing asked for: a task other than next-token prediction is refused; a model that can't keep packed
        examples apart is said in one line, and runs padded."""
        if not (self.task.per_token and self.task.predicts_input_positions):
            raise ValueError(f"packing packs a causal LM's examples; {self.name} is a {self.task} model: drop packing "
                             "(--packing)")
        why = (f"{PACKING_NEEDS}, to keep packed examples apart" if not self.packs else None if self._keeps_apart()
               else "its forward lets a packed example see the one before it (checked on two examples)")
        if why:
            warnings.warn(f"packing isn't available for {self.name} ({why}): running padded", stacklevel=3)
        return why is None

    def _keeps_apart(self) -> bool:
        """Two short examples packed in one row: the second gets the logits it has alone. A leak raises nothing, so
        it is checked on the model itself (a transformers model whose forward builds its mask another way)."""
        n = min(4, self.max_len // 2)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (1, 2 * n), generator=g).to(self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():  # not inference_mode: this may be a sharded model's first forward (FSDP2's buffers)
                positions = torch.arange(n, device=self.device).repeat(1, 2)
                packed = extract_logits(self.forward(ids, position_ids=positions), self.name)
                alone = self.logits(ids[:, n:])
        finally:
            self.model.train(was_training)
        tolerance = (1e-3 if alone.dtype == torch.float32 else 3e-2) * float(alone.abs().max().clamp_min(1))
        return bool((packed[0, n:].float() - alone[0].float()).abs().max() <= tolerance)

    def longest_batch(self, data, seq_len: int, target_len: int | None = None, chat=None) -> LongestBatch | None:
        """The longest batch `data` makes for this model at `seq_len` (and an encoder-decoder's `target_len`), every
        example read, none held out, chat rows read as `chat` says; None: the task's batches are one shape whatever
        the data (images)."""
        if not self.task.reads_tokens:
            return None
        splits = self.datasets(data, seq_len, val_fraction=0.0, target_len=target_len, chat=chat)
        return longest_batch(splits.train, splits.collate, splits.describe().data, self.task.input_key,
                             "labels" if self.task.own_target_length else None)

    def embeddings(self) -> nn.Embedding | None:
        return input_embedding(self.model)

    def example_batch(self, batch_size: int = 2, seq_len: int | None = None, seed: int = 0,
                      target_len: int | None = None) -> dict:
        """A random batch of the right shape and task, on the model's device; `target_len`: the targets' own length
        where the task's targets have one (an encoder-decoder's; None: seq_len)."""
        T = min(seq_len or self.max_len, self.max_len)
        g = torch.Generator().manual_seed(seed)
        batch = self.task.example_inputs(self, batch_size, T, g)
        U = min(target_len, self.max_len) if target_len and self.task.own_target_length else T
        batch["labels"] = self.task.example_labels(self, batch_size, U, g)
        return {k: v.to(self.device) for k, v in batch.items()}

    def require_trainable(self) -> list[nn.Parameter]:
        """The trainable parameters; none is a one-line error before any step is taken."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise AdapterError(f"{self.name} has no trainable parameters (every requires_grad is False); "
                               "unfreeze some with p.requires_grad_(True) to train or benchmark it")
        return params

    def fit_length(self, seq_len: int, what: str = "seq_len") -> int:
        """The rule for every tier: a length past the model's max_len is capped to it, with a warning
        (callers record the length used). The one place this is decided. A task that reads no tokens runs at the
        model's own length (an image model: its image side), whatever a token length setting says."""
        if not self.task.reads_tokens:
            return self.max_len
        if seq_len <= self.max_len:
            return seq_len
        warnings.warn(f"{what}={seq_len} exceeds {self.name}'s max_len={self.max_len}; using {self.max_len}",
                      stacklevel=3)
        return self.max_len

    def target_length(self, target_len: int | None) -> int | None:
        """The target length a run counts apart from its source's (None: as many as the source), by fit_length's
        rule: only a task whose targets have a length of their own (an encoder-decoder's) takes one."""
        if target_len is None:
            return None
        if not self.task.own_target_length:
            raise ValueError(f"target_len counts an encoder-decoder's targets apart from its source; {self.name} is "
                             f"a {self.task} model with one length: drop target_len (--target-len)")
        return self.fit_length(target_len, "target_len")

    def check_forward(self) -> None:
        """One small forward before a run, so a model that cannot run fails in one line, not mid-loop."""
        _probe_output(self)

    def summary(self) -> dict:
        params = list(self.model.parameters())
        # The task is None only while adapt() first probes the model (a forward that raises is reported then).
        return {"model": self.name, "task": self.task and self.task.name, "parameters": sum(p.numel() for p in params),
                "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
                "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
                "buffer_bytes": sum(b.numel() * b.element_size() for b in self.model.buffers()),
                **dict(zip((self.task or CAUSAL_LM).size_names, (self.vocab_size, self.max_len))),
                "num_classes": self.num_classes,
                "tokenizer": self.tokenizer.name, **{key: dtype and dtype_name(dtype) for key, dtype in
                                                    (("stored_dtype", self.stored_dtype),
                                                     ("weights_dtype", self.weights_dtype))}}


def extract_logits(output, model_name: str = "model") -> torch.Tensor:
    """Logits from a tensor, an HF ModelOutput / dict with `logits`, or a tuple whose first tensor is them."""
    if isinstance(output, torch.Tensor):
        return output
    logits = None
    if isinstance(output, dict) or hasattr(output, "keys"):
        logits = output.get("logits") if hasattr(output, "get") else None
    elif isinstance(output, (tuple, list)):
        logits = next((o for o in output if isinstance(o, torch.Tensor)), None)
    if isinstance(logits, torch.Tensor):
        return logits
    raise AdapterError(f"{model_name} returned {type(output).__name__} with no logits; return a tensor, "
                       "a tuple starting with the logits, or an object with a .logits field")


def resolve_model(model, **model_kwargs) -> ModelAdapter:
    """An adapter for anything a tier accepts: a load_model spec (built with the kwargs; `weights` and
    `tokenizer` apply to it), an nn.Module (HF included; the kwargs may be adapt's: task, vocab_size, max_len,
    num_classes, tokenizer, and `weights` to load) or an adapter."""
    if isinstance(model, ModelAdapter):
        if model_kwargs:
            raise ModelSpecError("keyword arguments only apply when building a model from a spec, not to an adapter; "
                                 "pass them to adapt(model, ...) when you make it")
        return model
    if isinstance(model, nn.Module):
        loading = {k: model_kwargs.pop(k) for k in ("weights", "tokenizer") if k in model_kwargs}
        other = sorted(set(model_kwargs) - set(ADAPTER_KEYWORDS))
        if other:
            raise ModelSpecError(f"{', '.join(other)}: an nn.Module instance is already built, so only "
                                 f"{', '.join(ADAPTER_KEYWORDS)} apply to it; build it with those arguments yourself")
        return adapt(load_model(model, **loading), **model_kwargs)
    return adapt(load_model(model, **model_kwargs))


def adapt(model, task: str | None = None, vocab_size: int | None = None, max_len: int | None = None,
          num_classes: int | None = None, tokenizer=None) -> ModelAdapter:
    """Work out how to drive `model` (an nn.Module or an adapter, returned as is).

    tokenizer: anything `load_tokenizer` takes; None: the model's own (the one its spec or save_pretrained
    folder came with), else byte-level. One whose ids exceed the model's vocabulary is refused here."""
    if isinstance(model, ModelAdapter):
        return model
    if not isinstance(model, nn.Module):
        raise AdapterError(f"expected a torch.nn.Module, got {type(model).__name__}; load it with load_model first")
    if next(model.parameters(), None) is None:
        raise AdapterError(f"{type(model).__name__} has no parameters; there is nothing to smoke-test or train")
    name = type(model).__name__
    config = getattr(model, "config", None)
    unsupported = unsupported_encoder_decoder(config)
    if unsupported:
        raise AdapterError(f"{name}: {unsupported}")
    params = _forward_params(model)
    chosen = _task_for(model, task, params)
    facts = chosen and chosen.input_facts(model, _own_preprocessor(model, tokenizer), max_len)
    vocab, length, preprocessor, note = facts or (*_token_sizes(model, vocab_size, max_len), None, None)
    tokens = chosen is None or chosen.reads_tokens
    adapter = ModelAdapter(model, chosen, int(vocab), DEFAULT_MAX_LEN if length == math.inf else int(length),
                           num_classes, (chosen.input_key if chosen else "input_ids") in params,
                           tokens and "attention_mask" in params, "inputs_embeds" in params, "position_ids" in params,
                           max_len_note=note)
    adapter.fills_mask = adapter.takes_attention_mask and hasattr(model, "warn_if_padding_and_no_attention_mask")
    adapter.packs = adapter.fills_mask and adapter.takes_position_ids
    adapter.targets_keyword = _targets_keyword(adapter, params)
    adapter.task = adapter.task or _probe_task(adapter)
    if length == math.inf:
        _check_default_length(adapter)
    if adapter.task.has_classes and adapter.num_classes is None:
        adapter.num_classes = (getattr(config, "num_labels", None) or getattr(model, "num_classes", None)
                               or _probe_output(adapter).shape[-1])
    side = getattr(model, "padding_side", None)
    adapter.padding_side = side if side in ("left", "right") else adapter.task.padding_side
    adapter.tokenizer = preprocessor or _tokenizer_for(model, _own_preprocessor(model, tokenizer), adapter.vocab_size)
    adapter.source = source_of(model)
    adapter.stored_dtype = (adapter.source.stored_dtype if adapter.source and adapter.source.stored_dtype
                            else parameters_dtype(model))
    return adapter


def _token_sizes(model: nn.Module, vocab_size: int | None, max_len: int | None) -> tuple[int, float]:
    """A language model's vocabulary (given, declared or its embedding's rows) and max length (given, else the
    least of its declared one and its position table's rows; inf where neither exists)."""
    config = getattr(model, "config", None)
    vocab = (vocab_size or _first_attr((config, model), _VOCAB_KEYS)
             or getattr(input_embedding(model), "num_embeddings", None))
    if not vocab:
        raise AdapterError(f"cannot find {type(model).__name__}'s vocabulary size; pass vocab_size=N "
                           "(model_kwargs={'vocab_size': N} in any tier, or adapt(model, vocab_size=N))")
    declared = _first_attr((config, model), _MAX_LEN_KEYS)
    usable = _position_rows(model)
    return vocab, max_len or min(n for n in (declared, usable, math.inf) if n and n > 0)


def _own_preprocessor(model: nn.Module, spec):
    """The tokenizer (an image model: image processor) spec given, else the model's own: its spec's, or the folder
    a transformers model loaded by the user came from where it holds one; None: none."""
    if spec is not None:
        return spec
    source = source_of(model)
    if source is not None:
        return source.tokenizer
    folder = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return folder if folder and (is_tokenizer_folder(Path(folder)) or has_image_processor(Path(folder))) else None


def _tokenizer_for(model: nn.Module, spec, vocab: int) -> Tokenizer:
    """The tokenizer given or the model's own (`_own_preprocessor`), else bytes; a given or own one must fit the
    vocabulary (bytes are checked when text is encoded, since synthetic data needs no tokenizer)."""
    tok = load_tokenizer(spec)
    if tok.name != BYTES and tok.vocab_size > vocab:
        raise AdapterError(f"the tokenizer {tok.name} emits ids up to {tok.vocab_size - 1} but "
                           f"{type(model).__name__}'s vocabulary has {vocab}; pass the tokenizer the model was "
                           "trained with (tokenizer=, --tokenizer)")
    return tok


def _targets_keyword(adapter: ModelAdapter, params: set[str]) -> str | None:
    """A forward that takes targets and, without them, returns fewer positions than it was given (the
    last-position inference shortcut) gets them on every call."""
    keyword = next((k for k in TARGET_KEYWORDS if k in params), None)
    if keyword is None:
        return None
    out = _probe_output(adapter)
    if out.dim() == 3 and out.size(1) < min(_PROBE_LEN, adapter.max_len):
        return keyword
    return None


def _forward_params(model: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return set()


def _first_attr(objs, keys) -> int | None:
    for obj in objs:
        for key in keys:
            value = getattr(obj, key, None) if obj is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def input_embedding(model: nn.Module) -> nn.Embedding | None:
    """The token embedding: HF's get_input_embeddings() when it gives one, else the first nn.Embedding."""
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
        except (NotImplementedError, AttributeError):
            emb = None
        if isinstance(emb, nn.Embedding):
            return emb
    return next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)


def _position_rows(model: nn.Module) -> int | None:
    """How many positions the learned position table serves: its rows less the family's offset (OPT and
    BART keep `offset` rows in front; RoBERTa-style tables start after the padding row, at padding_idx + 1)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and ("pos" in name.lower() or name.endswith("wpe")):  # GPT-2: wpe
            offset = getattr(module, "offset", 0)
            if module.padding_idx is not None:
                offset += module.padding_idx + 1
            return module.num_embeddings - (offset if isinstance(offset, int) else 0)
    return None


def _check_default_length(adapter: ModelAdapter) -> None:
    """No position table and no declared limit: run DEFAULT_MAX_LEN tokens once, so a model with a hidden
    limit asks for max_len instead of failing every long check."""
    try:
        _probe_output(adapter, adapter.max_len)
    except AdapterError as exc:
        cause = exc.__cause__ or exc
        raise AdapterError(f"cannot find {adapter.name}'s maximum sequence length and {adapter.max_len} tokens fail "
                           f"({describe(cause, limit=None)}); pass max_len=N "
                           "(model_kwargs={'max_len': N} in any tier, or adapt(model, max_len=N))") from exc
    adapter.max_len_note = (f"{adapter.name} has no position table and declares no maximum length, so no limit of "
                            f"its own: checked up to {adapter.max_len} tokens (tier_utils' default; pass max_len=N "
                            "for longer)")


def _task_for(model: nn.Module, task, params: set[str]) -> Task | None:
    """The task asked for, else the one the model declares; None: its output decides. A model that can run as its
    declared task only (an encoder-decoder) refuses another."""
    declared = _declared_task(model, params)
    if task is None:
        return declared
    asked = task_named(task)
    if declared is not None and declared.binds_model and asked is not declared:
        raise AdapterError(f"{type(model).__name__} runs as the {declared.name} task; drop task={asked.name} "
                           "(--model-arg task=...)")
    return asked


def _declared_task(model: nn.Module, params: set[str]) -> Task | None:
    """A module's declared `task` (a registered name, or a Task), else the one its class name, its config or its
    forward's parameters declare."""
    declared = getattr(model, "task", None)
    if isinstance(declared, Task):
        return declared
    if isinstance(declared, str):  # a `task` attribute that names no registered task is the model's own business
        try:
            return task_named(declared)
        except AdapterError:
            pass
    return (recognized_task(type(model).__name__, getattr(model, "config", None), frozenset(params))
            or marked_task(model))


def _probe_output(adapter: ModelAdapter, length: int = _PROBE_LEN) -> torch.Tensor:
    task = adapter.task or CAUSAL_LM  # no task declared yet: a language model's token ids tell its output
    ids = task.probe_input(adapter, min(length, adapter.max_len))
    was_training = adapter.model.training
    adapter.model.eval()
    try:
        with torch.inference_mode():
            return adapter.logits(ids)
    except AdapterError:
        raise
    except Exception as exc:
        what = task.describe_input(adapter, ids.size(-1))
        err = ModelForwardError(f"calling {adapter.name} on a {what} raised {describe(exc)}; fix its forward (or its "
                                f"signature: it gets {task.input_key}, and attention_mask if it takes one)")
        err.model = adapter.summary()  # what smoke/analyze report it under
        raise err from exc
    finally:
        adapter.model.train(was_training)


def _probe_task(adapter: ModelAdapter) -> Task:
    """No declared task: the first task whose output layout the model's logits have ((B, T, V): a causal LM,
    (B, C): a classifier)."""
    out = _probe_output(adapter)
    task = task_of_output(out)
    if task is not None:
        if task.has_classes:
            adapter.num_classes = adapter.num_classes or out.size(-1)
        return task
    raise AdapterError(f"{adapter.name} returned logits of shape {tuple(out.shape)}; expected (B, T, vocab) "
                       "or (B, classes); pass task= explicitly")
