"""The notebooks' settings: a `RunConfig` object and an ipywidgets panel that edits it.

The panel's observers only write into the config; nothing runs until a run cell reads it.
Once the user changes a widget, the panel is the source of truth for this kernel: re-running
the parameters and panel cells (or Run All) keeps that choice instead of the parameters cell's
default. A headless run (nbval, papermill) never touches a widget, so its parameters always win.
Only APIs common to ipywidgets 7.7 (Colab) and 8.x are used.
"""
from __future__ import annotations

import html
from dataclasses import asdict, dataclass, fields, replace

import ipywidgets as widgets
import torch

from .analysis import AnalysisConfig
from .benchmark.config import BenchConfig
from .core.memory_settings import MEMORY_CHOICES, MemorySettings, memory_setting
from .core.precision import canonical_precision, resolve_device, resolve_precision, supported_precisions
from .core.settings import check_fields, check_switch, setting
from .models.builtins import BUILTIN_MODELS, DEFAULT_MODEL
from .models.loading import load_model
from .planning.planner import FitConfig
from .planning.ranks import RanksConfig
from .presets import Preset, notebook_preset
from .smoketest.suite import SmokeConfig
from .training.config import TrainConfig
from .tuning.study import SearchConfig

MAX_BATCH_SIZE = 4096
PANEL_FIELDS = ("model", "data", "precision", "batch_size", "compile", "memory", "activation_checkpointing")

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
    defaults are the tiers' own. `model_kwargs` and `tokenizer` belong to the model they were set for: setting
    `model` later resets them to the new model's own (`own_kwargs()`; the model's own tokenizer)."""

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
    # Memory, for train, the benchmark and search: full, lora, qlora or adamw8bit (MEMORY_CHOICES), or
    # MemorySettings; checkpointing on/off on top.
    memory: str | MemorySettings = "full"
    activation_checkpointing: bool = MemorySettings.checkpointing

    def __post_init__(self):
        preset = self.preset
        if self.model_kwargs is None:
            self.model_kwargs = self.own_kwargs()
        for name, value in (("batch_size", preset.batch_size), ("seq_len", preset.seq_len),
                            ("max_steps", preset.train.max_steps)):
            if getattr(self, name) is None:
                setattr(self, name, value)
        canonical_precision(self.precision)  # a bad spelling fails here, naming the valid ones
        check_switch(self, "compile")
        check_switch(self, "activation_checkpointing")
        memory_setting(self.memory)  # a bad name fails here, naming the choices
        if isinstance(self.memory, str):
            self.memory = self.memory.strip().lower()  # the dropdown's value
        check_fields(self)  # the panel's box holds at most MAX_BATCH_SIZE: it would clamp silently

    def __setattr__(self, name, value):
        # A model's keyword arguments and tokenizer belong to the model they were set for (tiny-gpt's d_model means
        # nothing to a GPT-2 folder's from_pretrained): a new model starts from its own, its own tokenizer included.
        changed = name == "model" and "model" in self.__dict__ and value != self.model
        super().__setattr__(name, value)
        if changed:
            super().__setattr__("model_kwargs", self.own_kwargs())
            super().__setattr__("tokenizer", None)

    def own_kwargs(self) -> dict:
        """The model's own keyword arguments: the device preset's sizes for a built-in, none for any other spec."""
        return dict(self.preset.model_kwargs) if self.model in BUILTIN_MODELS else {}

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
        memory = self._memory()["memory"]  # checkpointing: the benchmark's extra rows
        return self._sized().bench_config(**{"device": self.device, "compile": "both" if self.compile else "off",
                                             "memory": replace(memory, checkpointing=False),
                                             "activation_checkpointing": memory.checkpointing, **given})

    def fit_config(self, **given) -> FitConfig:
        """The fit planner at this config's length and device; `given` on top."""
        return self._sized().fit_config(**{"device": self.device, **given})

    def ranks_config(self, **given) -> RanksConfig:
        """The per-rank planner at this config's length, precision and device; `given` on top."""
        return self._sized().ranks_config(**{**self._decided(), **given})

    def search_config(self, **given) -> SearchConfig:
        """A study whose trials train as `train_config()` does, but eager: compiling every short trial would cost
        more than the trial. `given` SearchConfig fields on top."""
        return SearchConfig(trial=self.train_config(compile=False), **given)

    def _sized(self) -> Preset:
        return replace(self.preset, batch_size=self.batch_size, seq_len=self.seq_len)

    def _memory(self) -> dict:
        return {"memory": memory_setting(self.memory, self.activation_checkpointing)}

    def _decided(self) -> dict:
        return {"precision": self.precision, "device": self.device}

    def to_dict(self) -> dict:
        return asdict(self)


# The boxes each tier's run cells read; None: every box.
TIER_BOXES = {"smoke": ("model", "precision", "batch_size"),
              "analysis": ("model", "data", "precision", "batch_size"),
              "train": PANEL_FIELDS}
_SIZES = ("d_model", "n_layer", "n_head")  # a built-in's size boxes (its max_len follows the sequence length)


def _path_box(description: str, value: str, options: list, placeholder: str, style: dict) -> widgets.Combobox:
    """A box wide enough for a path; it takes what was typed on Enter or on leaving it, not at every keystroke
    (a half-typed path is no spec)."""
    return widgets.Combobox(options=options, value=value, description=description, placeholder=placeholder,
                            ensure_option=False, continuous_update=False, style=style,
                            layout=widgets.Layout(width="100%", max_width="760px"))


class ConfigPanel(widgets.VBox):
    """Model, sizes, data, precision, batch size, compile and memory-mode controls bound to a RunConfig (see
    `config_panel`)."""

    def __init__(self, config: RunConfig, models=None, tier: str | None = None):
        if tier is not None and tier not in TIER_BOXES:
            raise ValueError(f"tier must be one of {', '.join(TIER_BOXES)} (or None: every box), got {tier!r}")
        order = [f.name for f in fields(RunConfig)]  # the model first: setting it resets its kwargs
        kept = {k: v for k, v in sorted(_user_choices.items(), key=lambda kv: order.index(kv[0]))
                if getattr(config, k) != v}
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
        self.model_select = _path_box("model", config.model, names, "built-in, save_pretrained folder, "
                                      "hf:ORG/NAME, runs/x/checkpoints/last.pt", style)
        self.size_inputs = {k: widgets.BoundedIntText(value=1, min=1, max=1 << 16, description=k, style=style,
                                                      layout=widgets.Layout(width="190px")) for k in _SIZES}
        self.sizes = widgets.HBox(list(self.size_inputs.values()))
        self.data_input = _path_box("data", config.data or "", ["synthetic"],
                                    "empty: the bundled corpus; or a file, folder, hf-dataset:NAME", style)
        self.precision_select = widgets.Dropdown(options=precisions, value=current, description="precision",
                                                 style=style)
        self.batch_size_input = widgets.BoundedIntText(value=config.batch_size, min=1, max=MAX_BATCH_SIZE,
                                                       description="batch size", style=style)
        self.compile_box = widgets.Checkbox(value=config.compile, description="torch.compile", style=style)
        # The memory modes: what train, the benchmark and the search run with (docs/precision.md).
        self.checkpointing_box = widgets.Checkbox(value=config.activation_checkpointing, style=style,
                                                  description="activation checkpointing")
        # ipywidgets 7.7: Dropdown's options as (label, value) pairs. A MemorySettings given in code shows as its
        # own entry.
        options = [(label, name) for name, label in MEMORY_CHOICES.items()]
        if config.memory not in MEMORY_CHOICES:
            options.append((str(config.memory), config.memory))
        self.memory_select = widgets.Dropdown(options=options, value=config.memory, description="memory",
                                              style=style)
        self.decision = widgets.HTML()
        self.status = widgets.HTML()
        self._show_sizes()
        boxes = {"model": self.model_select, "data": self.data_input, "precision": self.precision_select,
                 "batch_size": self.batch_size_input, "compile": self.compile_box,
                 "memory": self.memory_select, "activation_checkpointing": self.checkpointing_box}
        for name, widget in boxes.items():
            widget.observe(self._set(name), names="value")
        for widget in self.size_inputs.values():
            widget.observe(self._set_size, names="value")
        self._show_decision()
        if kept:
            shown = ", ".join(f"{k}={v}" for k, v in kept.items())
            self._say(f"kept your earlier panel choice ({shown}) over the parameters cell; "
                      "<code>tier_utils.widgets.forget_panel_choices()</code> drops it")
        shown = TIER_BOXES[tier] if tier else PANEL_FIELDS
        rows = [boxes[n] for n in shown]
        rows.insert(1, self.sizes)  # under the model box it belongs to
        super().__init__(rows + [self.decision, self.status])

    def _set(self, attribute: str):
        def write(change):
            value = change["new"] if change["new"] != "" else None  # an emptied data box: the bundled corpus
            if attribute == "model" and value is None:
                return  # a box being retyped: nothing to build yet
            setattr(self.config, attribute, value)
            _user_choices[attribute] = value
            if attribute == "model":  # its sizes and tokenizer went with the old model
                _user_choices.pop("model_kwargs", None)
                self._show_sizes()
            self._changed(attribute, change["new"])
        return write

    def _set_size(self, change):
        if self._filling:
            return
        self.config.model_kwargs = {**self.config.model_kwargs, change["owner"].description: change["new"]}
        _user_choices["model_kwargs"] = dict(self.config.model_kwargs)
        self._changed(change["owner"].description, change["new"])

    def _changed(self, name: str, value) -> None:
        self._show_decision()
        self._say(f"{name} is now {html.escape(str(value))}: outputs below are from the old "
                  "settings; re-run from the cell after this panel (Run ▸ Run Selected Cell and All Below)")

    def _show_sizes(self) -> None:
        """The size boxes for a built-in, filled with its sizes; hidden for any other spec (no known sizes)."""
        builtin = self.config.model in BUILTIN_MODELS
        self.sizes.layout.display = None if builtin else "none"
        self._filling = True  # filling the boxes is not the user setting a size
        try:
            for key, box in self.size_inputs.items():
                box.value = self.config.model_kwargs.get(key) or self.config.preset.model_kwargs[key]
        finally:
            self._filling = False
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


def config_panel(config: RunConfig, models=None, tier: str | None = None) -> ConfigPanel:
    """A widget box editing `config` in place: model (a built-in, or any spec typed in; a built-in's sizes show
    under it), data (empty: the bundled corpus), precision (auto + the modes the device runs natively, from
    `supported_precisions`), batch size, torch.compile on/off, and memory: full fine-tune, LoRA, QLoRA (4-bit
    base) or the 8-bit optimizer, and activation checkpointing on/off. `tier` ("smoke", "analysis", "train")
    shows only the boxes that tier's cells read. `models` overrides the model choices offered. Choices the user
    made in an earlier panel of this kernel are applied to `config` first (see `forget_panel_choices`)."""
    return ConfigPanel(config, models, tier)
