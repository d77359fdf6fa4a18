"""Every training and benchmark result says the share of the positions it computed that was padding, and what
padding each example to seq_len would have made it (issue 57): counted exactly on a hand-built dataset."""
import pytest
import torch
from tiny import tiny
from torch.utils.data import Dataset

from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.training.loop import train

LENGTHS = [3, 5, 8, 9]  # one batch of 4: padded to 16 (the longest, 9, rounded up to a multiple of 8)


class Examples(Dataset):
    """Classifier examples at their own lengths."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = self.lengths[i]
        return {"input_ids": torch.arange(1, n + 1), "attention_mask": torch.ones(n, dtype=torch.long),
                "labels": torch.tensor(i % 2)}


def test_train_states_the_padding_share_of_its_batches_and_at_seq_len():
    data = (Examples(LENGTHS), Examples(LENGTHS))
    result = train(tiny("tiny-encoder", seed=0), data, max_steps=2, batch_size=4, seq_len=32, eval_every=0,
                   eval_batches=1, progress=False, device="cpu")
    padding = result.summary.padding
    real = sum(LENGTHS) * 2  # two steps, each the four examples
    assert (padding["computed"], padding["real"], padding["at_length"]) == (2 * 4 * 16, real, 2 * 4 * 32)
    assert padding["share"] == pytest.approx(1 - real / 128)
    said = "padding 61 % of positions per batch (80 % at seq_len 32, every example padded to it)"
    assert padding["describe"] == said
    assert said in result.summary_line()
    assert dict(zip(result.table["metric"], result.table["value"]))["padding"] == said
    assert result.to_json()["summary"]["padding"]["share"] == pytest.approx(1 - real / 128)


def test_corpus_windows_have_no_padding_and_no_comparison():
    result = train(tiny(seed=0), None, max_steps=1, batch_size=2, seq_len=16, eval_every=0, eval_batches=1,
                   progress=False, device="cpu")
    assert result.summary.padding["describe"] == "padding 0 % of positions per batch"


def test_the_benchmark_states_the_padding_share_of_its_batches():
    result = amp_benchmark(tiny("tiny-encoder", seed=0), (Examples(LENGTHS * 4), Examples(LENGTHS)),
                           precisions=["fp32"], batch_size=4, seq_len=32, untimed_steps=1, timed_steps=1, repeats=1,
                           accuracy_steps=1, eval_batches=1, progress=False, device="cpu")
    padding = result.config.padding
    assert padding["computed"] > padding["real"] > 0 and 0 < padding["share"] < padding["share_at_length"]
    assert padding["describe"] in result.summary_line()
    assert result.to_json()["config"]["padding"]["describe"] == padding["describe"]
