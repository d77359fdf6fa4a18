"""Which reading a table or dataset gets (its rows in a chat or instruction format, or running text), and the
record every result keeps of a chat reading: the format, the template and its end-of-turn marker, the share of tokens
scored, the rows left out, one example rendered with its scored part marked, and the held-out prompts generation
answers at each evaluation."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, replace

import torch
from torch.utils.data import Subset

from ..core.errors import DataError, UnusableRow
from .chat import MARK, MAX_PROMPTS, ChatData, chat_examples, converted_rows, hf_of, unusable_clause, warn_counts
from .chat_formats import MESSAGES_COLUMN, recognized_format
from .datasets import DataRequest, DataSplits, split_off
from .pairs import Pairs
from .userdata import Rows, read_rows


def chat_rows(data, request: DataRequest) -> Rows | None:
    """The rows of `data` where they are chat or instruction rows in the request's format (named, or recognised
    from the columns); None where the data is running text (read as before)."""
    column, forced = getattr(data, "text_column", None), request.chat.data_format
    rows = read_rows(data, lambda names: column in names or not recognized_format(names, forced).plain)
    if rows is None or not rows.train:
        return None
    listed = column is not None and column in rows.train[0] and any(
        isinstance(r.get(column), list) or getattr(r.get(column), "ndim", 0) for r in rows.train)
    fmt = recognized_format(rows.train[0].keys(), request.chat.data_format, column if listed else None)
    if fmt.plain:
        return None
    if listed and column != MESSAGES_COLUMN:  # --text-column naming a column of message lists: read as messages
        rename = lambda part: [{**r, MESSAGES_COLUMN: r[column]} for r in part]  # noqa: E731
        rows = replace(rows, train=rename(rows.train), val=rows.val and rename(rows.val))
    return replace(rows, message_column=column if listed else None)


def instruction_pairs(rows: Rows, request: DataRequest) -> DataSplits:
    """Prompt-completion or Alpaca rows as a sequence-to-sequence model's pairs (instruction + input as the source,
    the output as the target); message lists are refused in one line."""
    fmt = recognized_format(rows.train[0].keys(), request.chat.data_format, rows.message_column)

    def convert(row):
        source, target = fmt.pair(row)
        if not target.strip():
            raise UnusableRow("an empty target")
        return source, target

    pairs, unusable = converted_rows(rows.train + (rows.val or []), fmt, convert)
    if unusable:
        warnings.warn(f"{rows.name}: {unusable_clause(unusable)}", stacklevel=3)
    data = Pairs.encode([s for s, _ in pairs], [t for _, t in pairs], request, rows.name)
    n_train = len(rows.train) - sum(r <= len(rows.train) for r in unusable)
    if rows.val is not None:
        train, val, how = Subset(data, range(n_train)), Subset(data, range(n_train, len(data))), rows.validation
    else:
        train, val = split_off(data, request.val_fraction, request.seed)
        how = f"a seeded random {request.val_fraction:.0%} of the pairs ({len(val)} pairs)"
    return DataSplits(train, val, "table", f"{rows.name}, {fmt.name} rows as pairs", request.tokenizer.name, how)


def marked(hf, ids: list[int], labels: list[int]) -> str:
    """An example's text with its scored part between MARK: each run of scored targets bracketed."""
    out, inside = [], False
    for position, token in enumerate(ids):
        now = position > 0 and labels[position - 1] != -100
        if now != inside:
            out.append(MARK[0] if now else MARK[1])
            inside = now
        out.append(hf.decode([token]))
    return "".join(out) + (MARK[1] if inside else "")


@dataclass
class ChatReading:
    """What a result says about chat data, and what generation reads from it."""

    format: str
    scored: str  # which tokens the loss scores, in words
    template: str  # where the chat template came from
    end_markers: list[str]  # the end-of-turn tokens the answers end with
    end_ids: list[int]
    scored_share: float  # of the training targets
    counts: str  # the rows left out or cut ("": none)
    example: str  # example 0 rendered, its scored part between [[ ]]
    ends_scored: bool  # every training example's last scored target is an end token
    prompts: list  # (prompt ids, the question in words, reference) of the first held-out examples
    data: ChatData | None = None

    @classmethod
    def of(cls, data: ChatData, request: DataRequest, train, val) -> ChatReading:
        hf, options = hf_of(request.tokenizer), request.chat
        end_ids, ends_scored, scored, total = set(), True, 0, 0
        for i in range(len(train)):
            labels = train[i]["labels"]
            scored, total = scored + int((labels != -100).sum()), total + len(labels)
            encoded = (train.dataset if isinstance(train, Subset) else train).encoded[
                train.indices[i] if isinstance(train, Subset) else i]
            end_ids.update(encoded.ids[p] for p in encoded.ends)
            # each answer's end token a scored target (position p is the target of input p - 1)
            ends_scored &= bool(encoded.ends) and all(encoded.scored[p] for p in encoded.ends)
        end_ids = sorted(end_ids)
        first = data.examples.encoded[0]
        held = [(val.dataset if isinstance(val, Subset) else val).encoded[j]
                for j in (val.indices if isinstance(val, Subset) else range(len(val)))][:MAX_PROMPTS]
        fmt_scored = data.format.scored if options.loss_on == "answer" else "every token"
        template = (options.chat_template or "the tokenizer's own") if data.templated else \
            "none (string prompt-completion is not templated)"
        return cls(data.format.name, fmt_scored, template, [hf.decode([t]) for t in end_ids], end_ids,
                   scored / max(total, 1), data.counts(), marked(hf, first.ids, data.examples.labels[0].tolist()),
                   ends_scored and scored > 0,
                   [(torch.tensor(e.prompt, dtype=torch.long), e.question, e.reference) for e in held], data)

    def describe(self) -> str:
        ends = " / ".join(self.end_markers) or "none"
        counts = f"; {self.counts}" if self.counts else ""
        return (f"{self.format} format, {self.scored} scored ({self.scored_share:.0%} of the tokens), chat template "
                f"{self.template}, end of turn {ends}{counts}")

    def to_dict(self) -> dict:
        return {"format": self.format, "scored": self.scored, "scored_share": self.scored_share,
                "template": self.template, "end_of_turn": self.end_markers, "counts": self.counts,
                "example": self.example}

    def check(self) -> None:
        """A run on chat data scores some tokens and the answers' end token, or is refused in one line."""
        if not self.ends_scored:
            what = "no token is scored" if not self.scored_share else "the answers' end token is not scored"
            raise DataError(f"{self.format} data: {what}, so the model would never learn to stop; give a chat template "
                            "whose turns end with a special token (--chat-template FILE)")


def chat_splits(rows: list[dict], val_rows: list[dict] | None, name: str, validation: str | None,
                request: DataRequest, message_column: str | None = None) -> DataSplits:
    """Rows (and the source's own validation rows) as train and validation examples, read in the request's
    format; the result names the format, the template and the share of tokens scored."""
    options = request.chat
    kw = dict(data_format=options.data_format, loss_on=options.loss_on, chat_template=options.chat_template,
              seq_len=request.seq_len)
    data = chat_examples(rows, request.tokenizer, where=name, **kw)
    warn_counts(data, name)
    if val_rows is not None:
        val_data = chat_examples(val_rows, request.tokenizer, where=f"{name} [validation]", **kw)
        warn_counts(val_data, f"{name} [validation]")
        train, val, how = data.examples, val_data.examples, validation
    else:
        train, val = split_off(data.examples, request.val_fraction, request.seed) if request.val_fraction else (
            data.examples, Subset(data.examples, []))
        how = (f"a seeded random {request.val_fraction:.0%} of the rows ({len(val)} examples)"
               if request.val_fraction else "none asked for (every example trains, and nothing is evaluated)")
    reading = ChatReading.of(data, request, train, val)
    return DataSplits(train, val, "chat", f"{name}, {reading.describe()}", request.tokenizer.name, how,
                      chat=reading)


def read_chat(data, request: DataRequest) -> DataSplits | None:
    """`data` as chat examples where its rows are in a chat or instruction format; None: running text."""
    rows = chat_rows(data, request)
    if rows is None:
        return None
    return chat_splits(rows.train, rows.val, rows.name, rows.validation, request)


