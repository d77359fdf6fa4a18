"""torch.compile for the training step: the one place that compiles, times the compile and falls back.

Compilation is lazy (it happens on the first call), so `compile_for_training` makes that first
call itself: one warm-up forward + backward, timed apart from training (`compile_s`; step times
and tokens/s never include it), after which the model's weights, gradients, buffers and every RNG
state are as they were. If compiling fails (an op the compiler can't handle, no C++ compiler, ...)
the eager module comes back with the reason and a `CompileFallbackWarning`: compiling never
crashes a run. The compiled wrapper shares the eager module's parameters; state dicts are always
taken from the eager module, so no `_orig_mod.` key reaches a checkpoint.
"""
from __future__ import annotations

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
                         mode: str, progress: bool = False) -> tuple[ModelAdapter, CompileInfo]:
    """(the adapter a TrainStep should call, CompileInfo).

    The warm-up is one forward + backward on `batch` under the precision's autocast, exactly as a
    training step runs it (shapes, dtypes, train mode), so the steps themselves don't recompile.
    `progress`: a progress line says what the pause is (compiling takes seconds to minutes, and nothing
    else moves meanwhile).
    """
    with progress_bar(total=1, enabled=progress, unit="warm-up",
                      desc=f"torch.compile {precision.name} (the first step compiles)") as bar:
        compiled = _warm_up(adapter, precision, batch, mode)
        bar.update(1)
    return compiled


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
