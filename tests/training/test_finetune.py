"""Fine-tuning: best.pt by validation loss, early stopping with patience (Lightning's rule) and exact resume of
its count, restore_best, and save_hf writing a save_pretrained folder that loads back with the same logits."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from real import bpe_tokenizer
from tiny import TINY_ARGS, tiny

import tier_utils as tu
from tier_utils import cli
from tier_utils.core.errors import OutputError
from tier_utils.models.checkpoint import load_checkpoint, save_checkpoint
from tier_utils.training.finetune import Selection

# 36 training rows of random tokens and a high learning rate: the model memorises them, so its val loss (on 4
# other random rows) falls for a few evaluations, then rises by far more than any rounding: the best is early.
OVERFIT = dict(precision="fp32", device="cpu", batch_size=4, seq_len=16, eval_batches=None, lr=0.01, warmup_steps=0,
               eval_every=3, progress=False)
DETERMINISTIC = ["kind", "step", "epoch", "train_loss", "val_loss", "perplexity", "accuracy", "grad_norm", "lr"]
HF_GPT2 = dict(n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=300)


def rows(vocab=256) -> torch.Tensor:
    return torch.randint(0, vocab, (40, 17), generator=torch.Generator().manual_seed(1))


def hf_gpt2(seed=0, **sizes):
    torch.manual_seed(seed)
    return tu.load_model("hf:GPT2LMHeadModel", **{**HF_GPT2, **sizes})


def evals(result) -> pd.DataFrame:
    return result.history[result.history["kind"] != "step"]


def lightning_stop(losses: list[float], patience: int, min_delta: float = 0.0) -> int | None:
    """Written apart from Selection: the index of the evaluation Lightning's EarlyStopping stops at, or None."""
    best, wait = float("inf"), 0
    for i, loss in enumerate(losses):
        best, wait = (loss, 0) if loss < best - min_delta else (best, wait + 1)
        if wait >= patience:
            return i
    return None


def test_best_pt_holds_the_state_of_the_lowest_val_loss(tmp_path):
    snapshots = {}

    def keep(step, metrics):  # the weights as they were at each evaluation
        snapshots[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    model = tiny(seed=0)
    result = tu.train(model, rows(), **OVERFIT, max_steps=30, checkpoint_dir=tmp_path, on_eval=keep)
    e = evals(result)
    lowest = int(e.loc[e["val_loss"].idxmin(), "step"])
    assert lowest != result.summary.steps  # the best is not simply the last: a test that could fail
    s = result.summary
    assert s.best_step == lowest and s.best_val_loss == pytest.approx(e["val_loss"].min(), rel=1e-12)
    assert s.best_checkpoint == str(tmp_path / "best.pt")
    best, last = load_checkpoint(tmp_path / "best.pt"), load_checkpoint(tmp_path / "last.pt")
    assert best["step"] == lowest and last["step"] == 30 and best.keys() == last.keys()  # the same format
    assert all(torch.equal(best["model"][k], v) for k, v in snapshots[lowest].items())
    assert not all(torch.equal(best["model"][k], v) for k, v in last["model"].items())
    assert f"{s.best_val_loss:.4f} at step {lowest}" in result.table.set_index("metric").loc["best_val_loss", "value"]
    # load_model reads best.pt like last.pt: the model rebuilt from its recorded spec, with the best weights.
    rebuilt = tu.load_model(str(tmp_path / "best.pt"))
    assert all(torch.equal(rebuilt.state_dict()[k], v) for k, v in snapshots[lowest].items())


def test_early_stop_stops_where_lightnings_rule_says_and_writes_last_pt(tmp_path):
    patience, max_steps = 2, 60
    result = tu.train(tiny(seed=0), rows(), **OVERFIT, max_steps=max_steps, checkpoint_dir=tmp_path,
                      early_stop_patience=patience, log_every=5)
    s, e = result.summary, evals(result)
    at = lightning_stop(e["val_loss"].tolist(), patience)
    assert at == len(e) - 1  # it stopped at the first evaluation the rule says, not before or after
    stop_step = int(e["step"].iloc[at])
    assert s.steps == s.early_stopped_at_step == stop_step < max_steps
    assert stop_step % 5  # it stops inside a history row's window: the steps since the last row still get one
    steps = result.history.query("kind == 'step'")["step"].tolist()
    epoch = 9  # 36 training rows / batch 4: an epoch's end closes a row too
    assert steps == sorted({*range(5, stop_step, 5), *range(epoch, stop_step, epoch), stop_step})
    assert f"for {patience} evaluations in a row (patience {patience})" in s.early_stop_reason
    assert load_checkpoint(tmp_path / "last.pt")["step"] == stop_step
    # Without patience the same run goes on: the stop is the setting's doing.
    assert tu.train(tiny(seed=0), rows(), **OVERFIT, max_steps=max_steps).summary.steps == max_steps


def test_min_delta_counts_only_improvements_larger_than_it():
    # Every evaluation after the first improves by less than 100, so with patience 2 the third one stops it,
    # whatever the losses are on this machine.
    result = tu.train(tiny(seed=0), rows(), **{**OVERFIT, "lr": 3e-4}, max_steps=30, early_stop_patience=2,
                      early_stop_min_delta=100.0)
    assert result.summary.early_stopped_at_step == 9 and len(evals(result)) == 3
    assert "did not improve by more than 100 on" in result.summary.early_stop_reason
    # Falls of 0.06 against a min_delta of 0.1: Lightning's reference moves only on an improvement, so every second
    # fall adds up to one and the run goes on; HF's compares with the best, which moves each time, so it would stop.
    creeping, hf_count, losses = Selection(patience=3, min_delta=0.1), 0, [1.0, 0.94, 0.88, 0.82, 0.76]
    for step, loss in enumerate(losses):
        creeping.update(step, loss)
        hf_count = 0 if step == 0 or losses[step - 1] - loss > 0.1 else hf_count + 1
    assert not creeping.stop and creeping.reference == 0.76 and creeping.bad_evals == 0 and creeping.best_step == 4
    assert hf_count >= 3


def test_resume_from_a_checkpoint_mid_count_stops_exactly_like_the_whole_run(tmp_path):
    run = dict(**OVERFIT, max_steps=60, early_stop_patience=3, checkpoint_every=3, deterministic=True)
    whole = tu.train(tiny(seed=0), rows(), **run, checkpoint_dir=tmp_path / "whole")
    e = evals(whole)
    # Interrupt at the first evaluation after one that did not improve: last.pt (from the step before) holds a
    # count of 1, which the resumed run must carry on from.
    bad = [int(st) for st, loss, low in zip(e["step"], e["val_loss"], e["val_loss"].cummin()) if loss > low]
    assert bad and bad[0] < whole.summary.steps, e
    cut = bad[0] + 3

    def interrupt(step, metrics):
        if step == cut:
            raise KeyboardInterrupt

    part = tu.train(tiny(seed=0), rows(), **run, checkpoint_dir=tmp_path / "part", on_eval=interrupt)
    assert part.interrupted and part.summary.early_stopped_at_step is None
    saved = load_checkpoint(tmp_path / "part" / "last.pt")
    assert saved["step"] == bad[0] and saved["selection"]["bad_evals"] == 1
    resumed = tu.train(tiny(seed=0), rows(), **run, checkpoint_dir=tmp_path / "part", resume=True)
    for field in ("steps", "early_stopped_at_step", "early_stop_reason", "best_step", "best_val_loss", "val_loss"):
        assert getattr(resumed.summary, field) == getattr(whole.summary, field), field
    pd.testing.assert_frame_equal(resumed.history[DETERMINISTIC].reset_index(drop=True),
                                  whole.history[DETERMINISTIC].reset_index(drop=True), check_exact=True)
    for name in ("last.pt", "best.pt"):
        a, b = load_checkpoint(tmp_path / "whole" / name), load_checkpoint(tmp_path / "part" / name)
        assert a["step"] == b["step"] and all(torch.equal(a["model"][k], v) for k, v in b["model"].items()), name
    # Resuming a run that stopped early does no step more; more patience lets it go on.
    again = tu.train(tiny(seed=0), rows(), **run, checkpoint_dir=tmp_path / "whole", resume=True)
    assert again.summary.steps == again.summary.early_stopped_at_step == whole.summary.steps
    longer = tu.train(tiny(seed=0), rows(), **{**run, "early_stop_patience": 50}, checkpoint_dir=tmp_path / "whole",
                      resume=True)
    assert longer.summary.steps > whole.summary.steps and longer.summary.early_stopped_at_step is None


def test_a_best_pt_written_past_the_resumed_last_pt_stays_the_best(tmp_path):
    run = dict(**OVERFIT, max_steps=12, checkpoint_every=5, deterministic=True)

    def interrupt(step, metrics):
        if step == 9:
            raise KeyboardInterrupt  # before step 10's checkpoint: last.pt is step 5's

    tu.train(tiny(seed=0), rows(), **run, checkpoint_dir=tmp_path, on_eval=interrupt)
    best = load_checkpoint(tmp_path / "best.pt")
    assert best["step"] == 6 and load_checkpoint(tmp_path / "last.pt")["step"] == 5
    # The attempt that died did better at step 6 than the replay will (a lower loss stands in for a GPU's
    # other rounding): the file keeps its weights, and the summary says what it holds.
    best["selection"]["best_loss"] = 0.5
    save_checkpoint(tmp_path / "best.pt", {k: v for k, v in best.items() if k != "format"})
    resumed = tu.train(tiny(seed=0), rows(), **run, checkpoint_dir=tmp_path, resume=True)
    assert resumed.summary.best_step == 6 and resumed.summary.best_val_loss == 0.5
    assert load_checkpoint(tmp_path / "best.pt")["selection"]["best_loss"] == 0.5


def test_restore_best_returns_the_best_weights(tmp_path):
    result = tu.train(tiny(seed=0), rows(), **OVERFIT, max_steps=30, checkpoint_dir=tmp_path, restore_best=True)
    s = result.summary
    assert s.best_step != s.steps and s.weights.startswith(f"best weights (step {s.best_step}")
    best = load_checkpoint(tmp_path / "best.pt")["model"]
    assert all(torch.equal(best[k], v) for k, v in result.model.state_dict().items())
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 30  # last.pt stays the final state, for resume
    with pytest.raises(ValueError, match="restore_best needs checkpoint_dir"):
        tu.TrainConfig(restore_best=True)
    with pytest.raises(ValueError, match="early_stop_patience must be a whole number >= 1"):
        tu.TrainConfig(early_stop_patience=0)


def _logits(model, vocab=300):
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.eval()(ids).logits


def test_save_hf_writes_a_folder_that_loads_back_with_equal_logits(tmp_path):
    folder = tmp_path / "hf"
    result = tu.train(hf_gpt2(), rows(300), **OVERFIT, max_steps=4, save_hf=str(folder))
    s = result.summary
    assert s.hf_folder == str(folder) and (folder / "config.json").is_file()
    assert s.hf_detail.startswith("final weights (step 4)") and "tokenizer: bytes, nothing to save" in s.hf_detail
    assert not any(folder.glob("tokenizer*"))
    with pytest.warns(UserWarning, match="holds no tokenizer files"):
        reloaded = tu.load_model(str(folder))
    assert torch.equal(_logits(result.model.cpu()), _logits(reloaded))
    assert not torch.equal(_logits(hf_gpt2()), _logits(reloaded))  # the trained weights, not the initial ones


def test_save_hf_with_its_own_tokenizer_and_the_best_weights(tmp_path):
    tokenizer = bpe_tokenizer()
    model = tu.load_model(hf_gpt2(vocab_size=len(tokenizer)), tokenizer=tokenizer)
    folder = tmp_path / "hf"
    result = tu.train(model, rows(len(tokenizer)), **OVERFIT, max_steps=24, checkpoint_dir=tmp_path / "ck",
                      restore_best=True, save_hf=str(folder))
    s = result.summary
    assert s.best_step != s.steps, result.history  # so the folder holds the best, not the final weights
    assert s.hf_detail.startswith(f"best weights (step {s.best_step}") and "tokenizer" in s.hf_detail
    reloaded = tu.load_model(str(folder))
    adapter = tu.adapt(reloaded)
    assert adapter.tokenizer.vocab_size == len(tokenizer)
    assert adapter.tokenizer.encode("def f(x):").tolist() == tokenizer("def f(x):")["input_ids"]
    best = tu.load_model(str(tmp_path / "ck" / "best.pt"))
    assert torch.equal(_logits(best, len(tokenizer)), _logits(reloaded, len(tokenizer)))


def test_save_hf_on_a_model_without_save_pretrained_is_refused_before_any_step(tmp_path, monkeypatch, capsys):
    step_module = sys.modules["tier_utils.engine.step"]  # the step every run calls
    monkeypatch.setattr(step_module.TrainStep, "__call__", lambda *a: pytest.fail("a step ran"))
    folder = tmp_path / "hf"
    with pytest.raises(OutputError, match="save_hf needs a transformers model .* TinyGPT is not one") as info:
        tu.train(tiny(), rows(), **OVERFIT, max_steps=2, save_hf=str(folder), checkpoint_dir=tmp_path / "ck")
    assert "\n" not in str(info.value) and "best.pt" in str(info.value)
    out = tmp_path / "run"
    code = cli.main(["train", "--model", "tiny-gpt", *TINY_ARGS, "--max-steps", "2", "--no-progress",
                     "--device", "cpu", "--out", str(out), "--save-hf", str(folder)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "save_hf needs a transformers model" in lines[0]
    assert not out.exists() and not folder.exists() and not (tmp_path / "ck").exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(OutputError, match="save_hf .* is a file"):  # checked before the model is even built
        tu.train(hf_gpt2(), rows(300), **OVERFIT, max_steps=2, save_hf=str(afile))


def test_cli_early_stop_and_save_hf_end_to_end(tmp_path):
    out, folder = tmp_path / "run", tmp_path / "hf"
    args = [a for k, v in HF_GPT2.items() for a in ("--model-arg", f"{k}={v}")]
    done = subprocess.run(
        [sys.executable, "-m", "tier_utils", "train", "--model", "hf:GPT2LMHeadModel", *args, "--out", str(out),
         "--early-stop-patience", "2", "--early-stop-min-delta", "100", "--save-hf", str(folder), "--restore-best",
         "--max-steps", "30", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "2", "--seq-len", "16",
         "--precision", "fp32", "--device", "cpu", "--no-progress", "--json", str(tmp_path / "s.json")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["early_stopped_at_step"] == summary["steps"] == 6  # evaluations at 2, 4, 6: the third stops it
    e = pd.read_csv(out / "metrics.csv").query("kind != 'step'")
    assert summary["best_step"] == int(e.loc[e["val_loss"].idxmin(), "step"])
    which = "final weights (step 6, also the best)" if summary["best_step"] == 6 else "best weights"
    assert summary["hf_folder"] == str(folder) and summary["hf_detail"].startswith(which)
    assert "early_stop" in done.stdout and "save_hf" in done.stdout
    assert {"best.pt", "last.pt"} <= {p.name for p in (out / "checkpoints").iterdir()}
    with pytest.warns(UserWarning, match="holds no tokenizer files"):
        reloaded = tu.load_model(str(folder))
    best = tu.load_model(str(out / "checkpoints" / "best.pt"))
    assert torch.equal(_logits(best), _logits(reloaded))
