"""MFU of `train()` eager and compiled against a bare compiled loop, side by side on one GPU.

tiny-gpt at d_model=768, 12 layers, 12 heads (GPT-2 small's shape, vocab 256), bf16 autocast,
batch 32 x 1024 tokens, random tokens, fused AdamW with weight decay on matrices, warm-up +
cosine LR and grad clipping in all three:
  train() eager     tier_utils.train(compile=False)
  train() compiled  tier_utils.train(compile=True); its compile time is reported apart
  bare compiled     torch.compile(model) in the loop a careful user writes: fetch, autocast
                    forward + loss, backward, clip, fused AdamW step, LR step, loss.item() every
                    --window steps (train() also reads its losses back once per log window)
Repeats are interleaved (train eager, train compiled, bare, train eager, ...). Step times are
per-window means of CUDA-event-timed steps (train(): its history's step rows, log_every=--window),
the first window of every run dropped. FLOPs per step come from torch.utils.flop_counter (one
forward + backward); the peak is the best bf16 matmul this GPU reached in the same run (probe), and
the datasheet dense bf16 peak is printed beside it where the device is in the table below.
Targets (issue 14): train(compile=True) >= 45 % MFU on an H100 and <= 1.03x the bare compiled
loop's step time.

    python bench/gpu_mfu.py [--steps 60] [--window 10] [--repeats 3] [--compile-mode default] [--json out.json]

Needs a CUDA GPU with bf16 (compute capability >= 8.0); elsewhere it says so and exits 2.
"""
from __future__ import annotations

import argparse
import copy
import math
import sys

import torch

from tier_utils.core.files import write_json
from tier_utils.core.measure import StepTimer, count_flops, probe_ms, probe_size, summarize
from tier_utils.core.results import run_metadata
from tier_utils.data.datasets import make_loader, to_device
from tier_utils.engine.compiling import COMPILE_MODES
from tier_utils.engine.schedules import Schedule
from tier_utils.engine.step import make_optimizer
from tier_utils.models.loading import load_model
from tier_utils.tasks import build_datasets
from tier_utils.training.loop import train

SHAPE = dict(d_model=768, n_layer=12, n_head=12, max_len=1024)
# Dense bf16 tensor-core peaks from NVIDIA's datasheets (TFLOP/s, no sparsity), for context only.
DATASHEET_BF16 = {"H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100 NVL": 835.0, "H200": 989.4,
                  "A100": 312.0, "L4": 121.0, "A10G": 70.0}
LR, WEIGHT_DECAY, WARMUP, CLIP = 3e-4, 0.1, 10, 1.0


def bare_loop(model, dataset, steps: int, batch_size: int, window: int, mode: str) -> list[float]:
    """The hand-written compiled loop; returns per-window mean step milliseconds."""
    device = next(model.parameters()).device
    compiled = torch.compile(model, mode=mode)
    opt = make_optimizer(model, LR, WEIGHT_DECAY)
    sched = Schedule(warmup_steps=WARMUP).scheduler(opt, steps)
    batches, timer = iter(make_loader(dataset, batch_size, device=device, drop_last=True)), StepTimer(device)
    model.train()
    for i in range(steps):
        with timer.region():
            batch = to_device(next(batches), device)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = compiled(batch["input_ids"])
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                         batch["labels"].reshape(-1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            sched.step()
            if (i + 1) % window == 0:
                loss.item()
    ms = timer.milliseconds()
    return [sum(ms[i:i + window]) / window for i in range(0, len(ms) - window + 1, window)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    ap.add_argument("--window", type=int, default=10, help="steps per timing window / log row (default 10)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs of each variant (default 3)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--compile-mode", choices=COMPILE_MODES, default="default")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0):
        print("error: bench/gpu_mfu.py needs a CUDA GPU with bf16 tensor cores (compute capability >= 8.0); "
              "run it on one (CPU figures: bench/amp_cpu.py)", file=sys.stderr)
        return 2
    if args.steps < 2 * args.window:
        print("error: --steps must be at least 2 x --window (the first window of every run is dropped)",
              file=sys.stderr)
        return 2

    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 leftovers (optimizer, norms) as any GPU user runs them
    torch.manual_seed(0)
    initial = load_model("tiny-gpt", **{**SHAPE, "max_len": args.seq_len}).to(dev)
    # Random tokens, enough that one epoch covers a run: no loader restart and no evaluation mid-run.
    n = math.ceil((args.steps + 1) * args.batch_size / 0.9) + args.batch_size  # 10 % goes to validation
    rows = torch.randint(0, 256, (n, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    dataset = build_datasets(rows, "causal-lm", args.seq_len).train
    batch = to_device(next(iter(make_loader(dataset, args.batch_size, shuffle=False))), dev)

    def fwd_bwd():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = initial(batch["input_ids"])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
        loss.backward()

    flops = count_flops(fwd_bwd)["per_step"]
    initial.zero_grad(set_to_none=True)
    size = probe_size(dev, torch.bfloat16)
    probe = []

    variants = ("train() eager", "train() compiled", "bare compiled")
    windows = {v: [] for v in variants}
    compile_s, optimizers = [], set()
    run = dict(precision="bf16", batch_size=args.batch_size, seq_len=args.seq_len, max_steps=args.steps,
               log_every=args.window, eval_every=0, eval_batches=1, lr=LR, weight_decay=WEIGHT_DECAY,
               warmup_steps=WARMUP, grad_clip=CLIP, progress=False, device="cuda", compile_mode=args.compile_mode)
    for _ in range(args.repeats):
        for v in variants:
            model = copy.deepcopy(initial)
            if v == "bare compiled":
                ms = bare_loop(model, dataset, args.steps, args.batch_size, args.window, args.compile_mode)
            else:
                res = train(model, rows, **run, compile=v.endswith("compiled"))
                ms = res.history.query("kind == 'step'")["step_time_ms"].tolist()
                optimizers.add(res.summary.optimizer)
                if res.summary.compile_s is not None:
                    compile_s.append(res.summary.compile_s)
                elif v.endswith("compiled"):
                    print(f"warning: train(compile=True) ran eager: {res.summary.compile_reason}", file=sys.stderr)
            windows[v] += ms[1:]  # the first window holds the warm-up (and, bare, the compile)
            del model
            torch.cuda.empty_cache()
        probe += probe_ms(dev, torch.bfloat16, size, 3)  # rides along each repeat, like amp_benchmark's

    peak = max(2 * size**3 / (t * 1e-3) / 1e12 for t in probe)
    name = torch.cuda.get_device_name(dev)
    sheet = next((tf for key, tf in DATASHEET_BF16.items() if key in name), None)
    tokens = args.batch_size * args.seq_len
    print(f"{name} · torch {torch.__version__} · tiny-gpt d_model={SHAPE['d_model']} layers={SHAPE['n_layer']} "
          f"heads={SHAPE['n_head']} · bf16 · batch {args.batch_size} x {args.seq_len} · "
          f"{', '.join(sorted(optimizers))}"
          f" · compile mode {args.compile_mode}")
    print(f"FLOPs per step {flops / 1e12:.3f} T (flop_counter, forward + backward) · measured bf16 matmul peak "
          f"{peak:.0f} TFLOP/s ({size}x{size}, best of {len(probe)})"
          + (f" · datasheet {sheet:.0f}" if sheet else ""))
    print(f"{args.repeats} interleaved repeats x {args.steps} steps; n = windows of {args.window} steps, first "
          "window of each run dropped")
    print(f"{'variant':<17} {'n':>3} {'ms/step':>8} {'IQR':>6} {'TFLOP/s':>8} {'MFU':>6}"
          + (f" {'MFU sheet':>9}" if sheet else "") + f" {'tokens/s':>10}")
    report = {"meta": run_metadata(dev, torch.bfloat16), "args": vars(args), "flops_per_step": flops,
              "peak_tflops_measured": peak, "peak_tflops_datasheet": sheet, "compile_s": compile_s, "rows": {}}
    stats = {}
    for v in variants:
        s = stats[v] = summarize(windows[v])
        tflops = flops / (s.median * 1e-3) / 1e12
        print(f"{v:<17} {s.n:>3} {s.median:>8.2f} {s.iqr:>6.2f} {tflops:>8.1f} {tflops / peak:>6.3f}"
              + (f" {tflops / sheet:>9.3f}" if sheet else "") + f" {tokens / (s.median * 1e-3):>10,.0f}")
        report["rows"][v] = {"step_ms": s.to_dict(), "tflops": tflops, "mfu": tflops / peak,
                             "mfu_datasheet": tflops / sheet if sheet else None}
    if compile_s:
        print(f"train() compile time: {', '.join(f'{c:.1f}' for c in compile_s)} s (per compiled run; later runs "
              "reuse the process's compiled graphs)")
    c, b, e = stats["train() compiled"], stats["bare compiled"], stats["train() eager"]
    ratio = c.median / b.median
    noise = max(x.iqr / x.median for x in (c, b)) / 2  # a ratio closer to 1 than this is inside the noise
    mfu = report["rows"]["train() compiled"]["mfu"]
    print(f"train() compiled / bare compiled step time = {ratio:.3f} (noise +/- {noise:.3f}; target <= 1.03) -> "
          + ("no measurable difference" if abs(ratio - 1) <= noise else "within target" if ratio <= 1.03
             else "above target"))
    print(f"train() compiled MFU {mfu:.3f} of the measured peak (target >= 0.45) -> "
          + ("within target" if mfu >= 0.45 else "below target"))
    print(f"compiling train() changes its step time {e.median / c.median:.2f}x (eager {e.median:.2f} ms -> "
          f"compiled {c.median:.2f} ms)")
    report.update(ratio=ratio, noise=noise, speedup_compile=e.median / c.median)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
