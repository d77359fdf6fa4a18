"""Memory modes (issue 32): activation checkpointing and LoRA through peft, in train, the planner, the benchmark
and the CLI; a tiny HF Llama folder with its own BPE tokenizer, made here, for LoRA's round trips."""
import os

import pytest
import torch
import torch.nn as nn

from tier_utils import TinyGPT, load_model, train
from tier_utils.adapter.adapter import adapt
from tier_utils.cli import main
from tier_utils.core.budget import FREE_MEMORY_ENV
from tier_utils.core.measure import SavedTensorMeter, static_memory
from tier_utils.core.precision import resolve_precision
from tier_utils.engine.lora import LoraError, LoraSettings, apply_lora, lora_setting, lora_static_bytes
from tier_utils.engine.memory import NoRepeatedBlocks, checkpointed, repeated_blocks
from tier_utils.engine.step import TrainStep, make_optimizer
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.planning.planner import bisect_batch, device_room, fit, static_bytes

pytest.importorskip("peft")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TWO = dict(d_model=32, n_layer=2, n_head=2, max_len=32)  # two blocks: something to checkpoint
RUN = dict(batch_size=4, seq_len=32, eval_batches=1, progress=False, device="cpu", precision="fp32")
LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def _losses(result) -> list[float]:
    return result.history.train_loss.dropna().tolist()


# -- activation checkpointing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec,kwargs", [("tiny-gpt", dict(TWO, dropout=0.1)),
                                         ("hf:LlamaForCausalLM", dict(LLAMA, vocab_size=256))])
def test_checkpointing_leaves_the_fp32_loss_curve_unchanged(spec, kwargs):
    runs = []
    for on in (False, True):
        torch.manual_seed(0)
        result = train(load_model(spec, **kwargs), None, max_steps=5, eval_every=0, activation_checkpointing=on,
                       seed=3, **RUN)
        runs.append(result)
    plain, ck = (_losses(r) for r in runs)
    assert len(plain) >= 5 and plain == pytest.approx(ck, rel=1e-6)
    assert runs[0].summary.activation_checkpointing is None
    assert runs[1].summary.activation_checkpointing.startswith("2 blocks")
    assert not any("forward" in vars(b) for b in repeated_blocks(runs[1].model))  # the model comes back as it was


def test_checkpointing_saves_fewer_activation_bytes():
    model = TinyGPT(**TWO)
    batch = adapt(model).example_batch(4, 32)
    saved = []
    for on in (False, True):
        with SavedTensorMeter(model) as meter, checkpointed(model, meter) if on else torch.enable_grad():
            adapt(model).forward_loss(batch)[0].backward()
        saved.append(meter.bytes)
    assert saved[1] < 0.6 * saved[0]


def _checkpointed_step_bytes(adapter, batch: int, length: int) -> int:
    """A real training step with checkpointing at (batch, length), counted where the planner predicts: static bytes
    after the step, what the checkpointed forward keeps (block inputs included), the output's gradient, and one
    block's activations as its recompute holds them (measured: what block 0 saves without checkpointing, less its
    input, which checkpointing already keeps)."""
    adapter.model.zero_grad(set_to_none=True)
    optimizer = make_optimizer(adapter.model, 1e-3, 0.1)
    step = TrainStep(adapter, resolve_precision("fp32", "cpu", warn=False), optimizer)
    example = adapter.example_batch(batch, length)
    with SavedTensorMeter(adapter.model) as meter, checkpointed(adapter.model, meter):
        step([example])
    first = repeated_blocks(adapter.model)[0]
    marks = []

    def before(_module, args):
        block_meter.add(args[0])  # kept by checkpointing anyway: not part of the recompute
        marks.append(block_meter.bytes)

    hooks = [first.register_forward_pre_hook(before), first.register_forward_hook(lambda *_: marks.append(
        block_meter.bytes))]
    with SavedTensorMeter(adapter.model) as block_meter:
        adapter.forward_loss(example)
    for h in hooks:
        h.remove()
    output = 4 * batch * length * adapter.vocab_size
    return sum(static_memory(adapter.model, optimizer).values()) + meter.bytes + output + (marks[1] - marks[0])


def test_planner_with_checkpointing_agrees_with_a_bisection_under_an_injected_budget(monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layer=3, n_head=2, max_len=64)
    monkeypatch.setenv(FREE_MEMORY_ENV, "120MiB")
    result = fit(model, seq_len=64, precisions="fp32", device="cpu", progress=False)
    room = device_room(result.budget)
    planned = result.table.set_index("checkpointing").loc["on", "this_device"]
    adapter = adapt(model)
    found = bisect_batch(lambda b: _checkpointed_step_bytes(adapter, b, 64) <= room, 1)
    assert 10 <= found and abs(planned - found) <= max(1, 0.02 * found), (planned, found)


def test_bf16_with_checkpointing_fits_more_than_without():
    # Issue 32: the planner took autocast's batch-independent weight copies as per-sequence recompute bytes, so
    # bf16 with checkpointing looked smaller (13.5k) than without (15.8k) on the default model at T=64.
    result = fit("tiny-gpt", seq_len=64, precisions="bf16", device="cpu", progress=False)
    table = result.table[result.table.precision == "bf16"].set_index("checkpointing")
    assert table.loc["on", "this_device"] > table.loc["off", "this_device"]


def test_a_model_without_repeated_blocks_is_refused():
    plain = nn.Sequential(nn.Embedding(256, 16), nn.Linear(16, 256))
    plain.task, plain.max_len = "causal-lm", 32
    with pytest.raises(NoRepeatedBlocks, match="drop activation_checkpointing"):
        train(plain, None, max_steps=1, activation_checkpointing=True, **RUN)
