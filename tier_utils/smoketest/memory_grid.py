"""Tier 1's memory check, sized to the device: activations saved for backward per batch size, measured
where they fit and predicted where they don't, and out of memory as a row, never a crash.

The bytes come from a fit measured at three small sizes (budget.measure_activations). Each batch size of
the sweep then runs only if its prediction fits the run's budget: on a CPU at most CPU_PROBE_BYTES
(the count is exact, so a bigger size adds nothing but time and RSS); where even batch 1 is over, batch 1
runs at the longest length that fits, and the rest is predicted from the fit, said so in the row. A size
over the safe share of free memory is refused before it allocates (WARN: a training step there would not
fit); on a GPU one that runs out of memory anyway is caught, its memory released, and the sweep stops.
"""
from __future__ import annotations

import torch

from ..adapter.adapter import ModelAdapter
from ..core.budget import SAFE_SHARE, gib, measure_activations, out_of_memory_note, without_oom
from ..core.measure import SavedTensorMeter
from ..core.results import Check
from .run import Found


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def memory(adapter: ModelAdapter, run):
    s = run.model
    yield Check("memory: parameters + buffers (bytes)", "PASS", s["parameter_bytes"] + s["buffer_bytes"], None,
                f"{_mib(s['parameter_bytes'])} in {s['parameters']:,} parameters + {_mib(s['buffer_bytes'])} buffers")
    net, T, dtype, dev, budget = adapter.model, max(run.seq_lens), run.precision.name, adapter.device, run.budget
    cuda, rows, entries = dev.type == "cuda", [], []
    fit = run.activation_fit
    if fit is None:  # the latency group did not run before: measured here, for the report too
        fit = measure_activations(adapter, run.precision, T)
        yield Found("activation_fit", fit)
    net.train()
    for b in run.batch_sizes:  # ascending, so the first that does not fit ends the sweep
        predicted = fit.bytes(b, T)
        if predicted > budget.limit:
            rows.append(Check(f"memory: B={b}, T={T} (bytes)", "WARN", predicted,
                              f"<= {gib(budget.limit)} ({SAFE_SHARE[budget.device]:.0%} of free)",
                              f"not run: B={b}, T={T} predicted {gib(predicted)} of activations ({fit.where()}), "
                              f"over the safe share of {budget.describe()}; a training step at this size won't fit "
                              "here (see `tier_utils.fit`)"))
            entries.append(_entry(b, T, predicted, None, predicted=True))
            break
        length = T if predicted <= budget.probe_limit else fit.largest_length(1, budget.probe_limit, T)
        if length < T and (entries or length == 0):  # batch 1 was measured, or no length fits: predict
            entries.append(_entry(b, T, predicted, None, predicted=True))
            continue
        size = (1, length) if length < T else (b, T)
        measured, error = without_oom(_measure, adapter, run.precision, *size, cuda)
        net.zero_grad(set_to_none=True)
        if error is not None:
            rows.append(Check(f"memory: B={b}, T={T} (bytes)", "WARN", None, None,
                              f"{out_of_memory_note(dev, fit, *size, budget)}; the largest batch that fit was "
                              f"{entries[-1]['batch_size'] if entries else None}"))
            break
        entries.append(_entry(*size, *measured, predicted=False))
        if size != (b, T):  # batch 1 at a shorter length: the size asked for is predicted next to it
            entries.append(_entry(b, T, predicted, None, predicted=True))
        elif cuda:
            rows.append(Check(f"memory: peak CUDA B={b} (bytes)", "PASS", measured[1], None,
                              f"{_mib(measured[1])} peak allocated, forward + backward at T={T} in {dtype}"))
    yield Found("memory", entries)
    yield from _per_sample(entries, budget, fit, T, dtype)
    yield from rows
    if not cuda:
        yield Check("memory: peak CUDA", "SKIP", None, None,
                    f"runs on {dev.type}: no CUDA allocator to read; the activation bytes above hold anywhere")


def _entry(b: int, t: int, activation_bytes: int, peak, predicted: bool) -> dict:
    return {"batch_size": b, "seq_len": t, "activation_bytes": activation_bytes, "peak_bytes": peak,
            "predicted": predicted}


def _measure(adapter: ModelAdapter, precision, b: int, t: int, cuda: bool) -> tuple[int, int | None]:
    """(saved-activation bytes, CUDA peak or None) of one training forward (+ backward on a GPU) at (b, t)."""
    dev = adapter.device
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    with SavedTensorMeter(adapter.model) as meter, precision.autocast():
        loss, _ = adapter.forward_loss(adapter.example_batch(b, t))
    if cuda:  # the backward is what a training step adds to the peak
        loss.backward()
    return meter.bytes, torch.cuda.max_memory_allocated(dev) if cuda else None


def _per_sample(entries: list[dict], budget, fit, T: int, dtype: str):
    measured = [r for r in entries if not r["predicted"]]
    if not measured and not entries:
        return
    at_t = [r for r in measured if r["seq_len"] == T]
    if at_t:
        r = at_t[-1]
        per, how = r["activation_bytes"] // r["batch_size"], f"measured at B={r['batch_size']}, T={T}"
    else:  # nothing ran at T: per sample from the fit
        per, how = fit.bytes(1, T) - int(fit.k), "predicted"
    predicted = [r for r in entries if r["predicted"]]
    shorter = [r for r in measured if r["seq_len"] != T]
    notes = [f"B={r['batch_size']}, T={r['seq_len']} measured {gib(r['activation_bytes'])}" for r in shorter]
    notes += [f"B={r['batch_size']}, T={r['seq_len']} predicted {gib(r['activation_bytes'])}" for r in predicted]
    if notes:
        notes.append(f"predictions from a fit {fit.where()}, not run past the {gib(budget.probe_limit)} a "
                     f"probe may hold here")
    yield Check("memory: activations per sample (bytes)", "PASS", per, None,
                f"{_mib(per)} per sample saved for backward at T={T} in {dtype} ({how}"
                + "".join(f"; {n}" for n in notes) + "; saved-tensor accounting)")
