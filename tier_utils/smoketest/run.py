"""What a tier 1 check group reads, and what it finds besides its rows.

A group (checks.py, memory_grid.py) is a generator taking (adapter, run): `run` is a frozen `SmokeRun` (the
precision, the budget, the grid, the model's summary) with what the groups before it found (`run.found`). It yields
its Check rows, and a `Found` for each piece of the report's plot and JSON data it made (gradient norms, latency
samples, memory entries, parameter statistics, the activation fit). `smoke` gathers both and builds the SmokeReport
once, complete: no group writes to a report.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from ..core.budget import ActivationFit, Budget
from ..core.precision import Precision


@dataclass(frozen=True)
class Found:
    """A group's data for the report: `name` is a SmokeReport field (grad_norms, latency, memory, parameters,
    activation_fit)."""

    name: str
    value: object


@dataclass(frozen=True)
class SmokeRun:
    """What every check group reads: decided before the first runs, the same for all, and what the groups before
    this one found (`found`, by SmokeReport field)."""

    precision: Precision
    metadata: dict
    model: dict  # the adapter's summary, taken before any sharding
    batch_sizes: tuple[int, ...]
    seq_lens: tuple[int, ...]
    budget: Budget | None = None
    sharding: str | None = None  # strategy="fsdp": how the model was sharded
    found: Mapping = field(default_factory=lambda: MappingProxyType({}))

    @property
    def activation_fit(self) -> ActivationFit | None:
        """The fit of saved bytes by (B, T) a group before measured (memory, latency: whichever runs first)."""
        return self.found.get("activation_fit")
