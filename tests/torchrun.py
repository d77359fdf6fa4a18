"""Launching tier_utils under torchrun from the tests: CPU ranks with gloo, one thread each.

`torchrun(target)` runs `python -m torch.distributed.run --standalone --nproc_per_node N target...` with the test's
own import path (the worktree) in every rank. `worker_script(...)` is a CLI entry point for the ranks that runs one
command or several (separated by --next) and can SIGKILL each rank as it starts optimizer step KILL_AT=k (after
the checkpoint of step k-2 is on disk), send SIGTERM as step TERM_AT=k starts, forbid every file write on ranks
other than 0, and swap torch.compile's backend for a cheap one.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

# Two blocks: fully_shard per block, then the root (tiny.py's model has one).
TWO_BLOCKS = dict(d_model=32, n_layer=2, n_head=2, max_len=32)
TWO_BLOCK_ARGS = [a for k, v in TWO_BLOCKS.items() for a in ("--model-arg", f"{k}={v}")]


def text_file(path):
    """A small text file at `path`: about 68 training windows of 16 bytes and 7 validation ones (an odd count)."""
    path.write_text("".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 4 else "") for i in range(1030)))
    return path


# Rank != 0 must not write: every write path raises there.
_RANK0_WRITES_ONLY = """
import pathlib
import tier_utils.core.files, tier_utils.models.checkpoint, tier_utils.training.history

if int(os.environ["RANK"]) != 0:
    def forbidden(*args, **kwargs):
        raise AssertionError(f"rank {os.environ['RANK']} tried to write a file")
    for mod in (tier_utils.models.checkpoint, tier_utils.core.files, tier_utils.training.history):
        mod.atomic_write_bytes = forbidden  # checkpoints, metrics.csv, training.png, --json
    pathlib.Path.write_bytes = pathlib.Path.write_text = forbidden
"""

# aot_eager traces forward and backward as inductor would, without compiling C++ (seconds, not minutes).
_CHEAP_COMPILE = """
import torch
from tier_utils.engine import compiling

compiling._compile = lambda module, mode: torch.compile(module, backend="aot_eager")
"""

_KILL_AT = """
kill_at = int(os.environ.get("KILL_AT", 0))
if kill_at:
    from tier_utils.engine.step import TrainStep
    real_call, calls = TrainStep.__call__, [0]

    def call(self, micro):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_call(self, micro)

    TrainStep.__call__ = call
"""

# SIGTERM as a scheduler sends it: rank 0 sends it TERM_TIMES times (default 1) as it starts optimizer step TERM_AT,
# to itself, or with TERM_TO=launcher to torchrun, which passes it on to every rank.
_TERM_AT = """
term_at = int(os.environ.get("TERM_AT", 0))
if term_at and int(os.environ.get("RANK", 0)) == 0:
    from tier_utils.engine.step import TrainStep
    real_term_call, term_calls = TrainStep.__call__, [0]

    def term_call(self, micro):
        term_calls[0] += 1
        if term_calls[0] == term_at:
            target = os.getppid() if os.environ.get("TERM_TO") == "launcher" else os.getpid()
            for _ in range(int(os.environ.get("TERM_TIMES", 1))):
                os.kill(target, signal.SIGTERM)
                time.sleep(0.1)  # each its own delivery: two pending SIGTERMs would merge into one
        return real_term_call(self, micro)

    TrainStep.__call__ = term_call
"""

# `worker.py VERB ... --next VERB ...`: the commands one after the other in the same ranks (one launch, one import
# of torch), exiting with the highest code. The ranks' process group is then the worker's, so it outlives each
# command (a tier closes only a group it started, and gloo can't be joined again in the same process).
_COMMANDS = """
commands = [[]]
for word in sys.argv[1:]:
    commands.append([]) if word == "--next" else commands[-1].append(word)
if len(commands) > 1:
    import torch.distributed as dist
    dist.init_process_group("gloo")
codes = [cli.main(command) for command in commands]
if len(commands) > 1:
    dist.destroy_process_group()
sys.exit(max(codes))
"""


def worker_script(rank0_writes_only: bool = False, cheap_compile: bool = False, preamble: str = "") -> str:
    """The source of a rank's entry point: `python worker.py VERB ...` runs the CLI. `preamble`: code each rank runs
    first (e.g. registering a strategy a test defines)."""
    parts = ["import os, signal, sys, time", "from tier_utils import cli", preamble]
    parts += [_RANK0_WRITES_ONLY] * rank0_writes_only + [_CHEAP_COMPILE] * cheap_compile
    parts += [_KILL_AT, _TERM_AT, _COMMANDS]
    return "\n".join(textwrap.dedent(p) for p in parts) + "\n"


def rank_env(**extra) -> dict:
    """The ranks' environment: one torch thread each, the test's import path (the ranks import the code under
    test), and `extra`."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def torchrun(target: list[str], ranks: int = 2, env_extra: dict | None = None, launcher=("--standalone",),
             timeout: int = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc_per_node", str(ranks), *target]
    return subprocess.run(cmd, capture_output=True, text=True, env=rank_env(**(env_extra or {})), timeout=timeout)


def ok(run: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
