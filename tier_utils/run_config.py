"""The notebooks' settings: `RunConfig`, what a notebook's run cells read (the panel in widgets.py edits it).

Its tiers' configs are `Preset`'s own builders (presets.py), called on the device's notebook preset with this
config's choices stamped in (`tiers`): no tier's config is assembled here a second time.
"""
from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, replace

import torch

from .core.memory_settings import MemorySettings, memory_setting
from .core.precision import canonical_precision, resolve_device
from .core.settings import check_fields, check_switch, setting
from .models.builtins import BUILTIN_MODELS, DEFAULT_MODEL
from .models.heads import sized_to_data
from .models.loading import load_model
from .presets import Preset, notebook_preset
from .training.config import TrainConfig
from .tuning.study import SearchConfig

MAX_BATCH_SIZE = 4096


def _preset_builder(name: str):
    """RunConfig's `name`: `Preset.name` itself, called on this config's preset (`RunConfig.tiers`)."""
    def build(self, **given):
        return getattr(self.tiers, name)(**given)

    build.__name__ = build.__qualname__ = name
    build.__doc__ = (f"`Preset.{name}` on this config's preset (`tiers`): the device's lengths at this config's "
                     "shape, precision, device, steps, seed, compile choice and memory modes; `given` on top.")
    return build


@dataclass
class RunConfig:
    """What a notebook's run cells read: the model spec and its sizes, the data, precision, batch size, lengths,
    and whether to torch.compile; `smoke_config()`, `analysis_config()`, `train_config()`, `bench_config()`,
    `fit_config()`, `ranks_config()` (Preset's builders) and `search_config()` hand each tier its own config, so a
    run cell passes one object and copies no setting by hand.

    `batch_size`, `seq_len` and `max_steps` left at None come from the device's notebook preset
    (`presets.NOTEBOOK`). `model_kwargs` and `tokenizer` left at None mean the model's own, whichever model the
    config names when it is built (`build_model`: a built-in's preset sizes, no argument for any other spec; the
    model's own tokenizer), so a config for another model, by setting `model` or by
    `dataclasses.replace(cfg, model=...)`, carries nothing of the old one's. Given, they are used as given. The other
    defaults are the tiers' own."""

    model: str = DEFAULT_MODEL  # any load_model spec: a built-in, a save_pretrained folder, hf:ORG/NAME, a checkpoint
    model_kwargs: dict | None = None  # None: the model's own (`model_arguments()`)
    tokenizer: str | None = None  # None: the model's own (bytes for built-ins)
    data: str | None = None  # None: the bundled corpus; else a file, folder, table or hf-dataset:NAME
    precision: str = TrainConfig.precision
    batch_size: int | None = setting(None, low=1, high=MAX_BATCH_SIZE)
    seq_len: int | None = setting(None, low=1)
    max_steps: int | None = setting(None, low=1)
    device: str | None = TrainConfig.device
    seed: int = TrainConfig.seed
    compile: bool = TrainConfig.compile
    schedule: str = TrainConfig.schedule  # the LR after warm-up (engine/schedules.py): constant, linear, cosine, wsd
    shuffle: bool = TrainConfig.shuffle  # off: training reads the rows in the data's own order
    # Memory, for train, the benchmark and search: full, lora, qlora or adamw8bit (MEMORY_CHOICES), or
    # MemorySettings; checkpointing on/off on top.
    memory: str | MemorySettings = "full"
    activation_checkpointing: bool = MemorySettings.checkpointing

    def __post_init__(self):
        preset = self.preset
        for name, value in (("batch_size", preset.batch_size), ("seq_len", preset.seq_len),
                            ("max_steps", preset.train.max_steps)):
            if getattr(self, name) is None:
                setattr(self, name, value)
        canonical_precision(self.precision)  # a bad spelling fails here, naming the valid ones
        check_switch(self, "compile")
        check_switch(self, "shuffle")
        check_switch(self, "activation_checkpointing")
        memory_setting(self.memory)  # a bad name fails here, naming the choices
        if isinstance(self.memory, str):
            self.memory = self.memory.strip().lower()  # the dropdown's value
        check_fields(self)  # the panel's box holds at most MAX_BATCH_SIZE: it would clamp silently

    def model_arguments(self) -> dict:
        """The keyword arguments the model is built with: `model_kwargs` as given, else the model's own (the device
        preset's sizes a built-in takes: tiny-vit has no max_len, its length is its image side; none for any other
        spec: tiny-gpt's d_model means nothing to a GPT-2 folder's from_pretrained)."""
        if self.model_kwargs is not None:
            return dict(self.model_kwargs)
        if self.model not in BUILTIN_MODELS:
            return {}
        takes = inspect.signature(BUILTIN_MODELS[self.model]).parameters
        return {k: v for k, v in self.preset.model_kwargs.items() if k in takes}

    @property
    def preset(self) -> Preset:
        """The notebook preset of the device this config runs on: the lengths its tiers run for."""
        return notebook_preset(resolve_device(self.device))

    @property
    def tiers(self) -> Preset:
        """The device's preset with this config's choices in it, whose builders make each tier's config: its shape,
        precision and device; training's steps, seed, compile choice and memory modes; the benchmark's memory
        modes, and with compile on each precision eager and compiled, interleaved, so its table compares the two."""
        p, memory = self.preset, memory_setting(self.memory, self.activation_checkpointing)
        # Checkpointing is the benchmark's extra rows (each precision with and without it), the rest every row's.
        bench = replace(p.bench, compile="both" if self.compile else "off", memory=replace(memory, checkpointing=False),
                        activation_checkpointing=memory.checkpointing)
        return replace(p, batch_size=self.batch_size, seq_len=self.seq_len, precision=self.precision,
                       device=self.device, bench=bench,
                       train=replace(p.train, max_steps=self.max_steps, seed=self.seed, compile=self.compile,
                                     memory=memory, schedule=self.schedule, shuffle=self.shuffle))

    smoke_config = _preset_builder("smoke_config")
    analysis_config = _preset_builder("analysis_config")
    train_config = _preset_builder("train_config")
    bench_config = _preset_builder("bench_config")
    fit_config = _preset_builder("fit_config")
    ranks_config = _preset_builder("ranks_config")

    def search_config(self, **given) -> SearchConfig:
        """A study whose trials train as `train_config()` does, but eager: compiling every short trial would cost
        more than the trial. `given` SearchConfig fields on top."""
        return SearchConfig(trial=self.train_config(compile=False), **given)

    def build_model(self):
        """A fresh model from the spec, its initial weights fixed by `seed`: every run cell starts
        from the same weights, so re-running a cell with new settings compares like with like. Resolved with the
        data, as the CLI resolves it: a pretrained classifier's head follows the data's classes."""
        torch.manual_seed(self.seed)
        arguments = sized_to_data(self.model, self.model_arguments(), self.data)
        return load_model(self.model, tokenizer=self.tokenizer, **arguments)

    def to_dict(self) -> dict:
        return asdict(self)
