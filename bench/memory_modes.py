"""Memory modes side by side on a GPT-2-small config (124 M parameters, random weights, `hf:GPT2LMHeadModel`)
at 1 x 256 on this CPU: for each mode its peak RSS, static bytes (weights + gradients + optimizer state, after a
step), activation bytes (autograd's saved tensors of one step, and with checkpointing the blocks' kept inputs),
step time, the loss of each step against a reference's on the same batch (parity: fp32's; a LoRA row's against
LoRA over an fp32 base, since LoRA trains fewer weights), and each against fp32 (the plain fp32 step), all
measured in this run. Issue 42's rows: LoRA over a bf16 or fp16 base (the base held in it, fp32
adapters, autocast), AdamW8bit (bitsandbytes' 8-bit optimizer state) for a full fine-tune and under LoRA, and
QLoRA (a 4-bit NF4 base).

Each mode runs in its own subprocess, so its peak RSS (VmHWM: not ru_maxrss, which on Linux carries the parent's
peak over exec) is its own: the model built, put in the mode
(the memory settings decided by resolve_memory, LoRA through peft, the base and adapters in their dtypes by
Precision.convert_module, checkpointing through engine.activation_checkpointing), one untimed step,
then --steps timed steps through tier_utils' TrainStep; then one more step under the saved-tensor meter. A QLoRA
mode loads the same weights as a user's folder is loaded: saved once in bf16 by a child of its own, then quantised
as they load (transformers' BitsAndBytesConfig, which turns GPT-2's Conv1D layers into Linear4bit), so its peak RSS
never held the fp32 model. A mode whose 2-byte type this CPU only emulates runs anyway (the true modes are then
refused: they may not run emulated; they run here with TIER_UTILS_CPU_FLAGS set, to measure what they hold) and the
row says "emulated". A mode past --mode-timeout seconds is stopped and its row says so: the run stays bounded.

    python bench/memory_modes.py [--steps N] [--threads N] [--size small|tiny] [--modes A,B] [--mode-timeout S]
                                 [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import psutil

from tier_utils.core.device import CPU_FLAGS_ENV, cpu_flags, cpu_name
from tier_utils.core.files import write_json
from tier_utils.core.measure import PeakRSS, load_average

# mode: (precision, the memory settings' fields: checkpointing, LoRA as "r=8,alpha=16" (with bits=4: QLoRA), its
# base dtype, the optimizer)
LORA = "r=8,alpha=16"
MODES = {"fp32": ("fp32", {}), "fp32 + checkpointing": ("fp32", {"checkpointing": True}), "bf16": ("bf16", {}),
         "bf16 + checkpointing": ("bf16", {"checkpointing": True}), "fp16": ("fp16", {}),
         "bf16-true": ("bf16-true", {}), "fp16-true": ("fp16-true", {}),
         "fp32 · AdamW8bit": ("fp32", {"optimizer": "adamw8bit"}),
         "LoRA r=8 · fp32 base · fp32": ("fp32", {"lora": LORA, "base_dtype": "fp32"}),
         "LoRA r=8 · fp32 base · bf16": ("bf16", {"lora": LORA, "base_dtype": "fp32"}),
         "LoRA r=8 · bf16 base · bf16": ("bf16", {"lora": LORA, "base_dtype": "bf16"}),
         "LoRA r=8 · fp16 base · fp16": ("fp16", {"lora": LORA, "base_dtype": "fp16"}),
         "LoRA r=8 · bf16 base · bf16 · AdamW8bit": ("bf16", {"lora": LORA, "base_dtype": "bf16",
                                                              "optimizer": "adamw8bit"}),
         "QLoRA r=8 · bf16": ("bf16", {"lora": LORA + ",bits=4", "base_dtype": "bf16"})}
LORA_REFERENCE = "LoRA r=8 · fp32 base · fp32"  # LoRA's rows' parity is against it
# GPT-2-small (124 M); tiny: a quick look on a loaded machine (about 7 M, most of it GPT-2's vocabulary).
SIZES = {"small": {"n_embd": 768, "n_layer": 12, "n_head": 12}, "tiny": {"n_embd": 128, "n_layer": 2, "n_head": 4}}
# Per size: the batch (sequences x tokens) and the timed steps. GPT-2-small at 1 x 256 and 2 steps keeps the issue's
# rows within about 12 minutes on 2 shared cores (at 1 x 512 and 3 steps a run was stopped at 16 minutes).
SHAPES = {"small": (1, 256), "tiny": (1, 512)}
STEPS = {"small": 2, "tiny": 5}


def _build(size: str):
    """The GPT-2 config at `size`, its weights from seed 0: every mode starts from the same ones."""
    import torch

    from tier_utils import load_model

    torch.manual_seed(0)
    return load_model("hf:GPT2LMHeadModel", **SIZES[size])


def save_base(folder: str, size: str) -> None:
    """The weights every mode starts from, saved in bf16 as a user's folder is: what a QLoRA mode loads."""
    import torch

    _build(size).to(torch.bfloat16).save_pretrained(folder)


def _model(prec, held, folder: str | None, size: str):
    """The mode's model and the dtype its base was stored in: a QLoRA mode's quantised as it loads from `folder`."""
    import torch

    from tier_utils.engine.quantization import load_quantized

    if held.quantized:
        return load_quantized(folder, prec.compute_dtype), torch.bfloat16
    return _build(size), torch.float32


def child(precision: str, memory: dict, steps: int, size: str = "small", folder: str | None = None) -> dict:
    """One mode in this process: what it holds, how fast it steps and its losses. `folder`: save_base's, for QLoRA."""
    import time

    import torch

    from tier_utils import adapt
    from tier_utils.core.device import device_facts
    from tier_utils.core.measure import SavedTensorMeter, static_memory, summarize
    from tier_utils.core.memory_settings import MemorySettings, resolve_memory
    from tier_utils.core.precision import resolve_precision
    from tier_utils.engine.activation_checkpointing import kept_inputs, memory_context
    from tier_utils.engine.quantization import apply_memory
    from tier_utils.engine.step import TrainStep, make_optimizer

    prec = resolve_precision(precision, "cpu", warn=False)
    prec.check_runnable()
    settings = MemorySettings(**memory)
    held = resolve_memory(settings, prec, device_facts("cpu"), torch.float32)  # the rows give each base dtype
    model, stored = _model(prec, held, folder, size)
    held = resolve_memory(settings, prec, device_facts("cpu"), stored, model)
    batch = adapt(model).example_batch(*SHAPES[size])  # its own generator: every mode steps on the same batch
    torch.manual_seed(1)  # LoRA draws the same adapters in every mode, however its model was made
    if settings.lora is not None:
        model = apply_memory(model, held, prec.compute_dtype)
    prec.convert_module(model, held)
    adapter = adapt(model)
    model.train()
    step = TrainStep(adapter, prec, make_optimizer(model, 1e-4, 0.1, prec.adamw_eps, held.optimizer))
    times, losses = [], []
    with memory_context(model, settings.checkpointing):
        for i in range(steps + 1):
            start = time.perf_counter()
            losses.append(step([batch]).loss.item())
            if i:  # the first pays one-time allocations
                times.append(time.perf_counter() - start)
        with SavedTensorMeter(model) as meter, kept_inputs(model, meter) if settings.checkpointing else _null():
            step([batch])
    s = summarize([t * 1e3 for t in times])
    return {"static_bytes": sum(static_memory(model, step.optimizer).values()), "activation_bytes": meter.bytes,
            "step_ms": s.median, "step_iqr_ms": s.iqr, "n": s.n, "native": prec.native, "losses": losses,
            "memory": held.describe(), "parameters": sum(p.numel() for p in model.parameters()),
            "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "peak_rss_bytes": PeakRSS.own_peak()}


def _null():
    import contextlib

    return contextlib.nullcontext()


def _in_child(call: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """`memory_modes.<call>` in a fresh Python process (its own peak RSS); TimeoutExpired past `timeout` s."""
    code = f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import memory_modes as m; {call}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)


def run_mode(name: str, steps: int, env: dict, size: str, timeout: float, folder: str) -> dict:
    precision, memory = MODES[name]
    try:
        done = _in_child(f"print(json.dumps(m.child({precision!r}, {memory!r}, {steps}, {size!r}, {folder!r})))",
                         env, timeout)
    except subprocess.TimeoutExpired:
        return {"mode": name, "error": f"stopped after {timeout:.0f} s (--mode-timeout), before its steps ended"}
    if done.returncode:
        return {"mode": name, "error": done.stderr.strip().splitlines()[-1][:200]}
    return {"mode": name, "precision": precision, **memory, **json.loads(done.stdout.strip().splitlines()[-1])}


def parity(losses: list[float], base: list[float]) -> float:
    """The largest relative deviation of a mode's step losses from fp32's on the same batches."""
    return max(abs(a - b) / abs(b) for a, b in zip(losses, base))


def _compared(row: dict, base: dict | None, reference: dict | None) -> str:
    """The row's ratios to fp32's and its parity, set on it; its printed line."""
    r = {k: f"{row[k] / base[k]:.2f}x" if base else "-" for k in
         ("peak_rss_bytes", "static_bytes", "activation_bytes", "step_ms")}
    row["vs_fp32"] = r
    row["parity_reference"] = reference and reference["mode"]
    row["parity_max_rel_dev"] = parity(row["losses"], reference["losses"]) if reference else None
    # Per weight of the model (fp32's count: a 4-bit layer's parameter packs two weights per element).
    bytes_per = row["static_bytes"] / (base or row)["parameters"]
    return (f"{row['mode']:<40} peak RSS {row['peak_rss_bytes'] / 2**30:5.2f} GiB ({r['peak_rss_bytes']}) · static "
            f"{row['static_bytes'] / 2**30:5.2f} GiB ({r['static_bytes']}; {bytes_per:.2f} B/weight) · activations "
            f"{row['activation_bytes'] / 2**20:6.0f} MiB ({r['activation_bytes']}) · step {row['step_ms']:7.0f} "
            f"ms (IQR {row['step_iqr_ms']:.0f}, n={row['n']}; {r['step_ms']})"
            + (f" · loss vs {reference['mode']} max rel dev {row['parity_max_rel_dev']:.2e}" if reference else "")
            + ("" if row["native"] else " · emulated on this CPU"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="timed steps per mode (default: 2 for small, 5 for "
                                                                "tiny)")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads in every child")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, from: " + ", ".join(MODES))
    parser.add_argument("--size", choices=SIZES, default="small", help="the GPT-2 config: small (124 M) or tiny")
    parser.add_argument("--mode-timeout", type=float, default=180, help="seconds a mode may take before it is "
                                                                       "stopped and its row says so")
    parser.add_argument("--json", help="write the figures here")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    steps, shape, modes = args.steps or STEPS[args.size], SHAPES[args.size], args.modes.split(",")
    # Where bf16/fp16 are only emulated the true modes are refused; the flags let them run here so that what they
    # hold is measured, and their rows say their speed is emulation's.
    emulated = not (cpu_flags() & {"avx512_bf16", "amx_bf16"})
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           **({CPU_FLAGS_ENV: "avx512_bf16,avx512_fp16"} if emulated else {})}
    start_load = load_average()
    print(f"{cpu_name()} · {os.cpu_count()} cores · {psutil.virtual_memory().total / 2**30:.0f} GiB RAM · load "
          f"{start_load} · GPT-2-{args.size} config at {shape[0]}x{shape[1]} · {steps} timed steps per mode · "
          f"{args.threads} threads", flush=True)
    rows, base, lora_base = [], None, None
    with tempfile.TemporaryDirectory(prefix="memory-modes-") as folder:
        if any(",bits=4" in MODES[name][1].get("lora", "") for name in modes):
            _in_child(f"m.save_base({folder!r}, {args.size!r})", env, args.mode_timeout).check_returncode()
        for name in modes:
            row = run_mode(name, steps, env, args.size, args.mode_timeout, folder)
            rows.append(row)
            if "error" in row:
                print(f"{name:<40} not run: {row['error']}", flush=True)
                continue
            base = base or (row if name == "fp32" else None)
            # LoRA trains fewer weights than a full fine-tune, so its curve is compared with LoRA's own fp32 one:
            # what is left is the base's dtype and the optimizer's state.
            lora_base = lora_base or (row if name == LORA_REFERENCE else None)
            print(_compared(row, base, lora_base if "lora" in row else base), flush=True)
    print(f"load average (1 min): {start_load} at the start, {load_average()} at the end", flush=True)
    if args.json:
        write_json(args.json, {"cpu": cpu_name(), "threads": args.threads, "load_average_1m": [start_load,
                               load_average()], "size": args.size, "config": SIZES[args.size], "shape": shape,
                               "steps": steps, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
