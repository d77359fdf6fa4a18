"""Batches made from examples at their own length: the task's collator pads each batch to its longest row, as
transformers' `DataCollatorWithPadding` / `DataCollatorForSeq2Seq` do, instead of padding every example to `seq_len`
when the dataset is built. Each key is padded on its own (a pair's source and target to their own longest), labels
with -100 so the loss and the metrics skip the padding, masks with 0.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import default_collate

IGNORE = -100  # a target the loss does not score (torch's cross_entropy ignore_index)
# Tensor cores multiply in tiles of 8 (16 bits) and a compiled step meets one shape per padded length: rounding the
# padded length up to a multiple of 8 serves both, at a few positions per row.
PAD_MULTIPLE = 8
# Filled with 0: the masks, and a packed row's positions (each pad position then a sequence of its own, unscored).
MASK_KEYS = ("attention_mask", "decoder_attention_mask", "position_ids")
LABEL_KEYS = ("labels",)


@dataclass(frozen=True)
class PadCollator:
    """Pads a list of example dicts into one batch dict.

    pad_id: what pads token ids (the tokenizer's pad id; a pad that is the EOS is fine: labels are padded with -100
    by place, never masked by id). side: "right" or "left". limit: the longest a padded row may be (the model's max
    length), so rounding up to `multiple` never passes it. Token rows are rounded up even when all one length (a
    grouped batch; corpus windows at a seq_len that is no multiple of 8); anything else of one shape (images, a
    classifier's labels) is stacked as it is."""

    pad_id: int = 0
    side: str = "right"
    multiple: int = PAD_MULTIPLE
    limit: int | None = None

    def __call__(self, examples: list[dict]) -> dict:
        return {key: self._batch(key, [example[key] for example in examples]) for key in examples[0]}

    def _batch(self, key: str, values: list) -> torch.Tensor:
        if not torch.is_tensor(values[0]):
            return default_collate(values)
        # Token rows (1-D integer tensors) are rounded up even when they are all one length (a length-grouped batch
        # of like rows), as transformers' pad_to_multiple_of does; anything else of one shape is stacked as it is.
        tokens = values[0].dim() == 1 and not values[0].is_floating_point()
        if not tokens and all(v.shape == values[0].shape for v in values):
            return torch.stack(values)
        fill = IGNORE if key in LABEL_KEYS else 0 if key in MASK_KEYS else self.pad_id
        return self.pad(values, fill)

    def padded_length(self, longest: int) -> int:
        """`longest` rounded up to the multiple, but never past the limit (and never below `longest`)."""
        rounded = -(-longest // self.multiple) * self.multiple
        return max(longest, min(rounded, self.limit)) if self.limit is not None else rounded

    def pad(self, rows: list[torch.Tensor], fill: int) -> torch.Tensor:
        """1-D rows (their first dimension is the sequence) into one (B, T, ...) tensor, `fill` in the padding."""
        length = self.padded_length(max(len(r) for r in rows))
        out = rows[0].new_full((len(rows), length, *rows[0].shape[1:]), fill)
        for i, row in enumerate(rows):
            if self.side == "left":
                out[i, length - len(row):] = row
            else:
                out[i, :len(row)] = row
        return out


@dataclass
class PaddingTally:
    """The positions a run's batches computed and the real tokens among them, counted on the host as each batch is
    made (no device sync): the share that was padding, and what padding every example to the run's length (as
    tier_utils did before it padded per batch) would have computed for the same examples."""

    per_row: int = 0  # the positions one example padded to the run's length computes (0: not compared)
    length: str = ""  # that length in words, e.g. "seq_len 128" or "seq_len 128, target_len 64"
    computed: int = 0
    real: int = 0
    at_length: int = 0  # the same examples' positions, each padded to the run's length

    def add(self, counted: tuple[int, int, int] | None) -> None:
        """A batch's (positions computed, real tokens, rows), as its task counts them (None: it holds no padding)."""
        if counted is None:
            return
        computed, real, rows = counted
        self.computed += computed
        self.real += real
        self.at_length += rows * self.per_row

    @property
    def share(self) -> float | None:
        """The share of computed positions that were padding (None: nothing counted)."""
        return 1 - self.real / self.computed if self.computed else None

    @property
    def share_at_length(self) -> float | None:
        return 1 - self.real / self.at_length if self.at_length else None

    def describe(self) -> str | None:
        """"padding 9 % of positions per batch (61 % at seq_len 128, every example padded to it)"; the comparison
        only where it differs (examples at their own length), None where nothing was counted."""
        if self.share is None:
            return None
        said = f"padding {self.share:.0%} of positions per batch"
        before = self.share_at_length
        if before is not None and round(before, 2) != round(self.share, 2):
            said += f" ({before:.0%} at {self.length}, every example padded to it)"
        return said.replace("%", " %")

    def to_dict(self) -> dict:
        return {"computed": self.computed, "real": self.real, "share": self.share, "at_length": self.at_length,
                "share_at_length": self.share_at_length, "length": self.length, "describe": self.describe()}


@dataclass(frozen=True)
class LongestBatch:
    """The longest batch a dataset's examples make under its collator: what a memory plan sizes a step at when the
    batches are cut to the data."""

    length: int  # the longest batch's length (the collator's rounding up, never past its limit)
    longest: int  # the longest example
    examples: int
    data: str  # what was read, in words
    target: int | None = None  # a pair's targets, padded apart (None: no target side of their own)
    longest_target: int | None = None
    same_length: bool = False  # every example is one length (corpus windows): nothing to cut to the data

    def describe(self) -> str:
        """"T=120, the longest batch the data makes (notes.csv, 2,000 examples: the longest 117 tokens, padded to
        a multiple of 8 up to the model's length)"."""
        target = f", target {self.target} (the longest {self.longest_target})" if self.target is not None else ""
        how = (f"every one {self.longest} tokens" if self.same_length else
               f"the longest {self.longest} tokens, padded to a multiple of {PAD_MULTIPLE} up to the model's length")
        return f"T={self.length}{target}, the longest batch the data makes ({self.data}, {self.examples:,} " \
               f"examples: {how})"

    def to_dict(self) -> dict:
        return {"length": self.length, "longest": self.longest, "examples": self.examples, "data": self.data,
                "target": self.target, "longest_target": self.longest_target, "describe": self.describe()}


def longest_batch(dataset, collate: PadCollator, data: str, input_key: str = "input_ids",
                  target_key: str | None = None) -> LongestBatch:
    """The longest batch `dataset` makes under `collate`: each example read once (its `input_key`, and
    `target_key`'s own length where the targets are padded apart)."""
    sizes = {key: set() for key in (input_key, target_key) if key is not None}
    for i in range(len(dataset)):
        example = dataset[i]
        for key, seen in sizes.items():
            seen.add(len(example[key]))

    def padded(key):
        return collate.padded_length(max(sizes[key]))

    same = all(len(seen) == 1 for seen in sizes.values())
    if target_key is None:
        return LongestBatch(padded(input_key), max(sizes[input_key]), len(dataset), data, same_length=same)
    return LongestBatch(padded(input_key), max(sizes[input_key]), len(dataset), data, padded(target_key),
                        max(sizes[target_key]), same)
