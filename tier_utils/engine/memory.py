"""The model's repeated blocks, found once for every job that works block by block: activation checkpointing
(the planner's `checkpointed`), FSDP2's `fully_shard` per block (sharding.py)."""
from __future__ import annotations

import torch.nn as nn


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer's blocks: the longest nn.ModuleList whose children all have one type."""
    best: list[nn.Module] = []
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > max(1, len(best)) and len({type(c) for c in m}) == 1:
            best = list(m)
    return best
