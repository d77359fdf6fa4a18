"""Tier 1 check groups, run by `smoke()`: shapes, gradients, stability, init, memory, latency, determinism.

A group is a generator of Check rows taking (adapter, run) (run.py's SmokeRun); the report's plot data it makes
(grad_norms, latency, parameters, the activation fit) it yields as a `Found`. Rows that can fail independently are
wrapped by `_guarded`.
"""
from __future__ import annotations

import copy
import math
import time
import traceback
from functools import partial
from pathlib import Path

import pandas as pd
import torch
import torch.nn as nn

from ..adapter.adapter import ModelAdapter
from ..core.budget import affordable_repeats, gib, measure_activations, row_chunks, size_note, sized_to
from ..core.errors import describe, one_line
from ..core.measure import StepTimer, percentile, summarize
from ..core.precision import (
    BASELINE,
    Precision,
    autocast_precisions,
    computed_in,
    dtype_name,
    native_support,
    precision_class,
    resolve_precision,
)
from ..core.results import Check, failed_check
from ..engine.quantization import describe_quantized
from ..engine.strategies import placed_by
from ..models.stored_dtype import as_loaded, fp32_copy, fp32_reference
from .memory_grid import memory
from .run import Found

VANISHING, EXPLODING = 1e-7, 1e3  # a layer's gradient norm / the median layer's
# Two computations of one model compared by the same relative measure: a padded row vs the same tokens alone, the
# same input twice, train vs eval mode. These are fp32's bounds; a model held in bf16 or fp16 gets its dtype's
# (`_tolerance`), or every bf16-stored model would fail on two kernel paths' rounding.
PADDING_TOL, KERNEL_TOL = 1e-3, 1e-5
INIT_GAIN = (1e-3, 4.0)  # std * sqrt(fan_in) of weight matrices; about 1 keeps the activation scale
EMBEDDING_STD_MAX = 4.0  # nn.Embedding's default init is std 1
RECHECK_LR = 1e-3  # the one Adam step that lets gradients reach what sits behind zero-initialised weights
# Output projections of residual branches (GPT-2 c_proj, Llama o_proj/down_proj, BERT/T5 naming): all-zero is
# the zero-init residual scheme when the projection also writes the residual stream's width.
RESIDUAL_OUTPUTS = ("proj", "o_proj", "out_proj", "down_proj", "fc2", "w2", "wo", "dense", "to_out", "out")
# An AssertionError/ValueError raised here is the tool's or torch's, never the model's own limit.
_NOT_THE_MODEL = (Path(torch.__file__).resolve().parent, Path(__file__).resolve().parents[1])
_MODEL_CODE = Path(__file__).resolve().parents[1] / "models"  # the built-in networks are models too
# Timed forwards per latency probe: as many as fit LATENCY_BUDGET_S after the warm-up, up to LATENCY_MAX_RUNS;
# a big model gets fewer (its row says n). A call slower than a tenth of the budget warms up once only.
LATENCY_WARMUP, LATENCY_MAX_RUNS, LATENCY_BUDGET_S = 3, 20, 3.0
# Output-sized tensors alive at once, by which the checks on (batch, length, vocabulary) logits are sized to
# the budget: a shape case holds its output and the forward's own copy of it; the stability rows hold the fp32
# reference, a low-precision output and the forward's own copy (comparisons walk them in slices).
SHAPE_COPIES, STABILITY_COPIES = 2, 3


def _guarded(name: str, fn, *args) -> Check:
    """One row's isolation: its exception becomes its FAIL row; running out of GPU memory, a WARN (the
    device's limit, not a bug), its memory released when the row returns."""
    try:
        return fn(name, *args)
    except torch.cuda.OutOfMemoryError as exc:
        return Check(name, "WARN", None, None, f"ran out of memory: {describe(exc, 240)}")
    except Exception as exc:
        return failed_check(name, exc)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _names(names: list[str], k: int = 5) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def _rel_dev(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|: scale-free, and stable where single logits are near zero. Walked in slices
    (a NaN anywhere makes it NaN): the temporaries stay small next to a vocabulary x length tensor."""
    diff = scale = torch.zeros(())
    for a, r in row_chunks(x, ref):
        a, r = a.float(), r.float()
        diff = torch.maximum(diff, (a - r).abs().max().cpu())
        scale = torch.maximum(scale, r.abs().max().cpu())
    return (diff / scale.clamp_min(1e-12)).item()


def _tolerance(adapter: ModelAdapter, fp32_tol: float) -> tuple[float, str]:
    """The bound for two computations of the model in the dtype its weights are held in, and what set it: fp32's
    `fp32_tol`, or the rounding of a coarser dtype (the tolerance of the mode that computes in it)."""
    held = computed_in(adapter.weights_dtype)
    tol = held.tolerances().logits
    if held.compute_dtype == torch.float32 or tol <= fp32_tol:  # fp32's own bounds are the check's
        return fp32_tol, ""
    return tol, f"; bound {tol:g}: {dtype_name(held.compute_dtype)} rounding, the dtype the weights are held in"


def _output_bytes(adapter: ModelAdapter) -> int:
    """fp32 bytes of the output per token (a causal LM's logits row; a classifier's, an upper bound)."""
    return 4 * adapter.task.width(adapter)


def _limit(run) -> float:
    return run.budget.limit if run.budget is not None else math.inf


def _expected_shape(adapter: ModelAdapter, b: int, t: int) -> tuple:
    return adapter.task.output_shape(adapter, b, t)


def _inputs(adapter: ModelAdapter, batch: dict) -> tuple:
    """A batch's model input (the task's: token ids, pixel values) and its attention mask, if it has one."""
    return batch[adapter.task.input_key], batch.get("attention_mask")


# --- shapes -------------------------------------------------------------------------------------

def _shapes(adapter: ModelAdapter, run):
    adapter.model.eval()
    L = adapter.max_len
    if adapter.max_len_note:
        yield Check("shapes: max length (default)", "PASS", L, None, adapter.max_len_note)
    odd = sorted({n for n in (3, L - 1 - L % 2) if 1 < n < L})
    per_token, limit = SHAPE_COPIES * _output_bytes(adapter), _limit(run)
    b_max, t_max = sized_to(limit, per_token, 2, L)
    cases = [("batch 1", 1, min(8, L)), ("seq len 1", 2, 1), (f"max length {L}", b_max, L)]
    cases += [(f"odd batch 3, length {n}", 3, n) for n in odd]
    if not adapter.task.reads_tokens:  # its length is the model's own (an image's side): batch sizes only
        cases = [("batch 1", 1, L), (f"batch {b_max}", b_max, L), ("odd batch 3", 3, L)]
    for what, b, t in cases:
        if b * t * per_token > limit:  # not even one sequence of this length: refused before it allocates
            yield Check(f"shapes: {what}", "SKIP", None, None, f"not run: B=1, T={t} would take "
                        f"{gib(per_token * t)} of outputs, over the safe share of {run.budget.describe()}")
            continue
        yield _guarded(f"shapes: {what}", _shape_case, adapter, b, t)
    yield _guarded("shapes: padded batch + attention_mask", _padding_case, adapter)
    if adapter.task.decodes_targets:  # an encoder-decoder: its two lengths apart, and its decoder's causality
        S = min(12, L)
        for s_len, t_len in ((S, max(1, S // 3)), (max(1, S // 3), S)):
            yield _guarded(f"shapes: source {s_len}, target {t_len}", _pair_case, adapter, s_len, t_len)
        yield _guarded("decoder: a later target token changes no earlier logit", _decoder_causal_case, adapter)
    if not adapter.task.reads_tokens:  # no padding to test rows with: a row alone against the same row in a batch
        yield _guarded("shapes: batch rows independent", _rows_case, adapter)


def _rows_case(name: str, adapter: ModelAdapter) -> Check:
    batch = adapter.example_batch(3, adapter.max_len, seed=1)
    with torch.no_grad():
        together = adapter.logits(*_inputs(adapter, batch))
        alone = adapter.logits(*_inputs(adapter, {k: v[1:2] for k, v in batch.items()}))
    dev = _rel_dev(together[1:2], alone)
    tol, why = _tolerance(adapter, KERNEL_TOL)
    ok = math.isfinite(dev) and dev <= tol
    detail = (f"row 2 of a batch of 3 vs the same input alone: max relative difference {dev:.2g}"
              + ("" if ok else ": rows of a batch change each other's outputs (batch norm in eval mode?)") + why)
    return Check(name, "PASS" if ok else "FAIL", _sig(dev), f"<= {tol:g}", detail)


def _own_limit(exc: BaseException) -> str | None:
    """The model refusing a shape with its own `assert` or ValueError, quoted with where it says so; None
    when torch or this tool raised it (a crash inside a layer stays a FAIL)."""
    if not isinstance(exc, (AssertionError, ValueError)) or exc.__traceback__ is None:
        return None
    frame = traceback.extract_tb(exc.__traceback__)[-1]
    where = Path(frame.filename).resolve()
    if any(where.is_relative_to(root) for root in _NOT_THE_MODEL) and not where.is_relative_to(_MODEL_CODE):
        return None
    message = one_line(exc) or (frame.line or "").strip()  # a bare `assert T > 1` says it in its source line
    return f"{message} ({type(exc).__name__} at {where.name}:{frame.lineno})"


def _shape_case(name: str, adapter: ModelAdapter, b: int, t: int) -> Check:
    batch = adapter.example_batch(b, t)
    want = _expected_shape(adapter, b, t)
    try:
        with torch.no_grad():
            got = tuple(adapter.logits(*_inputs(adapter, batch)).shape)
    except (AssertionError, ValueError) as exc:
        limit = _own_limit(exc)
        if limit is None:
            raise
        return Check(name, "WARN", "refused", str(want), f"input ({b}, {t}): the model's own limit: {limit}")
    detail = f"input ({b}, {t}) -> logits {got}"
    if got != want:
        detail += f"; a {adapter.task} model should give {want}"
    return Check(name, "PASS" if got == want else "FAIL", str(got), str(want), detail)


def _padding_case(name: str, adapter: ModelAdapter) -> Check:
    if not adapter.task.reads_tokens:
        return Check(name, "SKIP", None, None, f"the {adapter.task} task's inputs have no padding")
    if not adapter.takes_attention_mask:
        return Check(name, "SKIP", None, None, f"{adapter.name}.forward takes no attention_mask")
    T = min(16, adapter.max_len)
    keep = max(1, T // 2)
    batch = adapter.example_batch(2, T, seed=1)
    ids, mask = batch["input_ids"].clone(), batch["attention_mask"].clone()
    # Pad (id 0) on the side the model family pads: left for decoder LMs (batched generation), else right.
    pad = slice(0, T - keep) if adapter.padding_side == "left" else slice(keep, T)
    real = slice(T - keep, T) if adapter.padding_side == "left" else slice(0, keep)
    ids[1, pad], mask[1, pad] = 0, 0
    with torch.no_grad():
        padded = adapter.logits(ids, mask)
        alone = adapter.logits(ids[1:, real], mask[1:, real])
    if tuple(padded.shape) != _expected_shape(adapter, 2, T):
        return Check(name, "FAIL", str(tuple(padded.shape)), str(_expected_shape(adapter, 2, T)),
                     "wrong output shape for a padded batch")
    row = padded[1, real] if adapter.task.per_token else padded[1]
    dev = _rel_dev(row, alone[0])
    tol, why = _tolerance(adapter, PADDING_TOL)
    ok = math.isfinite(dev) and dev <= tol
    detail = (f"row padded {keep}->{T} vs the same {keep} tokens alone: max relative difference {dev:.2g} "
              f"({adapter.padding_side} padding" + (", position ids from the mask)" if adapter.takes_position_ids
                                                   and adapter.task.positions_from_mask else ")") + why
              + ("" if ok else "; padding changes real tokens' outputs: is attention_mask used?"))
    return Check(name, "PASS" if ok else "FAIL", _sig(dev), f"<= {tol:g}", detail)


def _pair_case(name: str, adapter: ModelAdapter, s_len: int, t_len: int) -> Check:
    """A source and a target of different lengths: one prediction per target position."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, adapter.vocab_size, (2, s_len), generator=g).to(adapter.device)
    target = torch.randint(0, adapter.vocab_size, (2, t_len), generator=g).to(adapter.device)
    with torch.no_grad():
        got = tuple(adapter.logits(ids, torch.ones_like(ids), labels=target).shape)
    want = (2, t_len, adapter.vocab_size)
    return Check(name, "PASS" if got == want else "FAIL", str(got), str(want),
                 f"source (2, {s_len}), target (2, {t_len}) -> logits {got}")


def _decoder_causal_case(name: str, adapter: ModelAdapter) -> Check:
    """The teacher-forced target's later half changed: the logits of the first half must not move, or the decoder
    reads the answer it is scored on."""
    g = torch.Generator().manual_seed(6)
    T = min(12, adapter.max_len)
    ids = torch.randint(0, adapter.vocab_size, (2, T), generator=g).to(adapter.device)
    target = torch.randint(0, adapter.vocab_size, (2, T), generator=g).to(adapter.device)
    later = target.clone()
    k = T // 2
    later[:, k:] = (later[:, k:] + 1) % adapter.vocab_size
    with torch.no_grad():
        before = adapter.logits(ids, torch.ones_like(ids), labels=target)[:, :k]
        after = adapter.logits(ids, torch.ones_like(ids), labels=later)[:, :k]
    dev = _rel_dev(after, before)
    tol, why = _tolerance(adapter, KERNEL_TOL)
    ok = math.isfinite(dev) and dev <= tol
    return Check(name, "PASS" if ok else "FAIL", _sig(dev), f"<= {tol:g}",
                 f"target positions {k}..{T - 1} changed: the first {k} positions' logits moved by {dev:.2g} "
                 f"(relative){why}" + ("" if ok else "; the decoder sees future targets: is its self-attention "
                                                    "causal?"))


# --- gradient flow ------------------------------------------------------------------------------

def _gradients(adapter: ModelAdapter, run):
    net = adapter.model
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    if not named:
        yield Check("gradients", "SKIP", None, None, "no trainable parameters")
        return
    batch = adapter.example_batch(2, min(adapter.max_len, 32))
    value, got = _backward(adapter, batch)
    chance = adapter.task.chance_loss(adapter)
    status = "FAIL" if not math.isfinite(value) else "WARN" if value > 2 * chance else "PASS"
    yield Check(f"gradients: loss on {adapter.task.random_input}", status, _sig(value),
                f"finite, <= 2 ln(C) = {2 * chance:.3g}",
                f"cross-entropy {value:.4g}; a fresh model should be near ln(C) = {chance:.3g}"
                + ("" if status == "PASS" else "; check the output scale and the init"))

    unused = [n for n, p in named if p.grad is None]
    yield Check("gradients: every parameter gets one", "FAIL" if unused else "PASS", len(unused), 0,
                f"no gradient (unused in forward?): {_names(unused)}" if unused
                else f"all {len(named)} trainable tensors received a gradient")
    bad = [n for n, g in got if not torch.isfinite(g).all()]
    yield Check("gradients: finite", "FAIL" if bad else "PASS", len(bad), 0,
                f"NaN/inf gradient in: {_names(bad)}" if bad else "every gradient is finite")
    zero = [n for n, g in got if n not in bad and not g.any()]
    norms = _layer_norms(got)
    yield Found("grad_norms", norms)
    if bad:  # a NaN is "non-zero" too: nothing to judge until the gradients are finite
        yield Check("gradients: non-zero", "FAIL", None, 0,
                    f"{len(bad)} of {len(got)} gradients are NaN/inf (see 'gradients: finite'); "
                    f"{len(zero)} of the finite ones are exactly zero")
        broken = [k for k, v in norms.items() if not math.isfinite(v)]
        yield Check("gradients: layer norm ratio", "FAIL", None, None,  # ratios over finite layers would pass
                    f"gradient norm is NaN/inf in {len(broken)} of {len(norms)} layers: {_names(broken)}")
        return
    ratios = _ratios(got, matrices=True)
    zero_init = [n for n, p in named if not n.endswith("bias") and not p.detach().any()]
    again = None
    if zero_init and (zero or min(ratios.values(), default=1.0) < VANISHING):
        again = _after_one_step(adapter, batch, run)
    yield _zero_row(zero, len(got), zero_init, again)
    yield from _ratio_rows(ratios, _ratios(got, matrices=False), again)
    small = [(n, torch.linalg.vector_norm(g.float()).item()) for n, g in got if g.dim() < 2]
    least = min((item for item in small if item[1] > 0), key=lambda item: item[1], default=None)  # zeros: above
    yield Check("gradients: scalars and 1-d tensors", "PASS", len(small), None,
                f"{len(small)} gates, norm weights and biases judged apart from the layers' matrices"
                + (f"; smallest gradient norm {least[1]:.3g} ({least[0]}): a small one is no vanishing layer"
                   if least else ""))


def _backward(adapter: ModelAdapter, batch: dict) -> tuple[float, list[tuple[str, torch.Tensor]]]:
    """One training-mode forward and backward from zeroed gradients: the loss, and (name, grad) per tensor."""
    net = adapter.model
    net.train()
    net.zero_grad(set_to_none=True)
    loss, _ = adapter.forward_loss(batch)
    loss.backward()
    # An FSDP-sharded model's gradients are DTensors: each rank judges its own shard (an empty one, nothing).
    grads = [(n, p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad) for n, p in net.named_parameters()
             if p.requires_grad and p.grad is not None]
    return loss.item(), [(n, g) for n, g in grads if g.numel()]


def _layer_norms(got) -> dict[str, float]:
    """Gradient norm per module path, over the given tensors."""
    squares: dict[str, float] = {}
    for n, g in got:
        layer = n.rpartition(".")[0] or n
        squares[layer] = squares.get(layer, 0.0) + torch.linalg.vector_norm(g.float()).item() ** 2
    return {k: math.sqrt(v) for k, v in squares.items()}


def _ratios(got, matrices: bool) -> dict[str, float]:
    """Each layer's gradient norm / the median layer's; layers with a zero norm left out (the non-zero row
    judges them). matrices: over weight matrices only, as vanishing is judged (a gate's tiny gradient is
    no vanishing layer); exploding is judged over every tensor."""
    live = {k: v for k, v in _layer_norms([(n, g) for n, g in got if g.dim() >= 2 or not matrices]).items()
            if 0 < v < math.inf}
    median = sorted(live.values())[len(live) // 2] if live else 1.0
    return {k: v / median for k, v in live.items()}


def _after_one_step(adapter: ModelAdapter, batch: dict, run) -> tuple[list[str], dict] | str:
    """Zero and layer-ratio pictures after one optimizer step on a copy of the model (the model itself is
    untouched), or why it was not taken: what sits behind zero-initialised weights gets a gradient only then."""
    if placed_by(adapter.model) is not None:  # ranks would step a copy each, apart: its collectives need them together
        return "not re-checked: the model is sharded (run smoke in one process for the re-check)"
    params = sum(p.numel() * p.element_size() for p in adapter.model.parameters())
    need = 4 * params  # the copy, its gradients and Adam's two moments
    if run.budget is not None and need > run.budget.limit:
        return f"not re-checked: a copy with optimizer state needs {gib(need)}, over {run.budget.describe()}"
    twin = copy.copy(adapter)
    try:
        twin.model = copy.deepcopy(adapter.model)
    except Exception as exc:  # noqa: BLE001 - a model that can't be copied is not re-checked, not failed
        return f"not re-checked: the model could not be copied ({describe(exc, 120)})"
    _backward(twin, batch)
    torch.optim.Adam([p for p in twin.model.parameters() if p.requires_grad], lr=RECHECK_LR).step()
    _, got = _backward(twin, batch)
    return [n for n, g in got if not g.any()], _ratios(got, matrices=True)


def _zero_row(zero: list[str], total: int, zero_init: list[str], again) -> Check:
    name, step = "gradients: non-zero", f"one optimizer step on a copy (Adam, lr {RECHECK_LR:g})"
    if not zero:
        return Check(name, "PASS", 0, 0, "every gradient has a non-zero entry")
    if again is None:
        return Check(name, "WARN", len(zero), 0, "exactly zero gradient (fine only behind a deliberately "
                                                  f"zero-initialised layer): {_names(zero)}")
    at_init = (f"{len(zero)} of {total} tensors get exactly zero gradient at init ({_names(zero, 3)}), behind "
               f"zero-initialised weights ({_names(zero_init, 3)})")
    if isinstance(again, str):
        return Check(name, "WARN", len(zero), 0, f"{at_init}; {again}")
    still = again[0]
    if still:
        return Check(name, "FAIL", len(still), "0 after one step",
                     f"{at_init}; still exactly zero after {step}: {_names(still)}")
    return Check(name, "PASS", len(zero), "0 after one step",
                 f"{at_init}: the zero-init residual scheme; after {step} every gradient flows")


def _ratio_rows(matrices: dict[str, float], every: dict[str, float], again):
    if not every:
        yield Check("gradients: layer norm ratio", "FAIL", None, None, "no layer has a finite non-zero gradient")
        return
    matrices = matrices or every  # a model of 1-d tensors only
    low, high = min(matrices, key=matrices.get), max(every, key=every.get)
    for label, ratios, layer, limit in (("vanishing", matrices, low, f">= {VANISHING:g}"),
                                        ("exploding", every, high, f"<= {EXPLODING:g}")):
        flagged = ratios[layer] < VANISHING if label == "vanishing" else ratios[layer] > EXPLODING
        detail = (f"smallest matrix-gradient norm / median over {len(ratios)} layers" if label == "vanishing"
                  else f"largest gradient norm / median over {len(ratios)} layers") + f": {layer}" \
            + (f" is {label}" if flagged else "")
        status = "FAIL" if flagged else "PASS"
        if flagged and label == "vanishing" and isinstance(again, tuple) and again[1]:
            after = min(again[1].values())
            status = "FAIL" if after < VANISHING else "PASS"
            detail += (f" at init, behind zero-initialised weights; after one optimizer step on a copy the smallest "
                       f"ratio is {after:.3g}" + (": still vanishing" if status == "FAIL" else ": it flows"))
        yield Check(f"gradients: {label} layers", status, _sig(ratios[layer]), limit, detail)


# --- numerical stability ------------------------------------------------------------------------

def _stability(adapter: ModelAdapter, run):
    adapter.model.eval()
    L = adapter.max_len
    for what, ids in adapter.task.stability_inputs(adapter, min(L, 16)).items():
        yield _guarded(f"stability: {what}", _finite_case, adapter, partial(adapter.logits, ids.to(adapter.device)))
    # One random max-length batch serves twice, as a finiteness case and as the fp32 reference the low
    # precisions are compared with: on a big model each such forward costs seconds. Its size is the
    # budget's: fewer sequences, then a shorter length, and the rows say which ran.
    per_token, limit = STABILITY_COPIES * _output_bytes(adapter), _limit(run)
    b, t = sized_to(limit, per_token, 2, L)
    if t < 1:
        yield Check(f"stability: random, max length {L}", "SKIP", None, None, f"not run: one token's outputs "
                    f"take {gib(per_token)}, over the safe share of {run.budget.describe()}")
        return
    note = size_note((2, L), (b, t), per_token, limit, "the fp32 logits, a low-precision copy and the forward's own")
    batch = adapter.example_batch(b, t, seed=3)
    try:
        with torch.no_grad():
            ref = adapter.logits(*_inputs(adapter, batch))
    except Exception as exc:  # each row that needed it fails with it
        ref = exc
    yield _guarded(f"stability: random, {'max ' if t == L else ''}length {t}", _finite_case, adapter, ref, note)
    # The model runs as loaded; the comparison's reference is fp32, so weights held in bf16/fp16 are compared
    # as an fp32 copy (low precision autocast on fp32 weights: what a mixed precision training step runs).
    reference = fp32_reference(adapter.model, adapter.stored_dtype)
    with fp32_copy(adapter.model):
        if reference != BASELINE and not isinstance(ref, Exception):
            try:
                with torch.no_grad():
                    ref = adapter.logits(*_inputs(adapter, batch))
            except Exception as exc:
                ref = exc
        rows = [_guarded(f"stability: {low} vs fp32 logits", _low_precision_case, adapter, run.precision, low,
                         batch, ref, reference, note) for low in autocast_precisions()]
    yield from rows


def _finite_case(name: str, adapter: ModelAdapter, got, note: str = "") -> Check:
    """`got`: a forward to run (a callable), or a forward's logits (or the exception it raised) to judge."""
    if isinstance(got, Exception):
        raise got
    if callable(got):
        with torch.no_grad():
            got = got()
    out = got
    bad = sum(int((~torch.isfinite(c)).sum()) for (c,) in row_chunks(out))
    kinds = ("NaN" if any(bool(c.isnan().any()) for (c,) in row_chunks(out)) else "inf") if bad else ""
    return Check(name, "FAIL" if bad else "PASS", bad, 0,
                 (f"{bad} of {out.numel()} logits are {kinds}" if bad else f"all {out.numel()} logits finite")
                 + f" ({tuple(out.shape)})" * bool(note) + note)


def _low_precision_case(name: str, adapter: ModelAdapter, requested: Precision, low: str, batch: dict,
                        ref: torch.Tensor | Exception, reference: str = BASELINE, note: str = "") -> Check:
    if isinstance(ref, Exception):  # a model whose fp32 forward raises fails here too, supported or not
        raise ref
    tol = precision_class(low).tolerances().logits  # max |logits - fp32 logits| / max |fp32 logits|
    native, why = native_support(low, adapter.device)
    forced = requested.name == low  # asked for by name; auto only ever picks a native one
    if not native and not forced:
        return Check(name, "SKIP", None, f"<= {tol:g}", f"{why}; pass precision='{low}' to run it anyway")
    if not all(bool(torch.isfinite(c).all()) for (c,) in row_chunks(ref)):
        return Check(name, "FAIL", None, f"<= {tol:g}", "the fp32 logits are already NaN/inf: nothing to compare "
                                                         f"{low} with (see the stability rows above)")
    prec = requested if forced else resolve_precision(low, adapter.device, warn=False)
    with torch.no_grad(), prec.autocast():
        out = adapter.logits(*_inputs(adapter, batch))
    if not all(bool(torch.isfinite(c).all()) for (c,) in row_chunks(out)):
        return Check(name, "FAIL", None, f"<= {tol:g}", f"{low} autocast gives non-finite logits (overflow?)")
    dev = _rel_dev(out, ref)
    detail = (f"max |{low} - fp32| / max |fp32| over {tuple(ref.shape)} logits"
              + ("" if reference == BASELINE else f", {low} autocast and fp32 on {reference}")
              + ("" if native else " (forced: emulated on this device)")
              + ("" if dev <= tol else f"; more than {low} rounding explains") + note)
    return Check(name, "PASS" if dev <= tol else "WARN", _sig(dev, 3), f"<= {tol:g}", detail)


# --- initialisation -----------------------------------------------------------------------------

def _init(adapter: ModelAdapter, run):
    # A tied tensor (embedding = LM head) has several owners: it is an embedding if any of them is one.
    owners: dict[int, list[nn.Module]] = {}
    for m in adapter.model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
    rows = []
    for n, p in adapter.model.named_parameters():
        if not p.is_floating_point():  # a 4-bit base's packed weights: codes, not values (the dtype row names them)
            continue
        w = p.detach().float()
        tables = [m for m in owners[id(p)] if isinstance(m, nn.Embedding)]
        embedding = bool(tables)
        row = {"name": n, "shape": tuple(p.shape), "kind": "embedding" if embedding else "matrix" if w.dim() >= 2
               else "vector", "mean": w.mean().item(), "std": w.std(correction=0).item(),
               "finite": bool(torch.isfinite(w).all()), "constant": False, "scale": None, "dead_rows": 0}
        if w.dim() >= 2 and w.numel() > 1:
            # 1-d tensors (biases, norm weights) are legitimately constant at init; matrices are not.
            row["constant"] = bool((w == w.flatten()[0]).all())
            row["scale"] = row["std"] if embedding else row["std"] * math.sqrt(w[0].numel())
            dead = (w.flatten(1) == 0).all(1)
            for table in tables:
                if table.padding_idx is not None:
                    dead[table.padding_idx] = False  # the padding row is zero by design
            row["dead_rows"] = 0 if row["constant"] else int(dead.sum())
        rows.append(row)
    yield Found("parameters", pd.DataFrame(rows))
    yield _weights_dtype(adapter)

    bad = [r["name"] for r in rows if not r["finite"]]
    yield Check("init: finite values", "FAIL" if bad else "PASS", len(bad), 0,
                f"NaN/inf in: {_names(bad)}" if bad else f"all {len(rows)} tensors finite")
    yield _constant_row(rows, adapter.model)
    scaled = [r for r in rows if r["scale"] is not None and r["finite"] and not r["constant"]]
    odd = [r["name"] for r in scaled if not (r["kind"] == "embedding" and r["scale"] <= EMBEDDING_STD_MAX)
           and not (r["kind"] == "matrix" and INIT_GAIN[0] <= r["scale"] <= INIT_GAIN[1])]
    spread = (f"std*sqrt(fan_in) of {sum(r['kind'] == 'matrix' for r in scaled)} matrices "
              f"{min((r['scale'] for r in scaled if r['kind'] == 'matrix'), default=0):.3g}-"
              f"{max((r['scale'] for r in scaled if r['kind'] == 'matrix'), default=0):.3g}")
    yield Check("init: weight scale", "WARN" if odd else "PASS", len(odd),
                f"std*sqrt(fan_in) in [{INIT_GAIN[0]:g}, {INIT_GAIN[1]:g}]; embedding std <= {EMBEDDING_STD_MAX:g}",
                spread + (f"; suspicious: {_names(odd)}" if odd else ""))
    dead = [f"{r['name']} ({r['dead_rows']} of {r['shape'][0]} rows)" for r in rows if r["dead_rows"]]
    yield Check("init: dead units (all-zero rows)", "WARN" if dead else "PASS", len(dead), 0,
                f"all-zero rows: {_names(dead)}" if dead else "no all-zero row in any weight matrix")


def _constant_row(rows: list[dict], model: nn.Module) -> Check:
    """Constant matrices WARN, except all-zero output projections of residual branches: the zero-init
    residual scheme (each block starts as the identity), named as such."""
    width = {m.embedding_dim for m in model.modules() if isinstance(m, nn.Embedding)}
    scheme = [r["name"] for r in rows if r["constant"] and r["mean"] == 0 and r["kind"] == "matrix"
              and r["shape"][0] in width and r["name"].rpartition(".")[0].endswith(RESIDUAL_OUTPUTS)]
    const = [f"{r['name']} (all {r['mean']:.3g})" for r in rows if r["constant"] and r["name"] not in scheme]
    known = (f"{len(scheme)} all-zero residual output projections ({_names(scheme, 3)}): the zero-init residual "
             "scheme") if scheme else ""
    if const:
        return Check("init: constant weight matrices", "WARN", len(const), 0,
                     f"every entry equal, so units start identical: {_names(const)}" + (f"; {known}" if known else ""))
    return Check("init: constant weight matrices", "PASS", 0, 0,
                 known or "no constant matrix (constant 1-d biases/norm weights are expected)")


def _weights_dtype(adapter: ModelAdapter) -> Check:
    """The weights' stored dtype and what smoke runs them in (a statement, never a failure)."""
    held = adapter.weights_dtype
    reference = fp32_reference(adapter.model, adapter.stored_dtype)
    compared = "" if reference == BASELINE else f"; the bf16/fp16 stability rows compare with {reference}"
    quantized = describe_quantized(adapter.model)
    return Check("init: weights dtype", "PASS", dtype_name(held), None,
                 (f"{quantized}; " if quantized else "") + as_loaded(adapter.stored_dtype, held) + compared)


# --- inference latency --------------------------------------------------------------------------

def _latency(adapter: ModelAdapter, run):
    fit = run.activation_fit
    if fit is None:  # the memory group did not run before: measured here, for the report too
        fit = measure_activations(adapter, run.precision, max(run.seq_lens))
        yield Found("activation_fit", fit)
    adapter.model.eval()
    samples = []  # each case's timings, for the report's plot and JSON
    for t in run.seq_lens:
        for b in run.batch_sizes:
            yield _guarded(f"latency: B={b} T={t} (median ms)", _latency_case, adapter, run, fit, samples, b, t)
    yield Found("latency", samples)


def _latency_case(name: str, adapter: ModelAdapter, run, fit, samples: list, b: int, t: int) -> Check:
    need = fit.transient(b, t) * 2
    if need > run.budget.limit:  # refused before it allocates
        return Check(name, "SKIP", None, None, f"not run: B={b}, T={t} predicted {gib(need)} for the output and "
                                               f"one temporary its size, over the safe share of "
                                               f"{run.budget.describe()}")
    batch = adapter.example_batch(b, t)
    ids, mask = _inputs(adapter, batch)
    timer = StepTimer(adapter.device)
    with torch.inference_mode(), run.precision.autocast():
        for _ in range(LATENCY_WARMUP):
            start = time.perf_counter()
            adapter.logits(ids, mask)
            if timer.cuda:
                torch.cuda.synchronize(adapter.device)
            call_s = time.perf_counter() - start
            if call_s * 10 > LATENCY_BUDGET_S:  # a big model: its first call already settled the allocations
                break
        n = affordable_repeats(call_s, LATENCY_BUDGET_S, LATENCY_MAX_RUNS)
        for _ in range(n):
            with timer.region():
                adapter.logits(ids, mask)
    ms = timer.milliseconds()
    samples.append({"batch_size": b, "seq_len": t, "samples_ms": ms})
    s, p95 = summarize(ms), percentile(ms, 95)
    budget = f"; n set by the {LATENCY_BUDGET_S:g} s budget" if n < LATENCY_MAX_RUNS else ""
    return Check(name, "PASS", _sig(s.median), None,
                 f"median {s.median:.3g} ms, p95 {p95:.3g} ms, IQR {s.iqr:.2g} ms (n={s.n}{budget}); "
                 f"{adapter.task.units(batch) / (s.median / 1e3):,.0f} {adapter.task.unit}s/s; "
                 f"{run.precision.name} on "
                 f"{run.metadata['device_name']}")


# --- determinism --------------------------------------------------------------------------------

def _determinism(adapter: ModelAdapter, run):
    net = adapter.model
    batch = adapter.example_batch(2, min(adapter.max_len, 32), seed=4)
    args = _inputs(adapter, batch)
    with torch.no_grad():
        net.eval()
        first, second = adapter.logits(*args), adapter.logits(*args)
        net.train()
        trained = adapter.logits(*args)
    bad = sum(int((~torch.isfinite(t)).sum()) for t in (first, second, trained))
    if bad:  # NaN == NaN under equal_nan, and NaN - NaN is no difference: both rows would PASS
        for check in ("determinism: eval, same input twice", "determinism: train vs eval mode"):
            yield Check(check, "FAIL", None, None, f"{bad} of {3 * first.numel()} outputs are NaN/inf: "
                                                   "determinism can't be judged (see the stability rows)")
        return
    same = torch.allclose(first, second, rtol=0, atol=0, equal_nan=True)
    diff = 0.0 if same else _rel_dev(second, first)
    tol, why = _tolerance(adapter, KERNEL_TOL)
    status = "PASS" if same else "WARN" if diff <= tol else "FAIL"
    yield Check("determinism: eval, same input twice", status, _sig(diff), "identical",
                "bit-identical outputs" if same else
                f"outputs differ by {diff:.2g} (relative): " + ("non-deterministic kernels" if status == "WARN"
                                                              else "something random stays on in eval mode") + why)
    drop = _rel_dev(trained, first)
    if drop > tol:
        detail = f"train-mode outputs differ by {drop:.2g} (relative): dropout or similar is active in training"
    else:  # a rounding-level difference comes from different kernels (e.g. an eval fast path)
        detail = f"train and eval mode agree to {drop:.2g} (relative): no active dropout{why}"
    yield Check("determinism: train vs eval mode", "PASS", _sig(drop), None, detail)


CHECK_GROUPS = {"shapes": _shapes, "gradients": _gradients, "stability": _stability, "init": _init,
                "memory": memory, "latency": _latency, "determinism": _determinism}
