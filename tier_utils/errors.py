"""Errors a user can cause. Each message is one line that says what to change."""


class TierError(Exception):
    """Base class: the CLI prints the message and exits 2."""


class ModelSpecError(TierError, ValueError):
    """A model spec could not be turned into an nn.Module."""


class AdapterError(TierError, ValueError):
    """The model's calling convention, logits, vocab or length could not be worked out."""


class DataError(TierError, ValueError):
    """The data given does not fit the model or the task."""


def one_line(exc: BaseException) -> str:
    """An exception's message folded onto one line, for messages that embed it."""
    return " ".join(str(exc).split()) or type(exc).__name__
