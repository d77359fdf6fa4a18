"""torch.compile for the training step: the one place that compiles, times the compile and falls back.

Compilation is lazy (it happens on the first call), so `compile_for_training` makes that first
call itself: one warm-up forward + backward, timed apart from training (`compile_s`; step times
and tokens/s never include it), after which the model's weights, gradients, buffers and every RNG
state are as they were. If compiling fails (an op the compiler can't handle, no C++ compiler, ...)
the eager module comes back with the reason and a `CompileFallbackWarning`: compiling never
crashes a run. The compiled wrapper shares the eager module's parameters; state dicts are always
taken from the eager module, so no `_orig_mod.` key reaches a checkpoint.

Batches cut to the data (each padded to its longest row, a multiple of 8) come in many lengths: where they do, the
warm-up marks the batch's sequence dimension dynamic (`maybe_mark_dynamic`), so the one graph it compiles covers
every length the run will meet rather than one graph per length. `CompileWatch` counts the compiles after the
warm-up (recompiles) and turns dynamo's warning that a function hit torch's recompile limit, after which that
function runs eager, into a `CompileFallbackWarning` and a line of the result: never silent.
"""
from __future__ import annotations

import logging
import time
import warnings
from dataclasses import asdict, dataclass, replace

import torch

from ..adapter.adapter import ModelAdapter
from ..core.errors import describe, one_line
from ..core.precision import Precision
from ..core.progress import progress_bar
from ..core.seeding import rng_state, set_rng_state
from ..core.settings import setting

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune")  # torch.compile's modes, passed through


class CompileFallbackWarning(UserWarning):
    """The model could not be compiled; it runs eager."""


@dataclass
class CompileInfo:
    """What happened to a compile request, for summaries and JSON."""

    mode: str
    compiled: bool  # the step runs compiled code
    compile_s: float | None  # wall time of the warm-up forward + backward that compiled it
    graph_breaks: int | None  # dynamo graph breaks met while compiling: each one is a stretch run eager
    reason: str  # one line

    def to_dict(self) -> dict:
        return asdict(self)


def compile_mode_setting():
    """The `compile_mode` field of every config that compiles (training, the benchmark): declared here, once;
    the config's check_fields refuses a mode torch.compile doesn't have."""
    return setting("default", "torch.compile mode; reduce-overhead uses CUDA graphs", choices=COMPILE_MODES)


def _compile(module: torch.nn.Module, mode: str):
    """The one torch.compile call (tests swap in a cheaper backend here)."""
    return torch.compile(module, mode=mode)


def _graph_breaks() -> int | None:
    try:  # dynamo's counters are internal; without them the count is simply not reported
        from torch._dynamo.utils import counters
        return sum(counters["graph_break"].values())
    except Exception:
        return None


def compile_for_training(adapter: ModelAdapter, precision: Precision, batch: dict,
                         mode: str, progress: bool = False, lengths_vary: bool = False) -> tuple[ModelAdapter,
                                                                                                 CompileInfo]:
    """(the adapter a TrainStep should call, CompileInfo).

    The warm-up is one forward + backward on `batch` under the precision's autocast, exactly as a
    training step runs it (shapes, dtypes, train mode), so the steps themselves don't recompile.
    `lengths_vary`: the run's batches come in more than one length (examples at their own length): the batch's
    sequence dimension is marked dynamic first, so the warm-up's graph covers them all.
    `progress`: a progress line says what the pause is (compiling takes seconds to minutes, and nothing
    else moves meanwhile).
    """
    if lengths_vary:
        for tensor in batch.values():
            if torch.is_tensor(tensor) and tensor.dim() >= 2:  # (B, T, ...): T is the length
                torch._dynamo.maybe_mark_dynamic(tensor, 1)
    with progress_bar(total=1, enabled=progress, unit="warm-up",
                      desc=f"torch.compile {precision.name} (the first step compiles)") as bar:
        adapter, info = _warm_up(adapter, precision, batch, mode)
        bar.update(1)
    if lengths_vary and info.compiled:
        info = replace(info, reason=info.reason + "; the batch length marked dynamic (batches cut to the data)")
    return adapter, info


def _warm_up(adapter: ModelAdapter, precision: Precision, batch: dict, mode: str) -> tuple[ModelAdapter, CompileInfo]:
    module, device = adapter.model, adapter.device
    rng = rng_state()
    buffers = [b.detach().clone() for b in module.buffers()]  # e.g. BatchNorm statistics the warm-up moves
    breaks_before = _graph_breaks()
    compiled = _compile(module, mode)
    start = time.perf_counter()
    try:
        with precision.autocast():
            loss, _ = replace(adapter, model=compiled).forward_loss(batch)
        loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
    except Exception as exc:  # whatever the compiler raises, the run goes on eager
        hint = one_line(exc).split(" Set TORCHDYNAMO_VERBOSE")[0]  # torch's how-to-debug advice is no reason
        reason = f"could not compile ({describe(exc, text=hint)}); ran eager"
        warnings.warn(reason, CompileFallbackWarning, stacklevel=3)
        return adapter, CompileInfo(mode, False, None, None, reason)
    finally:
        module.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in zip(module.buffers(), buffers):
                b.copy_(saved)
        set_rng_state(rng)
    after = _graph_breaks()
    breaks = None if breaks_before is None or after is None else after - breaks_before
    reason = f"compiled (mode {mode}) in {seconds:.1f} s"
    if breaks:
        reason += f" with {breaks} graph break(s): those parts run eager"
    return replace(adapter, model=compiled), CompileInfo(mode, True, seconds, breaks, reason)


def _frames_compiled() -> int | None:
    try:  # dynamo's counters are internal; without them the count is simply not reported
        from torch._dynamo.utils import counters
        return counters["frames"]["ok"]
    except Exception:
        return None


class _LimitHits(logging.Handler):
    """Dynamo's warning that a function hit its recompile limit (it runs that function eager from then on)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.hits: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message and "recompile_limit" in message:
            first, function = message.splitlines()[0], next(
                (ln.split("function:")[1].strip() for ln in message.splitlines() if "function:" in ln), "a function")
            limit = first.split("(")[-1].rstrip(")") if "(" in first else "?"
            line = (f"torch.compile hit its recompile limit ({limit}) in {function}: that function runs eager from "
                    "then on; raise torch._dynamo.config.recompile_limit, or keep the batch shapes fewer")
            self.hits.append(line)
            warnings.warn(line, CompileFallbackWarning, stacklevel=2)


class CompileWatch:
    """The compiles after a warm-up, while a compiled run trains (`with watch:`): how many (each one a recompile:
    a batch shape or another guard the warm-up's graph did not cover) and any fall back to eager past torch's
    recompile limit, warned as it happens and said in `describe()`."""

    LOGGER = "torch._dynamo.convert_frame"  # where dynamo warns of the limit

    def __init__(self):
        self.recompiles: int | None = None
        self._hits = _LimitHits()
        self._before = None

    def __enter__(self) -> CompileWatch:
        self._before = _frames_compiled()
        logging.getLogger(self.LOGGER).addHandler(self._hits)
        return self

    def __exit__(self, *exc) -> bool:
        logging.getLogger(self.LOGGER).removeHandler(self._hits)
        after = _frames_compiled()
        if self._before is not None and after is not None:
            self.recompiles = (self.recompiles or 0) + after - self._before
        return False

    @property
    def fell_back(self) -> list[str]:
        return list(self._hits.hits)

    def describe(self) -> str:
        """"2 recompile(s) after the warm-up" and any fall back to eager; "" where nothing was counted."""
        said = [] if self.recompiles is None else [f"{self.recompiles} recompile(s) after the warm-up"]
        return "; ".join(said + self.fell_back)
