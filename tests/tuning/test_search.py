import importlib
import json
import math

import optuna
import pandas as pd
import pytest
from tiny import TINY_ARGS, tiny

from tier_utils import search, train
from tier_utils.training.config import TrainConfig

FAST = dict(max_steps=12, eval_every=4, eval_batches=2, seq_len=32, batch_size=8, warmup_steps=0)


def test_four_trial_search_on_cpu_ranks_trials_by_val_loss():
    result = search(tiny(seed=0), n_trials=4, **FAST)
    table = result.table
    assert list(table.columns[:1]) == ["trial"] and len(table) == 4
    assert {"lr", "weight_decay", "warmup_steps", "batch_size", "val_loss", "state", "duration_s"} <= set(table.columns)
    done = table[table.state == "COMPLETE"]
    assert len(done) >= 2 and math.isclose(done.val_loss.min(), result.study.best_value)
    summary = result.to_json()
    assert summary["n_trials"] == 4 and summary["best"]["val_loss"] == result.study.best_value


def test_clearly_worse_trial_is_pruned():
    # Two good learning rates first, then one that cannot learn: the median pruner stops it early.
    space = {"lr": ("log", 1e-9, 3e-3)}
    first = [{"lr": 3e-3}, {"lr": 2e-3}, {"lr": 1e-9}]
    result = search(tiny(seed=0), space=space, n_trials=3, start_with=first, **FAST)
    table = result.table.sort_values("trial")
    assert list(table.state) == ["COMPLETE", "COMPLETE", "PRUNED"]
    assert table.iloc[2].lr == 1e-9 and table.iloc[2].last_reported_step < FAST["max_steps"]


def test_diverged_trial_is_pruned_with_its_reason_and_the_study_goes_on():
    # lr=1e30 overflows the weights at once: that trial diverges; the study must still run the next one.
    space = {"lr": ("log", 1e-4, 1e30)}
    result = search(tiny(seed=0), space=space, n_trials=2, start_with=[{"lr": 1e30}, {"lr": 3e-3}], **FAST)
    table = result.table.sort_values("trial")
    assert list(table.state) == ["PRUNED", "COMPLETE"]
    assert "became nan" in table.iloc[0].diverged and "in fp32" in table.iloc[0].diverged
    assert pd.isna(table.iloc[1].diverged) and result.best_config.lr == 3e-3


def test_sqlite_study_continues_after_interruption(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    calls = {"n": 0}
    real_train = train

    def interrupt_second_trial(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real_train(*args, **kwargs)

    search_module = importlib.import_module("tier_utils.tuning.study")  # the module, not the function of that name
    monkeypatch.setattr(search_module, "train", interrupt_second_trial)
    with pytest.raises(KeyboardInterrupt):
        search(tiny(seed=0), n_trials=3, storage=url, study_name="resume-me", **FAST)
    monkeypatch.undo()
    first = optuna.load_study(study_name="resume-me", storage=url)
    assert [t.state.name for t in first.trials] == ["COMPLETE", "FAIL"]

    result = search(tiny(seed=0), n_trials=3, storage=url, study_name="resume-me", **FAST)
    states = [t.state.name for t in result.study.trials]
    assert len(states) == 4 and states[:2] == ["COMPLETE", "FAIL"]  # both runs' trials, in one study
    assert sum(s in ("COMPLETE", "PRUNED") for s in states) == 3


def test_best_config_trains():
    result = search(tiny(seed=0), space={"lr": ("log", 1e-3, 3e-3)}, n_trials=2, **FAST)
    cfg = result.best_config
    assert isinstance(cfg, TrainConfig) and cfg.lr == result.study.best_params["lr"]
    assert cfg.max_steps == FAST["max_steps"]
    trained = train(tiny(seed=0), config=cfg)
    assert math.isfinite(trained.summary.val_loss)


@pytest.mark.parametrize("space,message", [
    ({"learning_rate": ("log", 1e-4, 1e-3)}, "not a TrainConfig field"),
    ({"lr": (1e-4, 1e-3)}, "must be a tuple starting with"),
    ({"precision": ("choice", ["fp32", "fp8"])}, "unknown precision"),
])
def test_bad_space_names_the_fix(space, message):
    with pytest.raises(ValueError, match=message):
        search(tiny(seed=0), space=space, n_trials=1, **FAST)


def test_cli_search_with_sqlite_continues_and_writes_json(tmp_path):
    from tier_utils.cli import main

    db, out = tmp_path / "s.db", tmp_path / "s.json"
    args = ["search", *TINY_ARGS, "--seq-len", "32", "--max-steps", "6", "--eval-every", "3",
            "--storage", f"sqlite:///{db}", "--study-name", "cli", "--no-progress"]
    assert main([*args, "--trials", "1"]) == 0
    assert main([*args, "--trials", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    assert summary["n_trials"] == 2 and summary["study_name"] == "cli"
    assert set(summary) == {"study_name", "n_trials", "states", "best", "ran_on", "trials", "meta"}
    assert summary["ran_on"]["memory"].startswith("full fine-tune") and summary["ran_on"]["data"], summary["ran_on"]
    assert main([*args, "--trials", "0"]) == 2


@pytest.mark.parametrize("url", ["bogus://x", "sqlite:////no/such/folder/study.db"])
def test_bad_storage_is_one_line_naming_the_fix(url):
    from tier_utils.core.errors import SearchStorageError

    with pytest.raises(SearchStorageError, match="use e.g. sqlite:///") as info:
        search(tiny(seed=0), n_trials=1, storage=url, **FAST)
    assert "\n" not in str(info.value)


def test_an_existing_maximizing_study_is_refused_not_silently_reused(tmp_path):
    from tier_utils.core.errors import SearchStorageError

    url = f"sqlite:///{tmp_path / 'other.db'}"
    optuna.create_study(study_name="accuracy", storage=url, direction="maximize")
    with pytest.raises(SearchStorageError, match="maximizes; .* give a new study_name"):
        search(tiny(seed=0), n_trials=1, storage=url, study_name="accuracy", **FAST)


def test_import_tier_utils_leaves_optuna_unloaded():
    import subprocess
    import sys

    code = "import sys, tier_utils; print('optuna' in sys.modules, tier_utils.search.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "search"]  # the function, not the module, and no optuna until a study runs


def test_one_config_holds_the_study_and_its_trials_and_a_typo_is_refused_by_name():
    """The study's settings and its trials' TrainConfig travel in one SearchConfig; an override names a field
    of either, and anything else is named back rather than silently ignored."""
    from tier_utils import SearchConfig

    cfg = SearchConfig.of(SearchConfig(n_trials=3), {"max_steps": 5, "study_name": "s"})
    assert (cfg.n_trials, cfg.study_name, cfg.trial.max_steps, cfg.trial.eval_every) == (3, "s", 5, 10)
    assert cfg.trial.progress is False  # trials never draw bars of their own beside the study's
    with pytest.raises(ValueError, match="unknown search or trial training setting.s. n_trails"):
        search(tiny(seed=0), n_trails=2)
