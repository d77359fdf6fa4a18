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
