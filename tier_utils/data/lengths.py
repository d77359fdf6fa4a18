"""Orders that cut padding: batches grouped by length for training (transformers' `group_by_length` rule), and a
chosen set of rows put in length order for evaluation, generation and the benchmark.

Both only reorder: which rows train in an epoch, or which rows are scored, is decided before, as without them.
"""
from __future__ import annotations

from torch.utils.data import Dataset, Subset

# Batches per megabatch: the order is drawn at random, then each run of this many batches is sorted by length and cut
# into batches, so a batch holds rows of similar length while the epoch's order stays random (transformers' rule).
MEGABATCH = 50


def example_lengths(dataset: Dataset) -> list[int]:
    """Each example's length in tokens: its input's real positions (its mask's sum where it has one)."""
    lengths = []
    for i in range(len(dataset)):
        example = dataset[i]
        mask = example.get("attention_mask")
        lengths.append(int(mask.sum()) if mask is not None else len(example["input_ids"]))
    return lengths


def length_grouped(order: list[int], lengths: list[int], batch: int) -> list[int]:
    """`order` regrouped so that each run of `batch` rows (a global batch: every rank's rows of one micro-step)
    holds rows of similar length: megabatches of MEGABATCH batches, each sorted longest first. The longest row of all
    leads the epoch, so a batch too long for memory fails at the first step, not hours in."""
    size = batch * MEGABATCH
    grouped = [sorted(order[i:i + size], key=lambda k: -lengths[k]) for i in range(0, len(order), size)]
    if not grouped:
        return []
    longest = max(range(len(grouped)), key=lambda m: lengths[grouped[m][0]])
    grouped[0][0], grouped[longest][0] = grouped[longest][0], grouped[0][0]  # one row swapped: batches keep their size
    return [i for megabatch in grouped for i in megabatch]


def in_length_order(indices: list[int], lengths: list[int]) -> list[int]:
    """Chosen rows, longest first (the stable sort keeps equal lengths in their order): batches cut from them pad
    least. Only the order of rows already chosen changes, never which rows are chosen."""
    return sorted(indices, key=lambda i: -lengths[i])


def scored_in_length_order(val, eval_batches: int | None, batch_size: int) -> list[int]:
    """A validation order that cuts padding (training's with grouping, the benchmark's): the rows an evaluation
    scores chosen as without it (its first `eval_batches` batches), then put longest first among themselves; sorting
    the whole set would score only the shortest rows."""
    chosen = min(len(val), (eval_batches or len(val)) * batch_size)
    return in_length_order(list(range(chosen)), example_lengths(Subset(val, range(chosen)))) + list(
        range(chosen, len(val)))
