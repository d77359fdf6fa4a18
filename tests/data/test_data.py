import pytest
import torch

from tier_utils import DataError, build_datasets, corpus_split, corpus_topics, make_loader
from tier_utils.data.datasets import TOPIC_GROUPS, topic_group
from tier_utils.data.tokenizer import ByteTokenizer


def test_corpus_is_real_cpython_docs():
    topics = corpus_topics()
    assert len(topics) > 50 and sum(len(t) for t in topics.values()) > 300_000
    assert "assert" in topics


def test_split_is_by_topic_with_no_overlap_and_every_group_in_val():
    train, val = corpus_split()
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(corpus_topics())
    assert {topic_group(t) for t in val} == set(TOPIC_GROUPS)


def test_lm_windows_do_not_leak_val_text_into_train():
    splits = build_datasets(task="causal-lm", seq_len=32)
    x = splits.val[0]
    assert torch.equal(x["input_ids"][1:], x["labels"][:-1])  # labels are next tokens
    train_text = ByteTokenizer().decode(splits.train.tokens)
    val_topic_text = corpus_topics()[corpus_split()[1][0]]
    # A long val-only passage never appears in the training stream.
    assert val_topic_text[:200] not in train_text


def test_classification_set_labels_follow_topic_groups():
    splits = build_datasets(task="classification", seq_len=48)
    labels = set(splits.train.labels.tolist())
    assert labels == set(range(len(TOPIC_GROUPS)))
    item = splits.train[0]
    assert item["input_ids"].shape == (48,) and item["attention_mask"].sum() > 0


def test_byte_encoding_round_trips():
    assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"


def test_user_text_list_and_file(tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 40
    path = tmp_path / "t.txt"
    path.write_text(text)
    for data in (path, str(path), [text]):
        s = build_datasets(data, seq_len=16)
        assert s.source == "text" and len(s.train) > len(s.val) > 0


def test_tensor_data_and_synthetic():
    rows = torch.randint(0, 256, (20, 9))
    s = build_datasets(rows, seq_len=8)
    assert s.source == "tensors" and len(s.train) + len(s.val) == 20
    assert s.train[0]["input_ids"].shape == (8,)
    syn = build_datasets("synthetic", task="classification", seq_len=8, num_classes=3)
    assert syn.train[0]["labels"].dim() == 0 and int(syn.train[0]["labels"]) < 3


@pytest.mark.parametrize("kwargs,message", [
    (dict(data="missing.txt"), "not found"),
    (dict(data=42), "unsupported data int"),
    (dict(data=["short"], seq_len=64), "too short"),
    (dict(vocab_size=100), "vocab_size>=256"),
    (dict(task="classification", num_classes=2), "num_classes=4"),
    (dict(data=["some text " * 100], task="classification"), "no labels"),
])
def test_bad_data_names_the_fix(kwargs, message):
    with pytest.raises(DataError, match=message):
        build_datasets(**kwargs)


def test_loader_is_seeded_and_stacks_batches():
    ds = build_datasets("synthetic", seq_len=8).train
    first = [b["input_ids"] for b in make_loader(ds, 4, seed=3)][:3]
    again = [b["input_ids"] for b in make_loader(ds, 4, seed=3)][:3]
    other = next(iter(make_loader(ds, 4, seed=4)))["input_ids"]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert first[0].shape == (4, 8) and not torch.equal(first[0], other)


def test_loader_worker_options():
    ds = build_datasets("synthetic", seq_len=8).train
    dl = make_loader(ds, 4, num_workers=1)
    assert dl.persistent_workers and dl.prefetch_factor == 2 and not dl.pin_memory
    with pytest.raises(DataError, match="batch_size must be >= 1"):
        make_loader(ds, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_loader_pins_memory_and_batches_copy_without_blocking():
    from tier_utils.data.datasets import to_device
    splits = build_datasets(None, task="causal-lm", seq_len=16)
    loader = make_loader(splits.train, batch_size=4, device="cuda")
    batch = next(iter(loader))
    assert loader.pin_memory and all(t.is_pinned() for t in batch.values())
    moved = to_device(batch, "cuda")
    torch.cuda.synchronize()
    assert all(t.device.type == "cuda" and torch.equal(t.cpu(), batch[k]) for k, t in moved.items())
    assert not make_loader(splits.train, batch_size=4, device="cpu").pin_memory
