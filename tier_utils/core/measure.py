"""Measurement building blocks shared by the tiers: timing, robust statistics, activation bytes,
FLOP counts and the matmul peak probe.

Timing uses CUDA events on a GPU (one synchronize at the end) and perf_counter on a CPU.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .allocator import trim_heap


@dataclass(frozen=True)
class Stats:
    """Median and spread of n samples (IQR = q3 - q1)."""

    n: int
    median: float
    q1: float
    q3: float
    min: float
    max: float

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    def to_dict(self) -> dict:
        return {**asdict(self), "iqr": self.iqr}


def summarize(samples) -> Stats:
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples to summarize")
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Stats(len(xs), statistics.median(xs), q1, q3, xs[0], xs[-1])


def percentile(samples, q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    xs = sorted(float(x) for x in samples)
    if not xs:
        raise ValueError("no samples")
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class StepTimer:
    """Times a sequence of regions without a host sync between them.

    with timer.region(): ...   # as many times as needed
    timer.milliseconds()       # one synchronize (CUDA), then every region's duration
    """

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple] = []

    @contextlib.contextmanager
    def region(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._marks.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._marks.append((t0, time.perf_counter()))

    def milliseconds(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [s.elapsed_time(e) for s, e in self._marks]
        return [(e - s) * 1e3 for s, e in self._marks]


class SavedTensorMeter:
    """Bytes autograd saves for backward (activation memory), via saved_tensors_hooks.

    Device independent, so it works on CPU. Each storage counts once (views share it);
    parameters are excluded because they exist whether or not backward is pending, but
    low-precision copies autocast makes of them do count: they are extra memory.

    with SavedTensorMeter(model) as meter:
        loss = model(x).sum()
    meter.bytes
    """

    def __init__(self, model: torch.nn.Module | None = None):
        params = list(() if model is None else model.parameters())
        # An FSDP-sharded model's weights are DTensors: its own shards are its parameters here, and so are the
        # whole weights it gathers for a block while that block runs (read as each tensor is saved).
        self._sharded = model if any(hasattr(p, "to_local") for p in params) else None
        self._param_storages = {_storage_ptr(p.to_local() if hasattr(p, "to_local") else p) for p in params}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # Autograd gets a detached alias (the same storage and version counter), not the tensor itself: a saved
        # output packed as itself closes a cycle (tensor -> its grad_fn -> the saved tensor) through C++ that
        # Python's gc cannot see, and every measured graph (its activations, autocast's weight copies) would
        # outlive its forward.
        return self.add(tensor).detach()

    def add(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count `tensor`'s storage (once); the pack hook, and for memory kept outside autograd's saved tensors."""
        if tensor.layout == torch.strided and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._param_storages and ptr not in self._seen and not self._gathered(ptr):
                self._seen[ptr] = storage.nbytes()
        return tensor

    def _gathered(self, ptr: int) -> bool:
        """Whether `ptr` is a weight FSDP gathered for the block now running (a parameter, not an activation)."""
        return self._sharded is not None and ptr in {_storage_ptr(p) for p in self._sharded.parameters()
                                                     if not hasattr(p, "to_local")}

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def tensors(self) -> int:
        return len(self._seen)

    def __enter__(self) -> SavedTensorMeter:
        self._seen.clear()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def _storage_ptr(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def static_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes of weights, gradients (one per trainable parameter, same dtype) and optimizer state."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    param_states = optimizer.state.values() if optimizer is not None else ()
    state = sum(v.numel() * v.element_size() for s in param_states for v in s.values() if torch.is_tensor(v))
    return {"weights_bytes": weights, "grads_bytes": grads, "optimizer_state_bytes": state}


def count_flops(run) -> dict:
    """FLOPs of `run()` (e.g. one forward + backward) by torch.utils.flop_counter:
    {"per_step": total, "by_op": {op: flops}}."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop, sdpa_flop

    # torch has formulas for the GPU attention kernels; reuse them for the CPU one it lacks.
    extra = {}
    aten = torch.ops.aten
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        # The registered formulas are already shape-wrapped; FlopCounterMode wraps custom ones again.
        extra = {aten._scaled_dot_product_flash_attention_for_cpu: getattr(sdpa_flop, "__wrapped__", sdpa_flop),
                 aten._scaled_dot_product_flash_attention_for_cpu_backward:
                     getattr(sdpa_backward_flop, "__wrapped__", sdpa_backward_flop)}
    with FlopCounterMode(display=False, custom_mapping=extra) as counter:
        run()
    by_op = {str(k): v for k, v in counter.get_flop_counts().get("Global", {}).items()}
    return {"per_step": counter.get_total_flops(), "by_op": by_op}


_PROBE_TARGET_MS = 20.0  # a probe matmul shorter than this is launch- or timer-bound
_PROBE_MAX_MS = 250.0
_PROBE_MAX = {"cuda": 8192, "cpu": 1024}


def probe_size(dev: torch.device, dtype: torch.dtype) -> int:
    """Square-matmul size for the peak probe: doubled while one matmul is too short to time well or
    the bigger size still got faster, and never so big that an emulated dtype takes seconds."""
    size, cap, previous = 256, _PROBE_MAX.get(dev.type, 1024), 0.0
    while True:
        ms = min(probe_ms(dev, dtype, size, 2))  # the faster of two: one stall must not end the search
        tflops = 2 * size**3 / (ms * 1e-3) / 1e12
        if size >= cap or ms * 8 > _PROBE_MAX_MS or (ms >= _PROBE_TARGET_MS and tflops < 1.1 * previous):
            return size
        size, previous = size * 2, tflops


def probe_ms(dev: torch.device, dtype: torch.dtype, size: int, reps: int) -> list[float]:
    """Milliseconds of `reps` (size x size) @ (size x size) matmuls in `dtype`, after one untimed."""
    a = torch.randn(size, size, device=dev).to(dtype)
    b = torch.randn(size, size, device=dev).to(dtype)
    a @ b  # the first call pays for kernel selection
    timer = StepTimer(dev)
    for _ in range(reps):
        with timer.region():
            a @ b
    return timer.milliseconds()


def probe_summary(dtype: torch.dtype, size: int, ms: list[float]) -> dict:
    """The probe's TFLOP/s statistics: the device's reachable matmul peak in `dtype` is their max."""
    stats = summarize(2 * size**3 / (t * 1e-3) / 1e12 for t in ms)
    return {"dtype": str(dtype).replace("torch.", ""), "size": size, "tflops": stats.to_dict()}


def load_average() -> float | None:
    """The host's 1-minute load average: high means other jobs share the CPU."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on Windows
        return None


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity; all of them where the OS has no affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Load:
    """The CPU load a run shares its cores with: `average` (1-minute; None where the OS has none) on `cores`."""

    average: float | None
    cores: int

    @property
    def busy(self) -> bool:
        """More runnable threads than cores: everyone waits, so timings are slower and noisier."""
        return self.average is not None and self.average > self.cores

    def __str__(self) -> str:
        average = "unknown" if self.average is None else f"{self.average:.1f}"
        return f"load {average} on {self.cores} core{'s' if self.cores != 1 else ''}"


def cpu_load() -> Load:
    return Load(load_average(), usable_cores())


class PeakRSS:
    """This process's peak resident memory over a region, less its resident memory as the region starts (Linux).

    with PeakRSS() as rss: ...   # rss.increase: bytes, or None where /proc has no such figures
    Freed memory the allocator keeps is given back first (glibc's malloc_trim) and the kernel's high-water mark is
    reset (/proc/self/clear_refs), so a region's peak is its own, not an earlier region's in the same process.
    """

    HOW = "peak RSS increase over the run (VmHWM less VmRSS at its start, /proc/self)"

    def __init__(self):
        self.increase: int | None = None

    @staticmethod
    def _status(key: str) -> int:
        with open("/proc/self/status") as f:
            line = next(line for line in f if line.startswith(key + ":"))
        return int(line.split()[1]) * 1024  # kB

    @classmethod
    def own_peak(cls) -> int | None:
        """This process's own peak resident memory (VmHWM), None where /proc has none. Not getrusage's
        ru_maxrss: on Linux it carries a parent's peak over fork and exec, so a child started by a big process
        reads at least the parent's peak."""
        try:
            return cls._status("VmHWM")
        except (OSError, StopIteration):
            return None

    def __enter__(self) -> PeakRSS:
        import gc

        gc.collect()
        trim_heap()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self._start = self._status("VmRSS")
        except (OSError, StopIteration):
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is not None:
            self.increase = self._status("VmHWM") - self._start
