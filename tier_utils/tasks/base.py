"""The task as an object: one class per kind of model (what it predicts, how it is recognised and loaded, its batch,
loss and metrics, the data it reads), in one registry, like the precision modes. Nothing outside a task's class
tests its name: a tier asks the task it was handed (`adapter.task`), so a task defined elsewhere runs through every
tier. A task instance holds no state of one model: the adapter passes itself where a fact needs the model's sizes.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..core.budget import profile_sizes
from ..core.errors import AdapterError, DataError
from ..core.registry import Registry
from ..data.chat_formats import ChatOptions
from ..data.collate import IGNORE, PadCollator, PaddingTally
from ..data.datasets import (
    DEFAULT_VAL_FRACTION,
    DataRequest,
    DataSplits,
    given_splits,
    is_tensor_data,
    synthetic_splits,
    tensor_splits,
    user_texts,
    without_validation,
)
from ..data.image_files import is_image_folder
from ..data.packing import packed
from ..data.tokenizer import BYTE_VOCAB, ByteTokenizer, is_tokenizer_folder
from ..data.userdata import PLAIN, is_user_source

IGNORE_INDEX = IGNORE  # torch's cross_entropy default: a target it does not score


class Task:
    """A kind of model. Subclasses set the facts that differ from these defaults (one prediction per row)."""

    name = ""
    aliases: tuple[str, ...] = ()
    # transformers' Auto class that loads a folder or hub model of this task as its own architecture, and the
    # endings of the model class names (a config's `architectures`, a module's type) that declare the task.
    auto_class: str | None = None
    architectures: tuple[str, ...] = ()
    # Attributes that mark a module of this task whatever its class is called (timm's `pretrained_cfg`, which
    # every timm model carries: an image model), read without importing the library that made it.
    marks: tuple[str, ...] = ()
    peft_task_type = "FEATURE_EXTRACTION"  # peft's TaskType: how LoRA wraps the model
    # The head's module names in transformers' models of this task (matched as peft and bitsandbytes match them: the
    # module or its start): a 4-bit load keeps them whole, as LoRA trains them (RoBERTa's classifier is two Linears).
    head_modules: tuple[str, ...] = ()
    per_token = False  # one prediction per position, (B, T, width) logits; else one per row, (B, width)
    predicts_input_positions = False  # a per-position task's positions are its input's (else its targets')
    has_classes = False  # the output width is the model's number of classes (else its vocabulary)
    # Whether a checkpoint may lack this task's head (a base folder fine-tuned as a classifier): its new weights start
    # at random and are trained; elsewhere missing weights mean the folder holds another model.
    takes_new_head = False
    # Whether a model that declares this task can run as no other (an encoder-decoder's forward needs its decoder's
    # inputs): a task= naming another is refused.
    binds_model = False
    causal_attention = False  # its self-attention sees only the past (what an attention map may hold)
    padding_side = "right"  # where a padded batch of this task puts its padding, unless the model says
    # Where its training and evaluation batches are padded: on the right, as transformers' and TRL's training collators
    # pad, so positions never shift and a causal model's real tokens never reach the padding, whether or not the model
    # reads a mask. Generation pads prompts on `padding_side`.
    collate_side = "right"
    # Whether the forward gets the targets (the per-position labels), for a model that returns every position's
    # logits only when given them (the GPT training-code convention).
    feeds_targets = False
    positions_from_mask = False  # left padding shifts the real tokens: positions count from the first real one
    has_perplexity = False  # exp(loss) is a perplexity
    generates = False  # each evaluation also scores what the model writes (engine.generation)
    decodes_targets = False  # the forward reads the targets through a causal decoder (smoke checks its causality)
    export_inputs: tuple[str, ...] = ("input_ids", "attention_mask")
    prediction = "class"  # what one prediction is, in a sentence
    reading = PLAIN  # the columns its text data is read from (data.userdata.Reading)
    # The model's input in a batch, and whether it is token ids (a vocabulary, a max length, a tokenizer and padding
    # masks apply); an image task's is `pixel_values`, its "vocabulary" the channels and its length the image side.
    input_key = "input_ids"
    reads_tokens = True
    # Whether the input is an image's pixel values, (B, C, H, W): tier 2 perturbs it, attributes to it and draws its
    # maps over it (noise, blur, brightness; pixel attribution; attention rollout or a gradient saliency map).
    reads_pixels = False
    unit = "token"  # what a throughput counts (`units`)
    row = "sequence"  # what one row of a batch is, as result lines count them
    random_input = "random tokens"  # what tier 1's random batches are, in words
    # The AMP benchmark's memory threshold unless one is given (benchmark Thresholds.memory_reduction): a language
    # model's activations, dominated by its matmul outputs and logits, halve under bf16/fp16 autocast.
    amp_memory_reduction = 0.40
    size_names = ("vocab_size", "max_len")  # what the adapter's vocab_size and max_len are called in a summary
    preprocessor_what = "tokenizer"  # what turns the user's raw data into the model's inputs
    data_hint = "empty: the task's bundled demo; or a file, a folder, hf-dataset:NAME"  # the panel's
    augments = False  # whether its training data can be augmented (build_datasets' augment)
    without_preprocessor = "feeding byte ids; pass tokenizer= (--tokenizer) with the tokenizer it was trained with"

    def __str__(self) -> str:
        return self.name

    @property
    def own_target_length(self) -> bool:
        """Whether its targets are a sequence with a length of their own (an encoder-decoder's decoder side): one
        prediction per position, not of the input's positions. The planner counts both lengths."""
        return self.per_token and not self.predicts_input_positions

    def recognizes(self, architecture: str, config=None, params: frozenset = frozenset()) -> bool:
        """Whether a model declares this task: by its class name's ending (a module's type, a config's first
        architecture); a task may also read the config or the forward's parameters."""
        return bool(self.architectures) and architecture.endswith(self.architectures)

    def model_inputs(self, adapter, input_ids: torch.Tensor, labels: torch.Tensor | None) -> dict:
        """What the forward takes besides the ids and the mask (an encoder-decoder: its decoder's inputs)."""
        return {}

    def example_inputs(self, adapter, batch: int, length: int, generator: torch.Generator) -> dict:
        """A random batch's model inputs (the labels are `example_labels`)."""
        ids = torch.randint(0, adapter.vocab_size, (batch, length), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones(batch, length, dtype=torch.long)}

    def stability_inputs(self, adapter, length: int) -> dict[str, torch.Tensor]:
        """Tier 1's extreme inputs by name, each must give finite logits: the first and last token id and a random
        one, each repeated."""
        V = adapter.vocab_size
        token = int(torch.randint(V, (1,), generator=torch.Generator().manual_seed(2)))
        return {f"token id 0 x{length}": torch.zeros(2, length, dtype=torch.long),
                f"token id {V - 1} x{length}": torch.full((2, length), V - 1),
                f"token {token} repeated x{length}": torch.full((2, length), token)}

    def probe_input(self, adapter, length: int) -> torch.Tensor:
        """The one-row input of the adapter's probing forwards."""
        return torch.zeros(1, length, dtype=torch.long, device=adapter.device)

    def describe_input(self, adapter, length: int) -> str:
        """The probe's input in words, for the one line a forward that fails it gets."""
        return f"(1, {length}) batch of token ids"

    def input_facts(self, model, spec, max_len: int | None):
        """A task whose inputs are not token ids: (its ids' range, its length, its preprocessor, a note where the
        length is a default); None: the model's vocabulary, max length and tokenizer are read as a language model's."""
        return None

    def preprocessor_in(self, folder) -> bool:
        """Whether a save_pretrained folder holds this task's preprocessor (its tokenizer's files)."""
        return is_tokenizer_folder(folder)

    def batch_words(self, batch: int, length: int) -> str:
        """A batch's size in words, as result lines say it."""
        return f"batch {batch} x {length} tokens"

    def rows(self, n: int) -> str:
        """`n` rows of a batch in words: "4 sequences", "1 image"."""
        return f"{n} {self.row}{'' if n == 1 else 's'}"

    def length_words(self, length: int) -> str:
        """The length a plan or measurement ran at, as result lines say it: "T=32"."""
        return f"T={length}"

    def shape_label(self, adapter, batch: int, length: int) -> str:
        """A (batch, length) input's short label (an export's parity and latency rows): "4x32"."""
        return f"{batch}x{length}"

    def units(self, batch: dict) -> int:
        """How many of `unit` a batch holds (a throughput's numerator): its real tokens, the padding not counted (a
        packed row's too). MFU counts the positions computed, padding included, from the FLOPs of the step."""
        mask = batch.get("attention_mask")
        return int(mask.sum()) if mask is not None else batch[self.input_key].numel()

    def positions(self, batch: dict) -> tuple[int, int, int] | None:
        """(positions the model computes, real tokens among them, rows) of a collated batch on the host: the parts
        of its padding share (the mask's ones are real); None: its batches hold no padding (images)."""
        if not self.reads_tokens:
            return None
        ids, mask = batch[self.input_key], batch.get("attention_mask")
        return ids.numel(), int(mask.sum()) if mask is not None else ids.numel(), len(ids)

    def padding_tally(self, seq_len: int, target_len: int | None = None) -> PaddingTally:
        """An empty count of a run's padding, comparing with every example padded to `seq_len`."""
        return PaddingTally(seq_len, f"seq_len {seq_len}")

    def width(self, adapter) -> int:
        """How many values one prediction scores: the classes, or the vocabulary."""
        return adapter.num_classes if self.has_classes else adapter.vocab_size

    def output_shape(self, adapter, batch: int, length: int) -> tuple[int, ...]:
        return (batch, length, self.width(adapter)) if self.per_token else (batch, self.width(adapter))

    def chance_loss(self, adapter) -> float:
        """The cross-entropy of a uniform guess: what a fresh model's loss should be near."""
        return math.log(self.width(adapter))

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over every scored target (-100 marks a target not scored)."""
        if self.per_token:
            return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        return F.cross_entropy(logits, labels)

    # Which call of the source embedding in one forward embeds the input (a model that embeds twice calls it last
    # for its input, unless the task says otherwise: an encoder-decoder embeds its source first).
    source_call = -1

    def source_embedding(self, adapter):
        """The token embedding that reads the input (attribution and embedding noise perturb its output)."""
        return adapter.embeddings()

    def last_prediction(self, batch: dict, mask: torch.Tensor) -> torch.Tensor:
        """Each row's last prediction's position, for a per-position task: its last real input position."""
        return mask.long().sum(1).clamp_min(1) - 1

    def attention_role(self, layer: str) -> tuple[str, str, bool]:
        """What an attention layer's queries and keys are ("source": the input tokens; "target": an encoder-decoder's
        target tokens) and whether it is causal: every layer of a one-stack model attends over its input."""
        return "source", "source", self.causal_attention

    def attention_kind(self, layer: str) -> str:
        """An attention layer's role in words, as results name it: "self" ("causal self" where it sees only the
        past) for a one-stack model; an encoder-decoder's names its stack, and "cross" for target-to-source."""
        queries, keys, causal = self.attention_role(layer)
        return "cross" if queries != keys else "causal self" if causal else "self"

    def target_mask(self, batch: dict) -> torch.Tensor | None:
        """(B, T) bool: the target positions a decoder reads (None: the task has no target side)."""
        return None

    def target_tokens(self, adapter, batch: dict) -> torch.Tensor | None:
        """(B, T) the token ids a decoder reads at each target position (None: the task has no target side)."""
        return None

    def scored(self, labels: torch.Tensor) -> torch.Tensor:
        """Which targets count (the loss's ignore_index, -100, marks the rest: a seq2seq target's padding)."""
        return labels != IGNORE_INDEX

    def example_labels(self, adapter, batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
        if self.per_token:
            return torch.randint(0, self.width(adapter), (batch, length), generator=generator)
        return torch.randint(0, self.width(adapter), (batch,), generator=generator)

    def fits_output(self, logits: torch.Tensor) -> bool:
        """Whether a probe's logits have this task's layout (how a model that declares nothing is recognised)."""
        return logits.dim() == (3 if self.per_token else 2)

    def name_target(self, target: int, label) -> str:
        """One prediction's target in words (`label` decodes a token id)."""
        return f"{self.prediction} {label(target)!r}" if not self.has_classes else f"{self.prediction} {target}"

    def datasets(self, data, request: DataRequest) -> DataSplits:
        """`data` as train and validation Datasets of this task's batches: the forms every task takes as they are
        (Datasets), then None (the task's bundled demo), "synthetic", tensors, and text from any user source."""
        given = given_splits(data, request)
        if given is not None:
            return given
        if data is None:
            return self.demo(request)
        if isinstance(data, str) and data == "synthetic":
            return synthetic_splits(request, self.synthetic_classes(request))
        if is_tensor_data(data):
            return tensor_splits(self.tensors(data, request), request)
        if is_user_source(data) and is_image_folder(data):
            raise DataError(f"{data} is a folder of images, but the {self.name} task reads text; give an image "
                            "classifier (a ...ForImageClassification folder, tiny-vit) or text data")
        return self.from_texts(user_texts(data, request, self.reading), request)

    def activation_sizes(self, adapter, length: int, target: int | None = None) -> tuple[tuple,
                                                                                     tuple[float, float] | None]:
        """The (batch, length) sizes the planner's activation fit measures at, and how the per-sequence bytes split
        between its linear and quadratic terms where they are measured at one length (None: fitted from three
        sizes, core.budget.ActivationFit)."""
        return profile_sizes(adapter, length, target), None

    def describe_length(self, adapter, length: int) -> str:
        """The planner's length axis in words where it is not plain tokens per sequence ("": it is)."""
        return ""

    def data_classes(self, data) -> list[str] | None:
        """The class names `data` holds, read before a model is loaded for them (a pretrained classifier's head
        follows the data: models/heads.py); None: not known without reading it whole, or not a classifier's data."""
        return None

    def collator(self, request: DataRequest) -> PadCollator:
        """What makes a batch of this task's examples: each padded to the batch's longest row (the tokenizer's pad
        id, -100 in the labels, 0 in the masks), never past the model's max length."""
        return PadCollator(request.tokenizer.pad_id or 0, self.collate_side, limit=request.max_len)

    # What a task reads, each its own: a task defined elsewhere overrides what it takes.
    def demo(self, request: DataRequest) -> DataSplits:
        raise DataError(f"the {self.name} task has no bundled demo data; pass data")

    def synthetic_classes(self, request: DataRequest) -> int | None:
        """Random class ids' range for synthetic data; None: next tokens are the labels."""
        return (request.num_classes or 2) if self.has_classes else None

    def tensors(self, data, request: DataRequest):
        raise DataError(f"the {self.name} task takes no tensors; pass a Dataset of its batches")

    def from_texts(self, texts, request: DataRequest) -> DataSplits:
        raise DataError(f"the {self.name} task reads no text; pass a Dataset of its batches")


_REGISTRY = Registry("task", Task, classes=False)


def register_task(task: Task) -> Task:
    """Add a task (an instance): its name and aliases resolve to it from then on."""
    return _REGISTRY.add(task)


def task_names() -> tuple[str, ...]:
    return _REGISTRY.names()


def task_named(task) -> Task:
    """The registered task for any spelling of its name (a Task is returned as is); an unknown one is a one-line
    AdapterError listing the known ones."""
    if isinstance(task, Task):
        return task
    try:
        return _REGISTRY[task]
    except ValueError as exc:
        raise AdapterError(str(exc)) from exc


def recognized_task(architecture: str, config=None, params: frozenset = frozenset()) -> Task | None:
    """The first registered task a model declares (registry order): by its class name's ending
    (`...ForCausalLM`, `...ForSequenceClassification`), its config (an encoder-decoder's) or its forward's
    parameters (decoder inputs)."""
    return next((t for t in _REGISTRY.entries() if t.recognizes(architecture, config, params)), None)


def marked_task(model) -> Task | None:
    """The first registered task one of whose `marks` the module carries (registry order)."""
    return next((t for t in _REGISTRY.entries() if any(hasattr(model, mark) for mark in t.marks)), None)


def task_of_output(logits: torch.Tensor) -> Task | None:
    """The first registered task whose layout a probe's logits have (registry order: the built-in ones first)."""
    return next((t for t in _REGISTRY.entries() if t.fits_output(logits)), None)


def build_datasets(data=None, task="causal-lm", seq_len: int = 64, vocab_size: int = BYTE_VOCAB,
                   num_classes: int | None = None, val_fraction: float = DEFAULT_VAL_FRACTION, seed: int = 0,
                   max_len: int | None = None, tokenizer=None, target_len: int | None = None,
                   augment: bool = False, packing: bool = False, chat: ChatOptions | None = None) -> DataSplits:
    """Datasets for a task (a registered name or a Task) from any supported source.

    data: None (the task's bundled demo: the corpus as windows or as labelled snippets), "synthetic", a text file,
    a folder of .txt files, a .csv / .tsv / .jsonl / .parquet table, `hf-dataset:NAME[/CONFIG][:SPLIT]` or a folder
    `datasets.save_to_disk` wrote (any of these as a path string, or a `DataSource` naming its columns), a list of
    strings, a (train, val) pair of Datasets, a single Dataset (split off `val_fraction`), or tensors:
    `(N, seq_len + 1)` tokens for a causal LM, `(input_ids, labels)` for classification.
    tokenizer: turns text into ids (None: bytes); its ids must fit `vocab_size`.
    target_len: a seq2seq pair's target length (None: seq_len, the source's).
    chat: how chat and instruction rows are read (data.chat_formats.ChatOptions: format, loss_on, chat_template).
    augment: training examples drawn anew each time they are read, where the task augments (an image classifier's
    random resized crop and flip); validation stays as it is. A task that does not is refused in one line.
    packing: a causal LM's training examples packed into rows of seq_len (data.packing; a table's texts read one
    example per row); validation stays as examples.
    Validation: the source's own split when it has one; else the last `val_fraction` of the text
    (contiguous) for a causal LM, a seeded random `val_fraction` of the rows for classification; none at all for
    val_fraction=0 (a source's own validation split is then left unused).
    Tensors are checked whole before use: integer ids in [0, vocab_size), inputs no longer than
    `max_len`, class ids in [0, num_classes).
    """
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    chosen = task_named(task)
    if augment and not chosen.augments:
        raise DataError(f"augment: the {chosen.name} task has no augmentation (an image classifier's random crop and "
                        "flip); drop augment (--augment)")
    request = DataRequest(seq_len, vocab_size, num_classes, val_fraction, seed, max_len, tokenizer or ByteTokenizer(),
                          target_len, augment, packing, chat or ChatOptions())
    splits = replace(chosen.datasets(data, request), collate=chosen.collator(request))
    if packing:  # before any sampler shards it: every rank draws from the same rows
        splits = replace(splits, train=packed(splits.train, seq_len))
    return without_validation(splits) if val_fraction == 0 else splits
