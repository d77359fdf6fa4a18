"""Precision policy: one string in, a dtype + autocast + scaler decision out, with the reason.

Device rules live here and nowhere else (the Accelerate idea: hide them behind one string).
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import warnings
from dataclasses import dataclass

import torch

# Spellings users bring from Lightning and torch, mapped to ours.
_ALIASES = {
    "auto": "auto",
    "fp32": "fp32", "32": "fp32", "32-true": "fp32", "float32": "fp32",
    "fp16": "fp16", "16": "fp16", "16-mixed": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bf16-mixed": "bf16", "bfloat16": "bf16",
}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(_DTYPES)  # every precision tier_utils runs, fp32 (the baseline) first

# Ampere (8.0) is the first CUDA generation with bf16 tensor cores; Volta (7.0) the first with fp16 ones.
_CUDA_BF16_MIN = (8, 0)
_CUDA_FP16_MIN = (7, 0)

_slow_warned: set[tuple[str, str]] = set()


class SlowPrecisionWarning(UserWarning):
    """An explicitly requested precision runs, but emulated or without hardware support."""


def canonical_precision(requested) -> str:
    """Map any accepted spelling (or an int like 16/32) to auto/fp32/bf16/fp16; a Precision to its name."""
    if isinstance(requested, Precision):
        return requested.name
    key = str(requested).strip().lower()
    if key not in _ALIASES:
        valid = ", ".join(sorted(_ALIASES))
        raise ValueError(f"unknown precision {requested!r}; use one of: {valid}")
    return _ALIASES[key]


def precision_setting(value) -> str | Precision:
    """What a config's `precision` field holds: a Precision already decided (kept whole, so its device and reason
    reach the autocast context unchanged) or the canonical name of a spelling, to be resolved at the boundary."""
    return value if isinstance(value, Precision) else canonical_precision(value)


def resolve_device(device=None) -> torch.device:
    """None -> the first CUDA device if there is one, else the CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for but torch sees no GPU; use --device cpu")
    return dev


# Flags that decide low-precision support on a CPU. TIER_UTILS_CPU_FLAGS (comma-separated) replaces the
# detected set, so one machine can run every branch of the policy: `TIER_UTILS_CPU_FLAGS=` is a CPU
# with neither native bf16 nor fp16, `TIER_UTILS_CPU_FLAGS=avx512_bf16` one with bf16 only.
CPU_FLAGS_ENV = "TIER_UTILS_CPU_FLAGS"
_PRECISION_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "avx512f", "avx2"})


def _cpuinfo(field: str) -> str:
    """The first `field` line's value in Linux's /proc/cpuinfo; "" where there is none."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next((line.split(":", 1)[1].strip() for line in fh if line.startswith(field)), "")
    except OSError:
        return ""


@functools.cache
def _detected_cpu_flags() -> frozenset[str]:
    return frozenset(_PRECISION_FLAGS & set(_cpuinfo("flags").split()))


def cpu_flags() -> frozenset[str]:
    """CPU feature flags that matter for low precision: TIER_UTILS_CPU_FLAGS if set, else Linux's
    /proc/cpuinfo (empty elsewhere). Read at each call, so a test or notebook can switch profiles."""
    override = os.environ.get(CPU_FLAGS_ENV)
    if override is not None:
        return frozenset(f.strip() for f in override.split(",") if f.strip())
    return _detected_cpu_flags()


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "cpu"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return cpu_name()
    return device.type


def native_support(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether `name` (fp32/bf16/fp16) runs natively on `device`, and why (one line)."""
    if name == "fp32":
        return True, "fp32 runs everywhere"
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        cc_s = f"{cc[0]}.{cc[1]}"
        gpu = torch.cuda.get_device_name(device)
        if name == "bf16":
            # is_bf16_supported() says True on a T4 (7.5) because bf16 is emulated there; ask the capability.
            if cc >= _CUDA_BF16_MIN:
                return True, f"{gpu} (compute capability {cc_s}) has bf16 tensor cores"
            return False, f"{gpu} (compute capability {cc_s} < 8.0) has no bf16 tensor cores; bf16 is emulated and slow"
        if cc >= _CUDA_FP16_MIN:
            return True, f"{gpu} (compute capability {cc_s}) has fp16 tensor cores"
        return False, f"{gpu} (compute capability {cc_s} < 7.0) has no fp16 tensor cores"
    if device.type == "cpu":
        flags = cpu_flags()
        if name == "bf16":
            found = sorted(flags & {"avx512_bf16", "amx_bf16"})
            if found:
                return True, f"this CPU has native bf16 ({', '.join(found)})"
            return False, "this CPU has no avx512_bf16/AMX; bf16 is emulated and usually slower than fp32"
        found = sorted(flags & {"avx512_fp16", "amx_fp16"})
        if found:
            return True, f"this CPU has native fp16 ({', '.join(found)})"
        return False, "this CPU has no avx512_fp16/AMX-fp16; fp16 autocast is emulated and slower than fp32"
    return False, f"no native {name} rule for device type {device.type!r}"


@dataclass(frozen=True)
class Precision:
    """The decision for one (requested precision, device) pair."""

    requested: str
    name: str  # fp32, bf16 or fp16
    device: torch.device
    native: bool
    reason: str

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def needs_scaler(self) -> bool:
        # fp16's 5-bit exponent underflows small gradients; bf16 has fp32's range and needs none.
        return self.name == "fp16"

    def autocast(self):
        """A fresh context for forward + loss: torch.amp autocast, or a null context for fp32."""
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler that is a no-op unless fp16 (nanoGPT's trick: one code path for all)."""
        return torch.amp.GradScaler(self.device.type, enabled=self.needs_scaler)

    def to_dict(self) -> dict:
        return {"requested": self.requested, "precision": self.name, "dtype": str(self.dtype).replace("torch.", ""),
                "device": str(self.device), "device_name": device_name(self.device), "native": self.native,
                "needs_scaler": self.needs_scaler, "reason": self.reason}


def _auto(device: torch.device) -> tuple[str, str]:
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        gpu = torch.cuda.get_device_name(device)
        if cc >= _CUDA_BF16_MIN:
            return "bf16", f"auto: {gpu} (compute capability {cc[0]}.{cc[1]}) has bf16 tensor cores -> bf16, no scaler"
        if cc >= _CUDA_FP16_MIN:
            return "fp16", (f"auto: {gpu} (compute capability {cc[0]}.{cc[1]} < 8.0) emulates bf16 -> "
                            "fp16 with a GradScaler")
        return "fp32", f"auto: {gpu} (compute capability {cc[0]}.{cc[1]} < 7.0) has no fp16/bf16 tensor cores -> fp32"
    if device.type == "cpu":
        ok, why = native_support("bf16", device)
        if ok:
            return "bf16", f"auto: {why} -> bf16 autocast, no scaler"
        return "fp32", f"auto: {why} -> fp32"
    return "fp32", f"auto: no mixed-precision rule for {device.type!r} -> fp32"


def resolve_precision(requested="auto", device=None, *, warn: bool = True) -> Precision:
    """Decide what `requested` means on `device`; warn once if it will run emulated (slow).
    A Precision decided for this device comes back as is, so a job resolves once and passes it down."""
    dev = resolve_device(device)
    if isinstance(requested, Precision):
        if _same_device(requested.device, dev):
            return requested
        requested = requested.requested  # decided for another device: decide what was asked (auto too) again here
    name = canonical_precision(requested)
    if name == "auto":
        name, reason = _auto(dev)
        return Precision(str(requested), name, dev, True, reason)
    native, why = native_support(name, dev)
    if native:
        return Precision(str(requested), name, dev, True, f"{name} requested: {why}")
    reason = f"{name} requested: runs, but {why}"
    key = (str(dev), name)
    if warn and key not in _slow_warned:
        _slow_warned.add(key)
        warnings.warn(reason, SlowPrecisionWarning, stacklevel=2)
    return Precision(str(requested), name, dev, False, reason)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are one device when 0 is the current one (torch.device compares them unequal)."""
    def index(d):
        return d.index if d.index is not None else torch.cuda.current_device() if d.type == "cuda" else 0
    return a.type == b.type and index(a) == index(b)


def supported_precisions(device=None) -> list[str]:
    """fp32 plus the low precisions `device` runs natively (what a widget should offer besides auto)."""
    dev = resolve_device(device)
    return [n for n in PRECISIONS if native_support(n, dev)[0]]
