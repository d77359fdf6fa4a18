"""tier_utils.notebook: the lines a notebook prints about its run, and the summary that ends it."""
import math

import pytest
from tiny import TINY

import tier_utils
from tier_utils.notebook import about, summary
from tier_utils.run_config import RunConfig


@pytest.fixture
def cfg():
    return RunConfig(model_kwargs=dict(TINY), batch_size=2, seq_len=16, max_steps=2, device="cpu")


def test_the_lines_are_computed_from_the_run(cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    smoke = tier_utils.smoke(cfg.build_model(), cfg.smoke_config(progress=False))
    trained = tier_utils.train(cfg.build_model(), None, cfg.train_config(progress=False, eval_every=None,
                                                                              eval_batches=1))
    exported = tier_utils.export(trained.model, "runs/t/model.pt2", format="pt2", repeats=1)
    lines = about(cfg, exported, trained).splitlines()  # an export records no model: the training run says it
    assert lines[0] == "model: built-in tiny-gpt (d_model=32, n_layer=1, n_head=2, max_len=32) → TinyGPT " \
                       f"({trained.summary.parameters:,} parameters, causal-lm)"
    assert lines[1] == "tokenizer: bytes" and lines[2].startswith("data: bundled corpus")
    first = trained.history.query("kind == 'step'")["train_loss"].iloc[0]
    assert lines[3].startswith(f"loss: {first:.2f} at step 1 (initialisation)")
    assert f"uniform ln(256) = {math.log(256):.2f} nats" in lines[3]

    shown = summary(cfg, {"smoke": smoke, "train": trained, "export": exported}, "runs/t", tier="train",
                    files=["runs/t/model.pt2", "runs/missing"])
    text, page = repr(shown), shown._repr_html_()
    assert "model checks: PASS · benchmark verdicts: not run" in text and "tokenizer: bytes" in text
    assert "<a href='runs/t/index.html'" in page and "<a href='runs/t/model.pt2'" in page  # relative: JupyterLab
    assert "runs/missing" not in text  # only what was written
    assert "model checks: PASS · benchmark verdicts: not run" in (tmp_path / "runs/t/index.html").read_text()
    with pytest.raises(ValueError, match="tier must be one of smoke, analysis, train"):
        summary(cfg, {"smoke": smoke}, "runs/u", tier="tier1")
