"""A benchmark size that answers the AMP question on a GPU: grow the batch until fp32's step is about
arithmetic rather than per-step overhead, or until a memory budget is reached.

At a launch-bound size every precision waits on the host alike, so a speedup measured there says
nothing about the precision. `grow_batch` is a pure loop over `measure(batch)` (tested with
injected numbers); `fp32_measure` is the real measurement the main job uses on a GPU.
"""
from __future__ import annotations

import copy
import statistics
import types

import torch

from ..core.budget import without_oom
from ..core.precision import resolve_precision
from .config import BenchConfig, Thresholds
from .measurements import FLOOR_TOKENS, timed_repeat
from .verdicts import TARGET_FIXED_SHARE, launch_bound

MAX_DOUBLINGS = 10  # 8 -> 8192 sequences: past that, a model is no longer "tiny at this size"
MEMORY_FRACTION = 0.5  # of the GPU's memory: the benchmark also holds low-precision copies and AdamW state
_UNTIMED, _TIMED = 2, 3
_NO_BAR = types.SimpleNamespace(update=lambda n=1: None)


def grow_batch(batch_size: int, measure, budget_bytes: int | None, t: Thresholds = Thresholds(),  # noqa: B008 frozen
               max_doublings: int = MAX_DOUBLINGS) -> dict:
    """Double the batch while fp32's step is mostly fixed cost and the next size is predicted to fit.

    measure(b) -> {"step_ms", "floor_ms", "peak_bytes"} for fp32 at batch b (floor: one short
    sequence), or None when b ran out of memory. Stops once the fixed cost is at most
    TARGET_FIXED_SHARE of the step, when twice this size's peak would pass `budget_bytes`, or after
    `max_doublings`. Returns the chosen batch, every size tried and why it stopped there.
    """
    trail, b = [], batch_size
    for _ in range(max_doublings + 1):
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
            why = (f"batch {2 * b} would pass the memory budget ({budget_bytes / 2**30:.1f} GiB); fp32's step is "
                   f"still {share:.0%} fixed cost")
            break
        b *= 2
    else:
        why = f"stopped after {max_doublings} doublings; fp32's step is still {trail[-1]['fixed_share']:.0%} fixed cost"
    chosen = trail[-1]["batch_size"] if trail else batch_size
    return {"batch_size": chosen, "from_batch_size": batch_size, "trail": trail, "reason": why}


def fp32_measure(adapter, seq_len: int, lr: float = BenchConfig.lr):
    """`measure(b)` for grow_batch: fp32 steps at batch b and at one short sequence on the model's device,
    median of the timed steps and the CUDA peak; the model's weights are restored after each call."""
    dev = adapter.device
    prec = resolve_precision("fp32", dev, warn=False)
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
