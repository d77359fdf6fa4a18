"""Errors a user can cause. Each message is one line that says what to change."""


class TierError(Exception):
    """Base class: the CLI prints the message and exits 2."""


class ModelSpecError(TierError, ValueError):
    """A model spec could not be turned into an nn.Module."""


class AdapterError(TierError, ValueError):
    """The model's calling convention, logits, vocab or length could not be worked out."""


class ModelForwardError(AdapterError):
    """The model's own forward raised on a well-formed batch: the model is broken, not the input.
    smoke/analyze turn it into FAIL rows; the CLI exits 1 on it, not 2."""


class DataError(TierError, ValueError):
    """The data given does not fit the model or the task."""


class OutputError(TierError, ValueError):
    """An output file or folder cannot be written; checked before any work starts."""


def one_line(exc: BaseException) -> str:
    """An exception's message folded onto one line, for messages that embed it."""
    return " ".join(str(exc).split()) or type(exc).__name__


def describe(exc: BaseException, limit: int | None = 300, text: str | None = None) -> str:
    """The exception as one line, "TypeError: message", the message capped at `limit` characters (None:
    whole) so it fits a table cell or an error line. `text` stands in for the message where part of it helps."""
    message = one_line(exc) if text is None else " ".join(text.split())
    return f"{type(exc).__name__}: {message[:limit]}"
