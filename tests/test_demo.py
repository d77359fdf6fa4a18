"""The shipped demo model (tiny-gpt-trained): it loads, it learned the corpus, its recipe reproduces it,
and tier 2 sees a trained model's attention in it (by default in `all`)."""
import hashlib
import json

import pytest
import torch
from tiny import TINY

from tier_utils import AnalysisConfig, ModelSpecError, adapt, analyze, load_model, mainjob
from tier_utils import demo_recipe as demo_module
from tier_utils.benchmark.config import BenchConfig
from tier_utils.demo_recipe import SEED, STEPS, UNIFORM_LOSS, corpus_val_loss
from tier_utils.models.builtins import DEFAULT_MODEL, DEMO_MODEL
from tier_utils.models.demo_model import ASSETS, CARD_NAME, MODEL_KWARGS, WEIGHTS_NAME, demo_card
from tier_utils.presets import FAST, JOB, Preset
from tier_utils.training.config import TrainConfig

# Two runs of the recipe on different CPUs round differently and drift apart; their val losses agree
# this closely (a model that failed to train is > 1 nat off).
REPRODUCE_TOLERANCE = 0.05


def test_demo_model_loads_byte_level_and_its_val_loss_is_well_below_uniform():
    model = load_model(DEMO_MODEL)
    adapter = adapt(model)
    card = demo_card()
    assert (adapter.task.name, adapter.vocab_size) == ("causal-lm", 256)
    tier2_lengths = (AnalysisConfig.seq_len, JOB.seq_len, FAST.seq_len)
    assert adapter.max_len >= max(tier2_lengths)
    assert (ASSETS / WEIGHTS_NAME).stat().st_size <= 5 * 2**20
    val_loss, targets = corpus_val_loss(model)
    assert targets > 100_000 and val_loss < UNIFORM_LOSS - 3  # uniform guessing: ln 256 = 5.55 nats per byte
    assert val_loss == pytest.approx(card["val_loss"], abs=REPRODUCE_TOLERANCE)  # the card is what it scores
    assert model.provenance["name"] == DEMO_MODEL and model.provenance["training_steps"] == card["steps"]


def test_the_shipped_model_is_the_recipe_s_default():
    card = demo_card()
    assert (card["steps"], card["seed"]) == (STEPS, SEED)
    assert card["model_kwargs"] == MODEL_KWARGS and card["training"]["lr"] == demo_module.RECIPE.lr
    assert {"train_loss", "val_loss", "torch", "data"} <= set(card)


def test_demo_model_refuses_size_arguments():
    with pytest.raises(ModelSpecError, match="takes no keyword arguments.*use tiny-gpt"):
        load_model(DEMO_MODEL, d_model=64)


@pytest.mark.slow  # trains the demo model from scratch: about a minute on 2 idle CPU cores
def test_the_recipe_reproduces_the_shipped_model(tmp_path, capsys):
    assert demo_module.main(["--out", str(tmp_path), "--no-progress"]) == 0
    assert "tiny-gpt-trained: TinyGPT trained" in capsys.readouterr().out
    card, shipped = json.loads((tmp_path / CARD_NAME).read_text()), demo_card()
    assert (card["steps"], card["seed"], card["model_kwargs"]) == (shipped["steps"], shipped["seed"],
                                                                   shipped["model_kwargs"])
    # Not bitwise: float rounding differs between CPUs (AVX2 / AVX-512 / AMX), and so do the trajectories.
    assert card["val_loss"] == pytest.approx(shipped["val_loss"], abs=REPRODUCE_TOLERANCE)
    # The file written holds the model that was scored (the card hashes the bytes it wrote).
    assert hashlib.sha256((tmp_path / WEIGHTS_NAME).read_bytes()).hexdigest() == card["weights_sha256"]


def test_cli_refuses_a_file_as_out_before_training(tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    assert demo_module.main(["--out", str(tmp_path / "a_file")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "give a folder" in err and len(err.strip().splitlines()) == 1


def test_tier2_sees_trained_attention_in_the_demo_model():
    result = analyze(DEMO_MODEL, analyses=["attention"], batch_size=8, n_batches=2, seq_len=64, progress=False,
                     device="cpu", precision="fp32")
    rows = result.table
    assert (rows.status == "PASS").all(), rows.to_string()  # no collapsed head or layer
    assert not rows.detail.str.contains("untrained").any()
    heads = result.frames["attention"]
    # Layer 0 has local heads: mean distance a few tokens, where attending evenly over a 64-token causal
    # window averages ~16 (fresh weights do).
    assert heads[heads.layer_index == 0].mean_distance.min() < 4
    assert result.model["provenance"]["name"] == DEMO_MODEL
    assert {"training_steps", "val_loss"} <= set(result.model["provenance"])
    assert DEMO_MODEL in result.to_json()["model"]["provenance"]["summary"]


def test_the_demo_trained_further_is_no_longer_named_as_shipped():
    model = load_model(DEMO_MODEL)
    with torch.no_grad():
        model.head.weight[0, 0] += 1e-3  # what one more optimizer step (or other loaded weights) does
    result = analyze(model, analyses=["attention"], batch_size=2, n_batches=1, seq_len=16, progress=False,
                     device="cpu", precision="fp32")
    assert "provenance" not in result.model  # the card's steps and val loss describe other weights


def test_all_analyses_the_demo_model_only_when_the_default_model_is_left(tmp_path, monkeypatch):
    loaded = []
    real = mainjob.load_model
    monkeypatch.setattr(mainjob, "load_model", lambda spec, **kw: loaded.append(spec) or real(spec, **kw))
    sizes = Preset(batch_size=2, seq_len=16, analysis_batches=1,
                   train=TrainConfig(max_steps=2, eval_every=1, eval_batches=1),
                   bench=BenchConfig(untimed_steps=1, timed_steps=1, repeats=1, accuracy_steps=1, eval_batches=1))
    monkeypatch.setattr(mainjob, "FAST", sizes)
    result = mainjob.run_all(DEFAULT_MODEL, tmp_path / "default", fast=True, progress=False, device="cpu")
    assert loaded == [DEFAULT_MODEL, DEMO_MODEL]
    analysis, trained = result.results["analysis"], result.results["train"]
    assert analysis.model["provenance"]["name"] == DEMO_MODEL
    steps = trained.history[trained.history.kind == "step"]
    assert steps.train_loss.iloc[0] > 4  # tier 3 started from fresh weights (~ln 256), not the demo's (~1.4)
    assert not (analysis.table.detail.str.contains("untrained")).any()
    assert f"on {DEMO_MODEL}: TinyGPT trained" in result.summary_text()
    assert f"tier 2 on {DEMO_MODEL}" in result.index.read_text()
    loaded.clear()
    sized = mainjob.run_all(DEFAULT_MODEL, tmp_path / "sized", fast=True, progress=False, device="cpu",
                           model_kwargs=TINY)
    assert loaded == [DEFAULT_MODEL] and "provenance" not in sized.results["analysis"].model


def test_fresh_default_weights_do_show_the_untrained_finding():
    """The contrast the demo model is for (and what makes the assertions above able to fail)."""
    torch.manual_seed(0)
    result = analyze(load_model(DEFAULT_MODEL), analyses=["attention"], batch_size=8, n_batches=1, seq_len=64,
                     progress=False, device="cpu", precision="fp32")
    assert result.table.detail.str.contains("untrained").any()
