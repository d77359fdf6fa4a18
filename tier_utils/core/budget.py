"""What the device can hold and what a probe will need: free memory read once at a tier's start, a probe's
bytes predicted from a small measured one, out-of-memory turned into a result, repeats sized to a time budget.

Free memory: a CPU's available RAM (psutil), a GPU's free memory (torch.cuda.mem_get_info), a
TIER_UTILS_GPU_PROFILE card's memory less the CUDA context (core.device decides which card). The one override,
TIER_UTILS_FREE_MEMORY=BYTES (e.g. 2GiB), replaces that reading for every device: a test injects an
out-of-memory through it, not through a mock of the tier.

Activation bytes: autograd's saved tensors of a training forward (measure.SavedTensorMeter, an exact count)
at batch 1 and two short lengths, and at batch 2, fitted as k + B * (a*T + c*T^2): k holds what does not
grow with the batch (autocast's low-precision weight copies), c what grows with T^2 (materialised
attention). A task whose targets have a length of their own (an encoder-decoder: source S, target U) is fitted
as k + B * (a*S + c*S^2 + a_u*U + c_u*U^2 + x*S*U): its encoder, its decoder and its cross-attention's (U, S)
maps apart, from five batch-1 sizes and one at batch 2. Any other size is extrapolated from that fit, and says so.
"""
from __future__ import annotations

import contextlib
import gc
import os
import re
from dataclasses import dataclass

import psutil
import torch

from .device import GPU_PROFILE_ENV, device_facts
from .errors import one_line
from .measure import SavedTensorMeter

FREE_MEMORY_ENV = "TIER_UTILS_FREE_MEMORY"
# What torch's CUDA context takes of a card's memory before the allocator gets any: a profiled card's free
# memory, and the planner's GPU columns, start from its memory less this.
CUDA_CONTEXT = 512 << 20
# The share of free memory a probe may plan to fill. A CPU shares its RAM with the OS, the notebook and
# other jobs, and an overrun there is the OOM killer ending the kernel, not an exception: half. On a GPU an
# overrun is a caught OutOfMemoryError, and the rest covers the allocator's fragmentation and workspaces.
SAFE_SHARE = {"cpu": 0.5, "cuda": 0.9}
# On a CPU, smoke's and analyze's measuring forwards hold at most this many bytes of activations: the
# saved-tensor count is exact and its fit predicts bigger sizes, so running them would add time, not facts.
CPU_PROBE_BYTES = 512 << 20
# On a GPU, at most this many: a probe answers the same question on a T4 and an H200, so its cap doesn't grow
# with the card (a T4's safe share, 13.5 GiB, holds it).
GPU_PROBE_BYTES = 2 << 30
PROFILE_LENGTH = 32  # the short length the activation fit measures at (and twice it)
# A comparison or statistic over a vocabulary x length tensor walks it in slices this big, so its
# temporaries (differences, masks, upcasts) stay small next to the tensor itself.
CHUNK_BYTES = 64 << 20
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 2**10, "kib": 2**10, "m": 2**20, "mb": 2**20, "mib": 2**20,
          "g": 2**30, "gb": 2**30, "gib": 2**30}


def gib(n: float) -> str:
    """Bytes as the rows print them: GiB from 1 GiB up, else MiB."""
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.0f} MiB"


def _parse_bytes(text: str) -> int:
    found = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not found or found.group(2).lower() not in _UNITS:
        raise ValueError(f"{FREE_MEMORY_ENV}={text!r} is not a size; give bytes, e.g. 2147483648 or 2GiB")
    return int(float(found.group(1)) * _UNITS[found.group(2).lower()])


@dataclass(frozen=True)
class Budget:
    """Free memory on one device, read once, and the share of it a probe may plan to use."""

    device: str  # cpu or cuda: the hardware decided for (a GPU profile's card is cuda)
    free_bytes: int
    source: str  # where the reading came from
    on_cpu: bool | None = None  # the tensors are on a CPU (None: as `device` says; a profile's are on the CPU)

    @property
    def limit(self) -> int:
        return int(SAFE_SHARE[self.device] * self.free_bytes)

    @property
    def probe_limit(self) -> int:
        """What a measuring forward of smoke, analyze or fit may hold: the safe share, at most CPU_PROBE_BYTES where
        the tensors are on a CPU (a GPU profile's too) and GPU_PROBE_BYTES on a GPU, whatever the card's size."""
        on_cpu = self.device == "cpu" if self.on_cpu is None else self.on_cpu
        return min(self.limit, CPU_PROBE_BYTES if on_cpu else GPU_PROBE_BYTES)

    def describe(self) -> str:
        return f"{gib(self.free_bytes)} free ({self.source}; probes plan for {SAFE_SHARE[self.device]:.0%} of it)"

    def to_dict(self) -> dict:
        return {"device": self.device, "free_bytes": self.free_bytes, "source": self.source,
                "safe_share": SAFE_SHARE[self.device], "limit_bytes": self.limit,
                "probe_limit_bytes": self.probe_limit}


def read_budget(device) -> Budget:
    """The device's free memory now: TIER_UTILS_FREE_MEMORY if set, else a GPU profile's card less the CUDA
    context, else torch.cuda.mem_get_info / psutil. Its kind (and so SAFE_SHARE) follows the card decided for."""
    facts = device_facts(device)
    kind, on_cpu = ("cuda" if facts.is_gpu else "cpu"), facts.device.type == "cpu"
    override = os.environ.get(FREE_MEMORY_ENV)
    if override is not None:
        return Budget(kind, _parse_bytes(override), FREE_MEMORY_ENV, on_cpu)
    if facts.profiled:
        return Budget(kind, facts.total_bytes - CUDA_CONTEXT, f"{GPU_PROFILE_ENV}={facts.gpu.key}: "
                      f"{gib(facts.total_bytes)} less {CUDA_CONTEXT >> 20} MiB for the CUDA context", on_cpu)
    if kind == "cuda":
        return Budget(kind, torch.cuda.mem_get_info(facts.device)[0], "torch.cuda.mem_get_info", on_cpu)
    return Budget(kind, psutil.virtual_memory().available, "available RAM", on_cpu)


@dataclass(frozen=True)
class ActivationFit:
    """Saved-activation bytes of one training forward as k + B * (a*T + c*T^2), from three measured sizes, or from
    two batches at one length whose per-sequence bytes the model's `shares` split between a*T and c*T^2; for a task
    with a target length apart, k + B * (a*S + c*S^2 + target_a*U + target_c*U^2 + cross*S*U), from six."""

    k: float
    a: float
    c: float
    output_per_token: float  # fp32 bytes of the output per token (per target token): its gradient is alive in backward
    measured: tuple  # ((B, T, bytes), ...) or ((B, S, U, bytes), ...) as measured
    probe: str = ""  # how the bytes were had where not from the whole model (a shallower probe's, extrapolated)
    target_a: float = 0.0  # the target side's per-token bytes (an encoder-decoder's decoder), 0 for one length
    target_c: float = 0.0  # its (U, U) maps: the decoder's self-attention
    cross: float = 0.0  # the (U, S) maps: cross-attention
    # A model that runs at one length only (an image model at its own side): the shares of its per-sequence bytes
    # that grow linearly and quadratically with the length (a ViT's extra tokens and its patch grid); None: fitted.
    shares: tuple[float, float] | None = None

    @classmethod
    def from_points(cls, measured, output_per_token: float, probe: str = "",
                    shares: tuple[float, float] | None = None) -> ActivationFit:
        """The fit through three sizes (B=1, t), (B=1, t2), (B=2, t2) and their bytes; with `shares`, through
        (B=1, T) and (B=2, T), the per-sequence bytes split as they say; six (B, S, U, bytes) sizes:
        `from_pair_points`."""
        if shares is not None:
            (_, t, b1), (_, _, b2) = measured
            per = max(0, b2 - b1)
            return cls(max(0, b1 - per), per * shares[0] / t, per * shares[1] / t**2, output_per_token,
                       tuple(measured), probe, shares=shares)
        if len(measured[0]) == 4:
            return cls.from_pair_points(measured, output_per_token, probe)
        (_, t, b1), (_, t2, b2), (_, _, b3) = measured
        per2 = max(0, b3 - b2)  # one sequence at t2
        k = max(0, b2 - per2)
        per1 = max(0, b1 - k)
        c = max(0.0, (per2 * t - per1 * t2) / (t * t2 * (t2 - t))) if t2 > t else 0.0
        a = max(0.0, (per2 - c * t2**2) / t2)
        return cls(k, a, c, output_per_token, tuple(measured), probe)

    @classmethod
    def from_pair_points(cls, measured, output_per_token: float, probe: str = "") -> ActivationFit:
        """The two-length fit through five batch-1 sizes (B=1, S, U) and, last, the largest of them at batch 2 (which
        parts k from the per-sequence bytes): a least-squares solve of the five coefficients, exact where the sizes
        differ on both sides (two sources, three targets), the minimum-norm one where a length is too short to."""
        *single, (_, s2, u2, b2) = measured
        per = max(0, b2 - single[-1][3])  # one sequence at the largest size
        k = max(0, single[-1][3] - per)
        rows = torch.tensor([[s, s * s, u, u * u, s * u] for _, s, u, _ in single], dtype=torch.float64)
        bytes_ = torch.tensor([[b - k] for *_, b in single], dtype=torch.float64)
        a, c, ua, uc, x = (max(0.0, float(v)) for v in torch.linalg.lstsq(rows, bytes_).solution.flatten())
        return cls(k, a, c, output_per_token, tuple(measured), probe, ua, uc, x)

    def extrapolated(self, deeper: ActivationFit, depths: tuple[int, int], blocks: int) -> ActivationFit:
        """The fit of a model with `blocks` repeated blocks, from this one measured with `depths[0]` of them and
        `deeper` with `depths[1]`: each size's bytes grow by what one block added between the two."""
        d1, d2 = depths
        points = [(*size, round(x1 + (x2 - x1) * (blocks - d1) / (d2 - d1)))
                  for (*size, x1), (*_, x2) in zip(self.measured, deeper.measured)]
        return ActivationFit.from_points(points, deeper.output_per_token,
                                         f"with {d1} and {d2} of its {blocks} blocks, extrapolated to {blocks} "
                                         "(predicted)", self.shares)

    def per_sequence(self, length: int, target: int | None = None) -> float:
        """One sequence's bytes at `length` tokens (a source's, where the task has a target length apart: `target`
        tokens, None: as many as the source, as train runs it)."""
        u = length if target is None else target
        return (self.a * length + self.c * length**2 + self.target_a * u + self.target_c * u**2
                + self.cross * length * u)

    def bytes(self, batch: int, length: int, target: int | None = None) -> int:
        return int(self.k + batch * self.per_sequence(length, target))

    def transient(self, batch: int, length: int, target: int | None = None) -> int:
        """The output's gradient (for a causal LM the logits', for an encoder-decoder its target positions'), alive
        during backward next to the saved tensors."""
        return int(self.output_per_token * batch * (length if target is None else target))

    def where(self) -> str:
        sizes = [f"B={b}, T={t}" if len(rest) == 1 else f"B={b}, S={t}, U={rest[0]}" for b, t, *rest in self.measured]
        return "measured at " + ", ".join(sizes) + (f" {self.probe}" if self.probe else "")

    def probe_bytes(self) -> int:
        """What the largest measuring forward held: its saved tensors and its output."""
        b, *lengths, saved = self.measured[-1]
        return int(saved + self.transient(b, *lengths))

    def largest_length(self, batch: int, room: float, up_to: int) -> int:
        """The longest length up to `up_to` whose activations at `batch` fit in `room` bytes (0: none)."""
        lo, hi = 0, up_to
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.bytes(batch, mid) <= room else (lo, mid - 1)
        return lo


def profile_sizes(adapter, length: int, target: int | None = None) -> list[tuple]:
    """A token model's measuring forwards' sizes: (B, T) at t, 2t and batch 2 (t = min(PROFILE_LENGTH,
    length // 2), so small whatever the model); for a task whose targets have a length of their own, (B, S, U): two
    sources by three targets' worth (u/2, u, 2u at one source, u and 2u at the other), the largest again at batch 2."""
    t = max(1, min(PROFILE_LENGTH, length // 2))
    t2 = min(2 * t, adapter.max_len)
    if not adapter.task.own_target_length:
        return [(1, t), (1, t2), (2, t2)]
    u = max(1, min(PROFILE_LENGTH, (target or length) // 2))
    u2 = min(2 * u, adapter.max_len)
    return [(1, t, max(1, u // 2)), (1, t, u), (1, t2, u), (1, t, u2), (1, t2, u2), (2, t2, u2)]


def measure_activations(adapter, precision, length: int, context=contextlib.nullcontext,
                        target: int | None = None) -> ActivationFit:
    """Fit the saved bytes of `adapter`'s training forward under `precision`'s autocast, measured at the sizes its
    task chooses (`Task.activation_sizes`: `profile_sizes` for tokens, `target` an encoder-decoder's target length,
    None: the source's; an image model's own side, where the shares its tokens give split the bytes).
    `context(meter)` wraps each forward (e.g. activation checkpointing that reports what it keeps)."""
    sizes, shares = adapter.task.activation_sizes(adapter, length, target)
    measured = []
    was_training = adapter.model.training
    adapter.model.train()
    try:
        for b, tt, *u in sizes:
            batch = adapter.example_batch(b, tt, target_len=u[0] if u else None)
            with SavedTensorMeter(adapter.model) as meter, context(meter), precision.autocast():
                # The batch is held through the step: counted once, whether a layer saves it (an embedding's ids,
                # fp32 pixels) or a copy (autocast's bf16 pixels: the fp32 ones are still held).
                for tensor in batch.values():
                    meter.add(tensor)
                loss, logits = adapter.forward_loss(batch)
            output = 4 * logits.numel() / (b * (u[0] if u else tt))
            del loss, logits
            measured.append((b, tt, *u, meter.bytes))
    finally:
        adapter.model.train(was_training)
    return ActivationFit.from_points(measured, output, shares=shares)


def out_of_memory_note(dev, fit: ActivationFit | None, batch: int, length: int, budget: Budget) -> str:
    """The row's words for a size that did not fit: which size, how much was free, what it would have needed."""
    need = f"; {gib(fit.bytes(batch, length))} of activations predicted ({fit.where()})" if fit else ""
    return f"B={batch}, T={length} ran out of memory on {dev} with {gib(budget.free_bytes)} free{need}"


def sized_to(limit: float, per_token: float, batch: int, length: int) -> tuple[int, int]:
    """The largest (batch, length), at most the one asked, whose `per_token` bytes fit in `limit`: fewer
    sequences first, then a shorter length (length 0: not even one token fits)."""
    if per_token * batch * length <= limit:
        return batch, length
    rows = int(limit // (per_token * length))
    return (rows, length) if rows >= 1 else (1, min(length, int(limit // per_token)))


def size_note(asked: tuple[int, int], ran: tuple[int, int], per_token: float, limit: float, what: str) -> str:
    """The row's words for a probe run smaller than asked ("" when it ran as asked)."""
    if asked == ran:
        return ""
    return (f"; ran at B={ran[0]}, T={ran[1]}, not B={asked[0]}, T={asked[1]}: {what} would take "
            f"{gib(per_token * asked[0] * asked[1])}, over the {gib(limit)} this probe may hold here")


def row_chunks(*tensors: torch.Tensor):
    """The tensors (same shape) as matching slices of their rows (the last dimension kept whole), each slice
    about CHUNK_BYTES in fp32: a reduction over them holds one slice's temporaries, not the whole tensor's."""
    flat = [t.detach().reshape(-1, t.shape[-1]) if t.dim() else t.detach().reshape(1, 1) for t in tensors]
    rows = max(1, CHUNK_BYTES // (4 * max(1, flat[0].shape[-1])))
    yield from zip(*(f.split(rows) for f in flat))


def without_oom(fn, *args, **kwargs) -> tuple[object, str | None]:
    """(fn's result, None), or (None, the error in one line) when a CUDA out-of-memory stopped it, with the
    memory it held released: the run goes on."""
    try:
        return fn(*args, **kwargs), None
    except torch.cuda.OutOfMemoryError as exc:
        message = one_line(exc)
    # Outside the except block: the traceback, and the tensors its frames held, are gone.
    release_memory()
    return None, message


def release_memory(device=None) -> None:
    """Give back what dropped tensors held: gc (reference cycles) and, on CUDA, the allocator's cached blocks."""
    gc.collect()
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.empty_cache()


def affordable_repeats(call_s: float, budget_s: float, high: int) -> int:
    """How many timed repeats of a call that took `call_s` fit in `budget_s`: 1 to `high`."""
    return max(1, min(high, int(budget_s // call_s) if call_s > 0 else high))
