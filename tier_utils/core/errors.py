"""Every error tier_utils raises on purpose, and the exit code the CLI gives it. Each message is one line that
says what to change."""
import os

_debug: list[bool] = []  # debug(on) sets it; empty: the TIER_UTILS_DEBUG environment variable decides


def debug(on: bool | None = True) -> None:
    """Show a TierError's full traceback in a notebook (as `TIER_UTILS_DEBUG=1` does) instead of its one line;
    False: the one line whatever the environment says; None: the environment variable decides again."""
    _debug[:] = [] if on is None else [bool(on)]


def debugging() -> bool:
    return _debug[0] if _debug else os.environ.get("TIER_UTILS_DEBUG", "").strip() not in ("", "0")


class TierError(Exception):
    """Base class: the CLI prints the message on one line and exits with `exit_code`."""

    exit_code = 2  # the input (a setting, a path, the data) is wrong: change it and run again

    @property
    def _render_traceback_(self):
        """What IPython shows for this error: the CLI's one red line, which says the fix; transformers' internals
        above it would only bury it. With `debug()` on, no such method: IPython prints the whole traceback."""
        if debugging():
            raise AttributeError("_render_traceback_")
        return lambda: [f"\x1b[1;31merror: {one_line(self)}\x1b[0m  \x1b[2m({type(self).__name__}; "
                        "tier_utils.debug() shows the traceback)\x1b[0m"]


class ModelSpecError(TierError, ValueError):
    """A model spec could not be turned into an nn.Module."""


class AdapterError(TierError, ValueError):
    """The model's calling convention, logits, vocab or length could not be worked out."""


class ModelForwardError(AdapterError):
    """The model's own forward raised on a well-formed batch: the model is broken, not the input.
    smoke/analyze turn it into FAIL rows."""

    exit_code = 1  # a finding about the model, as a FAIL row is


class DataError(TierError, ValueError):
    """The data given does not fit the model or the task."""


class TemplateError(DataError):
    """A chat template that cannot be used as it is: none, not Jinja, prefixes that don't render as prefixes."""


class UnusableRow(DataError):
    """One chat or instruction row that cannot become an example: the reader counts it and reads on."""


class OutputError(TierError, ValueError):
    """An output file or folder cannot be written; checked before any work starts."""


class RunFolderBusy(TierError):
    """Another live run holds the run folder's lock."""


class CheckpointError(TierError, ValueError):
    """A checkpoint is missing, unreadable, unsafe, or from a different run."""


class LaunchError(TierError, ValueError):
    """A distributed strategy was asked for outside the launcher it needs (e.g. fsdp without torchrun)."""


class LoggerError(TierError, ValueError):
    """A logger was asked for that is unknown or not installed."""


class ExportError(TierError, ValueError):
    """The model could not be exported (an unsupported op or construct) or the export was asked wrongly."""


class CompareError(TierError, ValueError):
    """Two runs `compare` cannot pair: not a run folder, or runs of other models, tokenizers or validation data."""


class SearchStorageError(TierError, ValueError):
    """The storage URL given to `search` could not be opened."""


class NoRepeatedBlocks(TierError, ValueError):
    """Activation checkpointing was asked for a model with no repeated blocks to checkpoint."""


class LoraError(TierError, ValueError):
    """LoRA was asked wrongly: a bad setting, a target that matches no layer, peft missing."""


class QuantizationError(TierError, ValueError):
    """A 4-bit base (QLoRA) was asked wrongly: bitsandbytes missing, or a model with no nn.Linear to quantise."""


class MemorySettingError(TierError, ValueError):
    """A memory setting (LoRA's base dtype or bits, the optimizer's state) that cannot run as given, or its
    package missing."""


class TrainingDiverged(TierError):
    """The loss or gradient norm became NaN/inf with no scaler to absorb it, or fp16's loss scale collapsed.
    `.result` holds the run's partial TrainResult (its history up to the step before)."""

    exit_code = 1  # a finding about this run's settings, not bad input: the partial results are written

    def __init__(self, step: int, precision: str, value: float, result=None, quantity: str = "loss",
                 cause: str | None = None, final: str | None = None):
        """`cause`: the likeliest one the run saw (training/divergence.py); None: the learning rate. `final`: the
        non-finite figures a run that ended with them reported (None: stopped at `step`)."""
        other = "" if precision == "fp32" else ", or train in fp32"
        cause = cause or f"the learning rate; lower lr, keep grad_clip on or lengthen warmup_steps{other}"
        ended = f" and the run ended with {final}" if final else ""
        super().__init__(f"{quantity} became {value} at step {step} in {precision}{ended}; likeliest cause: {cause}")
        self.step, self.precision, self.value, self.result = step, precision, value, result
        self.quantity, self.cause = quantity, cause


class Fp16RangeError(TierError, ValueError):
    """A weight the run's fp16 would make inf (beyond ±65504), named before training: every step would be skipped
    or NaN."""


class TrainingOutOfMemory(TierError):
    """A training step ran out of device memory. The message says where, what ran out, what fits (the planner's
    prediction) and where a resume continues; the memory is released before it is raised."""

    exit_code = 2  # a setting to change: the batch, the mode


class RankStopped(TierError):
    """Under torchrun: another rank stopped with its own one-line error (out of memory, a full disk), so this one
    stops too. The message names that rank and repeats its line; the exit code is that rank's."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class HostMemoryShort(TierError):
    """A run predicted to need more host RAM than is available, refused before it loads or trains (on a Colab CPU
    runtime the kernel would otherwise be killed without a word)."""


def one_line(exc: BaseException) -> str:
    """An exception's message folded onto one line, for messages that embed it."""
    return " ".join(str(exc).split()) or type(exc).__name__


def describe(exc: BaseException, limit: int | None = 300, text: str | None = None) -> str:
    """The exception as one line, "TypeError: message", the message capped at `limit` characters (None:
    whole) so it fits a table cell or an error line. `text` stands in for the message where part of it helps."""
    message = one_line(exc) if text is None else " ".join(text.split())
    return f"{type(exc).__name__}: {message[:limit]}"
