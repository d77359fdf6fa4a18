"""Measurement building blocks shared by the tiers: timing, robust statistics, activation bytes.

Timing uses CUDA events on a GPU (one synchronize at the end) and perf_counter on a CPU.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import asdict, dataclass

import torch


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
        self._param_storages = set()
        if model is not None:
            self._param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.layout == torch.strided and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._param_storages and ptr not in self._seen:
                self._seen[ptr] = storage.nbytes()
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def tensors(self) -> int:
        return len(self._seen)

    def __enter__(self) -> "SavedTensorMeter":
        self._seen.clear()
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def static_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Bytes of weights, gradients (one per trainable parameter, same dtype) and optimizer state."""
    params = list(model.parameters())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    state = 0
    if optimizer is not None:
        for per_param in optimizer.state.values():
            state += sum(v.numel() * v.element_size() for v in per_param.values() if torch.is_tensor(v))
    return {"weights_bytes": weights, "grads_bytes": grads, "optimizer_state_bytes": state}
