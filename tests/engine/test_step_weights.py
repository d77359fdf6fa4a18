"""A step over micro-batches that hold different counts of scored targets (batches cut to the data) takes the gradient
of the mean over all of them, as one batch of the same rows would: not a mean of the micro-batches' means."""
import types

import pytest
import torch
from tiny import tiny

from tier_utils.adapter.adapter import adapt
from tier_utils.core.precision import resolve_precision
from tier_utils.data.collate import PadCollator
from tier_utils.engine.step import TrainStep, make_optimizer
from tier_utils.engine.strategies import Single


def rows(*lengths):
    out = []
    for n in lengths:
        ids = torch.arange(1, n + 2) % 250 + 1
        out.append({"input_ids": ids[:-1], "attention_mask": torch.ones(n, dtype=torch.long), "labels": ids[1:]})
    return out


def step_grads(micro_batches, strategy=None):
    torch.manual_seed(0)
    adapter = adapt(tiny(seed=0))
    step = TrainStep(adapter, resolve_precision("fp32"), make_optimizer(adapter.model, 1e-3, 0.0), grad_clip=None,
                     strategy=strategy)
    out = step(micro_batches)
    return out.loss, [p.grad.clone() for p in adapter.model.parameters()], step


def test_micro_batches_of_uneven_lengths_step_as_one_batch_of_their_rows():
    collate = PadCollator()
    short, long = rows(2, 3), rows(14, 16)
    loss, grads, _ = step_grads([collate(short), collate(long)])
    whole_loss, whole, _ = step_grads([collate(short + long)])
    torch.testing.assert_close(loss, whole_loss, rtol=0, atol=1e-6)
    for g, w in zip(grads, whole):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_under_ranks_each_micro_batch_is_weighted_by_its_share_of_every_ranks_targets():
    collate = PadCollator()
    other_rank = 30.0  # the scored targets the other rank's micro-batches hold
    env = types.SimpleNamespace(world_size=2, all_sum=lambda t: t + other_rank)
    _, _, step = step_grads([collate(rows(2, 3))], Single(env=env))
    a, b = collate(rows(2, 3)), collate(rows(14, 16))
    weights = step._weights([a, b])
    assert [w.item() for w in weights] == pytest.approx([5 * 2 / (35 + 30), 30 * 2 / (35 + 30)])
