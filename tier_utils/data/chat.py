"""Chat and instruction rows as a causal LM's examples: each row rendered through the tokenizer's chat template
(transformers' `apply_chat_template`; a standard prompt-completion untemplated, as TRL reads it), one example per
row at its own length, with a label mask that scores the answer.

The answer's tokens are found by rendering the conversation's prefixes: `messages[:i]` with the generation prompt
ends where assistant turn i starts, `messages[:i + 1]` where it ends; the turn's end token (the last special token it
adds: `<|im_end|>`, `<|eot_id|>`, EOS) is scored, what the template writes after it (a newline) is not. A template
whose prefixes don't render as prefixes of the whole is refused in one line: nothing is guessed.

Examples are `input_ids = row[:-1]`, `labels = row[1:]` with -100 where a target is not scored: the shape every causal
example has here, so the task's collator (and packing) take them as they are. The rendered text is tokenized without
the tokenizer's own special tokens, as `apply_chat_template(tokenize=True)` does, so a template that writes the BOS
never gets a second one.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils.data import Dataset

from ..core.errors import DataError, TemplateError, UnusableRow, one_line
from .chat_formats import ChatFormat, ChatOptions, Completion, Dialogue, read_template, recognized_format
from .collate import IGNORE

FIRST_ROWS = 5  # the unusable rows said by number
MAX_PROMPTS = 16  # held-out prompts generated from at each evaluation
MARK = ("[[", "]]")  # the scored part of the example shown at a run's start


def hf_of(tokenizer):
    """The transformers tokenizer behind tier_utils' Tokenizer (or given as one); bytes have none."""
    hf = getattr(tokenizer, "hf", tokenizer)
    if not hasattr(hf, "apply_chat_template"):
        raise TemplateError("chat data needs the model's own tokenizer with a chat template; the byte-level built-ins "
                            "have none: give a transformers model folder (or --tokenizer FOLDER)")
    return hf


def with_template(hf, template_file: str | None):
    """`hf`, or with `template_file` given a copy of it carrying that chat template: a shallow copy (the vocabulary is
    shared), so a tokenizer the caller passed in keeps its own template."""
    if template_file is None:
        return hf
    copied = copy.copy(hf)
    copied.chat_template = read_template(template_file)
    return copied


def templated(tokenizer, template_file: str | None):
    """The transformers tokenizer the rows render with, its chat template `template_file`'s where one is given (on a
    copy: save_hf writes it into the saved folder); none at all is a one-line TemplateError naming --chat-template."""
    hf = with_template(hf_of(tokenizer), template_file)
    if not getattr(hf, "chat_template", None):
        raise TemplateError(f"the tokenizer {getattr(hf, 'name_or_path', '') or type(hf).__name__} has no chat "
                            "template; give one with --chat-template FILE (a Jinja file; chat_template= in the API)")
    try:
        render(hf, [{"role": "user", "content": "hi"}], True)
    except Exception as exc:  # jinja2's and transformers' errors alike: the template does not render
        raise TemplateError(f"the chat template does not render a conversation ({one_line(exc)[:160]}); fix it or "
                            "give another with --chat-template FILE") from exc
    return hf


def render(hf, messages: list[dict], generation_prompt: bool) -> list[int]:
    """The conversation's token ids through the chat template (its own special tokens only: no second BOS)."""
    text = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)
    return list(hf(text, add_special_tokens=False)["input_ids"])


def special_ids(hf) -> set[int]:
    """The tokenizer's special tokens (an end of turn is one of them)."""
    added = {i for i, t in getattr(hf, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    return set(hf.all_special_ids) | added


@dataclass
class Encoded:
    """One example: its token ids, which of them are scored targets, and what generation starts from."""

    ids: list[int]
    scored: list[bool]
    prompt: list[int]  # the last answer's prompt (with the generation prompt)
    reference: str  # the last answer
    question: str  # what the last answer answers, as the samples table shows it (the last user turn)
    ends: list[int] = field(default_factory=list)  # where each answer's end token is (its position in ids)
    truncated: bool = False


def _prefix(full: list[int], part: list[int], turn: int) -> int:
    if full[:len(part)] != part:
        raise TemplateError(f"the chat template renders the first {turn} turns differently from how the whole "
                            "conversation begins, so the answers' tokens cannot be found; give a template whose "
                            "prefixes render as prefixes (--chat-template FILE), or --loss-on all")
    return len(part)


def encode_dialogue(hf, dialogue: Dialogue, loss_on: str, ends: set[int]) -> Encoded:
    """The conversation's ids and its scored tokens: the assistant turns (from `first_scored`), each up to its end
    token; every token for loss_on="all"."""
    messages = dialogue.messages
    full = render(hf, messages, False)
    scored, found = [loss_on == "all"] * len(full), []
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = render(hf, messages[:last], True)
    _prefix(full, prompt, last)
    for i in range(dialogue.first_scored, len(messages)):
        if messages[i]["role"] != "assistant":
            continue
        start = _prefix(full, render(hf, messages[:i], True), i)
        end = _prefix(full, render(hf, messages[:i + 1], False), i + 1)
        end = next((p + 1 for p in range(end - 1, start - 1, -1) if full[p] in ends), end)
        found += [end - 1] if full[end - 1] in ends else []
        scored[start:end] = [True] * (end - start)
    question = next((m["content"] for m in reversed(messages[:last]) if m["role"] == "user"), "")
    return Encoded(full, scored, prompt, messages[last]["content"], question, found)


def encode_completion(hf, row: Completion, loss_on: str) -> Encoded:
    """TRL's standard prompt-completion: prompt + completion + EOS tokenized with the tokenizer's special tokens,
    every position after the prompt's tokens (their common prefix) scored."""
    eos = hf.eos_token or ""
    if not eos:
        raise TemplateError("prompt-completion rows end with the tokenizer's EOS, and this tokenizer has none; give a "
                            "tokenizer with an eos_token")
    completion = row.completion if row.completion.endswith(eos) else row.completion + eos
    prompt = list(hf(row.prompt)["input_ids"])
    full = list(hf(row.prompt + completion)["input_ids"])
    start = next((i for i, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
    scored = [loss_on == "all" or i >= start for i in range(len(full))]
    ends = [len(full) - 1] if full[-1] == hf.eos_token_id else []  # a tokenizer that appends no other token
    return Encoded(full, scored, prompt, row.completion, row.prompt, ends)


def fitted(hf, example: Dialogue | Completion, loss_on: str, limit: int, ends: set[int]) -> Encoded | None:
    """The example within `limit` tokens: whole turns dropped from the front (after a system prompt) until it fits;
    None where the last answer alone does not fit."""
    if isinstance(example, Completion):
        encoded = encode_completion(hf, example, loss_on)
        return encoded if len(encoded.ids) <= limit else None
    messages, first, cut = list(example.messages), example.first_scored, False
    while True:
        encoded = encode_dialogue(hf, Dialogue(messages, first), loss_on, ends)
        if len(encoded.ids) <= limit:
            encoded.truncated = cut
            return encoded
        keep = 1 if messages[0]["role"] == "system" else 0
        nxt = next((j for j in range(keep + 1, len(messages)) if messages[j]["role"] == "user"), None)
        if nxt is None or (first and nxt > first):
            return None  # only the last exchange is left (or a completion's prompt would be cut into)
        messages, cut = messages[:keep] + messages[nxt:], True
        first = first - (nxt - keep) if first else 0


class ChatExamples(Dataset):
    """One example per usable row, at its own length: input_ids = row[:-1], labels = row[1:] (-100: not scored)."""

    def __init__(self, encoded: list[Encoded]):
        self.encoded = encoded
        self.ids = [torch.tensor(e.ids, dtype=torch.long) for e in encoded]
        self.labels = [torch.tensor(e.ids[1:], dtype=torch.long).masked_fill(~torch.tensor(e.scored[1:]), IGNORE)
                       for e in encoded]

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, i: int) -> dict:
        ids = self.ids[i][:-1]
        return {"input_ids": ids, "attention_mask": torch.ones(len(ids), dtype=torch.long), "labels": self.labels[i]}


@dataclass
class ChatData:
    """What `chat_examples` made: the examples, and what every result says about them."""

    examples: ChatExamples
    format: ChatFormat
    unusable: dict[int, str] = field(default_factory=dict)  # row number (from 1) -> why
    truncated: int = 0  # conversations that lost turns from the front to fit
    dropped: int = 0  # examples whose last answer alone did not fit
    templated: bool = True  # rendered through the chat template (string prompt-completion is not)

    def counts(self) -> str:
        """The rows left out and cut, in one clause ("": none)."""
        said = [unusable_clause(self.unusable)] if self.unusable else []
        if self.truncated:
            said.append(f"{self.truncated} conversations lost turns from the front to fit")
        if self.dropped:
            said.append(f"{self.dropped} examples dropped: their last answer alone is longer than the length")
        return "; ".join(said)


def unusable_clause(unusable: dict[int, str]) -> str:
    """The rows left out, in one clause: how many, and the first by number (from 1) with why."""
    first = ", ".join(f"{r} ({why})" for r, why in list(unusable.items())[:FIRST_ROWS])
    return f"{len(unusable)} unusable rows skipped (first rows: {first})"


def converted_rows(rows: list[dict], fmt: ChatFormat, convert) -> tuple[list, dict[int, str]]:
    """`convert(row)` for each row, the unusable ones counted by row number (from 1) with why."""
    out, unusable = [], {}
    for number, row in enumerate(rows, 1):
        try:
            out.append(convert(row))
        except UnusableRow as exc:
            unusable[number] = str(exc)
    if not out:
        first = ", ".join(f"row {r}: {why}" for r, why in list(unusable.items())[:FIRST_ROWS])
        raise DataError(f"no usable {fmt.name} row ({first}); fix the rows or pick the format with --data-format")
    return out, unusable


def chat_examples(rows: list[dict], tokenizer, *, data_format: str = "auto", loss_on: str = "answer",
                  chat_template: str | None = None, seq_len: int | None = None, where: str = "the rows") -> ChatData:
    """Chat or instruction rows (dicts of their columns) as causal-LM examples with their label masks.

    tokenizer: a transformers tokenizer (or tier_utils' HFTokenizer); chat_template: a Jinja file (None: its own).
    seq_len: the most input tokens an example may have (None: no limit): longer conversations lose whole turns from
    the front, after the system prompt; an example whose last answer alone doesn't fit is dropped (both counted).
    Unusable rows (no assistant turn, an empty answer, an unknown role, content that is not text) are counted."""
    options = ChatOptions(data_format, loss_on, chat_template)
    fmt = recognized_format(rows[0].keys() if rows else (), options.data_format)
    if fmt.plain:
        raise DataError(f"{where} are running text, not chat or instruction rows; read them as text")
    examples, unusable = converted_rows(rows, fmt, fmt.example)
    templating = any(isinstance(e, Dialogue) for e in examples)
    hf = templated(tokenizer, chat_template) if templating else hf_of(tokenizer)
    ends = special_ids(hf)
    limit = seq_len + 1 if seq_len is not None else float("inf")
    encoded = [fitted(hf, e, options.loss_on, limit, ends) for e in examples]
    kept = [e for e in encoded if e is not None]
    if not kept:
        raise DataError(f"every example of {where} is longer than seq_len={seq_len} even with its last answer alone; "
                        "raise seq_len")
    return ChatData(ChatExamples(kept), fmt, unusable, sum(e.truncated for e in kept), len(encoded) - len(kept),
                    templating)


def warn_counts(data: ChatData, where: str) -> None:
    if data.counts():
        warnings.warn(f"{where}: {data.counts()}", stacklevel=3)
