"""The notebooks' settings: a `RunConfig` object and an ipywidgets panel that edits it.

The panel's observers only write into the config; nothing runs until a run cell reads it.
So "change a widget, re-run the run cell" uses the new values, and "Run all" uses the
parameters cell's defaults. Only APIs common to ipywidgets 7.7 (Colab) and 8.x are used.
"""
from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field

import ipywidgets as widgets
import torch

from .models import BUILTIN_MODELS, DEFAULT_MODEL, load_model
from .precision import canonical_precision, resolve_precision, supported_precisions
from .results import whole_number

MAX_BATCH_SIZE = 4096


@dataclass
class RunConfig:
    """What a notebook's run cells read: the model spec and its sizes, precision, batch size, lengths,
    and whether to torch.compile (train(compile=...), amp_benchmark(compile="both" or False))."""

    model: str = DEFAULT_MODEL
    model_kwargs: dict = field(default_factory=dict)
    precision: str = "auto"
    batch_size: int = 8
    seq_len: int = 64
    max_steps: int = 20
    device: str | None = None
    seed: int = 0
    compile: bool = False

    def __post_init__(self):
        canonical_precision(self.precision)  # a bad spelling fails here, naming the valid ones
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile must be True or False, got {self.compile!r}")
        for name in ("batch_size", "seq_len", "max_steps"):
            whole_number(getattr(self, name), name)
        if self.batch_size > MAX_BATCH_SIZE:  # the panel's box could not show it; it would clamp silently
            raise ValueError(f"batch_size must be <= {MAX_BATCH_SIZE}, got {self.batch_size}")

    def build_model(self):
        """A fresh model from the spec, its initial weights fixed by `seed`: every run cell starts
        from the same weights, so re-running a cell with new settings compares like with like."""
        torch.manual_seed(self.seed)
        return load_model(self.model, **self.model_kwargs)

    def to_dict(self) -> dict:
        return asdict(self)


class ConfigPanel(widgets.VBox):
    """Model, precision, batch-size and compile controls bound to a RunConfig (see `config_panel`)."""

    def __init__(self, config: RunConfig, models=None):
        self.config = config
        names = list(models or BUILTIN_MODELS)
        if config.model not in names:
            names.insert(0, config.model)  # a custom spec from the parameters cell stays selectable
        precisions = ["auto"] + supported_precisions(config.device)
        current = canonical_precision(config.precision)
        if current not in precisions:
            precisions.append(current)  # e.g. fp16 forced on a CPU: shown, not silently replaced
        style = {"description_width": "90px"}
        self.model_select = widgets.Dropdown(options=names, value=config.model, description="model", style=style)
        self.precision_select = widgets.Dropdown(options=precisions, value=current, description="precision",
                                                 style=style)
        self.batch_size_input = widgets.BoundedIntText(value=config.batch_size, min=1, max=MAX_BATCH_SIZE,
                                                       description="batch size", style=style)
        self.compile_box = widgets.Checkbox(value=config.compile, description="torch.compile", style=style)
        self.decision = widgets.HTML()
        self.model_select.observe(self._set("model"), names="value")
        self.precision_select.observe(self._set("precision"), names="value")
        self.precision_select.observe(lambda change: self._show_decision(), names="value")
        self.batch_size_input.observe(self._set("batch_size"), names="value")
        self.compile_box.observe(self._set("compile"), names="value")
        self._show_decision()
        super().__init__([self.model_select, self.precision_select, self.batch_size_input, self.compile_box,
                          self.decision])

    def _set(self, attribute: str):
        def write(change):
            setattr(self.config, attribute, change["new"])
        return write

    def _show_decision(self) -> None:
        # Resolving is a lookup of device rules, not a run; warn=False because the user is only browsing.
        decision = resolve_precision(self.config.precision, self.config.device, warn=False)
        self.decision.value = f"<small>{html.escape(decision.reason)}</small>"


def config_panel(config: RunConfig, models=None) -> ConfigPanel:
    """A widget box editing `config` in place: model (built-ins), precision (auto + what the device runs
    natively), batch size, torch.compile on/off. `models` overrides the model choices."""
    return ConfigPanel(config, models)
