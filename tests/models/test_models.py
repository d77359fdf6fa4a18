import textwrap

import pytest
import torch
import torch.nn as nn

from tier_utils import AdapterError, ModelSpecError, adapt, load_model
from tier_utils.adapter.adapter import DEFAULT_MAX_LEN, extract_logits
from tier_utils.models.builtins import TinyEncoder, TinyGPT

HF_GPT2 = dict(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
HF_BERT = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64,
               vocab_size=256, max_position_embeddings=64, num_labels=4)


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "my_models.py"
    path.write_text(textwrap.dedent("""
        import torch.nn as nn

        class Bag(nn.Module):
            def __init__(self, vocab=50, width=8, classes=3):
                super().__init__()
                self.emb = nn.EmbeddingBag(vocab, width)
                self.tok = nn.Embedding(vocab, width)
                self.pos_table = nn.Embedding(16, width)
                self.head = nn.Linear(width, classes)
            def forward(self, x):
                return (self.head(self.tok(x).mean(1)),)

        def make_gpt(**kw):
            from tier_utils.models.builtins import TinyGPT
            return TinyGPT(**kw)

        def broken():
            raise RuntimeError("out of sprockets")

        NOT_A_MODEL = 3
    """))
    return path


def test_builtin_models_take_size_kwargs():
    gpt = load_model("tiny-gpt", d_model=32, n_layer=1, n_head=2, max_len=16)
    assert isinstance(gpt, TinyGPT) and len(gpt.blocks) == 1 and gpt.max_len == 16
    enc = load_model("tiny-encoder", d_model=32, num_classes=3)
    assert isinstance(enc, TinyEncoder) and enc.head.out_features == 3


def test_module_instance_is_returned_as_is():
    m = TinyGPT(d_model=32, n_head=2)
    assert load_model(m) is m


def test_file_spec_class_and_factory(model_file):
    bag = load_model(f"{model_file}:Bag", classes=5)
    assert bag.head.out_features == 5
    gpt = load_model(f"{model_file}:make_gpt", d_model=32, n_head=2)
    assert isinstance(gpt, TinyGPT)


def test_package_module_spec():
    assert isinstance(load_model("tier_utils.models.builtins:TinyEncoder", d_model=32, n_head=2), TinyEncoder)


def test_hf_specs_build_from_config_without_download():
    gpt2 = load_model("hf:GPT2LMHeadModel", **HF_GPT2)
    bert = load_model("hf:BertForSequenceClassification", **HF_BERT)
    a, b = adapt(gpt2), adapt(bert)
    assert (a.task.name, a.vocab_size, a.max_len, a.takes_input_ids_kwarg) == ("causal-lm", 256, 64, True)
    assert (b.task.name, b.num_classes, b.max_len, b.takes_attention_mask) == ("classification", 4, 64, True)
    batch = b.example_batch(3, 10)
    loss, logits = b.forward_loss(batch)
    assert logits.shape == (3, 4) and torch.isfinite(loss)


@pytest.mark.parametrize("spec,message", [
    ("nope.py:Model", "not found"),
    ("tier_utils.models.loading:Missing", "has no attribute 'Missing'"),
    ("no_such_pkg_xyz:Model", "cannot import module"),
    ("hf:NoSuchModel", "no model class 'NoSuchModel'"),
    ("gpt-17", "unknown model 'gpt-17'"),
])
def test_bad_specs_give_one_line_naming_the_fix(spec, message):
    with pytest.raises(ModelSpecError, match=message) as info:
        load_model(spec)
    assert "\n" not in str(info.value)


def test_constructor_error_includes_its_message(model_file):
    with pytest.raises(ModelSpecError, match="out of sprockets"):
        load_model(f"{model_file}:broken")
    with pytest.raises(ModelSpecError, match="not a model class"):
        load_model(f"{model_file}:NOT_A_MODEL")
    with pytest.raises(ModelSpecError, match="check its arguments"):
        load_model("tiny-gpt", nonsense=1)


def test_adapter_probes_unknown_models(model_file):
    bag = adapt(load_model(f"{model_file}:Bag"))
    # Task from the output shape; vocab from the first embedding; length from a position table.
    assert (bag.task.name, bag.num_classes, bag.vocab_size, bag.max_len) == ("classification", 3, 50, 16)
    assert not bag.takes_input_ids_kwarg
    assert bag.logits(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 3)


def test_adapter_asks_for_what_it_cannot_find():
    class NoEmbedding(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x)

    with pytest.raises(AdapterError, match="pass vocab_size=N"):
        adapt(NoEmbedding())

    class NoLength(nn.Module):  # no position table, any length works (as ALiBi or state-space models)
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, x):
            return self.emb(x)

    a = adapt(NoLength())
    assert a.max_len == DEFAULT_MAX_LEN and "no position table" in a.max_len_note
    assert adapt(NoLength(), max_len=32).max_len_note is None

    class HiddenLimit(NoLength):  # a limit the adapter can't read: the default length is tried, and refused
        def forward(self, x):
            if x.size(1) > 16:
                raise ValueError("too long")
            return self.emb(x)

    with pytest.raises(AdapterError, match="pass max_len=N"):
        adapt(HiddenLimit())
    assert adapt(HiddenLimit(), max_len=16).task.name == "causal-lm"


def test_output_without_logits_is_a_clear_error():
    with pytest.raises(AdapterError, match="no logits"):
        extract_logits({"hidden": 1}, "M")
    assert extract_logits((torch.ones(1), None)).shape == (1,)


def test_lm_loss_is_mean_next_token_cross_entropy():
    a = adapt(TinyGPT(d_model=32, n_head=2, max_len=16))
    batch = a.example_batch(2, 8)
    loss, logits = a.forward_loss(batch)
    expected = torch.nn.functional.cross_entropy(logits.view(-1, 256), batch["labels"].view(-1))
    assert logits.shape == (2, 8, 256) and torch.equal(loss, expected)


def test_too_long_input_names_the_fix():
    with pytest.raises(ValueError, match="larger max_len"):
        TinyGPT(max_len=8, d_model=32, n_head=2)(torch.zeros(1, 9, dtype=torch.long))
