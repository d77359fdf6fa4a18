"""The torch thread count of a run: chosen at the run's entry (never at import) from the CPU time other
processes use now, restored when the run ends; the user's own choice wins, and a resumed run keeps its
checkpoint's count. Every result says which (`threads_reason`).

Threads that synchronise every op wait for each other when one of them has no core of its own: on a shared
2-core machine the main job ran 2.6-6.8x slower with 2 threads than with 1 (bench/RESULTS.md). So the count
goes down to the cores other processes leave free, measured over a short sample of the machine's CPU time
minus this process's own: not the load average, which counts the user's previous command for a minute.
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass, replace

import psutil
import torch

from .measure import cpu_load, usable_cores

# Thread counts the user chose before the process started: torch reads these at start-up.
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
SAMPLE_S = 0.2  # long enough for 20 scheduler ticks per core, short beside any run


@dataclass(frozen=True)
class Busy:
    """How many of the `cores` this process may use other processes kept busy over a short sample
    (`others`; None where the OS would not say)."""

    others: float | None
    cores: int

    def __str__(self) -> str:
        cores = f"{self.cores} core{'s' if self.cores != 1 else ''}"
        if self.others is None:
            return f"other processes' CPU use unknown on {cores}"
        return f"other processes busy on {self.others:.1f} of {cores}"


_WORK = ("user", "nice", "system", "irq", "softirq", "steal")  # not idle, not waiting for I/O


def work_seconds(cpus) -> float:
    """CPU-seconds spent working on the logical CPUs `cpus` since boot, by every process."""
    per_cpu = psutil.cpu_times(percpu=True)
    return sum(getattr(per_cpu[c], field, 0.0) for c in cpus for field in _WORK)


def others_busy(sample_s: float = SAMPLE_S) -> Busy:
    """The cores other processes keep busy now: the machine's CPU time on this process's cores over
    `sample_s`, minus this process's own (its threads, which this sample does not ask to share with)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: every CPU
        cpus = list(range(psutil.cpu_count() or 1))
    me = psutil.Process()
    try:
        machine, own, start = work_seconds(cpus), sum(me.cpu_times()[:2]), time.perf_counter()
        time.sleep(sample_s)
        machine, own = work_seconds(cpus) - machine, sum(me.cpu_times()[:2]) - own
    except (psutil.Error, OSError, IndexError):  # no per-CPU times here (a container hiding /proc/stat)
        return Busy(None, len(cpus))
    return Busy(max(0.0, (machine - own) / (time.perf_counter() - start)), len(cpus))


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str
    users: bool = False  # the user chose the count (OMP_NUM_THREADS, torch.set_num_threads): tier_utils keeps it


def choose_threads(current: int, env, sample=None, default: int | None = None) -> ThreadChoice:
    """The torch thread count for a run starting now: one per core other processes leave free (at least 1),
    never more than `current`. The user's choice wins: OMP_NUM_THREADS / MKL_NUM_THREADS in `env`, or a
    `current` count other than torch's `default` (one thread per usable core) set by torch.set_num_threads.
    `sample()` -> Busy (default `others_busy`) is taken only when the choice is tier_utils' to make."""
    for name in THREAD_ENV:
        if env.get(name):
            return ThreadChoice(current, f"{_threads(current)}: {name}={env[name]} is set", users=True)
    if current != (usable_cores() if default is None else default):
        return ThreadChoice(current, f"{_threads(current)}: set by torch.set_num_threads before the run, kept",
                            users=True)
    busy = (sample or others_busy)()
    free = busy.cores if busy.others is None else max(0, int(busy.cores - busy.others + 0.5))
    threads = max(1, min(current, free))
    if threads == current:
        return ThreadChoice(current, f"{_threads(current)}, one per core ({busy})")
    cores = "no core" if free == 0 else f"{free} core{'s' if free != 1 else ''}"
    return ThreadChoice(threads, f"{_threads(threads)}, not {current}: other processes leave {cores} free "
                                 f"({busy}); OMP_NUM_THREADS=N overrides")


def _threads(n: int) -> str:
    return f"{n} torch thread{'s' if n != 1 else ''}"


_RUN: list[ThreadChoice] = []  # the decision of the run in progress (its outermost entry's); empty between runs


@contextlib.contextmanager
def run_threads():
    """A run's torch thread count: chosen (`choose_threads`) and applied as the outermost run starts, kept by
    the runs it calls (the main job's tiers, a search's trials), and the caller's count back when it ends,
    so tier_utils leaves no thread count behind and a second run chooses afresh."""
    if _RUN:
        yield _RUN[-1]
        return
    before = torch.get_num_threads()
    choice = choose_threads(before, os.environ)
    torch.set_num_threads(choice.threads)
    _RUN.append(choice)
    try:
        yield choice
    finally:
        _RUN.clear()
        torch.set_num_threads(before)


def chooses_threads(entry):
    """A run's entry (a tier, the main job): its body runs under `run_threads()`."""
    @functools.wraps(entry)
    def run(*args, **kwargs):
        with run_threads():
            return entry(*args, **kwargs)
    return run


def resume_threads(threads: int, step: int) -> None:
    """A resumed run continues on its checkpoint's thread count (the count changes the last bits of every
    reduction), unless the user chose one; the reason says which."""
    if not _RUN:
        return
    chosen = _RUN[-1]
    if chosen.users:
        same = "the same" if chosen.threads == threads else f"{threads}: the last bits may differ from an " \
                                                             "uninterrupted run"
        _RUN[-1] = replace(chosen, reason=f"{chosen.reason}; the checkpoint's run (step {step}) used {same}")
        return
    torch.set_num_threads(threads)
    _RUN[-1] = ThreadChoice(threads, f"{_threads(threads)}, as the checkpoint's run: resumed from step {step} "
                                     "(a resume keeps the count, so a deterministic run stays bitwise)")


def threads_note() -> str:
    """How many torch threads run now, and why: the run's choice, or a change the caller made since."""
    now = torch.get_num_threads()
    if not _RUN:
        return f"{_threads(now)} (outside a tier_utils run)"
    if now != _RUN[-1].threads:
        return f"{_threads(now)}: set by torch.set_num_threads after tier_utils chose {_RUN[-1].threads}"
    return _RUN[-1].reason


def machine_load() -> str:
    """The torch threads and why, and whether the CPU is busy right now: a slow run on a shared machine
    explains itself."""
    busy = " · machine busy: timings will be slower and noisier than on an idle machine" if cpu_load().busy else ""
    return threads_note() + busy
