"""Fixtures shared by the test files; the sizes behind them live in tiny.py."""
import pytest
from tiny import TINY, tiny


@pytest.fixture
def tiny_kwargs() -> dict:
    return dict(TINY)  # a copy: a test may add to it


@pytest.fixture
def tiny_model():
    """The builder: tiny_model(), tiny_model("tiny-encoder", num_classes=3), tiny_model(MyGPT, seed=0)."""
    return tiny


@pytest.fixture(scope="session")
def trained_hf_folder(tmp_path_factory):
    """A trained model as users bring one: a BPE tokenizer (vocab 1000) trained with `tokenizers` on the
    bundled corpus, a small GPT-2 trained on its ids for 150 steps, both written with save_pretrained.
    Nothing is downloaded; a few seconds."""
    from real import trained_hf_folder as build

    return build(tmp_path_factory.mktemp("trained-hf"))
