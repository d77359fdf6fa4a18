"""Precision as a strategy object: one class per mode owns what the mode means, and nothing else in tier_utils
switches on a precision's name (the design of Lightning Fabric's precision plugins).

A mode's class holds its facts (`param_dtype`: what weights, gradients and AdamW state are held in; `compute_dtype`:
what the forward runs in), its hardware rule with the reason (`native_support`), how a module is put in its dtype
(`convert_module`), the forward's context (autocast or none) and whether the step scales its loss (`needs_scaler`:
engine/step.py's GradScaler). `resolve_precision` turns a name on a device into a decided
instance once, at a tier's boundary; adding a mode is one subclass and `register_precision`.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch

from .device import DeviceFacts, device_facts, dtype_name  # dtype_name: imported from here by the tiers
from .dtype_contexts import Autocast, default_dtype
from .registry import Registry

_slow_warned: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Tolerances:
    """How far a mode's logits may stray from fp32's, as max |Δ| / max |fp32 logits|: smoke's stability row
    PASSes up to `logits`; export's parity PASSes up to export[0] and WARNs up to export[1], and wants
    `agreement` (PASS, WARN) of the argmaxes where fp32's top-2 margin is decisive."""

    logits: float
    export: tuple[float, float]
    agreement: tuple[float, float]


class SlowPrecisionWarning(UserWarning):
    """An explicitly requested precision runs, but emulated or without hardware support."""


@dataclass(frozen=True)
class Precision:
    """One mode, decided for one device: what was asked, whether the device runs it natively, and why.

    `device` is where the tensors are (autocast's device type, the GradScaler's); `facts` the hardware the mode was
    decided for (core.device: the same device, or a TIER_UTILS_GPU_PROFILE card while tensors stay on the CPU).
    The class attributes are the mode's facts; subclasses set them and override what differs.
    """

    requested: str
    device: torch.device
    native: bool
    reason: str
    facts: DeviceFacts | None = field(default=None, compare=False, repr=False)  # None: read for `device`

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
    # Where `auto` ranks the mode among those whose auto_eligible() says yes (highest wins); None: auto never
    # picks it (a true mode trades accuracy, and is asked for by name).
    auto_rank = 0
    autocasts = False  # the forward runs under autocast over fp32 weights: compared with fp32 by smoke and analysis
    # What training in this mode costs its result, where fit ranks the modes that fit (cost_rank): 0 for the exact
    # ones; a true mode's updates smaller than half a step of the stored value are rounded away.
    accuracy_cost = 0

    def __post_init__(self):
        if self.facts is None:
            object.__setattr__(self, "facts", device_facts(self.device))

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the name callers had before param_dtype existed)."""
        return self.compute_dtype

    @classmethod
    def native_support(cls, device) -> tuple[bool, str]:
        """Whether `device` (a device, or its DeviceFacts) runs this mode natively, and why: the hardware rule of
        its compute dtype."""
        return device_facts(device).dtype_support(cls.compute_dtype)

    @classmethod
    def auto_eligible(cls, facts: DeviceFacts) -> tuple[bool, str]:
        """Whether `auto` may pick this mode on `facts`' hardware, and why: by default where it runs natively."""
        return cls.native_support(facts)

    def native_on(self, facts: DeviceFacts | None = None) -> bool:
        """Whether the mode runs natively on the device it was decided for (None), or on `facts`' hardware (a GPU
        profile's, for a prediction)."""
        return self.native if facts is None else self.native_support(facts)[0]

    def runs_here(self, facts: DeviceFacts | None = None) -> bool:
        """Whether the mode may run there at all: natively, or emulated where the mode allows it (a true mode may
        not)."""
        return self.native_on(facts) or self.runs_emulated

    def speed_rank(self, facts: DeviceFacts | None = None) -> tuple:
        """Where the mode stands by predicted speed there, fastest first (the rule where nothing was measured): a
        2-byte compute the hardware runs natively (tensor cores, CPU instructions), then fp32, then an emulated
        one; then a true mode (2-byte weights, nothing cast per step) before a mixed one; no loss scaler before
        one; the wider range first."""
        low = self.compute_dtype.itemsize < 4
        compute = (0 if self.native_on(facts) else 2) if low else 1
        return compute, self.param_dtype.itemsize, self.needs_scaler, -self.range_max()

    def cost_rank(self, facts: DeviceFacts | None = None) -> tuple:
        """Where the mode stands by what it costs there, cheapest first: its accuracy cost, then its compute's
        speed (speed_rank's), no loss scaler before one, the wider range first."""
        compute, _, scaler, wider = self.speed_rank(facts)
        return self.accuracy_cost, compute, scaler, wider

    @classmethod
    def range_max(cls) -> float:
        """The largest finite value the forward computes in (fp16's 65504): beyond it a value becomes inf."""
        return torch.finfo(cls.compute_dtype).max

    @classmethod
    def smallest_normal(cls) -> float:
        """The compute dtype's smallest normal value (fp16's 6.1e-5): below it values lose precision, and later
        flush to zero."""
        return torch.finfo(cls.compute_dtype).tiny

    @classmethod
    def out_of_range(cls, named_tensors) -> list[str]:
        """The names of the floating tensors with a value beyond the compute dtype's range: it would make them inf."""
        return [name for name, t in named_tensors if t.is_floating_point() and t.numel()
                and t.detach().abs().max().item() > cls.range_max()]

    @classmethod
    def tolerances(cls) -> Tolerances:
        """How far this mode's logits may stray from fp32's. By default from the compute dtype's rounding: a few
        units of its eps (a mode defined elsewhere gets sensible rows with no table to edit), never tighter than
        fp32's own 1e-4 (different kernels summing in another order)."""
        eps = torch.finfo(cls.compute_dtype).eps
        return Tolerances(logits=max(1e-4, 8 * eps), export=(max(1e-4, 4 * eps), max(1e-3, 40 * eps)),
                          agreement=(1.0, 0.99) if eps < 1e-6 else (0.98, 0.9))

    @classmethod
    def decide(cls, requested: str, device, warn: bool = True) -> Precision:
        """This mode on `device` (or its DeviceFacts), with the reason; warns once per (device, mode) if it runs
        emulated."""
        facts = device_facts(device)
        native, why = cls.native_support(facts)
        reason = f"{cls.name} requested: {why}" if native else f"{cls.name} requested: runs, but {why}"
        key = (f"{facts.device}:{facts.name}", cls.name)
        if not native and warn and key not in _slow_warned:
            _slow_warned.add(key)
            warnings.warn(reason, SlowPrecisionWarning, stacklevel=3)
        return cls(str(requested), facts.device, native, reason + cls.note, facts)

    def check_runnable(self) -> None:
        """A one-line ValueError where this mode may not run on its device (a true mode it only emulates)."""
        if not self.runs_here():
            why = self.native_support(self.facts)[1]
            raise ValueError(f"{self.name} needs native {dtype_name(self.param_dtype)} and {why}; use "
                             f"{dtype_name(self.compute_dtype)} (mixed) or fp32, or a device that has it")

    def convert_module(self, module: torch.nn.Module, memory=None) -> torch.nn.Module:
        """`module` in the run's dtypes, in place, the one conversion every run makes. A full fine-tune: its
        floating-point weights and buffers in `param_dtype` (a bf16- or fp16-stored checkpoint becomes fp32 master
        weights for fp32 and the mixed modes, a true mode's weights its dtype). A module carrying LoRA adapters
        (`carries_adapters`): the adapters and the modules trained in full in fp32 (peft casts their input to fp32
        and their output back), the frozen base in `memory`'s decided base dtype under fp32 weights (a
        DecidedMemory; None or a full fine-tune's: as it is) and in a true mode's own dtype, a 4-bit base computing
        in the compute dtype."""
        if not carries_adapters(module):
            return module.to(dtype=self.param_dtype)
        fp32_weights = self.param_dtype == torch.float32
        base = memory.base_dtype if memory is not None and fp32_weights else self.param_dtype
        for p in module.parameters():
            if p.is_floating_point():  # a 4-bit base's packed weights stay as bitsandbytes holds them
                p.data = p.data.float() if p.requires_grad else p.data.to(base)
        for m in module.modules():
            if getattr(getattr(m, "weight", None), "quant_state", None) is not None and hasattr(m, "compute_dtype"):
                # A 4-bit layer computes in the compute dtype: autocast does not reach bitsandbytes' matmul, and its
                # output in another half dtype stops CPU autocast (a QLoRA benchmark's fp16 row over bf16).
                m.compute_dtype = self.compute_dtype
            for name, b in m.named_buffers(recurse=False):
                # Under fp32 weights the buffers no checkpoint holds (rotary frequencies, computed at build) keep
                # their dtype, as from_pretrained leaves them at any dtype: so the trained model computes what its
                # adapter folder over a fresh load of the base computes. A true mode holds everything in its dtype.
                derived = name in m._non_persistent_buffers_set and fp32_weights
                if b.is_floating_point() and not derived:
                    b.data = b.data.to(base)
        return module

    def forward_context(self):
        """A fresh context for forward + loss: nothing for fp32 (the mixed and true modes override it)."""
        return contextlib.nullcontext()

    def autocast(self):
        """forward_context() by the name the tiers' forwards (smoke, analysis, evaluation) call it."""
        return self.forward_context()

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
                "device_name": self.facts.measured_on, "native": self.native, "needs_scaler": self.needs_scaler,
                "reason": self.reason}


def carries_adapters(module: torch.nn.Module) -> bool:
    """Whether `module` carries LoRA adapters over a frozen base: peft marks the model it wraps with its config."""
    return hasattr(module, "peft_config")


class Fp32(Precision):
    """fp32 everywhere: the baseline every other mode is compared with."""

    name = "fp32"
    aliases = ("32", "32-true", "float32")


class _Bf16:
    """bf16's tolerances (mixed and true): 8 mantissa bits, eps 7.8e-3; logits of a few layers stay within about
    6 eps of fp32's."""

    @classmethod
    def tolerances(cls) -> Tolerances:
        return Tolerances(logits=5e-2, export=(3e-2, 1e-1), agreement=(0.98, 0.9))


class _Fp16:
    """fp16's tolerances (mixed and true): 11 mantissa bits, eps 9.8e-4, about ten of them through a few layers."""

    @classmethod
    def tolerances(cls) -> Tolerances:
        return Tolerances(logits=1e-2, export=(5e-3, 5e-2), agreement=(0.99, 0.95))


class _Mixed(Precision):
    """fp32 master weights, gradients and AdamW state; the forward under torch.amp autocast."""

    autocasts = True

    def forward_context(self):
        # The tensors' device type (a CPU's under a GPU profile), whatever hardware the mode was decided for.
        return Autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _held(self) -> str:
        return f"fp32 master weights, {dtype_name(self.compute_dtype)} autocast"


class Bf16Mixed(_Bf16, _Mixed):
    name = "bf16"
    aliases = ("bf16-mixed", "bfloat16")
    compute_dtype = torch.bfloat16
    auto_rank = 20  # first where native: half the activations of fp32 and no loss scaler


class Fp16Mixed(_Fp16, _Mixed):
    name = "fp16"
    aliases = ("16", "16-mixed", "fp16-mixed", "float16", "half")
    compute_dtype = torch.float16
    # fp16's 5-bit exponent underflows small gradients: a GradScaler scales the loss. bf16 has fp32's range.
    needs_scaler = True
    measured_as = "bf16"
    auto_rank = 10  # after bf16: the same bytes, but a loss scaler and a narrower range

    @classmethod
    def auto_eligible(cls, facts: DeviceFacts) -> tuple[bool, str]:
        """On a GPU with fp16 tensor cores (a T4). On a CPU auto's rule is bf16 where native, else fp32: fp16, with
        its loss scaler and 5-bit exponent, is asked for there by name."""
        native, why = cls.native_support(facts)
        if native and not facts.is_gpu:
            return False, f"{why}, but auto takes fp16 on a GPU only"
        return native, why


class _True(Precision):
    """Weights, gradients and AdamW state all in the low dtype, no autocast and no fp32 copy (Lightning's
    "-true" modes): half the static memory of fp32, but an update smaller than half a step of the stored
    value is rounded away."""

    runs_emulated = False
    auto_rank = None  # auto never trades accuracy: a true mode is asked for by name
    accuracy_cost = 2  # after a mixed mode with checkpointing's recompute (1), before LoRA's adapters alone

    def forward_context(self):
        # Tensors the forward creates without a dtype (masks, positions) come out in the weights' dtype.
        return default_dtype(self.param_dtype)

    def _held(self) -> str:
        return f"{dtype_name(self.param_dtype)} weights, gradients and AdamW state ({self.name})"


class Bf16True(_Bf16, _True):
    name = "bf16-true"
    param_dtype = compute_dtype = torch.bfloat16
    note = "; weights, gradients and AdamW state in bf16, no fp32 master copy: small updates are rounded away"


class Fp16True(_Fp16, _True):
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


_REGISTRY = Registry("precision", Precision, extra=("auto",))


def register_precision(cls: type[Precision]) -> type[Precision]:
    """Add a mode: its name and aliases resolve to it from then on (usable as a class decorator)."""
    return _REGISTRY.add(cls)


for _cls in (Fp32, Bf16Mixed, Fp16Mixed, Bf16True, Fp16True):
    register_precision(_cls)
PRECISIONS = _REGISTRY.names()  # the modes tier_utils ships, fp32 (the baseline) first
BASELINE = Fp32.name  # what every other mode is compared with (its speedups, its drift, its verdicts)


def canonical_precision(requested) -> str:
    """Map any accepted spelling (or an int like 16/32) to auto or a mode's name; a Precision to its name."""
    return _REGISTRY.canonical(requested)


def precision_class(name) -> type[Precision]:
    """The class of a mode, by any spelling of its name."""
    return _REGISTRY[name]


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


def native_support(name: str, device) -> tuple[bool, str]:
    """Whether mode `name` runs natively on `device` (or its DeviceFacts), and why (one line)."""
    return precision_class(name).native_support(device)


def computed_in(dtype: torch.dtype | None) -> type[Precision]:
    """The registered mode whose weights and forward are both in `dtype` (fp32's for fp32, for a dtype no mode holds,
    and for None): its tolerances bound how far two computations of one model held in `dtype` may differ (two kernel
    paths, another summation order), so a check comparing them judges the model, not the dtype's rounding."""
    return next((cls for cls in _REGISTRY.entries() if not cls.autocasts and cls.param_dtype == dtype
                 and cls.compute_dtype == dtype), Fp32)


def autocast_precisions() -> tuple[str, ...]:
    """The registered modes whose forward runs under autocast over fp32 weights (bf16, fp16 and any registered
    like them): what smoke, analysis and `info` set beside fp32, in registry order."""
    return tuple(cls.name for cls in _REGISTRY.entries() if cls.autocasts)


def _auto(facts: DeviceFacts) -> tuple[type[Precision], str]:
    """The registered mode of highest auto_rank that its own auto_eligible() admits on `facts`' hardware; the
    reason says why each one ranked above it was passed over."""
    ranked = sorted((c for c in _REGISTRY.entries() if c.auto_rank is not None), key=lambda c: -c.auto_rank)
    passed = []
    for cls in ranked:
        ok, why = cls.auto_eligible(facts)
        if ok:
            scaler = " with a GradScaler" if cls.needs_scaler else ""
            return cls, f"auto: {cls.name}{scaler} ({why})" + "".join(f"; not {n}: {w}" for n, w in passed)
        passed.append((cls.name, why))
    raise ValueError(f"no registered precision may run on {facts.describe()}; register one whose auto_eligible() "
                     "says yes (fp32 does)")


def resolve_precision(requested="auto", device=None, *, warn: bool = True) -> Precision:
    """Decide what `requested` (a name, or a Precision of any subclass) means on `device`; warn once if it
    will run emulated (slow). A Precision decided for this device and hardware comes back as is, so a job
    resolves once and passes it down; one decided for another is decided again from what was asked (auto stays
    auto)."""
    dev = resolve_device(device)
    facts = device_facts(dev)
    if isinstance(requested, Precision):
        if _same_device(requested.device, dev) and requested.facts == facts:
            return requested
        if str(requested.requested).strip().lower() != "auto":  # its own class: it may be registered nowhere
            return type(requested).decide(requested.requested, facts, warn)
        requested = requested.requested
    if canonical_precision(requested) == "auto":
        cls, reason = _auto(facts)
        return cls(str(requested), dev, True, reason, facts)
    return precision_class(requested).decide(str(requested), facts, warn)


def _same_device(a: torch.device, b: torch.device) -> bool:
    """`cuda` and `cuda:0` are one device when 0 is the current one (torch.device compares them unequal)."""
    def index(d):
        return d.index if d.index is not None else torch.cuda.current_device() if d.type == "cuda" else 0
    return a.type == b.type and index(a) == index(b)


def supported_precisions(device=None) -> list[str]:
    """fp32 plus the modes `device` runs natively (what a widget should offer besides auto)."""
    facts = device_facts(resolve_device(device))
    return [n for n in PRECISIONS if native_support(n, facts)[0]]
