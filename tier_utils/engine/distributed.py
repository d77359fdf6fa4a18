"""The ranks under torchrun: process group and device mesh, sharded data order, cross-rank reductions. The
strategies that run on them are classes in strategies.py; FSDP2's sharding itself is in sharding.py.

Everything is torch.distributed, and rank, world size and local rank come only from torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK), on one machine or several. A plain (non-torchrun) process gets a one-rank
`DistEnv` whose collectives are no-ops, so the training loop has a single code path. FSDP needs the process
group even on one rank (its mesh is a process group): `join` joins one whatever the world size.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils.data import DistributedSampler, Subset

from ..core.errors import LaunchError, RankStopped, TierError, one_line
from ..core.precision import resolve_device
from ..data.lengths import length_grouped

# How long a rank waits at one collective for the others before it fails, on gloo and NCCL alike (their defaults: 30
# and 10 minutes). A rank that stops with a one-line error tells the others at once (`answering_for_ranks`); this is
# the bound for the rest (a rank killed outright, a hang), long enough for rank 0 to write a large checkpoint while
# the others wait at the next step.
RANK_TIMEOUT = timedelta(minutes=10)
_WATCH_EVERY_S = 1.0  # how often a rank looks for another's error in the job's store


def launch_hint(verb: str, strategy: str) -> str:
    """How to launch `verb` on torchrun's ranks, for the one-line error a plain process gets."""
    return f"torchrun --nproc_per_node N -m tier_utils {verb} ... --strategy {strategy} (several machines: " \
           "docs/distributed.md)"


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_world() -> int:
    """How many ranks this process is one of, without joining them: 1 outside torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device | None = None  # the device this rank must use; None: the caller decides
    owns_group: bool = False  # we initialised the process group, so we tear it down

    @property
    def active(self) -> bool:
        return self.world_size > 1

    def mesh(self):
        """The explicit 1-D device mesh FSDP shards over: CPU ranks (gloo) or one GPU per rank (nccl)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (self.world_size,))

    def all_max(self, value: int) -> int:
        if not self.active:
            return value
        t = torch.tensor([value], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.active:
            tensor = tensor.clone()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_mean(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_sum(tensor) / self.world_size if self.active else tensor

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (on every rank)."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def close(self) -> None:
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            self.owns_group = False


def join(device, verb: str, strategy: str) -> DistEnv:
    """Join the torchrun job: nccl on CUDA (one GPU per local rank), gloo on CPU. Without torchrun, a LaunchError
    saying how to launch `verb` with `strategy`."""
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif launched_by_torchrun() and dist.is_available():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    else:
        raise LaunchError(f"strategy={strategy!r} runs on torchrun's ranks; launch with {launch_hint(verb, strategy)}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    wants_cuda = resolve_device(device).type == "cuda"
    if wants_cuda:
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if wants_cuda else "gloo", device_id=dev if wants_cuda else None,
                                timeout=RANK_TIMEOUT)
    return DistEnv(rank, world, local_rank, dev, owns)


def eval_shard(dataset, env: DistEnv):
    """This rank's share of a validation set: examples rank, rank + N, ... Every example is scored
    exactly once across ranks (DistributedSampler would repeat some to even out the shares, and
    count them twice); shares may differ by one, which is fine: evaluation ends in one all_sum."""
    if not env.active:
        return dataset
    return Subset(dataset, range(env.rank, len(dataset), env.world_size))


class ShardedSampler(DistributedSampler):
    """The training order: a permutation drawn from (seed + epoch), or the data's own order (`shuffle=False`),
    dealt to ranks round-robin.

    One rank sees the order as it is; N ranks with batch b see together exactly what one
    rank with batch N*b sees. `start` skips that many of this rank's samples (resume mid-epoch).
    `lengths` (grouping by length): the order regrouped into global batches of `group` rows (the batch per rank times
    the ranks) of similar length before it is dealt, so each rank's batch is a share of one global batch, every rank
    runs the same steps, and the promise above holds.
    """

    def __init__(self, dataset, num_replicas: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True,
                 lengths: list[int] | None = None, group: int = 1):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=True)
        self.start, self.lengths, self.group = 0, lengths, group

    def __iter__(self):
        if self.lengths is None:
            return itertools.islice(super().__iter__(), self.start, None)
        n = len(self.dataset)  # DistributedSampler's own draw, so the order is a function of (seed, epoch) alone
        order = (torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
                 if self.shuffle else list(range(n)))
        grouped = length_grouped(order, self.lengths, self.group)[:self.total_size]
        return itertools.islice(grouped[self.rank::self.num_replicas], self.start, None)

    def __len__(self) -> int:
        return self.num_samples - self.start


def _stopped_key() -> str:
    """The job's store key for the first rank's error; a torchrun restart of the job gets a key of its own."""
    return f"tier_utils/stopped/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _heard(env: DistEnv) -> RankStopped | None:
    """Another rank's recorded error as this rank's, or None."""
    store, key = dist.distributed_c10d._get_default_store(), _stopped_key()
    try:
        if not store.check([key]):
            return None
        code, rank, line = store.get(key).decode().split("\t", 2)
    except dist.DistError:  # the store is gone (torchrun's agent ended): there is nothing to hear
        return None
    if int(rank) == env.rank:
        return None
    return RankStopped(f"rank {rank} stopped the run, so rank {env.rank} stopped too; rank {rank}'s answer (also on "
                       f"its own stderr): {line}", int(code))


def _record(env: DistEnv, exc: TierError) -> None:
    """This rank's one-line error in the job's store, for the others (the first rank's wins)."""
    store = dist.distributed_c10d._get_default_store()
    with contextlib.suppress(dist.DistError):  # no store left to tell: the others fail at their collective as before
        store.compare_set(_stopped_key(), "", f"{exc.exit_code}\t{env.rank}\t{one_line(exc)}")


def _watch(env: DistEnv, done: threading.Event) -> None:
    """A thread's loop: another rank's error, heard while this rank's main thread waits in a collective that will not
    return (NCCL waits out RANK_TIMEOUT), ends this process with that one line. Exiting from here skips the run's
    clean-up: its checkpoints are written whole or not at all, and a killed run's folder lock is taken over."""
    while not done.wait(_WATCH_EVERY_S):
        heard = _heard(env)
        if heard is not None and not done.wait(_WATCH_EVERY_S):  # the main thread's own answer first, if it comes
            print(f"error: {heard}", file=sys.stderr, flush=True)
            os._exit(heard.exit_code)


@contextlib.contextmanager
def answering_for_ranks(env: DistEnv):
    """A block of work on torchrun's ranks (one process: nothing). A rank that stops on a one-line error (TierError)
    records it in the job's key-value store (torchrun's); every other rank stops with one line naming that rank and
    repeating its answer: where its collective fails (gloo: at once), or from a watcher thread within about two
    seconds where it would wait (NCCL)."""
    if not (env.active and dist.is_initialized()):
        yield
        return
    done = threading.Event()
    threading.Thread(target=_watch, args=(env, done), daemon=True, name="tier_utils-ranks").start()
    try:
        yield
    except RankStopped:
        raise
    except TierError as exc:
        _record(env, exc)
        raise
    except Exception as exc:  # a collective that failed because a rank left: name it, if it said why
        heard = _heard(env)
        if heard is None:
            raise
        raise heard from exc
    finally:
        done.set()
