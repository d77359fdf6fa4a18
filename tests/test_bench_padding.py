"""bench/padding.py, train() beside the HF Trainer on long-tailed data (issue 57): at tiny sizes each runner has its
row with the positions it computed per real token, train() and the HF Trainer take the same first step's loss, and
its verdicts follow the benchmark's noise rule against the HF Trainer's default row."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from tier_utils.core.measure import summarize

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "padding.py"


@pytest.fixture(scope="module")
def padding():
    spec = importlib.util.spec_from_file_location("bench_padding", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow  # about 10 s of CPU: three training calls per runner and the HF Trainer's set-up
def test_tiny_run_has_each_runners_row_and_the_first_losses_agree(padding, tmp_path, capsys):
    pytest.importorskip("accelerate", reason="the HF Trainer needs accelerate (pip install .[bench])")
    args = ["--tiny", "--datasets", "classifier", "--runners", "hf", "train()", "train() seq_len", "--repeats", "1",
            "--steps", "1", "2", "--precision", "fp32", "--threads", "1", "--json", str(tmp_path / "p.json")]
    assert padding.main(args) == 0
    out = json.loads((tmp_path / "p.json").read_text())
    rows = {r["runner"]: r for r in out["rows"]}
    assert list(rows) == ["hf", "train()", "train() seq_len"]
    assert all(r["step_ms"]["median"] > 0 and r["positions_per_real"] >= 1 for r in rows.values())
    # padded to seq_len computes at least what padding each batch to its longest does, on the same rows
    assert rows["train() seq_len"]["positions_per_real"] >= rows["train()"]["positions_per_real"]
    losses = out["first_losses"]["classifier"]["fp32"]
    assert losses["train()"] == pytest.approx(losses["hf"], rel=padding.FP32_LOSS_TOLERANCE)
    printed = capsys.readouterr().out
    assert "first-step loss, classifier, fp32" in printed and ": equal within" in printed


def test_positions_count_the_mask_and_a_t5_targets_decoder_inputs(padding):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    assert padding.positions({"input_ids": torch.zeros(2, 4), "attention_mask": mask}) == (8, 5)
    decoder = torch.tensor([[0, 7, 9, 0], [0, 5, 0, 0]])  # start (pad id 0), targets, padding
    assert padding.positions({"input_ids": torch.zeros(2, 4), "attention_mask": mask,
                              "decoder_input_ids": decoder}) == (16, 5 + 3 + 2)


def test_the_verdict_is_the_benchmarks_noise_rule_against_hf(padding):
    base = summarize([100, 101, 102, 103, 104])
    assert padding.verdict("hf", base, base, 5) == "the baseline"
    assert padding.verdict("train()", base, summarize([101, 102, 103, 104, 105]), 5) == "no measurable difference"
    assert padding.verdict("hf grouped", base, summarize([70, 71, 72, 73, 74]), 5) == \
        "measurably faster; within the 0.77x target"
    assert padding.verdict("train()", base, summarize([110]), 1).startswith("no verdict from 1 repeat(s)")
