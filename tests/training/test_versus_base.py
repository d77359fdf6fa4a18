"""The fine-tune against its base, and one run against another: per-example scores on the same validation examples,
the paired bootstrap verdict, what a run saves for `compare`, and compare's refusals and exit codes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny import tiny
from torch.utils.data import Dataset

import tier_utils as tu
from tier_utils import cli
from tier_utils.core.files import jsonable
from tier_utils.core.paired import MIN_PAIRS, ExampleScores, Pairing, paired_verdict
from tier_utils.models.checkpoint import data_fingerprint, load_checkpoint, same_data
from tier_utils.training.versus_base import SCORES_FILE

QUICK = dict(precision="fp32", device="cpu", batch_size=8, seq_len=16, progress=False)


def counting_rows(n=400, seed=1) -> torch.Tensor:
    """Rows that count up from a random start: the next token is learnable within a few dozen steps."""
    start = torch.randint(0, 256, (n, 1), generator=torch.Generator().manual_seed(seed))
    return (start + torch.arange(17)) % 256


class Labelled(Dataset):
    """A classifier's rows: class 0 reads tokens 0..127, class 1 tokens 128..255 (`labels` may be shuffled)."""

    def __init__(self, classes: torch.Tensor, labels: torch.Tensor | None = None, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 128, (len(classes), 16), generator=g) + 128 * classes[:, None]
        self.labels = classes if labels is None else labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long),
                "labels": self.labels[i]}


def test_paired_verdicts_judge_the_interval_and_say_when_pairs_are_few():
    rng = np.random.default_rng(0)
    before = rng.normal(2.0, 0.3, 60)
    better = paired_verdict("loss", before, before - 0.2 + rng.normal(0, 0.05, 60))
    assert better.verdict == "improved" and better.high < 0 and not better.too_few and better.worse_share < 0.1
    assert paired_verdict("loss", before, before + 0.2).verdict == "regressed"
    assert paired_verdict("accuracy", before, before + 0.2).verdict == "improved"  # larger is better there
    same = paired_verdict("loss", before, before)
    assert (same.verdict, same.low, same.high, same.worse_share) == ("no measurable difference", 0, 0, 0)
    noise = paired_verdict("loss", before, before + rng.normal(0, 0.3, 60))
    assert noise.verdict == "no measurable difference" and noise.low < 0 < noise.high
    few = paired_verdict("loss", before[:10], before[:10] + 0.2)
    assert few.too_few and "fewer than 30 pairs, interval only" in few.describe()
    assert not paired_verdict("exact_match", [0.0] * 8, [0.0] * 8).too_few  # identical: said at any n
    noisy = before + rng.normal(0, 0.3, 60)
    assert paired_verdict("loss", before, noisy, seed=3) == paired_verdict("loss", before, noisy, seed=3)  # seeded


def test_the_validation_hash_sits_beside_the_training_fingerprint_and_old_checkpoints_still_resume():
    splits = tu.build_datasets(counting_rows(100), seq_len=16)
    now = data_fingerprint(splits)
    old = {k: v for k, v in now.items() if k != "val_sha1"}  # a checkpoint written before the validation hash
    assert same_data(old, now) and same_data(now, now)
    assert not same_data({**now, "val_sha1": "0" * 40}, now) and not same_data({**old, "sample_sha1": "0"}, now)
    other = tu.build_datasets(counting_rows(100, seed=2), seq_len=16)
    assert data_fingerprint(other)["val_sha1"] != now["val_sha1"]


def test_ranks_shares_merge_by_example_and_generation_adds_its_few():
    a = ExampleScores([0, 2, 4], {"loss": [1.0, 3.0, 5.0]})
    b = ExampleScores([1, 3], {"loss": [2.0, 4.0]})
    merged = ExampleScores.merged([a, b])
    assert merged.index == [0, 1, 2, 3, 4] and merged.metrics["loss"] == [1, 2, 3, 4, 5]
    more = merged.with_metrics([0, 1], {"chrf": [50.0, 60.0]})
    assert more.metrics["chrf"][:2] == [50, 60] and np.isnan(more.metrics["chrf"][2:]).all()
    back = ExampleScores.from_dict(json.loads(json.dumps(jsonable(more.to_dict()))))  # as scores.json keeps it
    assert back.metrics["chrf"][:2] == [50, 60] and np.isnan(back.metrics["chrf"][2:]).all()


def test_a_run_that_learns_improves_on_its_base_and_compare_on_itself_finds_no_difference(tmp_path, capsys):
    run = tmp_path / "run"
    result = tu.train(tiny(seed=0), counting_rows(300), **QUICK, max_steps=20, lr=1e-2, eval_every=0,
                      checkpoint_dir=run)
    record = result.summary.versus_base
    pairing = Pairing.from_dict(record["pairing"])
    loss = pairing.headline
    assert loss.metric == "loss" and loss.n >= MIN_PAIRS and loss.verdict == "improved" and loss.high < 0
    assert [v.metric for v in pairing.verdicts] == ["loss", "token_accuracy"]
    assert record["base"].startswith("the initial weights") and record["seconds"] > 0
    assert result.answer().startswith("fine-tune vs base: val loss \u2212") and "improved" in result.answer()
    assert "improved" in result.table.set_index("metric").loc["versus_base", "value"]
    tables = result.more_tables()
    assert list(tables["versus_base"]["metric"]) == ["loss", "token_accuracy"]
    assert result.plot_versus_base() is not None and "versus_base" in result.more_plots()
    # The fine-tune's scores are the last evaluation's: the same val loss, example by example.
    assert np.mean(pairing.after.metrics["loss"]) == pytest.approx(result.summary.val_loss, rel=1e-5)
    saved = json.loads((run / SCORES_FILE).read_text())
    assert saved["validation"]["sha1"] == load_checkpoint(run / "last.pt")["data"]["val_sha1"]

    # compare on the same run twice: no measurable difference, exit 0; --json like every verb.
    assert cli.main(["compare", str(run), str(run / SCORES_FILE), "--json", str(tmp_path / "c.json")]) == 0
    out = json.loads((tmp_path / "c.json").read_text())
    assert {v["verdict"] for v in out["verdicts"]} == {"no measurable difference"} and not out["regressed"]
    assert "run B vs run A: val loss +0 [+0, +0], no measurable difference" in capsys.readouterr().out
    # Another validation split, or another model: refused in one line, exit 2.
    other = tmp_path / "other"
    other.mkdir()
    (other / SCORES_FILE).write_text(json.dumps({**saved, "validation": {"sha1": "0" * 40, "examples": 3}}))
    assert cli.main(["compare", str(run), str(other)]) == 2
    assert "validated on different data" in capsys.readouterr().err
    (other / SCORES_FILE).write_text(json.dumps({**saved, "model": "GPT2LMHeadModel"}))
    with pytest.raises(tu.TierError, match="different architectures"):
        tu.compare(run, other)


def test_a_classifier_fine_tuned_on_shuffled_labels_regresses_and_compare_exits_1(tmp_path):
    classes = torch.arange(256) % 2
    val = Labelled(classes[:48], seed=9)
    first = tmp_path / "true"
    tu.train(tiny("tiny-encoder", seed=0, num_classes=2), (Labelled(classes[48:]), val), **QUICK, max_steps=40,
             lr=3e-3, eval_every=40, checkpoint_dir=first)
    shuffled = classes[48:][torch.randperm(208, generator=torch.Generator().manual_seed(0))]
    second = tmp_path / "shuffled"
    result = tu.train(tu.load_model(str(first / "last.pt")), (Labelled(classes[48:], shuffled), val), **QUICK,
                      max_steps=40, lr=3e-3, eval_every=40, checkpoint_dir=second)
    verdicts = {v.metric: v for v in Pairing.from_dict(result.summary.versus_base["pairing"]).verdicts}
    assert verdicts["loss"].n == 48 and verdicts["loss"].verdict == "regressed", verdicts["loss"]
    assert set(verdicts) == {"loss", "accuracy"}
    worst = result.more_tables()["regressed"]
    assert 0 < len(worst) <= 5 and worst["after"].gt(worst["before"]).all()
    # The shuffled run against the true one, on the same validation split: a measurable regression, exit 1.
    compared = tu.compare(first, second)
    assert compared.regressed and compared.exit_code == 1
    assert compared.differences.empty  # the same settings: only the labels differ
    assert cli.main(["compare", str(first), str(second)]) == 1


def test_lora_base_scores_equal_the_initial_weights_scores(tmp_path):
    data = counting_rows(200)
    full = tu.train(tiny(seed=0), data, **QUICK, max_steps=2, eval_every=0)
    lora = tu.train(tiny(seed=0), data, **QUICK, max_steps=2, eval_every=0,
                    memory=tu.MemorySettings(lora=tu.LoraSettings(r=4, alpha=8)))
    base_full = Pairing.from_dict(full.summary.versus_base["pairing"]).before
    base_lora = Pairing.from_dict(lora.summary.versus_base["pairing"]).before
    assert base_lora.index == base_full.index
    assert base_lora.metrics["loss"] == pytest.approx(base_full.metrics["loss"], rel=1e-5)
    assert lora.summary.versus_base["base"].startswith("LoRA's base: the model with its adapters off")
    assert "untrained" not in lora.summary.versus_base["base"]  # no new head


def test_a_resume_keeps_the_base_scores_and_off_says_so(tmp_path):
    run = dict(**QUICK, max_steps=6, eval_every=3, checkpoint_every=2, checkpoint_dir=tmp_path)

    def stop(step, metrics):
        if step == 3:
            raise KeyboardInterrupt

    part = tu.train(tiny(seed=0), counting_rows(200), **run, on_eval=stop)
    assert part.interrupted and "not run" in part.summary.versus_base["skipped"]
    kept = load_checkpoint(tmp_path / "last.pt")["base_scores"]
    whole = tu.train(tiny(seed=0), counting_rows(200), **{**run, "checkpoint_dir": tmp_path / "whole"})
    resumed = tu.train(tiny(seed=0), counting_rows(200), **run, resume=True)
    assert resumed.summary.resumed_from_step == 2
    before = Pairing.from_dict(resumed.summary.versus_base["pairing"]).before
    assert before.metrics == ExampleScores.from_dict(kept).metrics  # scored before step 1, not after step 2
    assert before.metrics == Pairing.from_dict(whole.summary.versus_base["pairing"]).before.metrics
    off = tu.train(tiny(seed=0), counting_rows(200), **QUICK, max_steps=1, compare_base=False)
    assert off.summary.versus_base["skipped"].startswith("off") and "--no-compare-base" in off.answer()
    never = tu.train(tiny(seed=0), counting_rows(200), **QUICK, max_steps=1, eval_every="never")
    assert "no held-out split" in never.answer()
