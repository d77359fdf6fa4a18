"""A training run on chat or instruction data: checked and shown before the first step (a run that scores no token,
or not the answers' end token, is refused in one line; one example is printed with its scored part marked), the
answers' end tokens added to the model's generation config so it stops where it learnt to, and the base model's
answers to the held-out prompts, generated once before the first step (a resume keeps the checkpoint's)."""
from __future__ import annotations

from ..data.chat import MARK
from ..engine.generation import Generated, answer_prompts, score_answers


def start_chat(adapter, splits, show: bool) -> None:
    """Before any step: the data checked, example 0 shown (`show`), the end tokens among the model's EOS ids."""
    chat = splits.chat
    chat.check()
    if show:
        print(f"chat data: {chat.describe()}\nexample 0 as the model reads it (scored between {' '.join(MARK)}):\n"
              f"{chat.example}")
    add_end_tokens(adapter.model, chat.end_ids)


def add_end_tokens(model, end_ids: list[int]) -> None:
    """The answers' end tokens among `generation_config.eos_token_id` (added where missing), so generation stops
    where the model learnt to stop."""
    config = getattr(model, "generation_config", None)
    if config is None or not end_ids:
        return
    have = config.eos_token_id
    have = [] if have is None else [have] if isinstance(have, int) else list(have)
    missing = [t for t in end_ids if t not in have]
    if missing:
        config.eos_token_id = have + missing


def cannot_generate(adapter) -> str | None:
    """Why the model's answers can't be generated here (None: they can)."""
    if not callable(getattr(adapter.model, "generate", None)):
        return f"{adapter.name} has no generate() (a transformers model has)"
    return None


def base_answers(adapter, splits, precision, synced: bool = False) -> list[str] | None:
    """The model's answers before training, for the samples table (None: it cannot generate, or nothing is held
    out); `synced`: a sharded model's ranks generate in step."""
    if cannot_generate(adapter) or not splits.chat.prompts:
        return None
    return answer_prompts(adapter, splits, precision, synced=synced)[0]


def chat_generation(adapter, splits, precision, base: list[str] | None, synced: bool = False) -> Generated | str:
    """This evaluation's answers beside the base's, scored; or why there are none."""
    why = cannot_generate(adapter) or (None if splits.chat.prompts else "no held-out prompts")
    return why or score_answers(adapter, splits, precision, base, synced)
