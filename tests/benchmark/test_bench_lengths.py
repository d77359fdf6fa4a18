"""The benchmark on examples at their own lengths (issue 57): its batches are the rows training's seeded shuffle draws,
put longest first among themselves (never chosen by length), and its throughput and FLOPs are the timed batches'
means, not the first batch's."""
import types

import pytest
import torch
from tiny import LengthExamples as Examples
from tiny import tiny
from torch.utils.data import RandomSampler

from tier_utils.adapter.adapter import adapt
from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.benchmark.measurements import same_batches
from tier_utils.core.measure import count_flops
from tier_utils.data.collate import PadCollator

LENGTHS = [3, 30, 5, 17, 8, 22, 9, 12, 4, 26, 11, 6]  # 12 rows: batches of 4 cut from them


def _splits(lengths):
    return types.SimpleNamespace(train=Examples(lengths), collate=PadCollator())


def _real(batch):
    return batch["attention_mask"].sum(1).tolist()


def test_the_benched_rows_are_the_drawn_ones_put_longest_first():
    cfg = types.SimpleNamespace(batch_size=4, seed=3)
    batches = list(same_batches(_splits(LENGTHS), 3, cfg, "cpu", by_length=True))
    drawn = list(RandomSampler(Examples(LENGTHS), generator=torch.Generator().manual_seed(3)))
    got = [n for b in batches for n in _real(b)]
    assert sorted(got) == sorted(LENGTHS[i] for i in drawn)  # the rows a seeded shuffle draws: here all 12
    assert got == sorted(got, reverse=True)  # longest first, so each batch holds rows of like length
    assert [b["input_ids"].shape[1] for b in batches] == [32, 16, 8]  # padded to 30, 12, 6 rounded up to 8
    again = list(same_batches(_splits(LENGTHS), 3, cfg, "cpu", by_length=True))
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(batches, again))


def test_a_subset_is_chosen_before_it_is_sorted_and_a_small_set_cycles():
    cfg = types.SimpleNamespace(batch_size=4, seed=0)
    one = [n for b in same_batches(_splits(LENGTHS), 1, cfg, "cpu", by_length=True) for n in _real(b)]
    drawn = list(RandomSampler(Examples(LENGTHS), generator=torch.Generator().manual_seed(0)))[:4]
    assert one == sorted((LENGTHS[i] for i in drawn), reverse=True)  # the first 4 drawn, not the 4 longest
    cycled = list(same_batches(_splits(LENGTHS[:5]), 3, cfg, "cpu", by_length=False))
    assert len(cycled) == 3  # 5 rows make one whole batch per pass: three passes


def test_the_throughput_and_flops_are_the_timed_batches_means():
    model = tiny("tiny-encoder", seed=0)
    result = amp_benchmark(model, (Examples(LENGTHS * 2), Examples(LENGTHS)), precisions=["fp32"], batch_size=4,
                           seq_len=32, untimed_steps=1, timed_steps=3, repeats=1, accuracy_steps=0, eval_batches=1,
                           progress=False, device="cpu")
    cfg = types.SimpleNamespace(batch_size=4, seed=result.config.settings.seed)
    batches = list(same_batches(_splits(LENGTHS * 2), 4, cfg, "cpu", by_length=True))
    timed = batches[1:]
    assert len({b["input_ids"].shape for b in timed}) > 1  # the check below could tell a mean from one batch
    assert result.config.tokens_per_step == pytest.approx(sum(sum(_real(b)) for b in timed) / 3)
    adapter = adapt(model)

    def flops(batch):
        return count_flops(lambda: adapter.forward_loss(batch)[0].backward())["per_step"]

    assert result.flops["per_step"] == pytest.approx(sum(flops(b) for b in timed) / 3)
    assert result.flops["per_step"] != pytest.approx(flops(batches[0]))
