"""The optimizer as an object: one class per optimizer owns every fact about it (how it is built, the bytes its
state holds, whether it needs CUDA and what runs instead, what it costs in accuracy, its words), and nothing else in
tier_utils tests an optimizer's name. `MemorySettings.optimizer` names one, `resolve_memory` decides it for the
device, and train, the benchmark and fit take the decided class. Adding one is a subclass and `register_optimizer`,
as a precision is.

bitsandbytes' import is here too (`require_bitsandbytes`): its 8-bit optimizers and QLoRA's 4-bit base
(engine/quantization.py) both need it, and both say so in the same line.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager

import torch

from .errors import MemorySettingError, QuantizationError
from .registry import Registry

BITSANDBYTES_EXTRA = "pip install 'tier_utils[qlora]' (or bitsandbytes)"
# bitsandbytes' 8-bit optimizers (0.45-0.50, measured on its CPU backend): state1/state2 uint8 per element, a
# float32 absmax per block of 256 elements for each, and a 256-entry float32 code map each, for tensors of at
# least min_8bit_size = 4096 elements; smaller tensors keep two float32 states.
MIN_8BIT_SIZE = 4096
STATE_BLOCK = 256
QMAP_BYTES = 2 * 256 * 4


@contextmanager
def _quiet_cpu_kernel_hint():
    """bitsandbytes' CPU backend logs, at import, that an optional kernels package would speed it up: a hint about
    an install the user did not ask for, printed on every run; its logger's level is the user's again afterwards."""
    logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def require_bitsandbytes(what: str):
    """The bitsandbytes module, or one line naming the extra that installs it."""
    try:
        with _quiet_cpu_kernel_hint():
            import bitsandbytes
    except ImportError:
        raise QuantizationError(f"{what} needs bitsandbytes; {BITSANDBYTES_EXTRA}") from None
    return bitsandbytes


class Optimizer:
    """One optimizer: a subclass sets the facts below and defines `build` and `state_bytes_per_param`. Its methods
    are class methods: the registry holds classes, and a decided memory setting carries one."""

    name = ""  # the --optimizer spelling
    aliases: tuple[str, ...] = ()  # other spellings (transformers' Trainer's `optim` names)
    label = ""  # how a result names it, e.g. "AdamW8bit"
    description = ""  # its state in words
    needs_cuda = False  # it runs only where the tensors are on a CUDA device
    instead = "adamw"  # where it cannot run: the registered optimizer that does the same there, named in the refusal
    # What it costs the training's result, added to fit's cost rank (planning.planner.cost_rank): 0 for exact
    # moments; 1 for quantised ones, a little accuracy.
    accuracy_cost = 0

    @classmethod
    def require(cls) -> None:
        """One line naming what to install where a package it is built from is missing (a config asks as it is
        made, before anything is built or written); torch's own need nothing."""

    @classmethod
    def build(cls, groups: list[dict], lr: float, eps: float) -> torch.optim.Optimizer:
        """The optimizer over parameter `groups` (torch's param_groups, each with its weight decay)."""
        raise NotImplementedError(f"{cls.__name__} must define build(groups, lr, eps)")

    @classmethod
    def state_bytes_per_param(cls, numel: int, trained_size: int = 4) -> float:
        """State bytes per element of a trained tensor of `numel` elements held in `trained_size`-byte values,
        once a step has made the state."""
        raise NotImplementedError(f"{cls.__name__} must define state_bytes_per_param(numel, trained_size)")

    @classmethod
    def state_bytes(cls, numels, trained_size: int = 4) -> int:
        """The state bytes over trained tensors of `numels` elements (what fit predicts and static_memory counts)."""
        return int(sum(n * cls.state_bytes_per_param(n, trained_size) for n in numels))

    @classmethod
    def runs_on(cls, device: torch.device) -> tuple[bool, str]:
        """Whether it runs with tensors on `device`, and why not."""
        if cls.needs_cuda and device.type != "cuda":
            return False, f"{cls.label} needs CUDA and this run's tensors are on {device.type}"
        return True, ""

    @classmethod
    def check_runs_on(cls, device: torch.device) -> None:
        """One line naming the optimizer that runs here, where this one does not."""
        runs, why = cls.runs_on(device)
        if not runs:
            other = optimizer_class(cls.instead)
            raise MemorySettingError(f"--optimizer {cls.name}: {why}; use --optimizer {other.name} ({other.label}, "
                                     f"{other.description}), which runs here")

    @classmethod
    def implementation(cls, optimizer: torch.optim.Optimizer) -> str:
        """How a built one's step runs: by default the package its class comes from."""
        return type(optimizer).__module__.partition(".")[0]

    @classmethod
    def describe(cls, optimizer: torch.optim.Optimizer) -> str:
        """What ran, for a result: e.g. "AdamW (fused)", "AdamW8bit (bitsandbytes)"."""
        return f"{cls.label} ({cls.implementation(optimizer)})"


class AdamW(Optimizer):
    name, label = "adamw", "AdamW"
    aliases = ("adamw_torch",)
    description = "two fp32 moments"

    @classmethod
    def build(cls, groups, lr, eps):
        """torch's AdamW, fused on CUDA (one kernel launch for all parameters, the fastest there), foreach
        elsewhere."""
        params = [p for g in groups for p in g["params"]]
        impl = {"fused": True} if params and all(p.is_cuda for p in params) else {"foreach": True}
        return torch.optim.AdamW(groups, lr=lr, eps=eps, **impl)

    @classmethod
    def state_bytes_per_param(cls, numel, trained_size=4):
        return 2 * trained_size

    @classmethod
    def state_bytes(cls, numels, trained_size=4):
        """Its two moments and a float32 step count per tensor."""
        numels = list(numels)
        return super().state_bytes(numels, trained_size) + 4 * len(numels)

    @classmethod
    def implementation(cls, optimizer):
        """fused, foreach or for-loop."""
        d = optimizer.defaults
        return "fused" if d.get("fused") else "foreach" if d.get("foreach") else "for-loop"


class AdamW8bit(Optimizer):
    name, label = "adamw8bit", "AdamW8bit"
    aliases = ("adamw_8bit", "adamw_bnb_8bit")
    description = "bitsandbytes' 8-bit moments"
    accuracy_cost = 1

    @classmethod
    def require(cls):
        require_bitsandbytes(f"--optimizer {cls.name}")

    @classmethod
    def build(cls, groups, lr, eps):
        return getattr(require_bitsandbytes(f"--optimizer {cls.name}").optim, cls.label)(groups, lr=lr, eps=eps)

    @classmethod
    def state_bytes_per_param(cls, numel, trained_size=4):
        """Two uint8 moments and a float32 absmax per block for each; a small tensor's two float32 moments."""
        return 8.0 if numel < MIN_8BIT_SIZE else 2 + 2 * 4 / STATE_BLOCK

    @classmethod
    def state_bytes(cls, numels, trained_size=4):
        """Its moments and an 8-bit tensor's two code maps (its step count is an int, no tensor)."""
        numels = list(numels)
        return super().state_bytes(numels, trained_size) + QMAP_BYTES * sum(n >= MIN_8BIT_SIZE for n in numels)


class PagedAdamW8bit(AdamW8bit):
    """AdamW8bit whose state bitsandbytes pages to host memory under CUDA's unified memory when the card is full."""

    name, label = "paged-adamw8bit", "PagedAdamW8bit"
    aliases = ("paged_adamw_8bit",)
    description = "bitsandbytes' 8-bit moments, paged to host memory"
    needs_cuda = True  # bitsandbytes pages through CUDA's unified memory: elsewhere it would run unpaged
    instead = AdamW8bit.name


_REGISTRY = Registry("optimizer", Optimizer)


def register_optimizer(cls: type[Optimizer]) -> type[Optimizer]:
    """Add an optimizer: its name and aliases resolve to it from then on (usable as a class decorator)."""
    return _REGISTRY.add(cls)


for _cls in (AdamW, AdamW8bit, PagedAdamW8bit):
    register_optimizer(_cls)
OPTIMIZERS = _REGISTRY.names()  # the optimizers tier_utils ships
DEFAULT_OPTIMIZER = AdamW  # what a run builds unless told otherwise (MemorySettings' default)


def canonical_optimizer(requested) -> str:
    """A registered optimizer's name from any spelling of it, or from its class; an unknown one is a one-line
    ValueError."""
    return _REGISTRY.canonical(requested)


def optimizer_class(name) -> type[Optimizer]:
    """The class of an optimizer, by any spelling of its name."""
    return _REGISTRY[name]
