"""The user's module comes back as it was given (issue 51): tier_utils keeps what it knows about a model beside it,
never on it, and what a run turns on (activation checkpointing) it turns off as it found it."""
import torch
from tiny import TINY

from tier_utils import TinyGPT, train
from tier_utils.core.memory_settings import MemorySettings
from tier_utils.engine.activation_checkpointing import checkpointed, checkpointing_on, repeated_blocks

RUN = dict(max_steps=2, batch_size=2, seq_len=16, eval_every=0, eval_batches=1, progress=False, device="cpu",
           precision="fp32", memory=MemorySettings(checkpointing=True))


def test_a_blocks_own_forward_is_put_back_after_checkpointing():
    torch.manual_seed(0)
    model = TinyGPT(**{**TINY, "n_layer": 2})
    first, second = repeated_blocks(model)
    calls = []

    def own(*args, _forward=first.forward, **kwargs):  # the user's wrapper, an attribute of the block itself
        calls.append(1)
        return _forward(*args, **kwargs)

    first.forward = own
    result = train(model, None, **RUN)
    assert result.summary.activation_checkpointing.startswith("2 blocks") and calls  # it ran, checkpointed
    assert vars(first)["forward"] is own and "forward" not in vars(second)
    with checkpointed(model):
        assert vars(first)["forward"] is not own
    assert vars(first)["forward"] is own


def test_a_transformers_models_use_cache_and_switch_are_put_back():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=256,
                                       bos_token_id=0, eos_token_id=0, use_cache=True))
    result = train(model, None, **RUN)
    assert "transformers'" in result.summary.activation_checkpointing
    assert model.config.use_cache is True and not checkpointing_on(model)
    with checkpointed(model):
        assert model.config.use_cache is False and checkpointing_on(model)
    assert model.config.use_cache is True and not checkpointing_on(model)


def test_what_tier_utils_knows_of_a_model_is_kept_beside_it_and_its_copies():
    """No tier_utils_* attribute on the module: the loader's record (spec, tokenizer, stored dtype) is kept beside
    it, the adapter carries it into every tier, and a copy for a training run keeps it (a checkpoint rebuilds it)."""
    from tier_utils import adapt, load_model, smoke
    from tier_utils.models.loading import copied, source_of

    sizes = {**TINY, "n_layer": 2}  # two blocks to checkpoint
    model = load_model("tiny-gpt", tokenizer="bytes", **sizes)
    smoke(model, checks="shapes", progress=False, device="cpu")
    train(model, None, **RUN)
    assert not [name for name in vars(model) if "tier_utils" in name]
    assert not [name for m in model.modules() for name in vars(m) if "tier_utils" in name]
    adapter = adapt(model)
    assert adapter.source is source_of(model) and adapter.source.spec == "tiny-gpt"
    twin = adapter.copied()
    assert twin.model is not model and source_of(twin.model) is adapter.source and twin.source is adapter.source
    assert source_of(copied(model)).kwargs == sizes
