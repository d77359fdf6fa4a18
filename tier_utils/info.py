"""`info`: the device (with the torch thread count and why), the precision decision with its reason, and a
model summary."""
from __future__ import annotations

import os
from dataclasses import dataclass

import pandas as pd
import torch

from .adapter import resolve_model
from .files import jsonable, write_json
from .models import DEFAULT_MODEL
from .precision import CPU_FLAGS_ENV, cpu_flags, native_support, resolve_device, resolve_precision
from .results import run_metadata


@dataclass
class InfoResult:
    environment: dict
    precision: dict
    model: dict

    @property
    def table(self) -> pd.DataFrame:
        rows = [(s, k, v) for s in ("environment", "precision", "model") for k, v in getattr(self, s).items()]
        return pd.DataFrame(rows, columns=["section", "key", "value"])

    def to_json(self) -> dict:
        return jsonable({"environment": self.environment, "precision": self.precision, "model": self.model})

    def save_json(self, path):
        return write_json(path, self.to_json())

    def _repr_html_(self) -> str:
        return self.table._repr_html_()


def info(model=DEFAULT_MODEL, precision: str = "auto", device=None, **model_kwargs) -> InfoResult:
    dev = resolve_device(device)
    env = run_metadata(dev)
    if dev.type == "cuda":
        cc = torch.cuda.get_device_capability(dev)
        env["compute_capability"] = f"{cc[0]}.{cc[1]}"
        env["gpu_memory_bytes"] = torch.cuda.get_device_properties(dev).total_memory
    else:
        env["cpu_flags"] = ", ".join(sorted(cpu_flags())) or "none detected"
        if CPU_FLAGS_ENV in os.environ:
            env["cpu_flags"] += f" (set by {CPU_FLAGS_ENV})"
    for name in ("bf16", "fp16"):
        env[f"native_{name}"] = native_support(name, dev)[0]
    adapter = resolve_model(model, **model_kwargs)
    # The environment section names the device once; the precision section says what was decided on it.
    decided = {k: v for k, v in resolve_precision(precision, dev).to_dict().items()
               if k not in ("device", "device_name")}
    return InfoResult(env, decided, adapter.summary())
