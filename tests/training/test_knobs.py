"""The training knobs HF Trainer and Lightning users bring (issue 52): evaluation never, the validation fraction
(none included), shuffling on or off, and the LR schedule; each through the API and the CLI, with every
contradiction one line."""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
from tiny import TINY_ARGS, tiny

from tier_utils import cli
from tier_utils.core.errors import CheckpointError
from tier_utils.core.precision import SlowPrecisionWarning
from tier_utils.data.datasets import NO_VALIDATION
from tier_utils.engine.schedules import Schedule
from tier_utils.training.loop import train

FAST = dict(batch_size=4, seq_len=16, eval_batches=1, progress=False, precision="fp32")


@pytest.fixture(autouse=True)
def _quiet_slow_precision():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPrecisionWarning)
        yield


def numbered_rows(n: int = 40, seq_len: int = 16) -> torch.Tensor:
    """Row i starts with token i: the first token names the row a batch came from."""
    rows = torch.randint(0, 256, (n, seq_len + 1), generator=torch.Generator().manual_seed(0))
    rows[:, 0] = torch.arange(n)
    return rows


class Recording(nn.Module):
    """A small causal LM that records the first token of every training row it is given."""

    max_len, vocab_size = 16, 256

    def __init__(self):
        super().__init__()
        self.emb, self.head, self.seen = nn.Embedding(256, 8), nn.Linear(8, 256), []

    def forward(self, input_ids):
        if self.training:
            self.seen += input_ids[:, 0].tolist()
        return self.head(self.emb(input_ids))


def test_each_schedule_has_its_shape_and_cosine_is_the_old_default():
    total, warmup = 100, 10
    old = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / (total - warmup))))
           for s in range(warmup, total)]
    cosine = Schedule.decide("cosine", warmup)
    assert [cosine.factor(s, total) for s in range(warmup, total)] == pytest.approx(old)
    assert cosine.factor(0, total) == pytest.approx(1 / 11) and cosine.factor(9, total) == pytest.approx(10 / 11)
    assert {Schedule.decide("constant", warmup).factor(s, total) for s in range(warmup, total)} == {1.0}
    linear = Schedule.decide("linear", warmup, final_fraction=0.0)
    assert linear.factor(55, total) == pytest.approx(0.5) and linear.factor(total, total) == 0.0
    wsd = Schedule.decide("wsd", warmup, final_fraction=0.05, decay_fraction=0.25)
    stable = [wsd.factor(s, total) for s in range(warmup, 77)]  # the decay starts 75% of the way through
    assert set(stable) == {1.0} and wsd.factor(100, total) == pytest.approx(0.05)
    assert 0.05 < wsd.factor(90, total) < 1.0
    assert "stable, then linear decay to 5% of lr over the last 25%" in wsd.describe()


def test_train_steps_through_the_schedule_asked(tmp_path):
    r = train(tiny(), max_steps=8, warmup_steps=2, schedule="linear", final_lr_fraction=0.0, lr=1e-3,
              eval_every="never", **FAST)
    lrs = r.history[r.history.kind == "step"]["lr"].tolist()
    expected = [1e-3 * Schedule.decide("linear", 2, 0.0).factor(s, 8) for s in range(8)]
    assert lrs == pytest.approx(expected)
    assert r.summary.lr_schedule == "2 warm-up steps, then linear to 0% of lr"
    assert r.config.to_dict()["schedule"] == "linear"


def test_eval_never_trains_on_every_row_and_evaluates_nothing():
    model = Recording()
    r = train(model, numbered_rows(), eval_every="never", epochs=1, **FAST)
    assert sorted(model.seen) == list(range(40))  # nothing held out: every row trained, once
    assert set(r.history["kind"]) == {"step"} and r.summary.val_loss is None and r.summary.accuracy is None
    assert r.summary.validation == NO_VALIDATION
    assert "validation never" in r.plot()._suptitle.figure.texts[-1].get_text()


def test_val_fraction_is_passed_through_and_zero_means_none():
    model = Recording()
    r = train(model, numbered_rows(), val_fraction=0.5, eval_every=0, epochs=1, **FAST)
    assert len(model.seen) == 20 and "a seeded random 50% of the rows" in r.summary.validation
    assert r.summary.val_targets == 4 * 16  # eval_batches=1: one batch of 4 rows, 16 targets each
    model = Recording()
    r = train(model, numbered_rows(), val_fraction=0, **FAST)
    assert sorted(model.seen) == list(range(40)) and r.summary.val_loss is None


def test_shuffle_off_trains_in_the_data_order_and_on_does_not():
    off, on = Recording(), Recording()
    train(off, numbered_rows(), shuffle=False, val_fraction=0, epochs=2, **FAST)
    train(on, numbered_rows(), val_fraction=0, epochs=2, **FAST)
    assert off.seen == list(range(40)) * 2
    assert sorted(on.seen) == sorted(off.seen) and on.seen[:40] != list(range(40)) and on.seen[:40] != on.seen[40:]
    assert train(Recording(), numbered_rows(), shuffle=False, val_fraction=0, max_steps=1,
                 **FAST).summary.order == "the data's own order, every epoch"


def exit_code(argv: list[str]) -> int:
    """The CLI's exit code, whether main returned it or argparse exited."""
    try:
        return cli.main(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("args,said", [
    (["--eval-every", "never", "--early-stop-patience", "2"], "early_stop_patience needs the validation loss"),
    (["--val-fraction", "0", "--restore-best"], "restore_best needs the validation loss"),
    (["--eval-every", "never", "--val-fraction", "0.2"], "eval_every=never never uses a validation split"),
    (["--schedule", "constant", "--final-lr-fraction", "0.2"], "a constant schedule stays at lr"),
    (["--decay-fraction", "0.3"], "use schedule=wsd"),
    (["--eval-every", "sometimes"], "argument --eval-every: invalid int value"),
    (["--val-fraction", "1"], "val_fraction must be a number >= 0 and < 1"),
])
def test_every_contradiction_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, args, said):
    code = exit_code(["train", "--model", "tiny-gpt", *TINY_ARGS, "--max-steps", "2", "--no-progress",
                      "--out", str(tmp_path / "out"), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and said in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("verb,args,said", [
    ("search", ["--eval-every", "never"], "search ranks and prunes its trials by validation loss"),
    ("search", ["--val-fraction", "0"], "search ranks and prunes its trials by validation loss"),
    ("all", ["--val-fraction", "0"], "all keeps its validation"),
    ("all", ["--eval-every", "never"], "train --eval-every never"),
])
def test_search_and_all_keep_their_validation(tmp_path, capsys, verb, args, said):
    assert exit_code([verb, "--model", "tiny-gpt", "--no-progress", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0]


@pytest.mark.parametrize("changed", [dict(shuffle=False), dict(schedule="wsd"), dict(val_fraction=0.2)])
def test_resume_refuses_other_knobs(tmp_path, changed):
    run = dict(max_steps=2, checkpoint_dir=tmp_path, eval_every=0, **FAST)
    train(tiny(), numbered_rows(), **run)
    with pytest.raises(CheckpointError, match=f"{next(iter(changed))}="):
        train(tiny(), numbered_rows(), resume=True, **run, **changed)


def test_resume_without_validation_is_refused_where_the_run_had_it(tmp_path):
    """eval_every=never holds nothing out: the training rows differ from the checkpoint's run, said as its data."""
    run = dict(max_steps=2, checkpoint_dir=tmp_path, **FAST)
    train(tiny(), numbered_rows(), eval_every=0, **run)
    with pytest.raises(CheckpointError, match="resume with the same data"):
        train(tiny(), numbered_rows(), eval_every="never", resume=True, **run)
