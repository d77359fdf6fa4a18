"""bench/padding.py, train() beside the HF Trainer (and, on chat data, TRL's SFTTrainer) on long-tailed data (issue
57): at tiny sizes each runner has its row with the positions it computed per real token, train() and the baseline
take the same first step's loss, and its verdicts follow the benchmark's noise rule against the baseline's row."""
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
    # a padding-free packed batch has no mask: its real tokens are the ids that are not the pad (0)
    assert padding.positions({"input_ids": torch.tensor([[5, 6, 7, 5, 6, 0, 0, 0]]),
                              "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 0, 0]])}) == (8, 5)


def test_the_verdict_is_the_benchmarks_noise_rule_against_hf(padding):
    base = summarize([100, 101, 102, 103, 104])
    assert padding.verdict("hf", base, base, 5) == "the baseline"
    assert padding.verdict("train()", base, summarize([101, 102, 103, 104, 105]), 5) == "no measurable difference"
    assert padding.verdict("hf grouped", base, summarize([70, 71, 72, 73, 74]), 5) == \
        "measurably faster; within the 0.77x target"
    assert padding.verdict("train()", base, summarize([110]), 1).startswith("no verdict from 1 repeat(s)")


@pytest.mark.slow  # about 12 s of CPU: TRL's dataset preparation on each of its calls
def test_tiny_chat_run_has_trls_rows_and_packing_computes_fewer_positions(padding, tmp_path, capsys):
    pytest.importorskip("trl", reason="TRL's SFTTrainer is chat data's peer (pip install .[bench])")
    args = ["--tiny", "--datasets", "chat", "--runners", "hf", "train() packed", "trl packed", "--repeats", "1",
            "--steps", "1", "2", "--precision", "fp32", "--threads", "1", "--json", str(tmp_path / "p.json")]
    assert padding.main(args) == 0
    out = json.loads((tmp_path / "p.json").read_text())
    rows = {r["runner"]: r for r in out["rows"]}
    assert list(rows) == ["trl", "train() packed", "trl packed"]  # TRL's padded row, the baseline, always runs
    assert all(r["baseline"] == "trl" for r in rows.values())
    # packing computes fewer positions per real token than padding each batch, on either side
    assert rows["train() packed"]["positions_per_real"] < rows["trl"]["positions_per_real"]
    assert rows["trl packed"]["positions_per_real"] < rows["trl"]["positions_per_real"]
    # the same first batch and weights: TRL's assistant-only loss scores the tokens train() scores
    losses = out["first_losses"]["chat"]["fp32"]
    assert losses["train()"] == pytest.approx(losses["trl"], rel=padding.FP32_LOSS_TOLERANCE)
    printed = capsys.readouterr().out
    assert "skipped HF Trainer, default collator on chat: chat data's peer is TRL's SFTTrainer" in printed
    assert "target, packed chat data computes <= 1.1 positions per real token: train() packed" in printed
