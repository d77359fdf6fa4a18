"""A benchmark size that answers the AMP question on a GPU: grow the batch until fp32's step is about
arithmetic rather than per-step overhead, or until a cap that is the same on every card.

The caps (GROWTH_MAX_BATCH sequences, GROWTH_BUDGET_BYTES) don't grow with the device: the user asked how the
precisions compare, not to fill the card (an H200 grew 8 -> 918 sequences before they were set). Where growth
stops at a cap, the reason says so with the fixed-cost share it left.

At a launch-bound size every precision waits on the host alike, so a speedup measured there says
nothing about the precision. `grow_batch` is a pure loop over `measure(batch)` (tested with
injected numbers); `fp32_measure` is the real measurement the main job uses on a GPU.
"""
from __future__ import annotations

import copy
import statistics
import types

import torch

from ...core.budget import without_oom
from ...core.precision import BASELINE, resolve_precision
from ..config import BenchConfig, Thresholds
from ..measurements import FLOOR_TOKENS, timed_repeat
from ..verdicts import TARGET_FIXED_SHARE, launch_bound

# The most sequences growth reaches, on any card: 8 -> 256 is five doublings, a few seconds of steps on a T4.
GROWTH_MAX_BATCH = 256
MEMORY_FRACTION = 0.5  # of the GPU's memory: the benchmark also holds low-precision copies and AdamW state
# ...and at most this much, on any card: half of the smallest profiled card (a T4's 15 GiB) holds it.
GROWTH_BUDGET_BYTES = 4 << 30
_UNTIMED, _TIMED = 2, 3
_NO_BAR = types.SimpleNamespace(update=lambda n=1: None)


def growth_budget(total_bytes: int) -> int:
    """The bytes growth may plan to use on a card of `total_bytes`: MEMORY_FRACTION of it, at most
    GROWTH_BUDGET_BYTES (the same on every card that holds it)."""
    return min(int(MEMORY_FRACTION * total_bytes), GROWTH_BUDGET_BYTES)


def grow_batch(batch_size: int, measure, budget_bytes: int | None, t: Thresholds = Thresholds(),  # noqa: B008 frozen
               max_batch: int = GROWTH_MAX_BATCH) -> dict:
    """Double the batch while fp32's step is mostly fixed cost and the next size is predicted to fit.

    measure(b) -> {"step_ms", "floor_ms", "peak_bytes"} for fp32 at batch b (floor: one short
    sequence), or None when b ran out of memory. Stops once the fixed cost is at most
    TARGET_FIXED_SHARE of the step, when twice this size's peak would pass `budget_bytes`, or when doubling
    would pass `max_batch` (a batch asked above it is measured as asked, not grown). Returns the chosen batch,
    every size tried, why it stopped there and whether a cap stopped it (`capped`, with the fixed-cost share left).
    """
    trail, b, capped = [], batch_size, False
    while True:
        m = measure(b)
        if m is None:
            why = f"batch {b} ran out of memory"
            break
        share = launch_bound(m["step_ms"], m["floor_ms"], None, b, t)["fixed_share"]
        trail.append({"batch_size": b, "step_ms": m["step_ms"], "floor_ms": m["floor_ms"], "fixed_share": share,
                      "peak_bytes": m["peak_bytes"]})
        if share <= TARGET_FIXED_SHARE:
            why = f"fp32's step is {share:.0%} fixed per-step cost at batch {b}"
            break
        if budget_bytes is not None and m["peak_bytes"] is not None and 2 * m["peak_bytes"] > budget_bytes:
            why, capped = (f"batch {2 * b} would pass the growth budget ({budget_bytes / 2**30:.1f} GiB, the same "
                           f"on every card); fp32's step is still {share:.0%} fixed cost"), True
            break
        if 2 * b > max_batch:
            why, capped = (f"stopped at the cap of {max_batch} sequences (the same on every card); fp32's step is "
                           f"still {share:.0%} fixed cost, so the speedups understate a bigger batch's"), True
            break
        b *= 2
    chosen = trail[-1]["batch_size"] if trail else batch_size
    return {"batch_size": chosen, "from_batch_size": batch_size, "trail": trail, "reason": why, "capped": capped,
            "fixed_share_left": trail[-1]["fixed_share"] if trail else None}


def fp32_measure(adapter, seq_len: int, lr: float = BenchConfig.lr):
    """`measure(b)` for grow_batch: fp32 steps at batch b and at one short sequence on the model's device,
    median of the timed steps and the CUDA peak; the model's weights are restored after each call."""
    dev = adapter.device
    prec = resolve_precision(BASELINE, dev, warn=False)
    cfg = BenchConfig(untimed_steps=_UNTIMED, lr=lr)  # the benchmark's optimizer, clipping and seed
    start = copy.deepcopy(adapter.model.state_dict())
    floor = [adapter.example_batch(1, min(FLOOR_TOKENS, seq_len))] * (_UNTIMED + _TIMED)

    def measure(b: int) -> dict | None:
        cuda = dev.type == "cuda"

        def steps() -> dict:
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            batches = [adapter.example_batch(b, seq_len, seed=i) for i in range(_UNTIMED + _TIMED)]
            step_ms = statistics.median(timed_repeat(adapter, prec, start, batches, cfg, _NO_BAR)[0])
            peak = torch.cuda.max_memory_allocated(dev) if cuda else None
            floor_ms = statistics.median(timed_repeat(adapter, prec, start, floor, cfg, _NO_BAR)[0])
            return {"step_ms": step_ms, "floor_ms": floor_ms, "peak_bytes": peak}

        try:
            return without_oom(steps)[0]  # None: batch b ran out of memory
        finally:
            adapter.model.load_state_dict(start)
            adapter.model.zero_grad(set_to_none=True)

    return measure
