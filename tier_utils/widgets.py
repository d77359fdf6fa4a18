"""The notebooks' settings: a `RunConfig` object and an ipywidgets panel that edits it.

The panel's observers only write into the config; nothing runs until a run cell reads it.
Once the user changes a widget, the panel is the source of truth for this kernel: re-running
the parameters and panel cells (or Run All) keeps that choice instead of the parameters cell's
default. A headless run (nbval, papermill) never touches a widget, so its parameters always win.
Only APIs common to ipywidgets 7.7 (Colab) and 8.x are used.
"""
from __future__ import annotations

import html
from dataclasses import asdict, dataclass, replace

import ipywidgets as widgets
import torch

from .analysis import AnalysisConfig
from .benchmark.config import BenchConfig
from .core.precision import canonical_precision, resolve_device, resolve_precision, supported_precisions
from .core.settings import check_fields, check_switch, setting
from .engine.lora import LoraSettings, lora_setting
from .models.builtins import BUILTIN_MODELS, DEFAULT_MODEL
from .models.loading import load_model
from .planning.planner import FitConfig
from .presets import Preset, notebook_preset
from .smoketest.suite import SmokeConfig
from .training.config import TrainConfig
from .tuning.study import SearchConfig

MAX_BATCH_SIZE = 4096
PANEL_FIELDS = ("model", "data", "precision", "batch_size", "compile")

# What the user set through a panel in this kernel, by RunConfig field: a later panel starts from it.
_user_choices: dict[str, object] = {}


def forget_panel_choices() -> None:
    """Drop the choices kept from earlier panels: the next panel starts from the parameters cell."""
    _user_choices.clear()


@dataclass
class RunConfig:
    """What a notebook's run cells read: the model spec and its sizes, the data, precision, batch size, lengths,
    and whether to torch.compile; `smoke_config()`, `analysis_config()`, `train_config()`, `bench_config()`,
    `fit_config()` and `search_config()` hand each tier its own config from them, so a run cell passes one object
    and copies no setting by hand.

    `model_kwargs`, `batch_size`, `seq_len` and `max_steps` left at None come from the device's notebook preset
    (`presets.NOTEBOOK`; model_kwargs only for the built-in models, whose size arguments are known). The other
    defaults are the tiers' own."""

    model: str = DEFAULT_MODEL  # any load_model spec: a built-in, a save_pretrained folder, hf:ORG/NAME, a checkpoint
    model_kwargs: dict | None = None
    tokenizer: str | None = None  # None: the model's own (bytes for built-ins)
    data: str | None = None  # None: the bundled corpus; else a file, folder, table or hf-dataset:NAME
    precision: str = TrainConfig.precision
    batch_size: int | None = setting(None, low=1, high=MAX_BATCH_SIZE)
    seq_len: int | None = setting(None, low=1)
    max_steps: int | None = setting(None, low=1)
    device: str | None = TrainConfig.device
    seed: int = TrainConfig.seed
    compile: bool = TrainConfig.compile
    # Memory modes, for train, the benchmark and search: checkpointing on/off; LoRA as a rank (0: off), a
    # "r=8,alpha=16" string or LoraSettings.
    activation_checkpointing: bool = TrainConfig.activation_checkpointing
    lora: LoraSettings | int | str | None = TrainConfig.lora

    def __post_init__(self):
        preset = self.preset
        if self.model_kwargs is None:
            self.model_kwargs = dict(preset.model_kwargs) if self.model in BUILTIN_MODELS else {}
        for name, value in (("batch_size", preset.batch_size), ("seq_len", preset.seq_len),
                            ("max_steps", preset.train.max_steps)):
            if getattr(self, name) is None:
                setattr(self, name, value)
        canonical_precision(self.precision)  # a bad spelling fails here, naming the valid ones
        check_switch(self, "compile")
        check_switch(self, "activation_checkpointing")
        self.lora = lora_setting(self.lora)
        check_fields(self)  # the panel's box holds at most MAX_BATCH_SIZE: it would clamp silently

    @property
    def preset(self) -> Preset:
        """The notebook preset of the device this config runs on: the lengths its tiers run for."""
        return notebook_preset(resolve_device(self.device).type)

    def build_model(self):
        """A fresh model from the spec, its initial weights fixed by `seed`: every run cell starts
        from the same weights, so re-running a cell with new settings compares like with like."""
        torch.manual_seed(self.seed)
        return load_model(self.model, tokenizer=self.tokenizer, **self.model_kwargs)

    def smoke_config(self, **given) -> SmokeConfig:
        """Tier 1 at one sequence and at this config's shape, precision and device; `given` on top."""
        return self._sized().smoke_config(**{**self._decided(), **given})

    def analysis_config(self, **given) -> AnalysisConfig:
        """Tier 2 over the preset's batches of this config's shape, at its precision and device; `given` on top."""
        return self._sized().analysis_config(**{**self._decided(), **given})

    def train_config(self, **given) -> TrainConfig:
        """Training at this config's shape, precision, steps, device, seed and compile choice, with the preset's
        evaluation lengths; `given` TrainConfig fields (e.g. checkpoint_dir) on top."""
        return self._sized().train_config(**{**self._decided(), "max_steps": self.max_steps, "seed": self.seed,
                                             "compile": self.compile, **self._memory(), **given})

    def bench_config(self, **given) -> BenchConfig:
        """The benchmark at this config's shape and device, with the preset's repeats; with compile on, each
        precision runs eager and compiled, interleaved, so the table compares the two. `given` on top."""
        return self._sized().bench_config(**{"device": self.device, "compile": "both" if self.compile else "off",
                                             **self._memory(), **given})

    def fit_config(self, **given) -> FitConfig:
        """The fit planner at this config's length and device; `given` on top."""
        return self._sized().fit_config(**{"device": self.device, **given})

    def search_config(self, **given) -> SearchConfig:
        """A study whose trials train as `train_config()` does, but eager: compiling every short trial would cost
        more than the trial. `given` SearchConfig fields on top."""
        return SearchConfig(trial=self.train_config(compile=False), **given)

    def _sized(self) -> Preset:
        return replace(self.preset, batch_size=self.batch_size, seq_len=self.seq_len)

    def _memory(self) -> dict:
        return {"activation_checkpointing": self.activation_checkpointing, "lora": self.lora}

    def _decided(self) -> dict:
        return {"precision": self.precision, "device": self.device}

    def to_dict(self) -> dict:
        return asdict(self)


class ConfigPanel(widgets.VBox):
    """Model, precision, batch-size and compile controls bound to a RunConfig (see `config_panel`)."""

    def __init__(self, config: RunConfig, models=None):
        kept = {k: v for k, v in _user_choices.items() if getattr(config, k) != v}
        for name, value in kept.items():
            setattr(config, name, value)
        self.config = config
        names = list(models or BUILTIN_MODELS)
        if config.model not in names:
            names.insert(0, config.model)  # a custom spec from the parameters cell stays selectable
        precisions = ["auto"] + supported_precisions(config.device)
        current = canonical_precision(config.precision)
        if current not in precisions:
            precisions.append(current)  # e.g. fp16 forced on a CPU: shown, not silently replaced
        style = {"description_width": "90px"}
        # A combobox: pick a built-in or type any spec (a folder, hf:ORG/NAME, runs/x/checkpoints/last.pt).
        self.model_select = widgets.Combobox(options=names, value=config.model, description="model", style=style,
                                             ensure_option=False, placeholder="built-in, folder, hf:ORG/NAME, .pt")
        self.data_input = widgets.Combobox(options=["synthetic"], value=config.data or "", description="data",
                                           style=style, ensure_option=False,
                                           placeholder="bundled corpus; or a file, folder, hf-dataset:NAME")
        self.precision_select = widgets.Dropdown(options=precisions, value=current, description="precision",
                                                 style=style)
        self.batch_size_input = widgets.BoundedIntText(value=config.batch_size, min=1, max=MAX_BATCH_SIZE,
                                                       description="batch size", style=style)
        self.compile_box = widgets.Checkbox(value=config.compile, description="torch.compile", style=style)
        self.decision = widgets.HTML()
        self.status = widgets.HTML()
        for name, widget in zip(PANEL_FIELDS, (self.model_select, self.data_input, self.precision_select,
                                                  self.batch_size_input, self.compile_box)):
            widget.observe(self._set(name), names="value")
        self._show_decision()
        if kept:
            shown = ", ".join(f"{k}={v}" for k, v in kept.items())
            self._say(f"kept your earlier panel choice ({shown}) over the parameters cell; "
                      "<code>tier_utils.widgets.forget_panel_choices()</code> drops it")
        super().__init__([self.model_select, self.data_input, self.precision_select, self.batch_size_input,
                          self.compile_box, self.decision, self.status])

    def _set(self, attribute: str):
        def write(change):
            value = change["new"] if change["new"] != "" else None  # an emptied data box: the bundled corpus
            setattr(self.config, attribute, value)
            _user_choices[attribute] = value
            self._show_decision()
            self._say(f"{attribute} is now {html.escape(str(change['new']))}: outputs below are from the old "
                      "settings; re-run from the cell after this panel (Run ▸ Run Selected Cell and All Below)")
        return write

    def _say(self, text: str) -> None:
        self.status.value = f"<small><b>{text}</b></small>"

    def _show_decision(self) -> None:
        # Resolving is a lookup of device rules, not a run; warn=False because the user is only browsing.
        decision = resolve_precision(self.config.precision, self.config.device, warn=False)
        self.decision.value = f"<small>{html.escape(decision.reason)}</small>"

    def __repr__(self) -> str:
        # What a notebook shows where the widget can't render (saved outputs without widget state,
        # a terminal): the settings, short enough for ipywidgets 7's 110-character plain-text cut.
        c = self.config
        ran = resolve_precision(c.precision, c.device, warn=False).name
        return f"settings: model {c.model} · precision {c.precision} → {ran} · batch size {c.batch_size}"


def config_panel(config: RunConfig, models=None) -> ConfigPanel:
    """A widget box editing `config` in place: model (a built-in, or any spec typed in), data (empty: the
    bundled corpus), precision (auto + what the device runs natively), batch size, torch.compile on/off.
    `models` overrides the model choices offered. Choices the user made in an earlier panel of this kernel
    are applied to `config` first (see `forget_panel_choices`)."""
    return ConfigPanel(config, models)
