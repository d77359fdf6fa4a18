"""glibc's mmap threshold for a sharded run on CPU ranks: fixed at 64 KiB as the run starts, so the memory FSDP
frees every step goes back to the OS, and a rank's resident memory is what its tensors need.

Why: FSDP2 frees and re-allocates each unit's all-gathered weights and reduce-scattered gradients every step.
On a CPU they come from malloc. glibc serves a request under its mmap threshold from the heap, and by default
that threshold is dynamic: each mmapped chunk freed raises it to that chunk's size (up to 32 MiB on 64-bit
machines), so a block's 2-28 MB buffers soon come from the heap, and freed heap memory stays resident. On 2 CPU
ranks training GPT-2-small, a rank's peak RSS increase was 2.8 GiB that way and 1.6 GiB with the threshold
fixed, within 3 % of what the planner predicts (bench/RESULTS.md). Setting the threshold (mallopt
M_MMAP_THRESHOLD, the same as the environment variable MALLOC_MMAP_THRESHOLD_) turns the dynamic adjustment off:
every allocation above it is mmapped and unmapped when freed. The price is step time (each buffer is faulted in
afresh: about x1.4 in that bench), which a user with RAM to spare buys back by setting the variable.

The user's own setting wins (MALLOC_MMAP_THRESHOLD_, or glibc.malloc.mmap_threshold in GLIBC_TUNABLES); another
C library (musl, macOS) is left alone. glibc has no call that turns its dynamic threshold back on, so the setting
holds for the rest of the process (under torchrun, the process is the run); the run's summary says so.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Mapping

M_MMAP_THRESHOLD = -3  # <malloc.h>
MMAP_THRESHOLD = 64 << 10  # above the small objects a step allocates in their thousands, below any weight buffer
ENV_VAR = "MALLOC_MMAP_THRESHOLD_"
TUNABLE = "glibc.malloc.mmap_threshold"


def _glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc, else None."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")  # "glibc 2.36"; unset elsewhere
    except (AttributeError, ValueError, OSError):
        return None
    return ctypes.CDLL(None) if version and version.startswith("glibc") else None


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's `mallopt(param, value)` (1 on success) where this process runs on glibc, else None."""
    libc = _glibc()
    if libc is None:
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def trim_heap() -> None:
    """Give the freed heap memory glibc keeps back to the OS (malloc_trim); nothing on another C library."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


def users_threshold(env: Mapping[str, str]) -> str | None:
    """The mmap threshold the user set for this process, as they wrote it, or None."""
    if env.get(ENV_VAR):
        return f"{ENV_VAR}={env[ENV_VAR]}"
    tunable = next((t for t in env.get("GLIBC_TUNABLES", "").split(":") if t.startswith(TUNABLE + "=")), None)
    return f"GLIBC_TUNABLES {tunable}" if tunable else None


def return_freed_memory(env: Mapping[str, str] | None = None) -> str:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD for this process, unless the user set one or the C library is
    not glibc. Returns what was done, in words, for the run's summary."""
    env = os.environ if env is None else env
    users = users_threshold(env)
    if users is not None:
        return f"glibc mmap threshold: the user's ({users}) kept"
    mallopt = glibc_mallopt()
    if mallopt is None:
        return "allocator: not glibc, left as it is"
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return f"glibc mmap threshold: mallopt refused {MMAP_THRESHOLD >> 10} KiB, left dynamic"
    return (f"glibc mmap threshold fixed at {MMAP_THRESHOLD >> 10} KiB for this process (buffers freed every step "
            f"go back to the OS, at some step time; set {ENV_VAR} to choose another)")
