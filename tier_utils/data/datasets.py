"""Data: the bundled corpus (CPython's own docs), synthetic tokens, user data, and the loader.

Text is turned into ids by the model's tokenizer (byte-level for the built-ins, so they need no
download). Datasets yield the batch dicts the adapter expects: `input_ids`, `labels`, `attention_mask`.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, replace

import numpy as np  # always installed: pandas and matplotlib need it
import torch
from torch.utils.data import DataLoader, Dataset, Subset

from ..core.errors import DataError
from .chat_formats import ChatOptions
from .collate import PadCollator
from .tokenizer import BYTE_VOCAB, BYTES, ByteTokenizer, Tokenizer
from .userdata import Reading, Texts, class_ids, is_user_source, read_source, usable_rows

# Topic groups for the classification set (snippet -> which part of the docs it came from).
TOPIC_GROUPS = ("statements", "expressions", "types", "runtime")
_STATEMENTS = {
    "assert", "assignment", "async", "augassign", "break", "class", "compound", "continue", "del", "else", "for",
    "function", "global", "if", "import", "nonlocal", "pass", "raise", "return", "try", "while", "with", "yield",
}
_EXPRESSIONS = {
    "atom-identifiers", "atom-literals", "attribute-references", "await", "binary", "bitwise", "booleans", "calls",
    "comparisons", "conversions", "exprlists", "floating", "formatstrings", "imaginary", "in", "integers", "lambda",
    "numbers", "operator-summary", "power", "shifting", "slicings", "strings", "subscriptions", "unary",
}
_TYPES = {"callable-types", "dict", "lists", "numeric-types", "objects", "sequence-types", "string-methods", "truth"}
_VAL_EVERY = 5  # within each group, every 5th topic (sorted) is held out for validation


def topic_group(topic: str) -> str:
    if topic in _STATEMENTS:
        return "statements"
    if topic in _EXPRESSIONS:
        return "expressions"
    if topic in _TYPES or topic.startswith(("types", "bltin-")):
        return "types"
    return "runtime"  # data model, execution model, exceptions, naming, ...


def corpus_topics() -> dict[str, str]:
    """CPython's bundled documentation: topic name -> text (~79 topics, ~465 KB)."""
    from pydoc_data.topics import topics
    return dict(sorted(topics.items()))


def corpus_split() -> tuple[list[str], list[str]]:
    """(train topics, val topics), split by whole topic within each group so no text leaks."""
    train, val = [], []
    for group in TOPIC_GROUPS:
        members = sorted(t for t in corpus_topics() if topic_group(t) == group)
        for i, topic in enumerate(members):
            (val if i % _VAL_EVERY == _VAL_EVERY // 2 else train).append(topic)
    return train, val


class TokenWindows(Dataset):
    """Non-overlapping causal-LM windows: input_ids = w[:-1], labels = w[1:]."""

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        n = (len(tokens) - 1) // seq_len
        if n < 1:
            raise DataError(f"text of {len(tokens)} tokens is shorter than one window of {seq_len + 1}; "
                            "give more text or a smaller seq_len")
        self.tokens, self.seq_len, self.n = tokens, seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        w = self.tokens[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return {"input_ids": w[:-1], "labels": w[1:], "attention_mask": torch.ones(self.seq_len, dtype=torch.long)}


class Snippets(Dataset):
    """Classification examples: token ids at their own length (cut to `seq_len`) with a class id; the task's
    collator pads each batch to its longest row."""

    def __init__(self, texts: list[torch.Tensor], labels: list[int], seq_len: int):
        if not texts:
            raise DataError("no classification examples; give at least one (text, label) pair")
        self.ids = [t[:seq_len] for t in texts]
        self.labels = torch.as_tensor(labels, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        return {"input_ids": ids, "labels": self.labels[i], "attention_mask": torch.ones(len(ids), dtype=torch.long)}


class TokenRows(Dataset):
    """One example per row of an (N, seq_len + 1) token tensor: input_ids = row[:-1].

    Causal LM: labels = row[1:]. Classification: labels = the given class ids.
    """

    def __init__(self, rows: torch.Tensor, class_ids: torch.Tensor | None = None):
        self.rows, self.class_ids = rows, class_ids
        self.mask = torch.ones(rows.size(1) - 1, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        labels = row[1:] if self.class_ids is None else self.class_ids[i]
        return {"input_ids": row[:-1], "labels": labels, "attention_mask": self.mask}


def synthetic_rows(n: int, seq_len: int, vocab_size: int, num_classes: int | None = None,
                   seed: int = 0) -> TokenRows:
    """Random tokens for speed-only runs (the loss means nothing): next tokens as labels, or random class ids
    where `num_classes` is given."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(0, vocab_size, (n, seq_len + 1), generator=g)
    class_ids = torch.randint(0, num_classes, (n,), generator=g) if num_classes else None
    return TokenRows(rows, class_ids)


def _snippets(topics: list[str], seq_len: int, tokenizer: Tokenizer) -> Snippets:
    texts, labels = [], []
    corpus = corpus_topics()
    for topic in topics:
        tokens = tokenizer.encode(corpus[topic])
        for start in range(0, len(tokens) - seq_len // 2, seq_len):
            texts.append(tokens[start: start + seq_len])
            labels.append(TOPIC_GROUPS.index(topic_group(topic)))
    return Snippets(texts, labels, seq_len)


@dataclass(frozen=True)
class DataDescription:
    """What every result records about its data: what it was, its kind, the tokenizer that made the ids, how
    the validation part was made, and both parts' sizes; `to_dict()` is how results' JSON says it."""

    data: str
    source: str
    tokenizer: str
    validation: str
    train_examples: int
    val_examples: int

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DataSplits:
    train: Dataset
    val: Dataset
    source: str  # the kind: "corpus", "synthetic", "text", "table", "dataset", "tensors", "datasets"
    name: str = ""  # what it was, e.g. "text file notes.txt"
    tokenizer: str = BYTES  # the tokenizer that made the ids
    validation: str = ""  # how the validation part was made
    classes: list[str] | None = None  # label names, where the labels were text
    # What makes a batch of its examples: the task's collator (build_datasets sets it), padding to the batch's longest.
    collate: PadCollator = field(default_factory=PadCollator)
    # Chat or instruction rows: their reading (data.chat_reading.ChatReading: format, template, scored share, the
    # held-out prompts generation answers); None for any other data.
    chat: object = None

    def describe(self) -> DataDescription:
        """What every result records about its data."""
        return DataDescription(self.name or self.source, self.source, self.tokenizer, self.validation,
                               len(self.train), len(self.val))


DEFAULT_VAL_FRACTION = 0.1  # held out for validation where the data has no split of its own
NO_VALIDATION = "none asked for (every example trains, and nothing is evaluated)"
CORPUS_VALIDATION = "whole documentation topics held out (every 5th per topic group), so no text is in both"


@dataclass(frozen=True)
class DataRequest:
    """What a task's reader needs besides the data: the model's sizes, its tokenizer and how to split."""

    seq_len: int = 64
    vocab_size: int = BYTE_VOCAB
    num_classes: int | None = None
    val_fraction: float = DEFAULT_VAL_FRACTION  # 0: nothing held out (a run without validation)
    seed: int = 0
    max_len: int | None = None
    tokenizer: Tokenizer = field(default_factory=ByteTokenizer)
    target_len: int | None = None  # a pair's target side (None: seq_len); the source side is seq_len
    augment: bool = False  # training examples augmented as they are read (a task that augments: ImageClassification)
    packing: bool = False  # a causal LM's training examples packed into rows (a table's rows read as examples)
    chat: ChatOptions = field(default_factory=ChatOptions)  # how chat and instruction rows are read


def synthetic_splits(request: DataRequest, num_classes: int | None = None) -> DataSplits:
    n = 512
    train = synthetic_rows(n, request.seq_len, request.vocab_size, num_classes, request.seed)
    val = synthetic_rows(n // 8, request.seq_len, request.vocab_size, num_classes, request.seed + 1)
    return DataSplits(train, val, "synthetic", "synthetic random tokens", "none (random ids)", "a second random draw")


def given_splits(data, request: DataRequest) -> DataSplits | None:
    """The forms any task takes as they are: a (train, val) pair of Datasets, or one Dataset split here."""
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(d, Dataset) for d in data):
        return DataSplits(data[0], data[1], "datasets", "the Datasets given", "as given", "the second Dataset given")
    if isinstance(data, Dataset):
        return DataSplits(*split_off(data, request.val_fraction, request.seed), "dataset", "the Dataset given",
                          "as given", f"a seeded random {request.val_fraction:.0%} of its examples")
    return None


def is_tensor_data(data) -> bool:
    return isinstance(data, torch.Tensor) or (isinstance(data, tuple) and all(isinstance(d, torch.Tensor)
                                                                                 for d in data))


def tensor_splits(dataset: Dataset, request: DataRequest) -> DataSplits:
    return DataSplits(*split_off(dataset, request.val_fraction, request.seed), "tensors", "the tensors given",
                      "as given", f"a seeded random {request.val_fraction:.0%} of the rows")


def user_texts(data, request: DataRequest, reading: Reading) -> Texts:
    """Text from any user source (a list of strings, a file, a folder, a table, a dataset), checked against the
    model's vocabulary first."""
    if not is_user_source(data) and not (isinstance(data, list) and all(isinstance(t, str) for t in data)):
        raise DataError(f"unsupported data {type(data).__name__}; use None, 'synthetic', a file or folder path, "
                        "hf-dataset:NAME, a list of strings, tensors or a Dataset")
    check_vocabulary(request)
    if isinstance(data, list):
        if not "".join(data):
            raise DataError("data is an empty list of strings; give some text, a text file, 'synthetic' or None")
        return Texts(data, None, None, None, f"{len(data)} strings given")
    return read_source(data, reading)


def check_vocabulary(request: DataRequest) -> None:
    tokenizer = request.tokenizer
    if tokenizer.vocab_size > request.vocab_size:
        fix = (f"pass the tokenizer the model was trained with (tokenizer=, --tokenizer PATH: a folder without "
               f"tokenizer files gets byte ids), or build the model with vocab_size>={tokenizer.vocab_size}, or pass "
               "token tensors" if tokenizer.name == BYTES else "pass the tokenizer the model was trained with")
        raise DataError(f"text is tokenized by {tokenizer.name} (vocab {tokenizer.vocab_size}) but the model's vocab "
                        f"is {request.vocab_size}; {fix}")


def corpus_name() -> str:
    train_topics, val_topics = corpus_split()
    return f"bundled corpus (CPython docs, {len(train_topics)} + {len(val_topics)} topics)"


def corpus_windows(request: DataRequest) -> DataSplits:
    """The bundled corpus as causal-LM windows: training topics, and whole held-out topics for validation."""
    check_vocabulary(request)
    train_topics, val_topics = corpus_split()
    corpus, tokenizer = corpus_topics(), request.tokenizer
    join = "\n\n".join
    return DataSplits(TokenWindows(tokenizer.encode(join(corpus[t] for t in train_topics)), request.seq_len),
                      TokenWindows(tokenizer.encode(join(corpus[t] for t in val_topics)), request.seq_len),
                      "corpus", corpus_name(), tokenizer.name, CORPUS_VALIDATION)


def corpus_snippets(request: DataRequest) -> DataSplits:
    """The bundled corpus as a classification set: each snippet labelled with the part of the docs it came from."""
    check_vocabulary(request)
    if request.num_classes is not None and request.num_classes < len(TOPIC_GROUPS):
        raise DataError(f"the corpus classification set has {len(TOPIC_GROUPS)} classes but the model has "
                        f"{request.num_classes}; build it with num_classes={len(TOPIC_GROUPS)} "
                        f"(num_labels={len(TOPIC_GROUPS)} for a Hugging Face model)")
    train_topics, val_topics = corpus_split()
    seq_len, tokenizer = request.seq_len, request.tokenizer
    return DataSplits(_snippets(train_topics, seq_len, tokenizer), _snippets(val_topics, seq_len, tokenizer),
                      "corpus", corpus_name(), tokenizer.name, CORPUS_VALIDATION, list(TOPIC_GROUPS))


def text_windows(texts: Texts, request: DataRequest) -> DataSplits:
    """Causal-LM windows: the source's own validation texts, else the last `val_fraction` of the tokens."""
    seq_len, tokenizer = request.seq_len, request.tokenizer
    kind = "dataset" if texts.val is not None else "text"
    tokens = tokenizer.encode("\n\n".join(texts.train))
    if texts.val is not None:
        train, val, how = tokens, tokenizer.encode("\n\n".join(texts.val)), texts.validation
    elif not request.val_fraction:  # no validation: every token trains
        windows = TokenWindows(tokens, seq_len)
        return DataSplits(windows, Subset(windows, []), kind, texts.name, tokenizer.name, NO_VALIDATION)
    else:
        cut = int(len(tokens) * (1 - request.val_fraction))  # contiguous: validation text never seen in training
        train, val = tokens[:cut], tokens[cut:]
        how = (f"the last {request.val_fraction:.0%} of the text ({len(val):,} tokens, contiguous, so no window is "
               "in both)")
    if len(train) < seq_len + 1 or len(val) < seq_len + 1:
        raise DataError(f"{texts.name} is too short: {len(train)} training and {len(val)} validation tokens for "
                        f"windows of {seq_len + 1}; give more text or a smaller seq_len")
    return DataSplits(TokenWindows(train, seq_len), TokenWindows(val, seq_len), kind, texts.name, tokenizer.name, how)


def labelled_rows(texts: Texts, request: DataRequest) -> DataSplits:
    """One example per row, cut to seq_len; labels as class ids. The source's own validation rows, else a
    seeded random `val_fraction` of the rows (whole rows, so no example is in both)."""
    if texts.train_labels is None:
        raise DataError("plain text has no labels for classification; give a table with a label column, "
                        "(input_ids, labels) tensors or a Dataset")
    rows = texts.train + (texts.val or [])
    encoded = [request.tokenizer.encode(t)[:request.seq_len] for t in rows]
    kept = usable_rows({"text": [t if len(t) else None for t in encoded],
                        "label": texts.train_labels + (texts.val_labels or []), "row": list(range(len(rows)))},
                       texts.name)  # a text of no tokens (emptiness is judged before special tokens)
    labels, names = class_ids(kept["label"], request.num_classes, texts.name)
    data = Snippets(kept["text"], labels.tolist(), request.seq_len)
    if texts.val is not None:
        n_train = sum(row < len(texts.train) for row in kept["row"])
        train, val = Subset(data, range(n_train)), Subset(data, range(n_train, len(data)))
        how = texts.validation
    else:
        train, val = split_off(data, request.val_fraction, request.seed)
        how = f"a seeded random {request.val_fraction:.0%} of the rows ({len(val)} rows)"
    return DataSplits(train, val, "table", texts.name, request.tokenizer.name, how, names or None)


def _check_ids(ids: torch.Tensor, what: str, high: int | None, fix: str) -> None:
    """Integer ids in [0, high): a float tensor would be truncated to 0s and an id past the
    table would fail deep inside torch, so both are refused here with the fix."""
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise DataError(f"{what} must be integer ids, got a {str(ids.dtype).replace('torch.', '')} tensor; "
                        "tokenize first (e.g. torch.tensor(ids, dtype=torch.long))")
    if ids.numel() == 0:
        raise DataError(f"{what} is empty; give at least a few examples")
    low, top = int(ids.min()), int(ids.max())
    if low < 0 or (high is not None and top >= high):
        bad = low if low < 0 else top
        raise DataError(f"{what} holds {bad}, outside [0, {high}); {fix}")


def token_rows(data, request: DataRequest) -> Dataset:
    """Causal-LM tensors: one (N, seq_len + 1) long tensor of token ids, checked whole."""
    if not isinstance(data, torch.Tensor) or data.dim() != 2 or data.size(1) < 2:
        raise DataError("causal-LM tensors must be one (N, seq_len + 1) long tensor of token ids")
    _check_ids(data, "the token tensor", request.vocab_size, _vocab_fix(request))
    if request.max_len is not None and data.size(1) - 1 > request.max_len:
        raise DataError(f"token rows of {data.size(1)} give inputs of {data.size(1) - 1} tokens, past the model's "
                        f"max_len={request.max_len}; cut rows to at most {request.max_len + 1} tokens")
    return TokenRows(data.long())


def labelled_tensors(data, request: DataRequest) -> Dataset:
    """Classification tensors: an (input_ids (N, T), labels (N,)) pair, checked whole."""
    if not (isinstance(data, tuple) and len(data) == 2 and data[0].dim() == 2 and data[1].dim() == 1):
        raise DataError("classification tensors must be an (input_ids (N, T), labels (N,)) pair")
    ids, labels = data
    num_classes = request.num_classes
    if len(ids) != len(labels):
        raise DataError(f"{len(ids)} input rows but {len(labels)} labels; give one label per row")
    _check_ids(ids, "input_ids", request.vocab_size, _vocab_fix(request))
    _check_ids(labels, "labels", num_classes, f"the model has {num_classes} classes: use class ids 0..{num_classes - 1}"
               if num_classes else "use class ids from 0")
    if request.max_len is not None and ids.size(1) > request.max_len:
        raise DataError(f"input_ids rows of {ids.size(1)} tokens are past the model's max_len={request.max_len}; "
                        f"cut them to at most {request.max_len}")
    return Snippets(list(ids.long()), labels.tolist(), ids.size(1))


def _vocab_fix(request: DataRequest) -> str:
    return (f"the model's vocab_size is {request.vocab_size}: re-tokenize or build the model with a larger "
            "vocab_size")


def split_off(ds: Dataset, val_fraction: float, seed: int) -> tuple[Dataset, Dataset]:
    """(train, val): a seeded random `val_fraction` of the rows held out (at least one; none for 0)."""
    n = len(ds)
    n_val = max(1, int(n * val_fraction)) if val_fraction else 0
    if n - n_val < 1:
        raise DataError(f"{n} examples are too few to split into train and val; give more data")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return Subset(ds, order[n_val:]), Subset(ds, order[:n_val])


def in_data_order(ds: Dataset) -> Dataset:
    """`ds` with a random split's rows put back in the data's own order: what a run without shuffling trains in."""
    return Subset(ds.dataset, sorted(ds.indices)) if isinstance(ds, Subset) else ds


def without_validation(splits: DataSplits) -> DataSplits:
    """A run with no validation (val_fraction=0, as eval_every=never asks): nothing held out, and a source's own
    validation split unused."""
    if not len(splits.val):
        return replace(splits, validation=NO_VALIDATION)
    return replace(splits, val=Subset(splits.val, []),
                   validation=f"{NO_VALIDATION}; the source's own validation split ({len(splits.val)} examples) "
                              "is left unused")


def _seed_worker(worker_id: int) -> None:
    # Each worker's torch seed derives from the loader's generator; numpy/random follow it.
    seed = torch.initial_seed() % 2**32
    random.seed(seed)
    np.random.seed(seed)


def make_loader(dataset: Dataset, batch_size: int, *, collate: PadCollator | None = None, shuffle: bool = True,
                device=None, num_workers: int = 0, seed: int = 0, drop_last: bool = False, sampler=None) -> DataLoader:
    """A DataLoader with the rules that matter for speed and reproducibility.

    collate: what makes a batch of the examples (the splits' own, `DataSplits.collate`: the task's collator, padding
    each batch to its longest row); None pads with id 0 on the right. pin_memory on CUDA (so
    `to_device(..., non_blocking=True)` overlaps), persistent workers and prefetch when num_workers > 0, a seeded
    generator and seeded workers.
    """
    if batch_size < 1:
        raise DataError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers < 0:
        raise DataError(f"num_workers must be >= 0, got {num_workers}")
    if len(dataset) < batch_size and drop_last:
        raise DataError(f"batch_size={batch_size} is larger than the dataset ({len(dataset)} examples); "
                        "use a smaller batch size")
    cuda = device is not None and torch.device(device).type == "cuda"
    extra = {"persistent_workers": True, "prefetch_factor": 2} if num_workers > 0 else {}
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle and sampler is None, sampler=sampler,
                      collate_fn=collate or PadCollator(), num_workers=num_workers, pin_memory=cuda,
                      drop_last=drop_last, generator=torch.Generator().manual_seed(seed),
                      worker_init_fn=_seed_worker, **extra)


def to_device(batch: dict, device) -> dict:
    """Copy a batch dict to `device`; non_blocking pairs with pinned memory on CUDA."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}
