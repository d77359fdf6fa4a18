"""The AMP benchmark's answer in one line, the answer first: the mode to train in here and what it buys against the
baseline, the faster mode where there is one and what it costs, then the modes whose verdicts failed and why.

"bf16 here: 7.0× fp32, −42 % activations, parity PASS; bf16-true 8.3× but rounds away 40 % of updates · failed:
fp16-true (val accuracy diff -0.02, threshold 0.01)". The mode led with is the fastest eager one that ran measurably
faster than the baseline (`Speedup.measurably_faster`: outside the noise, as the speed verdicts judge it) and kept
its accuracy (no FAIL in CORRECTNESS: a missed speed or memory target is named among
the failures, not held against the speed it did reach), a mixed mode (fp32 master weights) before a true one, as
fit's cost order has it; where none did, the baseline leads and the line says so. The memory rows (memory_rows.py)
follow, each with its memory and speed against the baseline and its parity: "· memory rows in bf16 vs fp32: qlora
0.31× peak memory, 0.80× speed, parity PASS".
"""
from __future__ import annotations

PARITY = "loss-curve parity"  # verdicts.parity_check's row
CORRECTNESS = ("val accuracy diff", PARITY)  # verdicts.accuracy_check's and parity_check's rows


def answer_line(records, checks) -> str:
    """The benchmark's answer from its PrecisionRecords and verdict rows (PrecisionCheck)."""
    ran = [r for r in records if r.mode == "eager" and not r.checkpointing and r.speed is not None]
    base = next((r for r in ran if r.speed.speedup is None), None)
    if base is None:
        return "no baseline ran: no speedup to give" + _failures(checks)
    return _precision_answer(ran, base, checks) + _memory_rows(records, base, checks) + _failures(checks)


def _precision_answer(ran, base, checks) -> str:
    """The mode to train in here and what it buys, and the faster mode's cost."""
    failed = _failed(checks)
    others = sorted((r for r in ran if r is not base), key=_speedup, reverse=True)
    kept = [r for r in others if not set(failed.get(r.precision, ())) & set(CORRECTNESS)]
    faster_kept = [r for r in kept if r.speed.speedup.measurably_faster]
    lead = next((r for r in faster_kept if _fp32_weights(r)), faster_kept[0] if faster_kept else None)
    if lead is None:
        speeds = ", ".join(f"{r.precision} {_speedup(r):.2f}×" for r in others) or "no other mode ran"
        return f"{base.precision} here: no mode ran measurably faster with its accuracy kept ({speeds})"
    line = f"{lead.precision} here: {_speedup(lead):.2f}× {base.precision}" + _gains(lead, checks)
    quicker = [r for r in others if _speedup(r) > _speedup(lead) and r.speed.speedup.measurably_faster]
    faster = next((r for r in quicker if r in kept), quicker[0] if quicker else None)
    if faster is not None:
        line += f"; {faster.precision} {_speedup(faster):.2f}× but {_cost(faster, failed)}"
    return line


def _memory_rows(records, base, checks) -> str:
    """" · memory rows in bf16 vs fp32: qlora 0.31× peak memory, 0.80× speed, parity PASS; adamw8bit skipped": each
    memory row's bytes against the baseline's (the CUDA peak where measured, else weights, gradients and optimizer
    state), its speed and its loss curve's verdict."""
    rows = [r for r in records if r.memory_row is not None]
    if not rows:
        return ""
    said = []
    for r in rows:
        if r.speed is None:
            said.append(f"{r.memory_row} {'stopped' if r.stopped else 'skipped'}")
            continue
        red = r.memory["reduction"]
        peak = red.get("peak_allocated")
        basis, saved = ("peak", peak) if peak is not None else ("static", red["static"])
        twin = (r.accuracy or {}).get("parity_vs_row") or {}
        said.append(f"{r.memory_row} {1 - saved:.2f}× {basis} memory, {_speedup(r):.2f}× speed" + _parity(r, checks)
                    + (f" (vs {twin['row']}: {twin['max_rel_dev']:.3g})" if twin.get("max_rel_dev") is not None
                       else ""))
    return f" · memory rows in {rows[0].precision} vs {base.precision}: " + "; ".join(said)


def _parity(r, checks) -> str:
    status = next((c.status for c in checks if c.precision == r.precision and c.mode == r.mode and c.check == PARITY),
                  None)
    return f", parity {status}" if status else ""


def _speedup(r) -> float:
    return r.speed.speedup.median


def _fp32_weights(r) -> bool:
    return (r.memory or {}).get("weights_dtype") == "float32"


def _gains(r, checks) -> str:
    """", −42 % activations, parity PASS": the memory it saves and whether its loss curve kept to the baseline's."""
    saved = ((r.memory or {}).get("reduction") or {}).get("activations")
    return (f", {-saved:+.0%} activations" if saved is not None else "") + _parity(r, checks)


def _cost(r, failed: dict) -> str:
    """What the faster mode costs: the updates its weights' dtype rounds away and its failed verdicts, else where
    it keeps its weights."""
    rounded = (r.accuracy or {}).get("rounded_away_share")
    costs = ([f"rounds away {rounded:.0%} of updates"] if rounded else []) + (
        [f"its {', '.join(failed[r.precision])} failed"] if r.precision in failed else [])
    return " and ".join(costs) or (f"keeps its weights in {(r.memory or {}).get('weights_dtype', r.dtype)} "
                                   "(no fp32 master copy)")


def _failed(checks) -> dict[str, list[str]]:
    """Precision -> the verdicts it FAILed (eager rows), in order."""
    failed: dict[str, list[str]] = {}
    for c in checks:
        if c.status == "FAIL" and c.mode == "eager":
            failed.setdefault(c.precision, []).append(c.check)
    return failed


def _failures(checks) -> str:
    """" · failed: fp16-true (val accuracy diff -0.02, threshold 0.01)": each mode whose verdicts FAILed, and why."""
    rows = [c for c in checks if c.status == "FAIL"]
    if not rows:
        return ""
    why = [f"{c.precision}{'' if c.mode == 'eager' else ' ' + c.mode} ({c.check} {_value(c.value)}"
           + (f", threshold {_value(c.threshold)}" if c.threshold is not None else "") + ")" for c in rows]
    return " · failed: " + "; ".join(why)


def _value(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else "none" if v is None else str(v)
