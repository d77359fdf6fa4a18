"""Packing: a causal LM's examples fitted best-fit-decreasing into rows of `seq_len`, each example keeping its own
positions (0, 1, ... from its first token), so that a model which builds its attention from them (transformers'
padding-free path: `position_ids`, no mask, no cache) lets no example attend to another.

A causal example is input_ids and its next-token labels, of one length (-100 where a target is not scored); its
labels are already shifted, so a packed row never scores one example's token as the next of another's.
"""
from __future__ import annotations

import bisect
import warnings

import torch
from torch.utils.data import Dataset, Subset

from ..core.errors import DataError
from .datasets import DataRequest, DataSplits, split_off
from .lengths import example_lengths
from .userdata import Texts, usable_rows

POSITIONS = "position_ids"  # a packed row's per-example positions: the key that marks a batch as packed


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of example indices, each summing to at most `capacity` (an example longer than that gets a bin of its
    own): examples taken longest first, each into the fullest bin it fits. Deterministic: the same lengths give the
    same bins, so a resume packs as the run did."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    by_room: dict[int, list[int]] = {}  # free room -> the bins with that much room left
    rooms: list[int] = []  # the rooms some bin has, ascending
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(rooms, n)
        if at == len(rooms):  # fits no open bin: a new one
            bins.append([i])
            room, b = max(capacity, n), len(bins) - 1
        else:
            room = rooms[at]
            b = by_room[room].pop()
            if not by_room[room]:
                del rooms[at]
            bins[b].append(i)
        left = room - n
        if left > 0:
            if not by_room.get(left):
                by_room[left] = []
                bisect.insort(rooms, left)
            by_room[left].append(b)
    return bins


class PackedRows(Dataset):
    """Rows of packed examples: input_ids and labels end to end, `position_ids` restarting at 0 for each example,
    and an attention_mask of ones (the real tokens: what a throughput counts)."""

    def __init__(self, examples: Dataset, bins: list[list[int]]):
        self.examples, self.bins = examples, bins

    def __len__(self) -> int:
        return len(self.bins)

    def __getitem__(self, i: int) -> dict:
        parts = [self.examples[k] for k in self.bins[i]]
        ids = torch.cat([p["input_ids"] for p in parts])
        return {"input_ids": ids, "labels": torch.cat([p["labels"] for p in parts]),
                "attention_mask": torch.ones(len(ids), dtype=torch.long),
                POSITIONS: torch.cat([torch.arange(len(p["input_ids"])) for p in parts])}


def packed(examples: Dataset, seq_len: int) -> Dataset:
    """`examples` packed into rows of `seq_len`; as they are, said in one line, where no two fit in one row (windows
    of seq_len, as the bundled corpus is)."""
    first = examples[0] if len(examples) else {}
    labels = first.get("labels")
    if labels is None or labels.dim() != 1 or labels.shape != first["input_ids"].shape:
        raise DataError("packing packs a causal LM's examples (input_ids with next-token labels of one length); this "
                        "data's examples are not: drop packing (--packing)")
    bins = best_fit_decreasing(example_lengths(examples), seq_len)
    if len(bins) == len(examples):
        warnings.warn(f"packing: no two of the {len(examples)} training examples fit in one row of seq_len={seq_len} "
                      "(windows of seq_len already have no padding): nothing to pack, trained as they are",
                      stacklevel=2)
        return examples
    return PackedRows(examples, bins)


class CausalExamples(Dataset):
    """Causal-LM examples at their own length, one per text: input_ids = tokens[:-1], labels = tokens[1:]."""

    def __init__(self, tokens: list[torch.Tensor]):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        t = self.tokens[i]
        return {"input_ids": t[:-1], "labels": t[1:], "attention_mask": torch.ones(len(t) - 1, dtype=torch.long)}


def text_examples(texts: Texts, request: DataRequest) -> DataSplits:
    """A causal LM's table (or dataset) read as separate texts, for packing: one example per row, cut to seq_len + 1
    tokens. A row of one token makes no (input, next-token) pair: dropped by the readers' one rule (counted, the
    first row numbers said; none left is refused). The source's own validation rows, else a seeded random
    `val_fraction` of the rows."""
    tokenizer = request.tokenizer
    rows = texts.train + (texts.val or [])
    encoded = [tokenizer.encode(t)[:request.seq_len + 1] for t in rows]
    kept = usable_rows({"text": [t if len(t) > 1 else None for t in encoded], "row": list(range(len(rows)))},
                       texts.name, "has under two tokens (nothing to predict)")
    data = CausalExamples(kept["text"])
    n_train = sum(row < len(texts.train) for row in kept["row"])
    if texts.val is not None:
        train, val, how = Subset(data, range(n_train)), Subset(data, range(n_train, len(data))), texts.validation
    else:
        train, val = split_off(data, request.val_fraction, request.seed)
        how = f"a seeded random {request.val_fraction:.0%} of the rows ({len(val)} rows)"
    return DataSplits(train, val, "table", texts.name, tokenizer.name, how)
