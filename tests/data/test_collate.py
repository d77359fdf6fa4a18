"""Examples at their own length, and the task's collator padding each batch to its longest row."""
import json

import pandas as pd
import pytest
import torch

from tier_utils import build_datasets, make_loader
from tier_utils.data.collate import PadCollator


def rows(*lengths, start=1):
    return [{"input_ids": torch.arange(start, start + n), "attention_mask": torch.ones(n, dtype=torch.long),
             "labels": torch.arange(start, start + n)} for n in lengths]


def test_a_batch_is_padded_to_its_longest_row_rounded_to_8_labels_minus_100_masks_0():
    batch = PadCollator(pad_id=7)(rows(3, 10))
    assert batch["input_ids"].shape == (2, 16)
    assert batch["input_ids"][0, 3:].eq(7).all() and batch["input_ids"][1, 10:].eq(7).all()
    assert batch["attention_mask"].sum(1).tolist() == [3, 10]
    assert batch["labels"][0, 3:].eq(-100).all() and batch["labels"][0, :3].tolist() == [1, 2, 3]


def test_left_padding_the_limit_and_rows_of_one_length():
    left = PadCollator(pad_id=0, side="left", limit=12)(rows(3, 10))
    assert left["input_ids"].shape == (2, 12)  # 16 would pass the model's max length
    assert left["input_ids"][0, -3:].tolist() == [1, 2, 3] and left["attention_mask"][0, :9].eq(0).all()
    same = PadCollator()(rows(5, 5))
    assert same["input_ids"].shape == (2, 8)  # rows of one length (a grouped batch) are rounded up too
    assert same["labels"][:, 5:].eq(-100).all() and same["attention_mask"].sum().item() == 10
    assert PadCollator()(rows(8, 8))["input_ids"].shape == (2, 8)
    images = [{"pixel_values": torch.rand(3, 5, 5), "labels": torch.tensor(1)}] * 2
    assert PadCollator()(images)["pixel_values"].shape == (2, 3, 5, 5)  # not token rows: stacked as they are
    assert PadCollator(limit=10).padded_length(10) == 10 and PadCollator(limit=4).padded_length(6) == 6


def test_a_pad_token_that_is_the_end_token_stays_scored_where_it_is_an_answer():
    eos = 2
    examples = [{"input_ids": torch.tensor([5, eos]), "labels": torch.tensor([eos, eos])},
                {"input_ids": torch.tensor([5, 6, 7, eos]), "labels": torch.tensor([6, 7, eos, eos])}]
    labels = PadCollator(pad_id=eos)(examples)["labels"]
    assert labels[0].tolist() == [eos, eos] + [-100] * 6  # padded by place, never masked by id
    assert (labels == eos).sum() == 4


def test_a_classifier_table_is_padded_per_batch_not_to_seq_len(tmp_path):
    texts = [("word " * n).strip() for n in (1, 2, 3, 4, 30, 5, 6, 2, 3, 1, 4, 2)]
    path = tmp_path / "t.csv"
    pd.DataFrame({"text": texts, "label": [i % 2 for i in range(len(texts))]}).to_csv(path, index=False)
    splits = build_datasets(path, "classification", seq_len=256, num_classes=2, val_fraction=0.25)
    lengths = [len(splits.train[i]["input_ids"]) for i in range(len(splits.train))]
    assert len(set(lengths)) > 1 and max(lengths) < 256  # each example at its own length
    widths = [b["input_ids"].shape[1] for b in make_loader(splits.train, 3, collate=splits.collate, shuffle=False)]
    assert max(widths) < 256 and all(w % 8 == 0 for w in widths)
    assert min(widths) < max(widths)  # a batch of short rows is not padded to the longest row of the set


def test_pairs_pad_each_side_to_its_own_longest(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"input": "a" * n, "target": "b" * (n // 3 + 1)}) + "\n"
                            for n in (3, 20, 7, 40, 9, 11)))
    splits = build_datasets(path, "seq2seq", seq_len=128, target_len=64, val_fraction=0)
    batch = next(iter(make_loader(splits.train, 6, collate=splits.collate, shuffle=False)))
    assert batch["input_ids"].shape == (6, 40) and batch["labels"].shape == (6, 16)
    for mask, labels in zip(batch["attention_mask"], batch["labels"]):
        scored = int(mask.sum()) // 3 + 1  # each target as long as its row says
        assert labels[:scored].ne(-100).all() and labels[scored:].eq(-100).all()


@pytest.mark.parametrize("task", ["classification", "seq2seq"])
def test_examples_are_kept_at_their_own_length_for_each_token_task(task):
    splits = build_datasets(None, task, seq_len=128)
    sizes = {len(splits.val[i]["input_ids"]) for i in range(len(splits.val))}
    assert min(sizes) < 128
