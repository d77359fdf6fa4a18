"""The AMP benchmark's bookkeeping per precision x mode: the `Plan` a run fills in and the
`PrecisionRecord` it becomes (one entry of the JSON's "precisions", one row of `.table`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .measure import probe_summary
from .precision import Precision
from .results import run_metadata
from .settings import Thresholds
from .verdicts import parity, reduction, speedup

MIB = 2**20


@dataclass
class Plan:
    """One precision x mode: how it runs, then what it measured, raw (step times as Stats)."""

    name: str
    mode: str  # "eager" or "compiled"
    precision: Precision
    adapter: object  # what the steps call: the compiled model where compiling worked
    ran: bool = True
    forced: bool = False
    skip_reason: str | None = None  # why it did not run: the detail of its SKIP rows
    compile: dict | None = None  # CompileInfo.to_dict() once compiled
    batches: list | None = None  # its own speed batches (the floor step's); None: the shared ones
    stopped: str | None = None  # why a non-finite loss stopped it
    memory: dict | None = None
    probe_size: int | None = None
    probe_ms: list = field(default_factory=list)
    step_samples: list = field(default_factory=list)  # mean timed step (ms) of each repeat
    speed: dict | None = None
    accuracy: dict | None = None


@dataclass
class PrecisionRecord:
    """What one precision x mode measured, with its comparisons against the baseline."""

    precision: str
    mode: str
    dtype: str
    native: bool
    ran: bool
    forced: bool
    reason: str  # the precision policy's reason (Precision.reason)
    compile: dict | None
    metadata: dict
    speed: dict | None = None
    mfu: dict | None = None
    memory: dict | None = None
    accuracy: dict | None = None
    stopped: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def table_row(self) -> dict:
        speed, mfu, mem, acc = self.speed or {}, self.mfu or {}, self.memory or {}, self.accuracy or {}
        step, tps, sp = speed.get("step_ms", {}), speed.get("tokens_per_s", {}), speed.get("speedup") or {}
        red, par = mem.get("reduction", {}), acc.get("parity") or {}
        def mib(key):
            return mem[key] / MIB if mem.get(key) is not None else None

        return {
            "precision": self.precision, "mode": self.mode, "dtype": self.dtype, "ran": self.ran,
            "n_repeats": step.get("n"), "step_ms_median": step.get("median"), "step_ms_iqr": step.get("iqr"),
            "tokens_per_s_median": tps.get("median"), "tokens_per_s_iqr": tps.get("iqr"),
            "speedup": sp.get("median", 1.0 if self.ran else None),  # ran with no speedup: the baseline
            "speedup_low": sp.get("low"), "speedup_high": sp.get("high"),
            "speedup_vs_eager": (speed.get("speedup_vs_eager") or {}).get("median"),
            "compile_s": (self.compile or {}).get("compile_s"), "achieved_tflops": mfu.get("achieved_tflops"),
            "peak_tflops": mfu.get("peak_tflops"), "mfu": mfu.get("mfu"), "weights_mib": mib("weights_bytes"),
            "grads_mib": mib("grads_bytes"), "optimizer_state_mib": mib("optimizer_state_bytes"),
            "activations_mib": mib("activation_bytes"), "total_mib": mib("total_bytes"),
            "peak_allocated_mib": mib("peak_allocated_bytes"), "peak_reserved_mib": mib("peak_reserved_bytes"),
            "activation_reduction": red.get("activations"), "total_reduction": red.get("total"),
            "peak_allocated_reduction": red.get("peak_allocated"),
            "val_loss": acc.get("val_loss"), "val_accuracy": acc.get("val_accuracy"),
            "val_accuracy_diff": acc.get("val_accuracy_diff"), "parity_max_rel_dev": par.get("max_rel_dev"),
            "parity_first_step_out": par.get("first_step_out"), "skipped_steps": acc.get("skipped_steps"),
            "reason": self.reason,
        }


def make_record(p: Plan, base: Plan, flops: dict, dev, t: Thresholds, eager: Plan | None = None) -> PrecisionRecord:
    """`p`'s record: measurements, comparisons with the baseline `base` (fp32 in the first mode) and,
    compiled, with the same precision `eager`; metadata."""
    prec = p.precision
    rec = PrecisionRecord(p.name, p.mode, str(prec.dtype).replace("torch.", ""), prec.native, p.ran, p.forced,
                          prec.reason, p.compile, run_metadata(dev, prec.dtype), stopped=p.stopped)
    if not p.ran or p.stopped:
        return rec
    step_ms = p.speed["step_ms"]
    speed = rec.speed = {**p.speed, "step_ms": step_ms.to_dict(), "speedup_vs_eager": None}
    if p is not base:
        speed["speedup"] = speedup(base.speed["step_ms"], step_ms)
    if p.mode == "compiled" and eager is not None:
        speed["speedup_vs_eager"] = speedup(eager.speed["step_ms"], step_ms)
    achieved = flops["per_step"] / (step_ms.median / 1e3) / 1e12
    probe = probe_summary(prec.dtype, p.probe_size, p.probe_ms)
    # The best probe matmul: a peak is what the device reached, and other load only slows it.
    peak = probe["tflops"]["max"]
    rec.mfu = {"achieved_tflops": achieved, "peak_tflops": peak, "mfu": achieved / peak, "probe": probe}
    mem = rec.memory = dict(p.memory)
    mem["reduction"] = {"activations": reduction(base.memory["activation_bytes"], mem["activation_bytes"]),
                        "total": reduction(base.memory["total_bytes"], mem["total_bytes"]),
                        "peak_allocated": reduction(base.memory["peak_allocated_bytes"], mem["peak_allocated_bytes"])}
    if p.accuracy is not None:
        acc = rec.accuracy = dict(p.accuracy)
        acc["val_loss_diff"] = acc["val_loss"] - base.accuracy["val_loss"]
        acc["val_accuracy_diff"] = acc["val_accuracy"] - base.accuracy["val_accuracy"]
        acc["parity"] = parity(base.accuracy["loss_curve"], acc["loss_curve"], t.parity_tolerance)
    return rec

