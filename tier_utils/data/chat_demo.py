"""The bundled chat demo, made offline in seconds: a tiny Llama-shaped model built from a config, a byte-level BPE
tokenizer trained on the demo's own text (the `tokenizers` library, at run time) and the Jinja chat template shipped
with the package (tier_utils/assets/chat_template.jinja, whose turns end with `<|end|>`), saved as a transformers
folder beside a `chat.jsonl` of conversations. The task: short questions with one right answer each (opposites,
colours, sounds), which a tiny model learns in seconds on a CPU, so the samples table shows the answers change.

The byte-level built-ins are not the demo's model: they have no chat template and no EOS, and TinyGPT ignores the
attention mask.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent.parent / "assets" / "chat_template.jinja"
END_OF_TURN = "<|end|>"
SPECIAL = ("<s>", END_OF_TURN, "<pad>", "<|system|>", "<|user|>", "<|assistant|>")
OPPOSITES = {"hot": "cold", "up": "down", "big": "small", "day": "night", "fast": "slow", "open": "closed",
             "light": "dark", "old": "new", "full": "empty", "early": "late"}
COLOURS = {"the sky": "blue", "grass": "green", "snow": "white", "a lemon": "yellow", "coal": "black",
           "a tomato": "red", "an orange": "orange", "a plum": "purple"}
SOUNDS = {"a dog": "woof woof", "a cat": "meow", "a cow": "moo", "a duck": "quack quack", "a sheep": "baa",
          "an owl": "hoot hoot"}
QUESTIONS = ([(f"What is the opposite of {k}?", v) for k, v in OPPOSITES.items()]
             + [(f"What colour is {k}?", v) for k, v in COLOURS.items()]
             + [(f"What does {k} say?", v) for k, v in SOUNDS.items()])
SYSTEM = "You answer in a few words."
LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)


@dataclass(frozen=True)
class ChatDemo:
    """The demo's files: the model folder (its tokenizer and chat template inside) and the conversations."""

    model: Path
    data: Path
    template: Path
    end_of_turn: str = END_OF_TURN

    def describe(self) -> str:
        return (f"chat demo: a tiny Llama ({LLAMA['num_hidden_layers']} layers, {LLAMA['hidden_size']} wide) in "
                f"{self.model}, conversations in {self.data.name}, template {self.template.name} (turns end with "
                f"{self.end_of_turn})")


def demo_rows(n: int = 240, seed: int = 0) -> list[dict]:
    """Conversations in TRL's messages format, each question with one right answer; every third has a system
    prompt, every fifth a second exchange."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": SYSTEM}] if i % 3 == 0 else []
        for question, answer in rng.sample(QUESTIONS, 2 if i % 5 == 0 else 1):
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages})
    return rows


def demo_tokenizer(rows: list[dict]):
    """A byte-level BPE tokenizer trained on the rows' text, with the template's markers as special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((m["content"] for row in rows for m in row["messages"]), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=END_OF_TURN, pad_token="<pad>",
                                   additional_special_tokens=list(SPECIAL[3:]), chat_template=TEMPLATE.read_text())


def chat_demo(folder, n: int = 240, seed: int = 0) -> ChatDemo:
    """Write the demo into `folder`: the model (a LlamaForCausalLM from a config, seeded, fp32) with its tokenizer
    and template, and chat.jsonl. Returns where each is."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    rows = demo_rows(n, seed)
    tokenizer = demo_tokenizer(rows)
    torch.manual_seed(seed)
    config = LlamaConfig(**LLAMA, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=True)
    model_dir = folder / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = folder / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ChatDemo(model_dir, data, TEMPLATE)
