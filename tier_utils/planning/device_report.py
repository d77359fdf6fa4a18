"""`info`: the device (with the torch thread count and why), the precision decision with its reason, and a
model summary."""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd
import torch

from ..adapter.adapter import resolve_model
from ..core.device import device_facts
from ..core.display import html_table
from ..core.files import jsonable, write_json
from ..core.precision import (
    Precision,
    autocast_precisions,
    native_support,
    precision_setting,
    resolve_device,
    resolve_precision,
)
from ..core.results import run_metadata
from ..core.settings import check_fields, device_field, merge, precision_field
from ..core.threads import chooses_threads
from ..models.builtins import DEFAULT_MODEL


@dataclass
class InfoConfig:
    """The device `info` describes and the precision it decides there."""

    precision: str | Precision = precision_field()
    device: str | torch.device | None = device_field()

    def __post_init__(self):
        self.precision = precision_setting(self.precision)
        check_fields(self)


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
        return html_table(self.table.set_index(["section", "key"]))  # as every result shows: blanks, rounding


@chooses_threads  # the run's torch thread count, chosen as it starts
def info(model=DEFAULT_MODEL, config: InfoConfig | dict | None = None, *, model_kwargs: dict | None = None,
         **overrides) -> InfoResult:
    """The device, the precision decided on it and a summary of `model` (a load_model spec is built with
    `model_kwargs`). config / overrides: an InfoConfig (or dict) and/or its field names as keywords."""
    cfg = merge(InfoConfig, config, overrides, "info")
    dev = resolve_device(cfg.device)
    facts = device_facts(dev)
    env = run_metadata(dev)
    env.update({k: v for k, v in facts.to_dict().items() if k not in env})  # the card (or CPU flags) decided for
    for name in autocast_precisions():
        env[f"native_{name}"] = native_support(name, facts)[0]
    adapter = resolve_model(model, **(model_kwargs or {}))
    # The environment section names the device once; the precision section says what was decided on it.
    decided = {k: v for k, v in resolve_precision(cfg.precision, dev).to_dict().items()
               if k not in ("device", "device_name")}
    return InfoResult(env, decided, adapter.summary())
