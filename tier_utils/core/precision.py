"""Precision as a strategy object: one class per mode owns what the mode means, and nothing else in tier_utils
switches on a precision's name (the design of Lightning Fabric's precision plugins).

A mode's class holds its facts (`param_dtype`: what weights, gradients and AdamW state are held in; `compute_dtype`:
what the forward runs in), its hardware rule with the reason (`native_support`), how a module is put in its dtype
(`convert_module`), the forward's context (autocast or none) and a `Stepper` that owns backward, unscaling, the
optimizer step and their state (the GradScaler's). `resolve_precision` turns a name on a device into a decided
instance once, at a tier's boundary; adding a mode is one subclass and `register_precision`.
"""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import warnings
from dataclasses import dataclass

import torch

from .precision_steppers import ScalerStepper, Stepper

# Ampere (8.0) is the first CUDA generation with bf16 tensor cores; Volta (7.0) the first with fp16 ones.
_CUDA_BF16_MIN = (8, 0)
_CUDA_FP16_MIN = (7, 0)
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}

_slow_warned: set[tuple[str, str]] = set()


class SlowPrecisionWarning(UserWarning):
    """An explicitly requested precision runs, but emulated or without hardware support."""


def dtype_name(dtype: torch.dtype) -> str:
    """fp32 / bf16 / fp16 (fp64), the short names results use; torch's own name for any other."""
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


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


def capability_has(dtype: torch.dtype, capability: tuple[int, int]) -> bool:
    """Whether a CUDA GPU of this compute capability has tensor cores for `dtype` (fp32: every GPU): the rule
    dtype_support applies to the GPU it runs on, and the planner to the GPUs it predicts for."""
    if dtype == torch.bfloat16:
        return capability >= _CUDA_BF16_MIN
    return capability >= _CUDA_FP16_MIN if dtype == torch.float16 else True


def dtype_support(dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether `device` computes in `dtype` natively, and why (one line): the hardware rule every mode shares."""
    short = dtype_name(dtype)
    if dtype not in (torch.bfloat16, torch.float16):
        return True, f"{short} runs everywhere"
    bf16 = dtype == torch.bfloat16
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        cc_s = f"{cc[0]}.{cc[1]}"
        gpu = torch.cuda.get_device_name(device)
        if bf16:
            # is_bf16_supported() says True on a T4 (7.5) because bf16 is emulated there; ask the capability.
            if capability_has(dtype, cc):
                return True, f"{gpu} (compute capability {cc_s}) has bf16 tensor cores"
            return False, f"{gpu} (compute capability {cc_s} < 8.0) has no bf16 tensor cores; bf16 is emulated and slow"
        if capability_has(dtype, cc):
            return True, f"{gpu} (compute capability {cc_s}) has fp16 tensor cores"
        return False, f"{gpu} (compute capability {cc_s} < 7.0) has no fp16 tensor cores"
    if device.type == "cpu":
        wanted = {"avx512_bf16", "amx_bf16"} if bf16 else {"avx512_fp16", "amx_fp16"}
        found = sorted(cpu_flags() & wanted)
        if found:
            return True, f"this CPU has native {short} ({', '.join(found)})"
        if bf16:
            return False, "this CPU has no avx512_bf16/AMX; bf16 is emulated and usually slower than fp32"
        return False, "this CPU has no avx512_fp16/AMX-fp16; fp16 is emulated and slower than fp32"
    return False, f"no native {short} rule for device type {device.type!r}"


@dataclass(frozen=True)
class Precision:
    """One mode, decided for one device: what was asked, whether the device runs it natively, and why.

    The class attributes are the mode's facts; subclasses set them and override what differs.
    """

    requested: str
    device: torch.device
    native: bool
    reason: str

    name = "fp32"
    aliases: tuple[str, ...] = ()  # other spellings of the name (Lightning's, torch's)
    param_dtype = torch.float32  # weights, gradients and AdamW state
    compute_dtype = torch.float32  # what the forward computes in
    needs_scaler = False  # a GradScaler scales the loss (fp16 mixed only)
    adamw_eps = 1e-8  # AdamW's eps, representable in param_dtype
    note = ""  # what the mode costs, appended to every decision's reason
    # The planner measures a mode the device only emulates as this one (same bytes per value, lowered alike).
    measured_as: str | None = None
    # Whether the mode may run where its dtype is only emulated (slowly, with a warning): the mixed modes may, a
    # true mode may not (every weight, gradient and AdamW state emulated: no bf16-true on a T4).
    runs_emulated = True

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the name callers had before param_dtype existed)."""
        return self.compute_dtype

    @classmethod
    def native_support(cls, device: torch.device) -> tuple[bool, str]:
        """Whether `device` runs this mode natively, and why: the hardware rule of its compute dtype."""
        return dtype_support(cls.compute_dtype, device)

    @classmethod
    def decide(cls, requested: str, device: torch.device, warn: bool = True) -> Precision:
        """This mode on `device`, with the reason; warns once per (device, mode) if it runs emulated."""
        native, why = cls.native_support(device)
        reason = f"{cls.name} requested: {why}" if native else f"{cls.name} requested: runs, but {why}"
        if not native and warn and (str(device), cls.name) not in _slow_warned:
            _slow_warned.add((str(device), cls.name))
            warnings.warn(reason, SlowPrecisionWarning, stacklevel=3)
        return cls(str(requested), device, native, reason + cls.note)

    def check_runnable(self) -> None:
        """A one-line ValueError where this mode may not run on its device (a true mode it only emulates)."""
        if not self.native and not self.runs_emulated:
            why = self.native_support(self.device)[1]
            raise ValueError(f"{self.name} needs native {dtype_name(self.param_dtype)} and {why}; use "
                             f"{dtype_name(self.compute_dtype)} (mixed) or fp32, or a device that has it")

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """`module`'s floating-point weights and buffers in `param_dtype`, in place: a bf16- or fp16-stored
        checkpoint becomes fp32 master weights for fp32 and the mixed modes, a true mode's weights its dtype."""
        return module.to(dtype=self.param_dtype)

    def forward_context(self):
        """A fresh context for forward + loss: nothing for fp32 (the mixed and true modes override it)."""
        return contextlib.nullcontext()

    def autocast(self):
        """forward_context() by the name the tiers' forwards (smoke, analysis, evaluation) call it."""
        return self.forward_context()

    def stepper(self, track: bool = True, grad_scaler=None) -> Stepper:
        """A fresh Stepper for one run: backward, unscale, optimizer step and their state. `track`: a scaling
        stepper reads the loss scale around each step (two host syncs) to say whether it was skipped.
        `grad_scaler(device_type)`: makes the GradScaler a scaling mode steps through (the distributed strategy's
        choice; None: torch.amp's)."""
        if not self.needs_scaler:
            return Stepper()
        return ScalerStepper(self.device, track, grad_scaler(self.device.type) if grad_scaler else None)

    def mixed_precision_policy(self):
        """FSDP2's casts for this mode (torch.distributed.fsdp.MixedPrecisionPolicy): a mixed mode gathers the
        weights in its compute dtype and reduces gradients in fp32 (the fp32 master weights stay sharded); fp32 and
        the true modes cast nothing (their weights already are what the forward computes in)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if self.param_dtype == self.compute_dtype:
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)

    def static_bytes_per_param(self) -> dict:
        """Bytes per trainable parameter the mode holds: its weight, its gradient and AdamW's two states."""
        size = self.param_dtype.itemsize
        return {"weights": size, "grads": size, "optimizer": 2 * size}

    def describe_weights(self, stored_dtype: torch.dtype | None) -> str:
        """What trains, from what was stored: e.g. "weights stored bf16 → fp32 master weights, bf16 autocast"."""
        stored = f"weights stored {dtype_name(stored_dtype)} → " if stored_dtype is not None else ""
        return stored + self._held()

    def _held(self) -> str:
        return "fp32 weights, gradients and AdamW state"

    def to_dict(self) -> dict:
        return {"requested": self.requested, "precision": self.name, "dtype": str(self.dtype).replace("torch.", ""),
                "param_dtype": str(self.param_dtype).replace("torch.", ""), "device": str(self.device),
                "device_name": device_name(self.device), "native": self.native, "needs_scaler": self.needs_scaler,
                "reason": self.reason}


class Fp32(Precision):
    """fp32 everywhere: the baseline every other mode is compared with."""

    name = "fp32"
    aliases = ("32", "32-true", "float32")


class _Mixed(Precision):
    """fp32 master weights, gradients and AdamW state; the forward under torch.amp autocast."""

    def forward_context(self):
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _held(self) -> str:
        return f"fp32 master weights, {dtype_name(self.compute_dtype)} autocast"


class Bf16Mixed(_Mixed):
    name = "bf16"
    aliases = ("bf16-mixed", "bfloat16")
    compute_dtype = torch.bfloat16


class Fp16Mixed(_Mixed):
    name = "fp16"
    aliases = ("16", "16-mixed", "fp16-mixed", "float16", "half")
    compute_dtype = torch.float16
    # fp16's 5-bit exponent underflows small gradients: a GradScaler scales the loss. bf16 has fp32's range.
    needs_scaler = True
    measured_as = "bf16"


class _True(Precision):
    """Weights, gradients and AdamW state all in the low dtype, no autocast and no fp32 copy (Lightning's
    "-true" modes): half the static memory of fp32, but an update smaller than half a step of the stored
    value is rounded away."""

    runs_emulated = False

    def forward_context(self):
        # Tensors the forward creates without a dtype (masks, positions) come out in the weights' dtype.
        return _default_dtype(self.param_dtype)

    def _held(self) -> str:
        return f"{dtype_name(self.param_dtype)} weights, gradients and AdamW state ({self.name})"


class Bf16True(_True):
    name = "bf16-true"
    param_dtype = compute_dtype = torch.bfloat16
    note = "; weights, gradients and AdamW state in bf16, no fp32 master copy: small updates are rounded away"


class Fp16True(_True):
    name = "fp16-true"
    aliases = ("16-true",)
    param_dtype = compute_dtype = torch.float16
    # torch's GradScaler refuses fp16 gradients (it unscales into fp32 master weights, which this mode has
    # not), so, as in Lightning's 16-true, there is no loss scaling. AdamW's eps of 1e-8 is 0 in fp16 (0/0 on
    # a parameter with no gradient yet): 1e-4 keeps the denominator off zero. Its second moment (1-beta2)*g^2
    # still underflows for |g| below ~5e-3, which enlarges those steps: the note says so.
    adamw_eps = 1e-4
    measured_as = "bf16-true"
    note = ("; weights, gradients and AdamW state in fp16 with no loss scaling (GradScaler cannot unscale fp16 "
            "gradients): gradients below 6e-8 flush to zero, an overflow is not skipped, and AdamW's second "
            "moment underflows for gradients below ~5e-3 (eps 1e-4); prefer bf16-true where bf16 is native")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@contextlib.contextmanager
def kept_dtypes(module: torch.nn.Module, exact: bool = False):
    """Each parameter and buffer of `module` back in its own dtype after the block, whatever precisions converted
    it inside (a caller's bf16-stored model stays bf16 after a benchmark ran it as fp32 and bf16-true).

    `exact`: the original tensors themselves are held and put back, bit for bit (an fp32 weight converted to bf16
    inside would otherwise come back rounded to bf16), at the cost of holding them beside the converted ones: for
    a probe that must leave a caller's model as it was (the fit planner's)."""
    params = {name: p.data if exact else p.dtype for name, p in module.named_parameters()}
    buffers = {name: b if exact else b.dtype for name, b in module.named_buffers()}
    try:
        yield module
    finally:
        for name, p in module.named_parameters():
            held = params[name]
            if exact:
                p.data = held
            elif p.dtype != held:
                p.data = p.data.to(held)
        for name, b in module.named_buffers():
            held = buffers[name]
            if (b is not held) if exact else (b.dtype != held):
                owner, _, attr = name.rpartition(".")
                setattr(module.get_submodule(owner), attr, held if exact else b.to(held))


_REGISTRY: dict[str, type[Precision]] = {}


def _aliases() -> dict[str, str]:
    table = {"auto": "auto"}
    for name, cls in _REGISTRY.items():
        table.update({s.lower(): name for s in (name, *cls.aliases)})
    return table


def register_precision(cls: type[Precision]) -> type[Precision]:
    """Add a mode: its name and aliases resolve to it from then on (usable as a class decorator)."""
    taken = _aliases()
    clash = [s for s in (cls.name, *cls.aliases) if s.lower() in taken and taken[s.lower()] != cls.name]
    if not issubclass(cls, Precision) or clash:
        raise ValueError(f"cannot register {cls!r}: not a Precision subclass, or {clash} already name a mode")
    _REGISTRY[cls.name] = cls
    return cls


for _cls in (Fp32, Bf16Mixed, Fp16Mixed, Bf16True, Fp16True):
    register_precision(_cls)
PRECISIONS = tuple(_REGISTRY)  # the modes tier_utils ships, fp32 (the baseline) first


def canonical_precision(requested) -> str:
    """Map any accepted spelling (or an int like 16/32) to auto or a mode's name; a Precision to its name."""
    if isinstance(requested, Precision):
        return requested.name
    key = str(requested).strip().lower()
    table = _aliases()
    if key not in table:
        raise ValueError(f"unknown precision {requested!r}; use one of: {', '.join(sorted(table))}")
    return table[key]


def precision_class(name) -> type[Precision]:
    """The class of a mode, by any spelling of its name."""
    return _REGISTRY[canonical_precision(name)]


def precision_setting(value) -> str | Precision:
    """What a config's `precision` field holds: a Precision already decided (kept whole, so its device and reason
    reach the forward unchanged) or the canonical name of a spelling, to be resolved at the boundary."""
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


def native_support(name: str, device: torch.device) -> tuple[bool, str]:
    """Whether mode `name` runs natively on `device`, and why (one line)."""
    return precision_class(name).native_support(device)


def _auto(device: torch.device) -> tuple[type[Precision], str]:
    """auto picks among fp32 and the mixed modes only: a true mode trades accuracy, and is asked for by name."""
    if device.type == "cuda":
        cc = torch.cuda.get_device_capability(device)
        gpu = torch.cuda.get_device_name(device)
        if cc >= _CUDA_BF16_MIN:
            return Bf16Mixed, (f"auto: {gpu} (compute capability {cc[0]}.{cc[1]}) has bf16 tensor cores -> bf16, "
                               "no scaler")
        if cc >= _CUDA_FP16_MIN:
            return Fp16Mixed, (f"auto: {gpu} (compute capability {cc[0]}.{cc[1]} < 8.0) emulates bf16 -> "
                               "fp16 with a GradScaler")
        return Fp32, f"auto: {gpu} (compute capability {cc[0]}.{cc[1]} < 7.0) has no fp16/bf16 tensor cores -> fp32"
    if device.type == "cpu":
        ok, why = Bf16Mixed.native_support(device)
        if ok:
            return Bf16Mixed, f"auto: {why} -> bf16 autocast, no scaler"
        return Fp32, f"auto: {why} -> fp32"
    return Fp32, f"auto: no mixed-precision rule for {device.type!r} -> fp32"


def resolve_precision(requested="auto", device=None, *, warn: bool = True) -> Precision:
    """Decide what `requested` (a name, or a Precision of any subclass) means on `device`; warn once if it
    will run emulated (slow). A Precision decided for this device comes back as is, so a job resolves once and
    passes it down; one decided for another device is decided again from what was asked (auto stays auto)."""
    dev = resolve_device(device)
    if isinstance(requested, Precision):
        if _same_device(requested.device, dev):
            return requested
        if str(requested.requested).strip().lower() != "auto":  # its own class: it may be registered nowhere
            return type(requested).decide(requested.requested, dev, warn)
        requested = requested.requested
    if canonical_precision(requested) == "auto":
        cls, reason = _auto(dev)
        return cls(str(requested), dev, True, reason)
    return precision_class(requested).decide(str(requested), dev, warn)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are one device when 0 is the current one (torch.device compares them unequal)."""
    def index(d):
        return d.index if d.index is not None else torch.cuda.current_device() if d.type == "cuda" else 0
    return a.type == b.type and index(a) == index(b)


def supported_precisions(device=None) -> list[str]:
    """fp32 plus the modes `device` runs natively (what a widget should offer besides auto)."""
    dev = resolve_device(device)
    return [n for n in PRECISIONS if native_support(n, dev)[0]]
