"""FSDP2 (`torch.distributed.fsdp.fully_shard`) for the FSDP strategy (strategies.py) under torchrun.

`fully_shard` goes on each repeated block (memory.repeated_blocks), then on the root, over the run's explicit
1-D device mesh (gloo on CPU ranks, nccl with one GPU per rank): each rank keeps 1/N of every weight, gradient
and AdamW state, and a block's full weights exist only while it runs. The decided precision becomes FSDP's
MixedPrecisionPolicy (Precision.mixed_precision_policy: the mixed modes gather weights in the compute dtype and
reduce gradients in fp32; fp32 and the true modes cast nothing). The strategy gives fp16 torch's
ShardedGradScaler, whose inf check is agreed across ranks, and clips the sharded (DTensor) gradients by their
global norm. On CPU ranks the run first fixes glibc's mmap threshold (host_allocator, core/allocator.py), so the
buffers FSDP frees every step leave the rank's resident memory.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.allocator import return_freed_memory
from ..core.precision import Precision
from .activation_checkpointing import repeated_blocks

if TYPE_CHECKING:  # torch.distributed.fsdp is imported where a model is sharded: 0.6 s on every `import tier_utils`
    from torch.distributed.fsdp import MixedPrecisionPolicy


def describe_policy(policy: MixedPrecisionPolicy) -> str:
    def name(dtype):
        return str(dtype).replace("torch.", "") if dtype is not None else "as stored"

    return f"MixedPrecisionPolicy(param_dtype={name(policy.param_dtype)}, reduce_dtype={name(policy.reduce_dtype)})"


@dataclass(frozen=True)
class Sharding:
    """How a model was sharded, for the run's summary."""

    world_size: int
    blocks: int
    block_type: str | None
    policy: MixedPrecisionPolicy
    reshard_after_forward: bool
    allocator: str | None = None  # CPU ranks: what the run did with glibc's mmap threshold (core/allocator.py)

    def describe(self) -> str:
        where = (f"each of {self.blocks} {self.block_type} blocks, then the root" if self.blocks else
                 "the root only (no repeated blocks: the whole model is gathered at once in forward and backward)")
        allocator = f"; {self.allocator}" if self.allocator else ""
        return (f"FSDP2 fully_shard over {self.world_size} rank(s) on {where}; {describe_policy(self.policy)}; "
                f"reshard_after_forward={self.reshard_after_forward}{allocator}")


def shard(model: torch.nn.Module, env, precision: Precision, reshard_after_forward: bool = True,
          allocator: str | None = None) -> Sharding:
    """`fully_shard` per repeated block, then on the root, in place (the module's weights become DTensors).
    Call it before building the optimizer, which must hold the sharded parameters. `allocator`: what the run did
    with the host allocator (host_allocator), for the summary."""
    from torch.distributed.fsdp import fully_shard

    mesh = env.mesh()
    policy = precision.mixed_precision_policy()
    blocks = repeated_blocks(model)
    block_type = type(blocks[0]).__name__ if blocks else None  # before fully_shard renames it FSDP<name>
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    sharding = Sharding(env.world_size, len(blocks), block_type, policy, reshard_after_forward, allocator)
    if not blocks and env.is_main:
        warnings.warn(f"{type(model).__name__} has no repeated blocks (no nn.ModuleList of one module type): FSDP "
                      "shards the root only, so its whole weights are gathered at once", stacklevel=3)
    return sharding


def host_allocator(env) -> str | None:
    """On CPU ranks, before the model is built: glibc's mmap threshold fixed (core/allocator.py), so the buffers
    FSDP frees every step leave the rank's resident memory; None on GPUs, whose buffers torch's caching allocator
    keeps on the card by design."""
    return return_freed_memory() if env.device.type == "cpu" else None


@contextlib.contextmanager
def gradient_sync(model, on: bool):
    """The sharded model's reduce-scatter on (the step's last micro-batch) or off, for one backward."""
    model.set_requires_gradient_sync(on)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def unsharded_class(model: torch.nn.Module) -> type:
    """The model's own class (fully_shard makes the module an instance of a subclass FSDP<name>)."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def param_bytes(model: torch.nn.Module) -> int:
    """The parameter bytes this rank holds: its shard of each DTensor, the whole of a plain tensor."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in model.parameters())
