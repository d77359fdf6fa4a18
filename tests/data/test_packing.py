"""Batches cut to the data (issue 57): grouped by length (a seeded order whose global batches are dealt to ranks),
and packed (best-fit-decreasing rows in which no example attends to another, on the models that can keep them apart;
the rest run padded, said in one line)."""
from __future__ import annotations

import random
import statistics
import warnings

import pandas as pd
import pytest
import torch
from styles import GPT

from tier_utils.adapter.adapter import adapt
from tier_utils.core.errors import DataError
from tier_utils.data.collate import PadCollator
from tier_utils.data.lengths import in_length_order, length_grouped
from tier_utils.data.packing import PackedRows, best_fit_decreasing, packed
from tier_utils.engine.distributed import ShardedSampler
from tier_utils.tasks import CAUSAL_LM, build_datasets

VOCAB = 96


class Lengths(torch.utils.data.Dataset):
    """Causal examples of the given lengths, each filled with its own index (a row's tokens name it)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = self.lengths[i]
        ids = torch.randint(1, VOCAB, (n + 1,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids[:-1], "labels": ids[1:], "attention_mask": torch.ones(n, dtype=torch.long)}


def long_tailed(n: int = 400, seed: int = 0) -> list[int]:
    """Lengths like real sentences': median about 12, a tail to 120."""
    rng = random.Random(seed)
    return [min(120, max(2, int(rng.lognormvariate(2.5, 0.7)))) for _ in range(n)]


def test_best_fit_decreasing_keeps_every_example_once_within_rows_and_packs_tightly():
    lengths = long_tailed()
    bins = best_fit_decreasing(lengths, 128)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert len(bins) <= -(-sum(lengths) // 128) * 1.1  # within 10 % of a perfect fill
    assert best_fit_decreasing(lengths, 128) == bins  # deterministic: a resume packs as the run did
    assert best_fit_decreasing([5, 3, 4, 2, 6, 1], 8) == [[4, 3], [0, 1], [2, 5]]  # 6+2, 5+3, 4+1


def test_grouped_batches_are_of_similar_length_seeded_and_two_ranks_see_what_one_sees():
    lengths = long_tailed()
    data = Lengths(lengths)
    b = 4

    def batches(world, rank, per_rank, epoch=0, seed=0):
        s = ShardedSampler(data, world, rank, seed, True, lengths, per_rank * world)
        s.set_epoch(epoch)
        order = list(s)
        return [order[i:i + per_rank] for i in range(0, len(order) - per_rank + 1, per_rank)]

    one = batches(1, 0, 2 * b)
    ranks = [batches(2, r, b) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(one)  # every rank runs the same steps
    for k, whole in enumerate(one):
        assert sorted(ranks[0][k] + ranks[1][k]) == sorted(whole)  # N ranks with b see what one rank with N*b sees
    spread = statistics.mean(max(lengths[i] for i in x) - min(lengths[i] for i in x) for x in one)
    plain = [list(ShardedSampler(data, 1, 0, 0, True))[i:i + 2 * b] for i in range(0, 400, 2 * b)]
    assert spread < 0.25 * statistics.mean(max(lengths[i] for i in x) - min(lengths[i] for i in x) for x in plain)
    assert sorted(sum(one, [])) == sorted(sum(plain, []))  # the same rows in an epoch, only regrouped
    assert batches(1, 0, 2 * b) == one and batches(1, 0, 2 * b, epoch=1) != one  # from (seed, epoch) alone
    assert max(lengths[i] for i in one[0]) == max(lengths)  # the longest row leads: memory fails at step 1


def test_grouping_keeps_batch_boundaries_and_length_order_only_reorders_chosen_rows():
    lengths = [3, 9, 1, 7, 5, 2, 8]
    grouped = length_grouped(list(range(7)), lengths, 2)
    assert sorted(grouped) == list(range(7)) and grouped[0] == 1
    assert in_length_order([0, 2, 4], lengths) == [4, 0, 2]  # rows 1, 3 (longer) are not chosen: not taken


def tiny_causal(kind: str, attn: str, dtype=torch.float32):
    """A tiny transformers causal LM, built here: Llama, GPT-2 or Qwen2."""
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, attn_implementation=attn, dtype=dtype)
    config = {"llama": lambda: tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128, **common),
              "qwen2": lambda: tf.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=128, **common),
              "gpt2": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=0,
                                            eos_token_id=0, **common)}[kind]()
    model = tf.AutoModelForCausalLM.from_config(config).to(dtype).eval()
    return adapt(model)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["llama", "gpt2", "qwen2"])
def test_a_packed_row_gives_each_example_the_logits_it_has_alone(kind, attn):
    """The only guard against a leak between packed examples: a leak raises nothing."""
    adapter = tiny_causal(kind, attn)
    assert adapter.packs
    examples = Lengths([11, 5, 17, 3, 9, 6])
    rows = PackedRows(examples, best_fit_decreasing(examples.lengths, 24))
    batch = PadCollator(limit=adapter.max_len)([rows[i] for i in range(len(rows))])
    assert len(rows) < len(examples) and batch["input_ids"].shape[1] == 24
    with torch.no_grad():
        got = adapter.batch_logits(batch)
        leaked = adapter.logits(batch["input_ids"], batch["attention_mask"])  # what a 2-D mask gave: no blocks
        worst, leak = 0.0, 0.0
        for r, members in enumerate(rows.bins):
            at = 0
            for k in members:
                n = examples.lengths[k]
                alone = adapter.logits(examples[k]["input_ids"][None])[0]
                worst = max(worst, (got[r, at:at + n] - alone).abs().max().item())
                leak = max(leak, (leaked[r, at:at + n] - alone).abs().max().item())
                at += n
    assert worst < 1e-4, f"{kind}/{attn}: a packed example's logits differ from its own by {worst}"
    assert leak > 1e-2  # the test can fail: without the blocks the later examples see the earlier ones


def test_packed_bf16_stays_within_bf16s_tolerance_and_the_loss_is_the_unpacked_mean():
    examples = Lengths([11, 5, 17, 3, 9, 6])
    rows = PackedRows(examples, best_fit_decreasing(examples.lengths, 24))
    fp32 = tiny_causal("llama", "sdpa")
    padded = PadCollator()([examples[i] for i in range(len(examples))])
    batch = PadCollator()([rows[i] for i in range(len(rows))])
    with torch.no_grad():
        loss_packed = CAUSAL_LM.loss(fp32.batch_logits(batch), batch["labels"])
        loss_padded = CAUSAL_LM.loss(fp32.batch_logits(padded), padded["labels"])
        assert loss_packed.item() == pytest.approx(loss_padded.item(), abs=1e-5)  # over the scored tokens, as unpacked
        bf16 = tiny_causal("llama", "sdpa", torch.bfloat16)
        got, alone = bf16.batch_logits(batch)[0, :17].float(), bf16.logits(examples[2]["input_ids"][None])[0].float()
    assert (got - alone).abs().max().item() < 0.05 * alone.abs().max().item()
    assert CAUSAL_LM.units(batch) == sum(examples.lengths) < batch["input_ids"].numel()  # real tokens, not positions


def table(path, n=60):
    words = "the cat sat on a mat while dogs ran past quickly".split()
    texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(1 + (i * 7) % 13)) for i in range(n)]
    pd.DataFrame({"text": texts}).to_csv(path, index=False)
    return path


def test_a_table_packs_one_example_per_row_and_stays_windows_without_packing(tmp_path):
    path = table(tmp_path / "t.csv")
    windows = build_datasets(str(path), "causal-lm", seq_len=32, val_fraction=0.1)
    rows = build_datasets(str(path), "causal-lm", seq_len=32, val_fraction=0.1, packing=True)
    assert {len(windows.train[i]["input_ids"]) for i in range(len(windows.train))} == {32}
    assert isinstance(rows.train, PackedRows) and len(rows.val) == 6  # validation: whole rows, as examples
    first = rows.train.examples[rows.train.bins[0][0]]
    assert len(first["input_ids"]) <= 32 and torch.equal(first["input_ids"][1:], first["labels"][:-1])
    lengths = [len(rows.train[i]["input_ids"]) for i in range(len(rows.train))]
    assert max(lengths) <= 32 and sum(lengths) == sum(len(rows.train.examples[k]["input_ids"])
                                                      for b in rows.train.bins for k in b)


def test_a_packed_tables_one_token_rows_are_dropped_counted_and_none_left_is_one_line(tmp_path):
    path = tmp_path / "t.csv"
    texts = ["hello world"] * 8
    texts[2] = texts[6] = "x"  # one byte, one token: no (input, next-token) pair
    pd.DataFrame({"text": texts}).to_csv(path, index=False)
    with pytest.warns(UserWarning, match=r"dropped 2 of 8 rows whose 'text' has under two tokens .*\(rows 3, 7\)"):
        splits = build_datasets(str(path), "causal-lm", seq_len=32, val_fraction=0.25, packing=True)
    assert isinstance(splits.train, PackedRows) and len(splits.train.examples) + len(splits.val) == 6
    pd.DataFrame({"text": ["x", "y"]}).to_csv(path, index=False)
    with pytest.raises(DataError, match="has no usable row: every row's 'text' has under two tokens"):
        build_datasets(str(path), "causal-lm", seq_len=32, packing=True)


def test_windows_pack_to_themselves_and_a_hand_written_gpt_runs_padded_in_one_line(tmp_path):
    with pytest.warns(UserWarning, match="nothing to pack") as said:
        splits = build_datasets(torch.randint(0, 256, (40, 17)), "causal-lm", seq_len=16, packing=True)
    assert len(said) == 1 and not isinstance(splits.train, PackedRows)
    hand = adapt(GPT())
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        splits = hand.datasets(str(table(tmp_path / "t.csv")), 16, packing=True)
    lines = [str(w.message) for w in said if "packing" in str(w.message)]
    assert lines == ["packing isn't available for GPT (packing needs a transformers model whose forward takes "
                     "position_ids, to keep packed examples apart): running padded"]
    assert not isinstance(splits.train, PackedRows)
    with pytest.raises(ValueError, match="packing packs a causal LM's examples"):
        packed(build_datasets(None, "classification", seq_len=16).train, 16)


def test_a_transformers_model_whose_forward_drops_the_positions_is_caught_and_runs_padded(tmp_path):
    """A forward that takes position_ids but builds its mask another way would leak without a sound: the adapter
    checks two packed examples on the model itself before packing."""
    from transformers import LlamaForCausalLM

    class Drops(LlamaForCausalLM):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    leaky = tiny_causal("llama", "sdpa")
    leaky.model.__class__ = Drops
    with pytest.warns(UserWarning, match="lets a packed example see the one before it") as said:
        leaky.datasets(Lengths([3, 5, 4, 6, 2, 7, 3, 2, 5, 4]), 16, packing=True)
    assert len([w for w in said if "packing" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert isinstance(tiny_causal("gpt2", "eager").datasets(Lengths([3, 5, 4, 6, 2, 7, 3, 2, 5, 4]), 16,
                                                                  packing=True).train, PackedRows)
    assert not [w for w in said if "packing" in str(w.message)]
