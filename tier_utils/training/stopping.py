"""SIGTERM, as Colab and job schedulers send it before they kill a process: the run finishes the step it is in,
saves its checkpoint, says where, and returns its partial result; a second SIGTERM stops it at once (the default
action, which the first restores). Ctrl-C's KeyboardInterrupt ends the loop; a second one is held off while the
partial result is written (`interrupts_deferred`).

Under torchrun the ranks agree after every step (one scalar all-reduced), so every rank stops after the same step
and saves the same checkpoint, whichever of them the signal reached first.
"""
from __future__ import annotations

import contextlib
import signal
import threading

from ..engine.distributed import DistEnv


class Terminated(BaseException):
    """Raised out of the loop after the step during which SIGTERM came; the run saves and returns. Not an error: a
    BaseException, as KeyboardInterrupt is, so no `except Exception` on the way (a guarded check, a logger) takes
    the stop for a failure and carries on."""


class StopSignal:
    """Whether SIGTERM has come during this run (set by its handler, read after every step)."""

    def __init__(self, env: DistEnv):
        self.env, self.asked = env, False

    @contextlib.contextmanager
    def listening(self):
        """SIGTERM handled for the block (the handler before it comes back after). Only the main thread can install a
        handler: elsewhere (a run started from a thread) SIGTERM keeps its own action."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        before = signal.signal(signal.SIGTERM, self._heard)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, before)

    def _heard(self, signum, frame) -> None:
        self.asked = True
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once

    def check(self, synced: bool = True) -> None:
        """After a step: raise Terminated when SIGTERM came to this process, or under torchrun to any rank. The ranks
        agree (a scalar all-reduced) only after a step where the loop syncs anyway (`synced`: its history rows,
        every `log_every` steps): a collective of its own on every step would hold up a GPU's queue."""
        if self.env.active and not synced:
            return
        asked = self.env.all_max(int(self.asked)) if self.env.active else self.asked
        if asked:
            raise Terminated


@contextlib.contextmanager
def interrupts_deferred():
    """Ctrl-C (SIGINT) held off for the block, in the main thread: what an interrupted run keeps (its last rows, its
    result, metrics.csv and training.png) is written whole, though a second Ctrl-C comes while it is (it left no
    training.png, and the CLI said only "interrupted"). The user's own handler is back after the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGINT, lambda signum, frame: None)  # heard, and the save goes on
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
