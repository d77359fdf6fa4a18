"""Compiling a run whose batches are cut to the data (issue 57): the warm-up marks the length dynamic so one graph
covers every batch length, the recompiles after it are counted and said, and a function that hits torch's recompile
limit (and so runs eager) is warned and said, never silent. Dynamo with the aot_eager backend: the same guards and
recompiles as inductor, without its code generation."""
import warnings

import pytest
import torch
from tiny import LengthExamples as Examples
from tiny import tiny

from tier_utils.engine import compiling
from tier_utils.engine.compiling import CompileFallbackWarning
from tier_utils.training import parts
from tier_utils.training.loop import train

LENGTHS = [3, 5, 8, 9, 12, 17, 20, 30] * 2  # batches of 4 padded to 8, 16, 24 or 32
RUN = dict(max_steps=4, batch_size=4, seq_len=32, eval_every=0, eval_batches=1, precision="fp32", progress=False,
           device="cpu", compile=True)


@pytest.fixture
def cheap_compile(monkeypatch):
    monkeypatch.setattr(compiling, "_compile", lambda module, mode: torch.compile(module, backend="aot_eager"))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_batches_of_many_lengths_compile_once_and_the_recompiles_are_counted(cheap_compile):
    result = train(tiny("tiny-encoder", seed=0), (Examples(LENGTHS), Examples(LENGTHS)), **RUN)
    s = result.summary
    assert s.compiled and "the batch length marked dynamic" in s.compile_reason
    assert isinstance(s.recompiles, int) and f"{s.recompiles} recompile(s) after the warm-up" in s.compile_reason
    assert s.recompiles == 0  # one graph for every length (unmarked, dynamo recompiles at the second length)


def test_a_fall_back_to_eager_past_the_recompile_limit_is_warned_and_said(cheap_compile, monkeypatch):
    monkeypatch.setattr(parts, "lengths_vary", lambda adapter, data: False)  # one graph per length
    # dynamo's own patch: monkeypatch's undo leaves the setting hidden, and torch.export then fails in later tests
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False, recompile_limit=1), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(tiny("tiny-encoder", seed=0), (Examples(LENGTHS), Examples(LENGTHS)), **RUN)
    said = [str(w.message) for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert said and "hit its recompile limit (1)" in said[0] and "runs eager" in said[0]
    assert said[0] in result.summary.compile_reason and result.summary.steps == 4
