"""Sharded training checkpoints (FSDP2) through torch.distributed.checkpoint (DCP), beside checkpoint.py's
single files.

A checkpoint is a folder (checkpoint_dir/last/, best/): DCP's `.metadata` and one `__R_0.distcp` file per rank
holding that rank's shard of the model and AdamW state, plus `trainer.pt` (rank 0, checkpoint.py's format: step,
scheduler, scaler, every rank's RNG, data position, history, config). Every rank writes its shard into
`<name>.partial/`; once all are on disk rank 0 renames it into place, so a crash never leaves half a checkpoint
under the name. DCP reshards on load: a run resumes on another number of ranks. With several machines the
folder must be on a filesystem every rank sees. `full_model_state` gathers the unsharded weights on rank 0, for
a consolidated last.pt that `load_model` reads.
"""
from __future__ import annotations

import shutil
from pathlib import Path

# torch.distributed.checkpoint is imported in the functions that use it: it pulls in DTensor and sympy (0.6 s here),
# which every `import tier_utils` would pay (each CLI call, notebook kernel and torchrun rank) for a sharded run's
# checkpoint.
from ..core.errors import CheckpointError, one_line
from .checkpoint import load_checkpoint, save_checkpoint

TRAINER_FILE = "trainer.pt"
METADATA_FILE = ".metadata"


def save_sharded(folders: list[Path], model, optimizer, trainer: dict, env) -> None:
    """Every rank: its shard of model + optimizer into each folder; rank 0 adds `trainer` and renames."""
    if not folders:
        return
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    for folder in folders:
        partial = folder.with_name(folder.name + ".partial")
        if env.is_main:
            shutil.rmtree(partial, ignore_errors=True)  # a crashed save's leftovers
        env.barrier()
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=partial)
        if env.is_main:
            save_checkpoint(partial / TRAINER_FILE, trainer)
            _replace(partial, folder)
        env.barrier()  # no rank goes on (or reads it) before it is in place


def _replace(partial: Path, folder: Path) -> None:
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    partial.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def check_complete(folder: Path) -> None:
    """A sharded checkpoint folder with its metadata, trainer state and every shard its metadata names."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"sharded checkpoint {folder} not found; check checkpoint_dir or drop resume")
    for name in (METADATA_FILE, TRAINER_FILE):
        if not (folder / name).is_file():
            raise CheckpointError(f"sharded checkpoint {folder} has no {name}: not one tier_utils wrote, or "
                                  "damaged; delete it to start over")
    from torch.distributed.checkpoint import FileSystemReader

    shards = sorted({info.relative_path for info in FileSystemReader(str(folder)).read_metadata()
                     .storage_data.values()})
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise CheckpointError(f"sharded checkpoint {folder} is missing shard {missing[0]} ({len(missing)} of "
                              f"{len(shards)} missing); copy every rank's file back into it, or delete it to start "
                              "over")


def read_trainer(folder: Path, mmap: bool = False) -> dict:
    """The trainer state of a complete sharded checkpoint (what a resume checks before loading any weights)."""
    check_complete(folder)
    return load_checkpoint(Path(folder) / TRAINER_FILE, mmap=mmap)


def load_sharded(folder: Path, model, optimizer=None) -> None:
    """Every rank: the weights (and, given one, the optimizer state) from a sharded checkpoint, resharded
    to this run's ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    try:
        if optimizer is None:
            state = {"model": get_model_state_dict(model)}
            dcp.load(state, checkpoint_id=str(folder))
            set_model_state_dict(model, state["model"])
            return
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(folder))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(f"{folder} holds weights for a different model ({one_line(exc)[:160]}); use a new "
                              "checkpoint_dir") from exc


def full_model_state(model) -> dict:
    """The unsharded weights on rank 0's CPU (an empty dict on the other ranks); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
