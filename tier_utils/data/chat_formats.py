"""The layouts chat and instruction data come in, one small class each in one registry (like the tasks and the
precisions): which columns mark it, how one row becomes a conversation (or TRL's untemplated prompt + completion),
and how it reads as a source-target pair for a sequence-to-sequence model. Nothing outside a format's class tests its
name: the readers ask the format they were handed.

A row that cannot be used raises `UnusableRow` with the reason; the reader counts them and says the first row numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core.errors import DataError, TemplateError, UnusableRow
from ..core.registry import Registry

ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
AUTO = "auto"  # --data-format's default: recognised from the columns
MESSAGES_COLUMN = "messages"  # where a message list is read from (a column named otherwise is read as it)


@dataclass(frozen=True)
class Dialogue:
    """A conversation rendered through the chat template; the assistant turns from `first_scored` on are the
    answer (a conversational prompt-completion's prompt turns are never scored)."""

    messages: list[dict]
    first_scored: int = 0


@dataclass(frozen=True)
class Completion:
    """A standard (string) prompt and completion: not templated, prompt + completion + EOS, as TRL reads them."""

    prompt: str
    completion: str


def plain_list(value):
    """A list cell as a Python list: parquet hands back numpy arrays of dicts, datasets and JSON lists."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    return value if isinstance(value, list) else None


def text_of(content) -> str:
    """A turn's content: a string, or a list of text parts (`{"type": "text", "text": ...}`) joined; any other
    part (an image) makes the row unusable."""
    if isinstance(content, str):
        return content
    parts = plain_list(content)
    if parts is None:
        raise UnusableRow("content that is not text")
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise UnusableRow("a content part that is not text")
    return "".join(p["text"] for p in parts)


def checked_turns(value, role_key: str = "role", content_key: str = "content", roles=None) -> list[dict]:
    """A list of turns as {role, content} (ShareGPT's {from, value} read through `roles`); an unknown role or a turn
    that is not a dict makes the row unusable."""
    turns = plain_list(value)
    if turns is None:
        raise UnusableRow("a message cell that is not a list")
    out = []
    for turn in turns:
        if not isinstance(turn, dict) or role_key not in turn:
            raise UnusableRow(f"a turn without {role_key!r}")
        role = roles.get(turn[role_key]) if roles else turn[role_key]
        if role not in ROLES:
            raise UnusableRow(f"an unknown role {turn[role_key]!r}")
        out.append({"role": role, "content": text_of(turn.get(content_key))})
    return out


def with_answer(messages: list[dict], first_scored: int = 0) -> Dialogue:
    """A conversation that holds an answer to learn: an assistant turn (from `first_scored` on), none empty."""
    answers = [m for m in messages[first_scored:] if m["role"] == "assistant"]
    if not answers:
        raise UnusableRow("no assistant turn")
    if any(not m["content"].strip() for m in answers):
        raise UnusableRow("an empty answer")
    return Dialogue(messages, first_scored)


class ChatFormat:
    """A layout of chat or instruction rows. `columns`: the columns that mark it (all present)."""

    name = ""
    aliases: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    plain = False  # running text: a causal LM's windows, not one example per row
    scored = "the assistant turns"  # what its default loss scores, in words (docs, results)

    def recognizes(self, columns) -> bool:
        return all(c in columns for c in self.columns)

    def example(self, row: dict) -> Dialogue | Completion:
        raise NotImplementedError

    def pair(self, row: dict) -> tuple[str, str]:
        """(source, target) for a sequence-to-sequence model."""
        raise DataError(f"{self.name} rows are message lists, which a sequence-to-sequence model cannot read; give "
                        "it prompt-completion or Alpaca rows (instruction, input, output), or a causal LM")


class Messages(ChatFormat):
    """TRL's conversational layout: `messages`, a list of {role, content}."""

    name, aliases, columns = "messages", ("conversational", "chatml"), (MESSAGES_COLUMN,)

    def example(self, row: dict) -> Dialogue:
        return with_answer(checked_turns(row[MESSAGES_COLUMN]))


class ShareGPT(ChatFormat):
    """ShareGPT's layout: `conversations`, a list of {from, value} (human / gpt / system)."""

    name, aliases, columns = "sharegpt", ("conversations",), ("conversations",)

    def example(self, row: dict) -> Dialogue:
        return with_answer(checked_turns(row["conversations"], "from", "value", SHAREGPT_ROLES))


class PromptCompletion(ChatFormat):
    """`prompt` and `completion`: strings (untemplated, as TRL reads them) or lists of messages (templated)."""

    name, aliases, columns = "prompt-completion", ("prompt_completion",), ("prompt", "completion")
    scored = "the completion"

    def example(self, row: dict) -> Dialogue | Completion:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if not completion.strip():
                raise UnusableRow("an empty completion")
            return Completion(prompt, completion)
        if isinstance(prompt, str) or isinstance(completion, str):
            raise UnusableRow("a prompt and a completion of different kinds (one text, one messages)")
        turns = checked_turns(prompt)
        return with_answer(turns + checked_turns(completion), len(turns))

    def pair(self, row: dict) -> tuple[str, str]:
        prompt, completion = row["prompt"], row["completion"]
        if not (isinstance(prompt, str) and isinstance(completion, str)):
            return super().pair(row)
        return prompt, completion


class Alpaca(ChatFormat):
    """Alpaca's `instruction`, optional `input`, `output`: a user turn of the instruction (then a blank line and the
    input, when there is one) and an assistant turn of the output."""

    name, columns = "alpaca", ("instruction", "output")
    aliases = ("instruction",)
    scored = "the output (the assistant turn)"

    def source(self, row: dict) -> str:
        instruction, given = row["instruction"], row.get("input")
        if not isinstance(instruction, str) or not instruction.strip():
            raise UnusableRow("an empty instruction")
        return f"{instruction}\n\n{given}" if isinstance(given, str) and given.strip() else instruction

    def example(self, row: dict) -> Dialogue:
        output = row["output"]
        if not isinstance(output, str):
            raise UnusableRow("an output that is not text")
        return with_answer([{"role": "user", "content": self.source(row)}, {"role": "assistant", "content": output}])

    def pair(self, row: dict) -> tuple[str, str]:
        if not isinstance(row["output"], str) or not row["output"].strip():
            raise UnusableRow("an empty output")
        return self.source(row), row["output"]


class Text(ChatFormat):
    """Running text (`text`, or the column --text-column names): a causal LM's windows, as before."""

    name, aliases, plain = "text", ("plain",), True
    scored = "every token"

    def recognizes(self, columns) -> bool:
        return True


_REGISTRY = Registry("data format", ChatFormat, classes=False, extra=(AUTO,))
for _format in (Messages(), ShareGPT(), PromptCompletion(), Alpaca(), Text()):
    _REGISTRY.add(_format)
DATA_FORMATS = (AUTO, *_REGISTRY.names())


def register_format(fmt: ChatFormat) -> ChatFormat:
    """Add a layout (an instance); it is tried before running text when the columns are read."""
    return _REGISTRY.add(fmt)


def format_named(name: str) -> ChatFormat | None:
    """The format of any spelling (None for auto); an unknown one is a one-line DataError listing them."""
    try:
        canonical = _REGISTRY.canonical(name)
    except ValueError as exc:
        raise DataError(f"{exc} (--data-format)") from exc
    return None if canonical == AUTO else _REGISTRY[canonical]


def recognized_format(columns, forced: str = AUTO, message_column: str | None = None) -> ChatFormat:
    """The format `forced` names, or the first (registry order, running text last) whose columns are there. A
    `message_column` (--text-column naming a column of message lists) reads as `messages`."""
    chosen = format_named(forced)
    if chosen is not None:
        missing = [c for c in chosen.columns if c not in columns]
        if missing and not (message_column and isinstance(chosen, Messages)):
            raise DataError(f"--data-format {chosen.name} needs the column(s) {', '.join(missing)}; the data's "
                            f"columns are {', '.join(map(str, columns))}")
        return chosen
    if message_column:
        return _REGISTRY["messages"]
    found = [f for f in _REGISTRY.entries() if not f.plain and f.recognizes(columns)]
    return found[0] if found else _REGISTRY["text"]


LOSS_ON = ("answer", "all")


def read_template(path) -> str:
    """A Jinja chat template file's text; a file that is not one is a one-line TemplateError."""
    where = Path(str(path)).expanduser()
    if not where.is_file():
        raise TemplateError(f"--chat-template {path} is not a file; give a Jinja chat template file")
    try:
        text = where.read_text("utf-8")
    except UnicodeDecodeError as exc:
        raise TemplateError(f"--chat-template {path} is not a text file; give a Jinja chat template") from exc
    if "{%" not in text and "{{" not in text:
        raise TemplateError(f"--chat-template {path} holds no Jinja ({{% %}} / {{{{ }}}}); give a chat template file")
    return text


@dataclass(frozen=True)
class ChatOptions:
    """How chat and instruction rows are read (TrainConfig's data_format, loss_on, chat_template, decided once):
    the format (auto: from the columns), which tokens the loss scores, and a Jinja file for the chat template
    (None: the tokenizer's own)."""

    data_format: str = AUTO
    loss_on: str = "answer"
    chat_template: str | None = None

    def __post_init__(self):
        format_named(self.data_format)  # an unknown one: one line, before any work
        if self.loss_on not in LOSS_ON:
            raise DataError(f"unknown loss_on {self.loss_on!r} (--loss-on); use one of: {', '.join(LOSS_ON)}")
        if self.chat_template is not None:
            read_template(self.chat_template)  # not a Jinja file: one line, before anything is read or written
