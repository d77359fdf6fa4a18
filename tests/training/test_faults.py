"""Faults in long work, injected: a disk that fills while a checkpoint is written, SIGTERM (once: finish the step,
save, say where; twice: at once), an --out that can't be written, and one rank of a torchrun job that stops.

Tests run as root (chmod makes nothing read-only) and may not mount a tmpfs, so each fault is raised where the OS
would raise it: the checkpoint writer's own file write, a signal sent from inside a training step.
"""
from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import warnings

import pandas as pd
import pytest
import torch
from tiny import TINY_ARGS, tiny
from torchrun import rank_env, torchrun, worker_script

from tier_utils.cli import main
from tier_utils.core.errors import OutputError, one_line
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.training.loop import train

SMALL = dict(precision="fp32", device="cpu", batch_size=2, seq_len=16, eval_batches=1, progress=False)


def _train(**kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(tiny(seed=0), **{**SMALL, **kw})


def test_out_with_a_folder_where_train_writes_a_file_is_one_line_before_training(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "metrics.csv").mkdir(parents=True)
    code = main(["train", "--model", "tiny-gpt", *TINY_ARGS, "--device", "cpu", "--max-steps", "2", "--no-progress",
                 "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    assert "metrics.csv" in lines[0] and "--out" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["metrics.csv"]  # nothing trained, no checkpoint written


class _FillsUp:
    """A file that takes half of what it is given, then raises ENOSPC, as a full disk does."""

    def __init__(self, fh):
        self.fh = fh

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.fh.close()

    def write(self, data):
        self.fh.write(bytes(data[:len(data) // 2]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_disk_full_while_checkpointing_keeps_the_last_good_one_and_is_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "checkpoints"
    real_fdopen, writes = os.fdopen, []

    def fdopen(fd, *args, **kwargs):
        fh = real_fdopen(fd, *args, **kwargs)
        target = os.readlink(f"/proc/self/fd/{fd}")
        writes.append(target)
        full = ".last.pt." in target and sum(".last.pt." in w for w in writes) == 2  # the step-4 checkpoint
        return _FillsUp(fh) if full else fh

    monkeypatch.setattr(os, "fdopen", fdopen)
    with pytest.raises(OutputError) as caught:
        _train(max_steps=6, checkpoint_every=2, checkpoint_dir=str(folder))
    message = str(caught.value)
    assert message == one_line(caught.value)
    assert "step-4 checkpoint" in message and "No space left on device" in message
    assert f"{folder / 'last.pt'} (step 2) is intact" in message
    assert load_checkpoint(folder / "last.pt")["step"] == 2  # the last good checkpoint survives, whole
    assert not [p for p in folder.iterdir() if p.name.startswith(".last.pt.")]  # the half-written temp is gone


def _train_args(out, *extra):
    return ["train", "--model", "tiny-gpt", *TINY_ARGS, "--precision", "fp32", "--device", "cpu", "--batch-size",
            "2", "--seq-len", "16", "--max-steps", "8", "--checkpoint-every", "100", "--eval-every", "100",
            "--eval-batches", "1", "--no-progress", "--out", str(out), *extra]


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(worker_script())
    return path


def test_sigterm_finishes_the_step_saves_says_where_and_exits(tmp_path, worker):
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, str(worker), *_train_args(out)], capture_output=True, text=True,
                         env=rank_env(TERM_AT="3"), timeout=120)
    assert run.returncode == 130, run.stderr[-3000:]
    last = out / "checkpoints" / "last.pt"
    assert f"SIGTERM: stopped after step 3; saved {last}; rerun with --resume (resume=True) to continue" in run.stderr
    assert "Traceback" not in run.stderr
    assert load_checkpoint(last)["step"] == 3  # the step it was in finished, and was saved (checkpoint_every: 100)
    assert pd.read_csv(out / "metrics.csv").query("kind == 'step'")["step"].max() == 3


@pytest.mark.slow  # three training processes
def test_a_run_stopped_by_sigterm_resumes_exactly(tmp_path, worker):
    def cli(out, *extra, **env):
        run = subprocess.run([sys.executable, str(worker), *_train_args(out, "--deterministic", *extra)],
                             capture_output=True, text=True, env=rank_env(**env), timeout=120)
        assert "Traceback" not in run.stderr, run.stderr[-3000:]
        return load_checkpoint(out / "checkpoints" / "last.pt")

    cli(tmp_path / "part", TERM_AT="3")  # stopped mid-epoch, between checkpoints
    resumed, whole = cli(tmp_path / "part", "--resume"), cli(tmp_path / "whole")
    assert resumed["step"] == whole["step"] == 8
    for name, tensor in whole["model"].items():
        assert torch.equal(resumed["model"][name], tensor), name


def test_a_second_sigterm_stops_at_once(tmp_path, worker):
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, str(worker), *_train_args(out)], capture_output=True, text=True,
                         env=rank_env(TERM_AT="3", TERM_TIMES="2"), timeout=120)
    assert run.returncode == -signal.SIGTERM, run.stderr[-3000:]
    assert "stopped after step" not in run.stderr and not (out / "checkpoints" / "last.pt").exists()


@pytest.mark.slow  # a torchrun launch of 2 CPU ranks: about 10 s on 2 cores
def test_sigterm_under_torchrun_stops_every_rank_after_the_same_step(tmp_path, worker):
    out = tmp_path / "run"
    # Rank 0 sends it to torchrun, which passes it to every rank, as a scheduler's SIGTERM to the job would.
    run = torchrun([str(worker), *_train_args(out)], env_extra={"TERM_AT": "3", "TERM_TO": "launcher"})
    said = re.findall(r"SIGTERM: stopped after step (\d+); saved (\S+); rerun with --resume", run.stderr)
    assert len(said) == 1, run.stderr[-3000:]  # rank 0 says it; rank 1 stopped with it (it gave its RNG state)
    step, path = int(said[0][0]), said[0][1]
    assert path == str(out / "checkpoints" / "last.pt") and 3 <= step < 8
    saved = load_checkpoint(path)
    assert saved["step"] == step and len(saved["rng"]) == 2  # one checkpoint of both ranks at the same step
    assert "error:" not in run.stderr and "tier_utils" not in run.stderr.split("SIGTERM: stopped")[1]


# Rank 1 runs out of CUDA memory as its step 7 starts (torch.cuda.OutOfMemoryError can be raised on a CPU); with
# STUCK=1 rank 0 does not reach the collective it would fail in, as a rank waiting on NCCL does not, for 60 s.
_RANK1_OOM = """
import time
import torch
from tier_utils.engine.step import TrainStep
real_oom_call, oom_calls = TrainStep.__call__, [0]

def oom_call(self, micro):
    oom_calls[0] += 1
    if oom_calls[0] == 7 and os.environ["RANK"] == "1":
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if oom_calls[0] == 7 and os.environ.get("STUCK"):
        time.sleep(60)
    return real_oom_call(self, micro)

TrainStep.__call__ = oom_call
"""


@pytest.mark.slow  # a torchrun launch of 2 CPU ranks: about 10 s on 2 cores
@pytest.mark.parametrize("stuck", [False, True], ids=["in-a-collective", "never-returning"])
def test_one_ranks_out_of_memory_is_one_line_on_every_rank(tmp_path, stuck):
    worker = tmp_path / "worker.py"
    worker.write_text(worker_script(preamble=_RANK1_OOM))
    args = _train_args(tmp_path / "run", "--max-steps", "10", "--checkpoint-every", "4")
    run = torchrun([str(worker), *args], env_extra={"STUCK": "1"} if stuck else {})
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2, run.stderr[-3000:]
    answer = next(line for line in errors if line.startswith("error: out of memory after 6 of 10 steps"))
    told = next(line for line in errors if line.startswith("error: rank 1 stopped the run, so rank 0 stopped too"))
    assert told.endswith(answer[len("error: "):])  # where rank 1's answer is: repeated in full
    # No gloo traceback from rank 0; stuck, rank 0 answered before torchrun's SIGKILL (30 s after its SIGTERM).
    assert "[rank0]: Traceback" not in run.stderr and "Connection closed" not in run.stderr
