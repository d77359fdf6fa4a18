"""Memory as one settings object, beside the precision class: `MemorySettings` says what a run holds its weights
and optimizer state in (LoRA's adapters and their frozen base's dtype, QLoRA's 4-bit base, the optimizer's state
format, activation checkpointing). train, the benchmark, fit, search and the panel read it; `resolve_memory`
decides it once at the boundary, with the decided precision and the device's facts, into a `DecidedMemory` that
is passed down and named in every result.

Bytes per parameter (docs/precision.md): a frozen base weight holds its dtype's size (4-bit NF4: about half a byte
and its quantisation state, measured by engine/quantization.py); a trained parameter its weight, its gradient
and the optimizer's state (its class says how much: core/optimizers.py).

The flags that say what the frozen base is held in (--qlora, --lora's bits=, --base-bits, --base-dtype) each claim
a quantised or an unquantised base: `MemorySettings._base_claims` reads them and `MemorySettings._agreed` refuses any
two that disagree, in one line naming both. That rule is the only place a contradiction among them is decided.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import asdict, dataclass, replace

import torch

from .device import DeviceFacts
from .errors import LoraError, MemorySettingError
from .optimizers import DEFAULT_OPTIMIZER, MIN_8BIT_SIZE, OPTIMIZERS, Optimizer, canonical_optimizer, optimizer_class
from .precision import BASELINE, PRECISIONS, Bf16Mixed, Fp16Mixed, Precision, dtype_name, precision_class
from .settings import check_fields, setting

# LoRA's frozen base may be held in what a mode over fp32 weights computes in (fp32, bf16, fp16), by the mode's name.
BASE_DTYPES = {cls.name: cls.compute_dtype for cls in map(precision_class, PRECISIONS)
               if cls.param_dtype == torch.float32}
BASE_BITS = (16, 4)
FP16 = Fp16Mixed  # the 2-byte mode whose range runs out: a bf16 base held in fp16 is checked against it


@dataclass(frozen=True)
class LoraSettings:
    """LoRA's settings (peft's LoraConfig: r, lora_alpha, lora_dropout, target_modules)."""

    r: int = setting(8, "adapter rank", low=1)
    alpha: float = setting(16, "adapter scale numerator: updates are scaled by alpha / r", above=0)
    dropout: float = setting(0.0, "dropout on the adapters' input", low=0, below=1)
    targets: tuple | None = setting(None, "linear layers to adapt, by name ending (none: the attention and MLP "
                                          "linear layers)")

    def __post_init__(self):
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", tuple(t for t in self.targets.split(",") if t.strip()))
        if self.targets is not None:
            object.__setattr__(self, "targets", tuple(str(t).strip() for t in self.targets) or None)
        try:
            check_fields(self)
        except ValueError as exc:
            raise LoraError(f"lora: {exc}; e.g. lora=LoraSettings(r=8, alpha=16) (--lora r=8,alpha=16)") from None

    @classmethod
    def parse(cls, text: str) -> LoraSettings:
        """'r=8,alpha=16,targets=q_proj,v_proj': names after targets= are all targets."""
        values, targets, key = {}, [], None
        for part in (p.strip() for p in text.split(",") if p.strip()):
            key, sep, value = part.partition("=") if "=" in part else (key, "=", part)
            if key == "targets":
                targets.append(value)
                continue
            if not sep or key not in ("r", "alpha", "dropout"):
                raise LoraError(f"--lora {text!r}: expected r=N,alpha=X[,dropout=X][,bits=4][,targets=NAME,NAME], "
                                "e.g. r=8,alpha=16")
            try:
                values[key] = int(value) if key == "r" else float(value)
            except ValueError:
                raise LoraError(f"--lora {text!r}: {key}={value!r} is not a number") from None
        return cls(**values, targets=tuple(targets) or None)

    def __str__(self) -> str:
        """The --lora spelling (what --help shows as the default): r=8,alpha=16[,dropout=X][,targets=...]."""
        return (f"r={self.r},alpha={self.alpha:g}" + (f",dropout={self.dropout:g}" if self.dropout else "")
                + (f",targets={','.join(self.targets)}" if self.targets else ""))

    def describe(self) -> str:
        return f"LoRA r={self.r}, alpha={self.alpha:g}" + (f", targets {','.join(self.targets)}" if self.targets
                                                             else "")

    def to_dict(self) -> dict:
        return asdict(self)


def lora_setting(value) -> LoraSettings | None:
    """What a `lora` setting may be given as: None, 0 or 'off' (no LoRA), a rank (alpha = 2 x rank, peft's usual
    ratio), 'r=8,alpha=16,...', a dict of LoraSettings' fields, or LoraSettings."""
    if value is None or isinstance(value, LoraSettings):
        return value
    if isinstance(value, bool):
        raise LoraError(f"lora must be a rank, 'r=8,alpha=16' or LoraSettings, got {value!r}")
    if isinstance(value, int):
        return None if value == 0 else LoraSettings(r=value, alpha=2 * value)
    if isinstance(value, dict):
        return LoraSettings(**value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("", "0", "off", "none"):
            return None
        return lora_setting(int(text)) if text.isdigit() else LoraSettings.parse(value)
    raise LoraError(f"lora must be a rank, 'r=8,alpha=16' or LoraSettings, got {type(value).__name__}")


def _split_bits(text: str) -> tuple[str, int | None]:
    """'r=8,alpha=16,bits=4' -> ('r=8,alpha=16', 4): the base's bits ride along in --lora's spelling."""
    parts, bits = [], None
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if key == "bits":
            if not value.strip().isdigit():
                raise MemorySettingError(f"--lora {text!r}: bits={value!r} is not a whole number; use bits=4 "
                                         "(QLoRA) or leave it out")
            bits = int(value)
        else:
            parts.append(part)
    return ",".join(parts), bits


@dataclass(frozen=True)
class MemorySettings:
    """What a training step holds its weights and optimizer state in: full fine-tuning (every weight trains, in the
    precision's dtype) or LoRA adapters over a frozen base (its dtype, or 4-bit NF4: QLoRA), the optimizer (its
    class: core/optimizers.py), and activation checkpointing."""

    lora: LoraSettings | None = setting(None, "LoRA adapters (peft) over the frozen base: r=N,alpha=X[,dropout=X]"
                                              "[,bits=4][,targets=NAME,NAME], e.g. r=8,alpha=16 (none: every weight "
                                              "trains)")
    base_dtype: str | None = setting(None, "LoRA's frozen base: fp16, bf16 or fp32 (none: its stored dtype where "
                                           "the device computes in it natively; on a card without bf16 a bf16 base "
                                           "becomes fp16 after a range check; else fp32); not with a 4-bit base",
                                     choices=tuple(BASE_DTYPES))
    base_bits: int | None = setting(None, "bits per frozen base weight: 16, or 4 (QLoRA: NF4 through bitsandbytes; "
                                          "needs lora) (none: what --lora's bits= or --qlora say, else 16)")
    optimizer: str = setting(DEFAULT_OPTIMIZER.name, f"the optimizer: {', '.join(OPTIMIZERS)} (adamw: fp32 "
                                                     "moments; the 8-bit ones bitsandbytes'; the paged one needs CUDA)")
    checkpointing: bool = setting(False, "activation checkpointing on the repeated blocks: their activations are "
                                         "recomputed in backward, not kept", flag="checkpointing")

    def __post_init__(self):
        lora, bits = self.lora, None
        if isinstance(lora, str):
            lora, bits = _split_bits(lora)
        object.__setattr__(self, "lora", lora_setting(lora))
        if self.base_dtype is not None:
            object.__setattr__(self, "base_dtype", str(self.base_dtype).strip().lower())
        try:
            object.__setattr__(self, "optimizer", canonical_optimizer(self.optimizer))
        except ValueError as exc:
            raise MemorySettingError(str(exc)) from None
        quantized = self._agreed(self._base_claims(bits, self.base_bits, self.base_dtype))
        object.__setattr__(self, "base_bits", 4 if quantized else 16)
        self._check()

    def _check(self) -> None:
        if not isinstance(self.checkpointing, bool):
            raise MemorySettingError(f"checkpointing must be True or False, got {self.checkpointing!r}")
        if self.quantized and self.lora is None:
            raise MemorySettingError("a 4-bit base (QLoRA) trains LoRA adapters over it; give lora too, e.g. "
                                     "--lora r=8,alpha=16,bits=4 or --qlora")
        if self.base_dtype is not None and self.base_dtype not in BASE_DTYPES:
            raise MemorySettingError(f"base dtype {self.base_dtype!r} is not one of {', '.join(BASE_DTYPES)}")
        if self.base_dtype is not None and self.lora is None:
            raise MemorySettingError(f"base dtype {self.base_dtype} applies to LoRA's frozen base; give lora too (e.g. "
                                     "--lora r=8,alpha=16), or drop it: a full fine-tune holds the precision's dtype")
        try:
            check_fields(self)
        except ValueError as exc:
            raise MemorySettingError(str(exc)) from None

    # The one rule for flags that say what the frozen base is held in: each claims a quantised or an unquantised
    # base, and any two that disagree are one line naming both.
    @staticmethod
    def _base_claims(lora_bits, base_bits, base_dtype, qlora: bool = False) -> dict[str, bool]:
        """What each flag given says the frozen base is, by the flag's spelling: quantised to 4 bits (True) or held
        in a float dtype (False). A bit width other than 4 or 16 is one line."""
        for bits in (lora_bits, base_bits):
            if bits is not None and (isinstance(bits, bool) or bits not in BASE_BITS):
                raise MemorySettingError(f"base bits {bits!r} is not supported; use 4 (QLoRA, e.g. --lora r=8,bits=4 "
                                         "or --qlora) or 16")
        claims = {"--qlora": True} if qlora else {}
        if lora_bits is not None:
            claims[f"--lora ...,bits={lora_bits}"] = lora_bits == 4
        if base_bits is not None:
            claims[f"--base-bits {base_bits}"] = base_bits == 4
        if base_dtype is not None:
            claims[f"--base-dtype {base_dtype}"] = False
        return claims

    @staticmethod
    def _agreed(claims: dict[str, bool]) -> bool:
        """Whether the base is quantised, as every claim says (none: it is not); two that disagree are one line
        naming both, whichever way they were given (flags, or MemorySettings' fields of the same names)."""
        four = [flag for flag, quantized in claims.items() if quantized]
        held = [flag for flag, quantized in claims.items() if not quantized]
        if four and held:
            raise MemorySettingError(f"{four[0]} asks for a 4-bit NF4 base (QLoRA) and {held[0]} for an unquantised "
                                     "one; drop one of them")
        return bool(four)

    @classmethod
    def qlora(cls, lora=None, **given) -> MemorySettings:
        """QLoRA: LoRA adapters (`lora`, in any form `lora` takes; none: LoraSettings()) over a 4-bit NF4 base, with
        the other settings `given` (the CLI's --qlora beside its other flags). A setting that says otherwise (no
        LoRA, a 16-bit base, a base dtype) is one line."""
        text, bits = _split_bits(lora) if isinstance(lora, str) else (lora, None)
        adapters = lora_setting(text)
        if lora is not None and adapters is None:
            raise MemorySettingError(f"--lora {lora} asks for no LoRA and --qlora for LoRA adapters over a 4-bit "
                                     "base; drop one of them")
        cls._agreed(cls._base_claims(bits, given.get("base_bits"), given.get("base_dtype"), qlora=True))
        return cls(lora=adapters or LoraSettings(), **{**given, "base_bits": 4})

    @property
    def quantized(self) -> bool:
        """The frozen base is 4-bit NF4 (QLoRA)."""
        return self.base_bits == 4

    @property
    def optimizer_class(self) -> type[Optimizer]:
        return optimizer_class(self.optimizer)

    def bytes_per_param(self, base_dtype: torch.dtype = torch.float32, trained_dtype: torch.dtype = torch.float32,
                        quantized: float | None = None) -> dict:
        """Bytes per parameter, for a tensor of at least MIN_8BIT_SIZE elements (where every optimizer's state
        reaches its steady rate): `base` per frozen base weight (this object's base dtype, else `base_dtype`;
        4-bit: `quantized`, engine.quantization's measured NF4 bytes), and per trained parameter its `weights`
        (LoRA: fp32 adapters, else `trained_dtype`), `grads` and `optimizer` state. A full fine-tune has no frozen
        base (base 0)."""
        trained = 4 if self.lora is not None else trained_dtype.itemsize
        if self.lora is None:
            base = 0.0
        elif self.quantized:
            if quantized is None:
                raise MemorySettingError("a 4-bit base's bytes come from bitsandbytes (engine.quantization."
                                         "quantized_bytes_per_param); pass quantized=")
            base = quantized
        else:
            base = BASE_DTYPES[self.base_dtype].itemsize if self.base_dtype else base_dtype.itemsize
        return {"base": base, "weights": trained, "grads": trained,
                "optimizer": self.optimizer_class.state_bytes_per_param(MIN_8BIT_SIZE, trained)}

    def describe(self, base: str | None = None) -> str:
        """In words, e.g. "LoRA r=8 over a bf16 base, fp32 adapters, AdamW8bit, checkpointing"; `base`: the
        decided base dtype's name where this object leaves it open."""
        if self.lora is None:
            words = ["full fine-tune"]
        else:
            held = "a 4-bit NF4" if self.quantized else f"a {self.base_dtype or base or 'stored-dtype'}"
            words = [f"{'QLoRA' if self.quantized else 'LoRA'} r={self.lora.r} over {held} base", "fp32 adapters"]
        words.append(self.optimizer_class.label)
        if self.checkpointing:
            words.append("checkpointing")
        return ", ".join(words)

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        """The fields that differ from the defaults, LoRA in its --lora spelling: MemorySettings(lora='r=8,alpha=16',
        base_bits=4)."""
        default = MemorySettings()
        changed = {f: getattr(self, f) for f in ("lora", "base_dtype", "base_bits", "optimizer", "checkpointing")
                   if getattr(self, f) != getattr(default, f)}
        shown = ", ".join(f"{k}={str(v)!r}" if k == "lora" else f"{k}={v!r}" for k, v in changed.items())
        return f"MemorySettings({shown})"

    def to_dict(self) -> dict:
        return {"lora": None if self.lora is None else self.lora.to_dict(), "base_dtype": self.base_dtype,
                "base_bits": self.base_bits, "optimizer": self.optimizer, "checkpointing": self.checkpointing}


# The panel's memory choices, and what each means (memory_setting's names).
MEMORY_CHOICES = {"full": "full fine-tune", "lora": "LoRA", "qlora": "QLoRA (4-bit base)",
                  "adamw8bit": "8-bit optimizer"}
# Each name memory_setting takes, and the settings it means: the panel's, and each registered optimizer's own.
_NAMED = {"full": MemorySettings, "lora": lambda: MemorySettings(lora=LoraSettings()), "qlora": MemorySettings.qlora,
          **{name: functools.partial(MemorySettings, optimizer=name) for name in OPTIMIZERS}}


def memory_setting(value, checkpointing: bool | None = None) -> MemorySettings:
    """What a `memory` setting may be given as: None (full fine-tune, AdamW), MemorySettings, a dict of its fields,
    or a name: full, lora, qlora, or an optimizer's (a full fine-tune with it); `checkpointing` on top when
    given."""
    if value is None:
        memory = MemorySettings()
    elif isinstance(value, MemorySettings):
        memory = value
    elif isinstance(value, dict):
        memory = MemorySettings(**value)
    elif isinstance(value, str) and value.strip().lower() in _NAMED:
        memory = _NAMED[value.strip().lower()]()
    else:
        raise MemorySettingError(f"memory must be MemorySettings, a dict of its fields or one of "
                                 f"{', '.join(_NAMED)}; got {value!r}")
    if checkpointing is not None and checkpointing != memory.checkpointing:
        memory = replace(memory, checkpointing=checkpointing)
    return memory


@dataclass(frozen=True)
class DecidedMemory:
    """MemorySettings decided for one run: the frozen base's dtype (None: a full fine-tune, every weight in the
    precision's dtype), the adapters' (fp32), and why; the optimizer it builds."""

    settings: MemorySettings
    base_dtype: torch.dtype | None
    reason: str
    adapter_dtype: torch.dtype = torch.float32

    @property
    def lora(self) -> LoraSettings | None:
        return self.settings.lora

    @property
    def checkpointing(self) -> bool:
        return self.settings.checkpointing

    @property
    def quantized(self) -> bool:
        return self.settings.quantized

    @property
    def optimizer(self) -> type[Optimizer]:
        """The optimizer the run builds: the one asked for (one the device cannot run was refused when decided,
        so a result never names another than ran)."""
        return self.settings.optimizer_class

    @property
    def accuracy_cost(self) -> int:
        """What these settings cost the training's result, where fit ranks the modes that fit (after a true mode's
        2): LoRA trains only its adapters (4), over a 4-bit base (6); plus the optimizer's."""
        return (6 if self.quantized else 4 if self.lora is not None else 0) + self.optimizer.accuracy_cost

    def describe(self) -> str:
        return self.settings.describe(dtype_name(self.base_dtype) if self.base_dtype is not None else None)

    def bytes_per_param(self, precision: Precision, quantized: float | None = None) -> dict:
        return self.settings.bytes_per_param(self.base_dtype or precision.param_dtype, precision.param_dtype,
                                             quantized)

    def to_dict(self) -> dict:
        return {**self.settings.to_dict(), "decided_base_dtype": self.base_dtype and dtype_name(self.base_dtype),
                "adapter_dtype": dtype_name(self.adapter_dtype) if self.lora is not None else None,
                "decided_optimizer": self.optimizer.name, "reason": self.reason, "describe": self.describe()}


def _named(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def resolve_memory(settings: MemorySettings, precision: Precision, facts: DeviceFacts,
                   stored_dtype: torch.dtype | None, model: torch.nn.Module | None = None) -> DecidedMemory:
    """`settings` decided for one run: the base dtype (LoRA) from the precision, the device's facts, the stored
    dtype and, before a bf16 base becomes fp16, `model`'s weights checked against fp16's range. An optimizer the
    tensors' device cannot run (paged AdamW8bit off CUDA) or a contradiction is one line (MemorySettingError)."""
    settings.optimizer_class.check_runs_on(facts.device)
    if settings.lora is None:
        return DecidedMemory(settings, None, "full fine-tune: every weight in the precision's dtype")
    base, reason = _base_dtype(settings, precision, facts, stored_dtype)
    fp16 = FP16.compute_dtype
    if base == fp16 and (stored_dtype or torch.float32) != fp16 and model is not None:
        over = FP16.out_of_range(model.named_parameters())
        beyond = f"hold values beyond {FP16.name}'s ±{FP16.range_max():g}"
        if over and BASE_DTYPES.get(settings.base_dtype) == fp16:
            raise MemorySettingError(f"base dtype {settings.base_dtype} would overflow: {_named(over)} {beyond}; use "
                                     f"--base-dtype {Bf16Mixed.name} or {BASELINE}")
        if over:
            base, reason = torch.float32, (f"base kept {BASELINE}: {_named(over)} {beyond} and {facts.describe()} "
                                           f"has no native {Bf16Mixed.name}")
            warnings.warn(f"LoRA base: {reason}", stacklevel=2)
    return DecidedMemory(settings, base, reason)


def _base_dtype(settings: MemorySettings, precision: Precision, facts: DeviceFacts,
                stored_dtype: torch.dtype | None) -> tuple[torch.dtype, str]:
    """LoRA's base dtype and why, before fp16's range check."""
    asked = BASE_DTYPES.get(settings.base_dtype)
    if precision.param_dtype != torch.float32:  # a true mode holds everything in its dtype: the base too
        if asked is not None and asked != precision.param_dtype:
            raise MemorySettingError(f"--base-dtype {settings.base_dtype} with --precision {precision.name}: the "
                                     f"true mode holds every weight in {dtype_name(precision.param_dtype)}; drop "
                                     f"--base-dtype or use a mixed precision ({dtype_name(precision.compute_dtype)})")
        return precision.param_dtype, f"{precision.name} holds the base in {dtype_name(precision.param_dtype)}"
    if asked is not None:
        return asked, f"base dtype {settings.base_dtype} as asked"
    stored = stored_dtype if stored_dtype in (torch.float16, torch.bfloat16) else None
    if stored is None:
        return torch.float32, f"base stored {dtype_name(stored_dtype or torch.float32)}: kept fp32"
    native, why = facts.dtype_support(stored)
    if native:
        return stored, f"base kept in its stored {dtype_name(stored)}: {why}"
    if stored == torch.bfloat16 and facts.dtype_support(FP16.compute_dtype)[0]:
        return FP16.compute_dtype, (f"base stored bf16 held in {FP16.name}: {why}; its weights are within "
                                    f"{FP16.name}'s range")
    return torch.float32, f"base stored {dtype_name(stored)} upcast to fp32: {why}"
