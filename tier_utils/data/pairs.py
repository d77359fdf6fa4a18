"""Source-target pairs for a sequence-to-sequence model: each side encoded as the model's tokenizer encodes it (its
special tokens: T5's and BART's end of sequence), truncated to its own length and kept at it; the task's collator pads
each side of a batch to its longest, the targets with -100, so the loss and the accuracy skip the padding."""
from __future__ import annotations

import warnings

import torch
from torch.utils.data import Dataset, Subset

from ..core.errors import DataError
from .collate import IGNORE
from .datasets import DataRequest, DataSplits, split_off
from .userdata import Texts, usable_rows


class Pairs(Dataset):
    """Sources and targets (the labels; -100 where a given target place is not scored), each at its own length."""

    def __init__(self, ids: list[torch.Tensor], labels: list[torch.Tensor], rows: list[int] | None = None):
        if not len(ids):
            raise DataError("no source-target pairs; give at least one row with both")
        self.ids, self.labels = ids, labels
        self.rows = list(range(len(ids))) if rows is None else rows  # each pair's row in what was encoded

    @classmethod
    def encode(cls, sources: list[str], targets: list[str], request: DataRequest, where: str = "the pairs") -> Pairs:
        """Both sides through the request's tokenizer, each cut to its length; the cuts are counted and said."""
        tokenizer, seq_len = request.tokenizer, request.seq_len
        target_len = request.target_len or seq_len
        # Empty is judged on the text's own tokens: an empty target still gets T5's or BART's end token.
        own = {"source": len(tokenizer.encode_example("")), "target": len(tokenizer.encode_example("", target=True))}
        kept = usable_rows({"source": [s if len(s) > own["source"] else None for s in
                                       (tokenizer.encode_example(s) for s in sources)],
                            "target": [t if len(t) > own["target"] else None for t in
                                       (tokenizer.encode_example(t, target=True) for t in targets)],
                            "row": list(range(len(sources)))}, where)
        src, tgt = kept["source"], kept["target"]
        for side, n, flag in ((src, seq_len, "seq_len"), (tgt, target_len, "target_len")):
            cut = sum(len(x) > n for x in side)
            if cut:
                warnings.warn(f"{cut} of {len(side)} {'sources' if side is src else 'targets'} in {where} are longer "
                              f"than {n} tokens and were cut to it; raise {flag} to keep them whole", stacklevel=3)
        return cls([s[:seq_len] for s in src], [t[:target_len] for t in tgt], kept["row"])

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones(len(ids), dtype=torch.long), "labels": self.labels[i]}


def pair_rows(texts: Texts, request: DataRequest) -> DataSplits:
    """A table's (or dataset's) source and target columns as Pairs: the source's own validation rows, else a seeded
    random `val_fraction` of the rows."""
    rows, targets = texts.train + (texts.val or []), texts.train_labels + (texts.val_labels or [])
    data = Pairs.encode(rows, targets, request, texts.name)
    if texts.val is not None:
        n_train = sum(row < len(texts.train) for row in data.rows)
        train, val, how = Subset(data, range(n_train)), Subset(data, range(n_train, len(data))), texts.validation
    else:
        train, val = split_off(data, request.val_fraction, request.seed)
        how = f"a seeded random {request.val_fraction:.0%} of the pairs ({len(val)} pairs)"
    return DataSplits(train, val, "table", texts.name, request.tokenizer.name, how)


def paired_tensors(data, request: DataRequest) -> Pairs:
    """Seq2seq tensors: an (input_ids (N, S), labels (N, T)) pair of token ids, -100 where a target place is not
    scored."""
    if not (isinstance(data, tuple) and len(data) == 2 and data[0].dim() == 2 and data[1].dim() == 2):
        raise DataError("seq2seq tensors must be an (input_ids (N, S), labels (N, T)) pair of token ids")
    ids, labels = data
    if len(ids) != len(labels):
        raise DataError(f"{len(ids)} source rows but {len(labels)} target rows; give one target per source")
    if ids.is_floating_point() or labels.is_floating_point() or ids.min() < 0 or \
            max(int(ids.max()), int(labels.max())) >= request.vocab_size or (labels.lt(0) & labels.ne(IGNORE)).any():
        raise DataError(f"seq2seq tensors must hold integer ids in [0, {request.vocab_size}) (labels may also be "
                        "-100); re-tokenize with the model's tokenizer")
    return Pairs(list(ids.long()), list(labels.long()))
