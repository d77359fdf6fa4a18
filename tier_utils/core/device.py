"""The device, read in one place: what a decision may know about the hardware a run is on.

Every decision that depends on the hardware (auto precision and its reason, native and SKIP decisions, the
planner's budget and GPU columns, the notebooks' preset) asks `device_facts(device)`, never torch.cuda or
/proc/cpuinfo itself. Two overrides make every branch testable on one CPU:

- TIER_UTILS_CPU_FLAGS (comma-separated) replaces the CPU's detected flags: `TIER_UTILS_CPU_FLAGS=` is a CPU with
  neither native bf16 nor fp16, `TIER_UTILS_CPU_FLAGS=avx512_bf16` one with bf16 only.
- TIER_UTILS_GPU_PROFILE=T4 (a key of GPU_PROFILES) makes decisions read that card: its capability, memory and
  tensor cores. Tensors stay where they are (on a CPU, on the CPU); only what is decided changes, and every
  reason says it came from the profile.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

CPU_FLAGS_ENV = "TIER_UTILS_CPU_FLAGS"
GPU_PROFILE_ENV = "TIER_UTILS_GPU_PROFILE"
# Flags that decide low-precision support on a CPU.
_PRECISION_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16", "avx512f", "avx2"})
# The first compute capability with tensor cores for each type: Volta (7.0) fp16, Ampere (8.0) bf16, Ada (8.9)
# fp8. A T4 (7.5) runs bf16, but emulated: torch.cuda.is_bf16_supported() says True there, so ask the capability.
TENSOR_CORES_FROM = {"fp16": (7, 0), "bf16": (8, 0), "fp8": (8, 9)}
_TYPE_KEY = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def dtype_name(dtype: torch.dtype) -> str:
    """fp32 / bf16 / fp16 (fp64), the short names results use; torch's own name for any other."""
    return _SHORT.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class GpuProfile:
    """One card as the driver reports it: name, compute capability and memory (MiB)."""

    key: str  # what TIER_UTILS_GPU_PROFILE names it by
    name: str  # as torch.cuda.get_device_name says it
    capability: tuple[int, int]
    memory_mib: int
    label: str = ""  # the planner's column name, as the card is sold (e.g. "T4 16 GB")

    @property
    def tensor_cores(self) -> frozenset[str]:
        """The low-precision types this card has tensor cores for (fp16, bf16, fp8)."""
        return frozenset(t for t, cc in TENSOR_CORES_FROM.items() if self.capability >= cc)

    def has(self, kind: str) -> bool:
        return kind in self.tensor_cores


# The cards users open the notebooks on, as their drivers report them.
GPU_PROFILES = {p.key: p for p in (
    GpuProfile("T4", "Tesla T4", (7, 5), 15360, "T4 16 GB"),
    GpuProfile("L4", "NVIDIA L4", (8, 9), 23034, "L4 24 GB"),
    GpuProfile("A100-40GB", "NVIDIA A100-SXM4-40GB", (8, 0), 40960, "A100 40 GB"),
    GpuProfile("A100-80GB", "NVIDIA A100-SXM4-80GB", (8, 0), 81920, "A100 80 GB"),
    GpuProfile("H100", "NVIDIA H100 80GB HBM3", (9, 0), 81559, "H100 80 GB"),
    GpuProfile("H200", "NVIDIA H200", (9, 0), 143771, "H200 141 GB"),
)}


def gpu_profile(key: str) -> GpuProfile:
    """A profile by its key, case-insensitive; a one-line ValueError naming the keys otherwise."""
    found = {k.lower(): p for k, p in GPU_PROFILES.items()}.get(str(key).strip().lower())
    if found is None:
        raise ValueError(f"unknown GPU profile {key!r}; use one of: {', '.join(GPU_PROFILES)}")
    return found


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
    """CPU feature flags that matter for low precision: TIER_UTILS_CPU_FLAGS if set, else Linux's /proc/cpuinfo
    (empty elsewhere). Read at each call, so a test or notebook can switch profiles."""
    override = os.environ.get(CPU_FLAGS_ENV)
    if override is not None:
        return frozenset(f.strip() for f in override.split(",") if f.strip())
    return _detected_cpu_flags()


def cpu_name() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine() or "cpu"


@dataclass(frozen=True)
class DeviceFacts:
    """What decisions know about one device: where its tensors live (`device`) and the hardware they are decided
    for (`kind`: "cuda" for a real card or a GPU profile, else the device's type)."""

    device: torch.device
    kind: str
    name: str
    gpu: GpuProfile | None = None  # the card decided for: the real one's facts, or the profile's
    profiled: bool = False  # the card is TIER_UTILS_GPU_PROFILE's, not the one the tensors are on
    tensors_on: str = ""  # the hardware the tensors are on, by name, where it is not `name` (under a profile)

    @property
    def measured_on(self) -> str:
        """The hardware a figure measured here was measured on: under a profile, the real one, not the card."""
        return self.tensors_on or self.name

    @property
    def is_gpu(self) -> bool:
        return self.gpu is not None

    @property
    def total_bytes(self) -> int | None:
        """The card's memory (None on a CPU)."""
        return None if self.gpu is None else self.gpu.memory_mib << 20

    def describe(self) -> str:
        """The card in words: e.g. "Tesla T4 (compute capability 7.5)", "... (profile TIER_UTILS_GPU_PROFILE=T4)"."""
        if self.gpu is None:
            return self.name
        cc = f"compute capability {self.gpu.capability[0]}.{self.gpu.capability[1]}"
        return f"{self.name} ({cc}" + (f", profile {GPU_PROFILE_ENV}={self.gpu.key})" if self.profiled else ")")

    def dtype_support(self, dtype: torch.dtype) -> tuple[bool, str]:
        """Whether this device computes in `dtype` natively, and why (one line): the rule every mode shares."""
        key = _TYPE_KEY.get(dtype)
        if key is None:
            return True, f"{dtype_name(dtype)} runs everywhere"
        if self.gpu is not None:
            if self.gpu.has(key):
                return True, f"{self.describe()} has {key} tensor cores"
            need = TENSOR_CORES_FROM[key]
            return False, (f"{self.describe()} has no {key} tensor cores (they start at compute capability "
                           f"{need[0]}.{need[1]}); {key} is emulated and slow")
        if self.kind == "cpu":
            wanted = {"avx512_bf16", "amx_bf16"} if key == "bf16" else {"avx512_fp16", "amx_fp16"}
            found = sorted(cpu_flags() & wanted)
            if found:
                return True, f"this CPU has native {key} ({', '.join(found)})"
            if key == "bf16":
                return False, "this CPU has no avx512_bf16/AMX; bf16 is emulated and usually slower than fp32"
            return False, "this CPU has no avx512_fp16/AMX-fp16; fp16 is emulated and slower than fp32"
        return False, f"no native {key} rule for device type {self.kind!r}"

    def to_dict(self) -> dict:
        facts = {"device": str(self.device), "device_kind": self.kind, "device_name": self.name}
        if self.gpu is not None:
            cc = self.gpu.capability
            facts.update({"compute_capability": f"{cc[0]}.{cc[1]}", "gpu_memory_bytes": self.total_bytes,
                          "tensor_cores": ", ".join(sorted(self.gpu.tensor_cores))})
            if self.profiled:
                facts["gpu_profile"] = f"{self.gpu.key} (set by {GPU_PROFILE_ENV}; tensors on {self.measured_on})"
        else:
            facts["cpu_flags"] = ", ".join(sorted(cpu_flags())) or "none detected"
            if CPU_FLAGS_ENV in os.environ:
                facts["cpu_flags"] += f" (set by {CPU_FLAGS_ENV})"
        return facts


def device_name(device) -> str:
    """The name of the hardware `device`'s tensors are on (a run's figures were measured there)."""
    return device_facts(device).measured_on


def predicted_facts(card: GpuProfile) -> DeviceFacts:
    """The facts of a card the planner predicts for, with no tensor on it (its GPU columns)."""
    return DeviceFacts(torch.device("cuda"), "cuda", card.name, card)


def device_facts(device) -> DeviceFacts:
    """The one reader of the hardware: TIER_UTILS_GPU_PROFILE's card if set, else the CUDA card `device` is on,
    else the CPU (its flags: TIER_UTILS_CPU_FLAGS or /proc/cpuinfo). Facts already read come back as they are."""
    if isinstance(device, DeviceFacts):
        return device
    dev = torch.device(device)
    profile = os.environ.get(GPU_PROFILE_ENV)
    if profile:
        card = gpu_profile(profile)
        return DeviceFacts(dev, "cuda", card.name, card, profiled=True, tensors_on=_real_facts(dev).name)
    return _real_facts(dev)


def _real_facts(dev: torch.device) -> DeviceFacts:
    """The facts of the hardware `dev` is on, whatever profile is set."""
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        card = GpuProfile("this GPU", props.name, (props.major, props.minor), props.total_memory >> 20, props.name)
        return DeviceFacts(dev, "cuda", props.name, card)
    return DeviceFacts(dev, dev.type, cpu_name() if dev.type == "cpu" else dev.type)
