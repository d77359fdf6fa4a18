"""The notebooks' config panel: widgets write into a RunConfig, and the next run reads it."""
import dataclasses
from dataclasses import replace

import pytest
import torch

import tier_utils
from tier_utils import TrainConfig
from tier_utils.core.device import GPU_PROFILE_ENV
from tier_utils.core.memory_settings import LoraSettings, MemorySettings, memory_setting
from tier_utils.core.precision import supported_precisions
from tier_utils.presets import NOTEBOOK
from tier_utils.run_config import RunConfig
from tier_utils.training.loop import train
from tier_utils.widgets import ConfigPanel, config_panel


def test_panel_offers_builtins_auto_and_what_the_device_runs():
    panel = config_panel(RunConfig())
    assert isinstance(panel, ConfigPanel) and len(panel.children) == 12  # 9 boxes, the sizes, 2 lines of text
    assert list(panel.model_select.options) == list(tier_utils.BUILTIN_MODELS)
    assert list(panel.precision_select.options) == ["auto"] + supported_precisions()
    preset = NOTEBOOK[tier_utils.resolve_device().type]  # None = sized for the device
    assert panel.precision_select.value == "auto" and panel.batch_size_input.value == preset.batch_size
    assert panel.compile_box.value is False
    assert panel.decision.value.startswith("<small>auto: ")


def test_the_panel_takes_any_model_spec_and_a_data_choice(tmp_path):
    cfg = RunConfig()
    panel = config_panel(cfg)
    panel.model_select.value = "runs/x/checkpoints/last.pt"  # typed, not one of the offered built-ins
    panel.data_input.value = "hf-dataset:wikitext/wikitext-2-raw-v1"
    assert cfg.model == "runs/x/checkpoints/last.pt" and cfg.data == "hf-dataset:wikitext/wikitext-2-raw-v1"
    panel.data_input.value = ""
    assert cfg.data is None  # an emptied box: the bundled corpus


def test_on_a_t4_the_choices_are_fp32_and_the_fp16_modes_and_auto_says_fp16(monkeypatch):
    monkeypatch.setenv(GPU_PROFILE_ENV, "T4")  # decisions read a T4; the tensors stay on this CPU
    panel = config_panel(RunConfig(device="cpu"))
    assert list(panel.precision_select.options) == ["auto", "fp32", "fp16", "fp16-true"]  # no bf16(-true) on a T4
    assert "Tesla T4" in panel.decision.value and "GradScaler" in panel.decision.value


def test_a_setting_outside_the_choices_is_kept_not_replaced():
    cfg = RunConfig(model="my_model.py:Net", precision="16-mixed")
    panel = config_panel(cfg)
    assert panel.model_select.value == "my_model.py:Net" and panel.precision_select.value == "fp16"
    assert cfg.model == "my_model.py:Net"


def test_widgets_write_into_the_config_and_nothing_else():
    cfg = RunConfig(batch_size=8)
    panel = config_panel(cfg)
    panel.model_select.value = "tiny-encoder"
    panel.precision_select.value = "fp32"
    panel.batch_size_input.value = 3
    panel.compile_box.value = True
    assert (cfg.model, cfg.precision, cfg.batch_size, cfg.compile) == ("tiny-encoder", "fp32", 3, True)
    assert panel.decision.value == "<small>fp32 requested: fp32 runs everywhere</small>"
    panel.batch_size_input.value = 0  # BoundedIntText clamps to its minimum: no invalid batch reaches a run
    assert cfg.batch_size == 1


@pytest.mark.parametrize("bad,match", [(dict(precision="fp8"), "unknown precision"),
                                       (dict(batch_size=0), "batch_size must be a whole number >= 1"),
                                       (dict(batch_size=10_000), "batch_size must be a whole number >= 1 and <= 4096"),
                                       (dict(seq_len=2.5), "seq_len must be a whole number"),
                                       (dict(compile="yes"), "compile must be True or False")])
def test_bad_config_values_fail_with_the_fix(bad, match):
    with pytest.raises(ValueError, match=match):
        RunConfig(**bad)


def test_the_next_run_uses_the_changed_widget_values(tiny_kwargs):
    cfg = RunConfig(model_kwargs=tiny_kwargs, seq_len=16, max_steps=2)
    panel = config_panel(cfg)
    # auto resolves to something; pick an explicit choice that differs from it, then a new batch size.
    auto = tier_utils.resolve_precision("auto").name
    choice = next((p for p in panel.precision_select.options if p not in ("auto", auto)), "fp32")
    panel.precision_select.value = choice
    panel.batch_size_input.value = 3
    # What the notebook's run cell does: it reads only the config.
    result = train(cfg.build_model(), precision=cfg.precision, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                   max_steps=cfg.max_steps, eval_every=None, eval_batches=1, progress=False)
    assert result.summary.precision == choice
    assert result.summary.global_batch == 3 and result.config.batch_size == 3
    assert result.summary.steps == 2


def test_build_model_gives_the_same_initial_weights_every_time(tiny_kwargs):
    cfg = RunConfig(model_kwargs=tiny_kwargs, seed=3)
    first, again = cfg.build_model(), cfg.build_model()
    assert first is not again
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), again.parameters()))
    cfg.seed = 4
    assert not torch.equal(cfg.build_model().tok_emb.weight, first.tok_emb.weight)


def test_rerunning_the_cells_keeps_the_users_panel_choice():
    # Run All: the parameters cell builds a fresh cfg, the panel cell shows a panel for it.
    cfg = RunConfig(precision="auto", batch_size=4)
    panel = config_panel(cfg)
    panel.precision_select.value = "fp32"
    panel.batch_size_input.value = 8
    assert "re-run" in panel.status.value and "batch_size is now 8" in panel.status.value
    # Run All again: the parameters cell says auto / 4 again, but the user's choice, kept on the earlier panel the
    # cell hands in, wins.
    again = RunConfig(precision="auto", batch_size=4)
    second = config_panel(again, earlier=panel)
    assert (again.precision, again.batch_size) == ("fp32", 8)
    assert (second.precision_select.value, second.batch_size_input.value) == ("fp32", 8)
    assert "kept your earlier panel choice (precision=fp32, batch_size=8)" in second.status.value
    assert "fp32 → fp32 · batch size 8" in repr(second) and second.choices == panel.choices
    fresh = RunConfig(precision="auto", batch_size=4)
    config_panel(fresh)  # no earlier panel (a new kernel, or `del panel`): the parameters cell's values
    assert (fresh.precision, fresh.batch_size) == ("auto", 4)


def test_headless_runs_keep_the_parameters_cell():
    # nbval/papermill never touch a widget: panels shown one after another change nothing.
    for batch in (4, 16):
        cfg = RunConfig(batch_size=batch)
        panel = config_panel(cfg)
        assert cfg.batch_size == batch and panel.status.value == ""


def test_panel_reads_as_text_where_widgets_cannot_render():
    text = repr(config_panel(RunConfig(model="tiny-gpt", precision="fp32", batch_size=4)))
    assert text == "settings: model tiny-gpt · precision fp32 → fp32 · batch size 4" and len(text) <= 110


def test_sizes_left_at_none_follow_the_device(monkeypatch):
    monkeypatch.setenv(GPU_PROFILE_ENV, "T4")  # a T4's preset, the tensors still on this CPU
    gpu = RunConfig(device="cpu")
    gpu_sizes = gpu.model_arguments()  # decided as the model is built, on the device it runs on
    monkeypatch.delenv(GPU_PROFILE_ENV)
    cpu = RunConfig(device="cpu")
    assert gpu_sizes["d_model"] > cpu.model_arguments()["d_model"] and gpu.batch_size > cpu.batch_size
    assert (cpu.batch_size, cpu.seq_len) == (NOTEBOOK["cpu"].batch_size, NOTEBOOK["cpu"].seq_len)
    assert RunConfig(model="my_model.py:Net", device="cpu").model_arguments() == {}  # unknown size arguments
    assert RunConfig(batch_size=7, model_kwargs={"d_model": 64}, device="cpu").batch_size == 7
    cpu.model_arguments()["d_model"] = 1
    assert NOTEBOOK["cpu"].model_kwargs["d_model"] == 32  # each config has its own copy


def test_the_notebook_path_declares_no_setting_of_its_own():
    """The panel's config shares the tiers' defaults and hands each tier the device preset's lengths: no setting
    the notebooks run is declared a second time, in RunConfig or in a run cell."""
    shared = {f.name for f in dataclasses.fields(TrainConfig)} & {f.name for f in dataclasses.fields(RunConfig)}
    sized = {"batch_size", "seq_len", "max_steps"}  # None in RunConfig: the device preset's
    assert shared - sized == {"precision", "device", "seed", "compile", "memory", "schedule", "shuffle"}
    assert RunConfig.activation_checkpointing == MemorySettings.checkpointing
    # The panel's memory is a choice's name (full, lora, ...), train's the MemorySettings it names: the same default.
    assert memory_setting(RunConfig.memory) == TrainConfig().memory
    for name in shared - sized - {"memory"}:
        assert getattr(RunConfig, name) == getattr(TrainConfig, name), name
    cfg, preset = RunConfig(device="cpu"), NOTEBOOK["cpu"]
    assert cfg.train_config() == preset.train_config(device="cpu")
    assert cfg.bench_config() == preset.bench_config(device="cpu")
    assert cfg.smoke_config() == preset.smoke_config(device="cpu")
    assert cfg.analysis_config() == preset.analysis_config(device="cpu")
    assert cfg.fit_config() == preset.fit_config(device="cpu")
    assert cfg.ranks_config() == preset.ranks_config(device="cpu", precision=cfg.precision)
    assert cfg.search_config().trial == replace(preset.train_config(device="cpu"), progress=False)
    edited = RunConfig(device="cpu", precision="fp32", batch_size=2, compile=True)
    assert (edited.train_config().precision, edited.train_config().batch_size, edited.train_config().compile) == \
        ("fp32", 2, True)
    assert edited.bench_config().compile == "both" and edited.smoke_config().batch_sizes == (1, 2)
    assert (edited.ranks_config().precision, edited.ranks_config().seq_len) == ("fp32", preset.seq_len)
    assert edited.search_config().trial.compile is False  # each short trial eager: compiling would cost more


def test_a_models_sizes_and_tokenizer_go_with_it_in_code_and_in_the_panel(tmp_path):
    """tiny-gpt's sizes handed to a save_pretrained folder's from_pretrained crash it: left at None, a config's
    model arguments and tokenizer are its model's own, decided when it is built; the panel, changing the model,
    drops those set for the old one."""
    cfg = RunConfig(device="cpu")
    assert cfg.model_kwargs is None and cfg.model_arguments() == NOTEBOOK["cpu"].model_kwargs
    cfg.model = str(tmp_path)
    assert (cfg.model_arguments(), cfg.tokenizer) == ({}, None)
    given = RunConfig(model_kwargs={"d_model": 16}, device="cpu")
    given.model = "tiny-gpt"  # given: used as given
    assert given.model_arguments() == {"d_model": 16}
    assert not any(f.name.startswith("_") for f in dataclasses.fields(RunConfig))  # no hidden owner field
    assert "__setattr__" not in vars(RunConfig)

    panel = config_panel(RunConfig(device="cpu", tokenizer="bytes"), tier="smoke")
    assert panel.sizes.layout.display is None and panel.size_inputs["d_model"].value == 32
    panel.size_inputs["d_model"].value = 48
    assert panel.config.model_kwargs["d_model"] == 48
    panel.model_select.value = str(tmp_path)
    assert panel.config.model_arguments() == {} and panel.config.tokenizer is None
    assert panel.sizes.layout.display == "none"
    # Run All: the parameters cell says tiny-gpt with its sizes; the panel's folder keeps no tiny-gpt size.
    again = RunConfig(model_kwargs={"d_model": 64}, device="cpu")
    config_panel(again, earlier=panel)
    assert (again.model, again.model_arguments()) == (str(tmp_path), {})


def test_each_tier_shows_only_the_boxes_it_reads():
    shown = {tier: config_panel(RunConfig(), tier=tier).children for tier in ("smoke", "analysis", "train")}
    panel = config_panel(RunConfig(), tier="smoke")
    assert panel.data_input not in panel.children and panel.compile_box not in panel.children
    assert len(shown["smoke"]) + 1 == len(shown["analysis"]) and len(shown["train"]) == 12
    assert all(p.model_select.layout.width == "100%" for p in [panel])  # a path fits
    with pytest.raises(ValueError, match="tier must be one of smoke, analysis, train"):
        config_panel(RunConfig(), tier="tier1")


def test_the_memory_modes_fill_the_configs_train_the_benchmark_and_the_search_read():
    cfg = RunConfig(device="cpu")
    panel = config_panel(cfg, tier="train")
    assert panel.checkpointing_box in panel.children and panel.memory_select.value == "full"
    assert [v for _, v in panel.memory_select.options] == ["full", "lora", "qlora", "adamw8bit"]
    panel.checkpointing_box.value = True
    panel.memory_select.value = "lora"
    assert cfg.activation_checkpointing is True and cfg.memory == "lora"
    for made in (cfg.train_config(), cfg.search_config().trial):
        assert made.memory.checkpointing is True and made.memory.lora == LoraSettings()
    bench = cfg.bench_config()  # checkpointing: the benchmark's extra rows
    assert bench.activation_checkpointing is True and bench.memory.lora == LoraSettings()
    panel.memory_select.value = "adamw8bit"
    assert cfg.train_config().memory.lora is None and cfg.train_config().memory.optimizer == "adamw8bit"
    panel.memory_select.value = "qlora"
    assert cfg.train_config().memory.base_bits == 4
    assert panel.checkpointing_box not in config_panel(RunConfig(), tier="analysis").children


def test_a_copy_for_another_model_drops_the_old_models_sizes(tmp_path):
    """dataclasses.replace(cfg, model=...) builds a new config: sizes left to the model follow the new one; given
    anew with the model, they stay."""
    cfg = RunConfig(device="cpu")
    assert cfg.model_arguments() == NOTEBOOK["cpu"].model_kwargs  # the built-in's preset sizes
    folder = replace(cfg, model=str(tmp_path))
    assert (folder.model_arguments(), folder.tokenizer) == ({}, None)
    assert replace(folder, model="tiny-gpt").model_arguments() == NOTEBOOK["cpu"].model_kwargs  # its own again
    given = replace(cfg, model=str(tmp_path), model_kwargs={"dtype": "float32"})
    assert given.model_arguments() == {"dtype": "float32"}


def test_a_copy_for_a_saved_folder_loads_it(tmp_path):
    """The issue's case: replace(RunConfig(), model=folder) used to hand the folder tiny-gpt's sizes."""
    from real import GPT2_SIZES, bpe_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = bpe_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), **GPT2_SIZES))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    built = replace(RunConfig(device="cpu"), model=str(tmp_path)).build_model()
    assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in model.parameters())


def test_run_config_makes_each_tiers_config_with_presets_own_builders():
    """RunConfig repeats none of Preset's builders: each of its six is Preset's, on `tiers`."""
    from tier_utils.presets import Preset

    cfg = RunConfig(device="cpu", precision="fp32", batch_size=2)
    for name in ("smoke_config", "analysis_config", "train_config", "bench_config", "fit_config", "ranks_config"):
        assert getattr(cfg, name)() == getattr(Preset, name)(cfg.tiers), name
    assert cfg.tiers.train.max_steps == cfg.max_steps and cfg.tiers.precision == "fp32"


def test_the_schedule_and_shuffle_boxes_fill_the_training_config():
    cfg = RunConfig(device="cpu")
    panel = config_panel(cfg, tier="train")
    assert panel.schedule_select in panel.children and panel.shuffle_box in panel.children
    assert list(panel.schedule_select.options) == ["constant", "linear", "cosine", "wsd"]
    assert (cfg.train_config().schedule, cfg.train_config().shuffle) == ("cosine", True)  # the defaults stay
    panel.schedule_select.value = "wsd"
    panel.shuffle_box.value = False
    made = cfg.train_config()
    assert (made.schedule, made.shuffle, made.lr_schedule.kind) == ("wsd", False, "wsd")
    assert cfg.search_config().trial.schedule == "wsd"
    assert panel.schedule_select not in config_panel(RunConfig(), tier="smoke").children


def test_each_task_has_its_own_data_hint_and_the_task_line_stays_when_data_is_typed():
    from tier_utils.tasks import CAUSAL_LM, CLASSIFICATION, IMAGE_CLASSIFICATION, SEQ2SEQ

    hints = {task.name: task.data_hint for task in (CAUSAL_LM, CLASSIFICATION, SEQ2SEQ, IMAGE_CLASSIFICATION)}
    assert len(set(hints.values())) == len(hints), hints  # a T5's box no longer offers a text file
    assert "pairs" in hints["seq2seq"] and "text file" not in hints["seq2seq"]
    cfg = RunConfig(device="cpu")
    panel = config_panel(cfg)
    panel.model_select.value = "tiny-seq2seq"
    assert panel.data_input.placeholder == hints["seq2seq"]
    panel.data_input.value = "pairs.jsonl"
    panel.precision_select.value = "fp32"
    assert "data is now" not in panel.status.value and "precision is now fp32" in panel.status.value
    assert "tiny-seq2seq runs as seq2seq: data" in panel.status.value


def test_the_panel_is_built_whole_in_its_init():
    """Every attribute a ConfigPanel method sets is first set in __init__ (objects are built whole)."""
    import ast
    import inspect

    from tier_utils import widgets

    tree = ast.parse(inspect.getsource(widgets.ConfigPanel))
    methods = {f.name: f for f in tree.body[0].body if isinstance(f, ast.FunctionDef)}

    def assigned(function):
        return {t.attr for node in ast.walk(function) if isinstance(node, (ast.Assign, ast.AugAssign))
                for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                for t in (t.elts if isinstance(t, ast.Tuple) else [t])
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}

    built = assigned(methods["__init__"])
    late = {name: sorted(assigned(f) - built) for name, f in methods.items() if assigned(f) - built}
    assert not late, f"set outside __init__: {late}"
