"""Tier 1 check groups, run by `smoke()`: shapes, gradients, stability, init, memory, latency, determinism.

A group is a generator of Check rows taking (adapter, report); it may fill the report's plot data
(grad_norms, latency, memory, parameters). Rows that can fail independently are wrapped by `_guarded`.
"""
from __future__ import annotations

import math
import time

import pandas as pd
import torch
import torch.nn as nn

from .adapter import ModelAdapter
from .measure import SavedTensorMeter, StepTimer, percentile, summarize
from .precision import Precision, native_support, resolve_precision
from .results import Check, failed_check

VANISHING, EXPLODING = 1e-7, 1e3  # a layer's gradient norm / the median layer's
LOW_PRECISION_TOL = {"bf16": 5e-2, "fp16": 1e-2}  # max |logits - fp32 logits| / max |fp32 logits|
PADDING_TOL = 1e-3  # same relative measure, padded row vs the same tokens alone
INIT_GAIN = (1e-3, 4.0)  # std * sqrt(fan_in) of weight matrices; about 1 keeps the activation scale
EMBEDDING_STD_MAX = 4.0  # nn.Embedding's default init is std 1
LATENCY_WARMUP, LATENCY_MIN_RUNS, LATENCY_MAX_RUNS, LATENCY_BUDGET_S = 3, 5, 20, 1.0


def _guarded(name: str, fn, *args) -> Check:
    """One row's isolation: its exception becomes its FAIL row."""
    try:
        return fn(name, *args)
    except Exception as exc:
        return failed_check(name, exc)


def _sig(x: float, digits: int = 4) -> float:
    return float(f"{x:.{digits}g}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def _names(names: list[str], k: int = 5) -> str:
    return ", ".join(names[:k]) + (f" and {len(names) - k} more" if len(names) > k else "")


def _rel_dev(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref|: scale-free, and stable where single logits are near zero."""
    x, ref = x.detach().float(), ref.detach().float()
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def _expected_shape(adapter: ModelAdapter, b: int, t: int) -> tuple:
    return (b, t, adapter.vocab_size) if adapter.task == "causal-lm" else (b, adapter.num_classes)


# --- shapes -------------------------------------------------------------------------------------

def _shapes(adapter: ModelAdapter, report):
    adapter.model.eval()
    L = adapter.max_len
    if adapter.max_len_note:
        yield Check("shapes: max length (default)", "PASS", L, None, adapter.max_len_note)
    odd = sorted({n for n in (3, L - 1 - L % 2) if 1 < n < L})
    cases = [("batch 1", 1, min(8, L)), ("seq len 1", 2, 1), (f"max length {L}", 2, L)]
    cases += [(f"odd batch 3, length {n}", 3, n) for n in odd]
    for what, b, t in cases:
        yield _guarded(f"shapes: {what}", _shape_case, adapter, b, t)
    yield _guarded("shapes: padded batch + attention_mask", _padding_case, adapter)


def _shape_case(name: str, adapter: ModelAdapter, b: int, t: int) -> Check:
    batch = adapter.example_batch(b, t)
    with torch.no_grad():
        got = tuple(adapter.logits(batch["input_ids"], batch["attention_mask"]).shape)
    want = _expected_shape(adapter, b, t)
    detail = f"input ({b}, {t}) -> logits {got}"
    if got != want:
        detail += f"; a {adapter.task} model should give {want}"
    return Check(name, "PASS" if got == want else "FAIL", str(got), str(want), detail)


def _padding_case(name: str, adapter: ModelAdapter) -> Check:
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
    row = padded[1, real] if adapter.task == "causal-lm" else padded[1]
    dev = _rel_dev(row, alone[0])
    ok = math.isfinite(dev) and dev <= PADDING_TOL
    detail = (f"row padded {keep}->{T} vs the same {keep} tokens alone: max relative difference {dev:.2g} "
              f"({adapter.padding_side} padding" + (", position ids from the mask)" if adapter.takes_position_ids
                                                   and adapter.task == "causal-lm" else ")")
              + ("" if ok else "; padding changes real tokens' outputs: is attention_mask used?"))
    return Check(name, "PASS" if ok else "FAIL", _sig(dev), f"<= {PADDING_TOL:g}", detail)


# --- gradient flow ------------------------------------------------------------------------------

def _gradients(adapter: ModelAdapter, report):
    net = adapter.model
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    if not named:
        yield Check("gradients", "SKIP", None, None, "no trainable parameters")
        return
    net.train()
    net.zero_grad(set_to_none=True)
    loss, _ = adapter.forward_loss(adapter.example_batch(2, min(adapter.max_len, 32)))
    loss.backward()
    value = loss.item()
    chance = math.log(adapter.vocab_size if adapter.task == "causal-lm" else adapter.num_classes)
    status = "FAIL" if not math.isfinite(value) else "WARN" if value > 2 * chance else "PASS"
    yield Check("gradients: loss on random tokens", status, _sig(value), f"finite, <= 2 ln(C) = {2 * chance:.3g}",
                f"cross-entropy {value:.4g}; a fresh model should be near ln(C) = {chance:.3g}"
                + ("" if status == "PASS" else "; check the output scale and the init"))

    unused = [n for n, p in named if p.grad is None]
    yield Check("gradients: every parameter gets one", "FAIL" if unused else "PASS", len(unused), 0,
                f"no gradient (unused in forward?): {_names(unused)}" if unused
                else f"all {len(named)} trainable tensors received a gradient")
    got = [(n, p.grad) for n, p in named if p.grad is not None]
    bad = [n for n, g in got if not torch.isfinite(g).all()]
    yield Check("gradients: finite", "FAIL" if bad else "PASS", len(bad), 0,
                f"NaN/inf gradient in: {_names(bad)}" if bad else "every gradient is finite")
    zero = [n for n, g in got if n not in bad and not g.any()]
    if bad:  # a NaN is "non-zero" too: nothing to judge until the gradients are finite
        yield Check("gradients: non-zero", "FAIL", None, 0,
                    f"{len(bad)} of {len(got)} gradients are NaN/inf (see 'gradients: finite'); "
                    f"{len(zero)} of the finite ones are exactly zero")
    else:
        yield Check("gradients: non-zero", "WARN" if zero else "PASS", len(zero), 0,
                    f"exactly zero gradient (fine only behind a deliberately zero-initialised layer): {_names(zero)}"
                    if zero else "every gradient has a non-zero entry")

    squares: dict[str, float] = {}
    for n, g in got:
        layer = n.rpartition(".")[0] or n
        squares[layer] = squares.get(layer, 0.0) + torch.linalg.vector_norm(g.float()).item() ** 2
    report.grad_norms = {k: math.sqrt(v) for k, v in squares.items()}
    broken = [k for k, v in report.grad_norms.items() if not math.isfinite(v)]
    if broken:  # ratios over the finite layers only would pass a model whose gradients are NaN
        yield Check("gradients: layer norm ratio", "FAIL", None, None,
                    f"gradient norm is NaN/inf in {len(broken)} of {len(squares)} layers: {_names(broken)}")
        return
    live = {k: v for k, v in report.grad_norms.items() if 0 < v < math.inf}
    if not live:
        yield Check("gradients: layer norm ratio", "FAIL", None, None, "no layer has a finite non-zero gradient")
        return
    median = sorted(live.values())[len(live) // 2]
    ratios = {k: v / median for k, v in live.items()}
    low, high = min(ratios, key=ratios.get), max(ratios, key=ratios.get)
    for label, layer, limit, flagged in (("vanishing", low, f">= {VANISHING:g}", ratios[low] < VANISHING),
                                         ("exploding", high, f"<= {EXPLODING:g}", ratios[high] > EXPLODING)):
        yield Check(f"gradients: {label} layers", "FAIL" if flagged else "PASS", _sig(ratios[layer]), limit,
                    f"{'smallest' if label == 'vanishing' else 'largest'} layer norm / median over {len(live)} "
                    f"layers: {layer}" + (f" is {label}" if flagged else ""))


# --- numerical stability ------------------------------------------------------------------------

def _stability(adapter: ModelAdapter, report):
    adapter.model.eval()
    V, L, T = adapter.vocab_size, adapter.max_len, min(adapter.max_len, 16)
    token = int(torch.randint(V, (1,), generator=torch.Generator().manual_seed(2)))
    inputs = {f"token id 0 x{T}": torch.zeros(2, T, dtype=torch.long),
              f"token id {V - 1} x{T}": torch.full((2, T), V - 1),
              f"token {token} repeated x{T}": torch.full((2, T), token),
              f"random, max length {L}": adapter.example_batch(2, L, seed=2)["input_ids"]}
    for what, ids in inputs.items():
        yield _guarded(f"stability: {what}", _finite_case, adapter, ids.to(adapter.device))
    batch = adapter.example_batch(2, L, seed=3)
    with torch.no_grad():
        ref = adapter.logits(batch["input_ids"], batch["attention_mask"])
    for low in ("bf16", "fp16"):
        yield _guarded(f"stability: {low} vs fp32 logits", _low_precision_case, adapter, report.precision, low,
                       batch, ref)


def _finite_case(name: str, adapter: ModelAdapter, ids: torch.Tensor) -> Check:
    with torch.no_grad():
        out = adapter.logits(ids)
    bad = int((~torch.isfinite(out)).sum())
    kinds = "NaN" if out.isnan().any() else "inf"
    return Check(name, "FAIL" if bad else "PASS", bad, 0,
                 f"{bad} of {out.numel()} logits are {kinds}" if bad else f"all {out.numel()} logits finite")


def _low_precision_case(name: str, adapter: ModelAdapter, requested: Precision, low: str, batch: dict,
                        ref: torch.Tensor) -> Check:
    tol = LOW_PRECISION_TOL[low]
    native, why = native_support(low, adapter.device)
    forced = requested.name == low  # asked for by name; auto only ever picks a native one
    if not native and not forced:
        return Check(name, "SKIP", None, f"<= {tol:g}", f"{why}; pass precision='{low}' to run it anyway")
    if not torch.isfinite(ref).all():
        return Check(name, "FAIL", None, f"<= {tol:g}", "the fp32 logits are already NaN/inf: nothing to compare "
                                                         f"{low} with (see the stability rows above)")
    prec = requested if forced else resolve_precision(low, adapter.device, warn=False)
    with torch.no_grad(), prec.autocast():
        out = adapter.logits(batch["input_ids"], batch["attention_mask"])
    if not torch.isfinite(out).all():
        return Check(name, "FAIL", None, f"<= {tol:g}", f"{low} autocast gives non-finite logits (overflow?)")
    dev = _rel_dev(out, ref)
    detail = (f"max |{low} - fp32| / max |fp32| over {tuple(ref.shape)} logits"
              + ("" if native else " (forced: emulated on this device)")
              + ("" if dev <= tol else f"; more than {low} rounding explains"))
    return Check(name, "PASS" if dev <= tol else "WARN", _sig(dev, 3), f"<= {tol:g}", detail)


# --- initialisation -----------------------------------------------------------------------------

def _init(adapter: ModelAdapter, report):
    # A tied tensor (embedding = LM head) has several owners: it is an embedding if any of them is one.
    owners: dict[int, list[nn.Module]] = {}
    for m in adapter.model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
    rows = []
    for n, p in adapter.model.named_parameters():
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
    report.parameters = pd.DataFrame(rows)

    bad = [r["name"] for r in rows if not r["finite"]]
    yield Check("init: finite values", "FAIL" if bad else "PASS", len(bad), 0,
                f"NaN/inf in: {_names(bad)}" if bad else f"all {len(rows)} tensors finite")
    const = [f"{r['name']} (all {r['mean']:.3g})" for r in rows if r["constant"]]
    yield Check("init: constant weight matrices", "WARN" if const else "PASS", len(const), 0,
                f"every entry equal, so units start identical: {_names(const)}" if const
                else "no constant matrix (constant 1-d biases/norm weights are expected)")
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


# --- memory -------------------------------------------------------------------------------------

def _memory(adapter: ModelAdapter, report):
    s = report.model
    yield Check("memory: parameters + buffers (bytes)", "PASS", s["parameter_bytes"] + s["buffer_bytes"], None,
                f"{_mib(s['parameter_bytes'])} in {s['parameters']:,} parameters + {_mib(s['buffer_bytes'])} buffers")
    net, T, dtype, dev = adapter.model, max(report.seq_lens), report.precision.name, adapter.device
    cuda, peaks = dev.type == "cuda", []
    net.train()
    for b in report.batch_sizes:  # ascending, so the first out-of-memory ends the sweep
        loss, oom = None, False
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        try:
            with SavedTensorMeter(net) as meter, report.precision.autocast():
                loss, _ = adapter.forward_loss(adapter.example_batch(b, T))
            if cuda:  # the backward is what a training step adds to the peak
                loss.backward()
        except torch.cuda.OutOfMemoryError:
            oom = True
        loss = None
        net.zero_grad(set_to_none=True)
        if oom:  # handled outside the except block, so the traceback's tensors are already freed
            torch.cuda.empty_cache()
            fit = report.memory[-1]["batch_size"] if report.memory else None
            peaks.append(Check(f"memory: peak CUDA B={b} (bytes)", "WARN", None, None,
                               f"out of memory at B={b}, T={T}; the largest batch that fit was {fit}"))
            break
        peak = torch.cuda.max_memory_allocated(dev) if cuda else None
        report.memory.append({"batch_size": b, "seq_len": T, "activation_bytes": meter.bytes, "peak_bytes": peak})
        if cuda:
            peaks.append(Check(f"memory: peak CUDA B={b} (bytes)", "PASS", peak, None,
                               f"{_mib(peak)} peak allocated, forward + backward at T={T} in {dtype}"))
    if report.memory:
        per = {r["batch_size"]: r["activation_bytes"] // r["batch_size"] for r in report.memory}
        b = max(per)
        yield Check("memory: activations per sample (bytes)", "PASS", per[b], None,
                    f"{_mib(per[b])} per sample saved for backward at T={T} in {dtype} (B={b}; "
                    + ", ".join(f"B={k}: {_mib(v)}" for k, v in per.items()) + "; saved-tensor accounting)")
    yield from peaks
    if not cuda:
        yield Check("memory: peak CUDA", "SKIP", None, None,
                    f"runs on {dev.type}: no CUDA allocator to read; the activation bytes above hold anywhere")


# --- inference latency --------------------------------------------------------------------------

def _latency(adapter: ModelAdapter, report):
    adapter.model.eval()
    for t in report.seq_lens:
        for b in report.batch_sizes:
            yield _guarded(f"latency: B={b} T={t} (median ms)", _latency_case, adapter, report, b, t)


def _latency_case(name: str, adapter: ModelAdapter, report, b: int, t: int) -> Check:
    batch = adapter.example_batch(b, t)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    timer, n = StepTimer(adapter.device), 0
    with torch.inference_mode(), report.precision.autocast():
        for _ in range(LATENCY_WARMUP):
            adapter.logits(ids, mask)
        if timer.cuda:
            torch.cuda.synchronize(adapter.device)
        start = time.perf_counter()
        # A time budget keeps big models quick; launches are async on CUDA, so it is only a bound.
        while n < LATENCY_MIN_RUNS or (n < LATENCY_MAX_RUNS and time.perf_counter() - start < LATENCY_BUDGET_S):
            with timer.region():
                adapter.logits(ids, mask)
            n += 1
    ms = timer.milliseconds()
    report.latency.append({"batch_size": b, "seq_len": t, "samples_ms": ms})
    s, p95 = summarize(ms), percentile(ms, 95)
    return Check(name, "PASS", _sig(s.median), None,
                 f"median {s.median:.3g} ms, p95 {p95:.3g} ms, IQR {s.iqr:.2g} ms (n={s.n}); "
                 f"{b * t / (s.median / 1e3):,.0f} tokens/s; {report.precision.name} on "
                 f"{report.metadata['device_name']}")


# --- determinism --------------------------------------------------------------------------------

def _determinism(adapter: ModelAdapter, report):
    net = adapter.model
    batch = adapter.example_batch(2, min(adapter.max_len, 32), seed=4)
    args = (batch["input_ids"], batch["attention_mask"])
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
    status = "PASS" if same else "WARN" if diff <= 1e-5 else "FAIL"
    yield Check("determinism: eval, same input twice", status, _sig(diff), "identical",
                "bit-identical outputs" if same else
                f"outputs differ by {diff:.2g} (relative): " + ("non-deterministic kernels" if status == "WARN"
                                                              else "something random stays on in eval mode"))
    drop = _rel_dev(trained, first)
    if drop > 1e-5:
        detail = f"train-mode outputs differ by {drop:.2g} (relative): dropout or similar is active in training"
    else:  # a rounding-level difference comes from different kernels (e.g. an eval fast path)
        detail = f"train and eval mode agree to {drop:.2g} (relative): no active dropout"
    yield Check("determinism: train vs eval mode", "PASS", _sig(drop), None, detail)


CHECK_GROUPS = {"shapes": _shapes, "gradients": _gradients, "stability": _stability, "init": _init,
                "memory": _memory, "latency": _latency, "determinism": _determinism}
