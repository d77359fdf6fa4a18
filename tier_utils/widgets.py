"""The notebooks' panel: ipywidgets that edit a `RunConfig` (run_config.py) in place.

The panel's observers only write into the config; nothing runs until a run cell reads it.
What the user changed in a widget the panel keeps on itself (`choices`); a panel made with an earlier one
(`config_panel(cfg, earlier=panel)`, as the notebooks' panel cell does) starts from those choices, so re-running
the parameters and panel cells (or Run All) keeps them instead of the parameters cell's default. A headless run
(nbval, papermill) never touches a widget, so its parameters always win. Only APIs common to ipywidgets 7.7 (Colab)
and 8.x are used.
"""
from __future__ import annotations

import html

import ipywidgets as widgets

from .core.memory_settings import MEMORY_CHOICES
from .core.precision import canonical_precision, resolve_precision, supported_precisions
from .engine.schedules import SCHEDULES
from .models.builtins import BUILTIN_MODELS
from .models.heads import spec_task
from .run_config import MAX_BATCH_SIZE, RunConfig
from .tasks import CAUSAL_LM

PANEL_FIELDS = ("model", "data", "precision", "batch_size", "compile", "memory", "activation_checkpointing", "schedule",
                "shuffle")

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

    def __init__(self, config: RunConfig, models=None, tier: str | None = None, earlier: ConfigPanel | None = None):
        if tier is not None and tier not in TIER_BOXES:
            raise ValueError(f"tier must be one of {', '.join(TIER_BOXES)} (or None: every box), got {tier!r}")
        # What the user set through this panel (or the earlier one it continues), by RunConfig field.
        self.choices = dict(earlier.choices) if earlier is not None else {}
        kept = {k: v for k, v in self.choices.items() if getattr(config, k) != v}
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
        self.data_input = _path_box("data", config.data or "", ["synthetic"], CAUSAL_LM.data_hint, style)
        self.precision_select = widgets.Dropdown(options=precisions, value=current, description="precision",
                                                 style=style)
        self.batch_size_input = widgets.BoundedIntText(value=config.batch_size, min=1, max=MAX_BATCH_SIZE,
                                                       description="batch size", style=style)
        self.compile_box = widgets.Checkbox(value=config.compile, description="torch.compile", style=style)
        self.checkpointing_box, self.memory_select, self.schedule_select, self.shuffle_box = \
            _training_boxes(config, style)
        self._filling = False  # the size boxes being filled from a built-in's sizes (not the user setting one)
        self.decision = widgets.HTML()
        self.status = widgets.HTML()
        self._show_sizes()
        boxes = {"model": self.model_select, "data": self.data_input, "precision": self.precision_select,
                 "batch_size": self.batch_size_input, "compile": self.compile_box,
                 "memory": self.memory_select, "activation_checkpointing": self.checkpointing_box,
                 "schedule": self.schedule_select, "shuffle": self.shuffle_box}
        for name, widget in boxes.items():
            widget.observe(self._set(name), names="value")
        for widget in self.size_inputs.values():
            widget.observe(self._set_size, names="value")
        self._show_decision()
        self._show_task(quiet=True)
        if kept:
            shown = ", ".join(f"{k}={v}" for k, v in kept.items())
            self._say(f"kept your earlier panel choice ({shown}) over the parameters cell; "
                      "<code>del panel</code> and re-running this cell drops it")
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
            self.choices[attribute] = value
            if attribute == "model":  # sizes and a tokenizer set for the old model: the new one brings its own
                for owned in ("model_kwargs", "tokenizer"):
                    setattr(self.config, owned, None)
                    self.choices[owned] = None
                self._show_sizes()
            self._changed(attribute, change["new"])
        return write

    def _set_size(self, change):
        if self._filling:
            return
        self.config.model_kwargs = {**self.config.model_arguments(), change["owner"].description: change["new"]}
        self.choices["model_kwargs"] = dict(self.config.model_kwargs)
        self._changed(change["owner"].description, change["new"])

    def _changed(self, name: str, value) -> None:
        self._show_decision()
        self._say(f"{name} is now {html.escape(str(value))}: outputs below are from the old "
                  "settings; re-run from the cell after this panel (Run ▸ Run Selected Cell and All Below)")
        self._show_task()  # the task line stays under every change (typing the data replaced it)

    def _show_sizes(self) -> None:
        """The size boxes for a built-in, filled with its sizes; hidden for any other spec (no known sizes)."""
        builtin = self.config.model in BUILTIN_MODELS
        self.sizes.layout.display = None if builtin else "none"
        self._filling = True  # filling the boxes is not the user setting a size
        try:
            for key, box in self.size_inputs.items():
                box.value = self.config.model_arguments().get(key) or self.config.preset.model_kwargs[key]
        finally:
            self._filling = False
    def _show_task(self, quiet: bool = False) -> None:
        """The task the model typed in runs as, and the data that task reads (the data box's hint); said unless
        `quiet` (the panel's first showing) or the spec only tells once it loads."""
        task = spec_task(self.config.model)
        self.data_input.placeholder = (task or CAUSAL_LM).data_hint
        if task is not None and not quiet:
            self.status.value += (f"<br><small>{html.escape(self.config.model)} runs as {task.name}: data "
                                  f"{html.escape(task.data_hint)}</small>")

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


def _training_boxes(config: RunConfig, style: dict) -> tuple:
    """The boxes only training reads: activation checkpointing, the memory modes (what train, the benchmark and the
    search run with: docs/precision.md), the LR schedule and shuffling."""
    checkpointing = widgets.Checkbox(value=config.activation_checkpointing, style=style,
                                     description="activation checkpointing")
    # ipywidgets 7.7: Dropdown's options as (label, value) pairs. A MemorySettings given in code shows as its own
    # entry.
    options = [(label, name) for name, label in MEMORY_CHOICES.items()]
    if config.memory not in MEMORY_CHOICES:
        options.append((str(config.memory), config.memory))
    memory = widgets.Dropdown(options=options, value=config.memory, description="memory", style=style)
    schedule = widgets.Dropdown(options=list(SCHEDULES), value=config.schedule, description="LR schedule",
                                style=style)
    shuffle = widgets.Checkbox(value=config.shuffle, description="shuffle the rows each epoch", style=style)
    return checkpointing, memory, schedule, shuffle


def config_panel(config: RunConfig, models=None, tier: str | None = None,
                 earlier: ConfigPanel | None = None) -> ConfigPanel:
    """A widget box editing `config` in place: model (a built-in, or any spec typed in; a built-in's sizes show
    under it), data (empty: the bundled corpus), precision (auto + the modes the device runs natively, from
    `supported_precisions`), batch size, torch.compile on/off, and memory: full fine-tune, LoRA, QLoRA (4-bit
    base) or the 8-bit optimizer, and activation checkpointing on/off. `tier` ("smoke", "analysis", "train")
    shows only the boxes that tier's cells read. `models` overrides the model choices offered. `earlier`: the
    panel this cell made before (a notebook passes `globals().get("panel")`): the choices the user made in it
    are applied to `config` first and kept on the new panel."""
    return ConfigPanel(config, models, tier, earlier)
