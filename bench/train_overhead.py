"""Overhead of `tier_utils.train()` over a minimal hand-written loop, side by side in one run.

Both loops train the same model (same initial weights) on the same bundled-corpus windows with
AdamW + warm-up/cosine + grad clipping, per precision. Repeats are interleaved (train, hand, hand,
train, ...) so machine load drifts hit both alike. Per-step time of each loop is its own wall time
per iteration:
  train(): the loop's recorded step_time_ms with log_every=1 — data fetch, host->device copy,
           TrainStep (autocast forward+loss, backward, clip, step, schedule) and history bookkeeping;
           evaluation, checkpoints and start-up are outside it (eval_every=0, no checkpoint_dir).
  hand:    data fetch, autocast forward+loss, backward, clip, step, schedule, loss.item().
The first --warmup steps of every run are dropped. Whole-call times (train() including its start-up
and one-batch final evaluation) are printed too, for context.

    python bench/train_overhead.py [--steps 40] [--repeats 5] [--precisions fp32 bf16] [--threads N] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import time
import warnings

import torch
import torch.nn.functional as F

from tier_utils.core.device import device_name
from tier_utils.core.files import write_json
from tier_utils.core.measure import summarize
from tier_utils.core.precision import SlowPrecisionWarning, resolve_precision
from tier_utils.core.results import run_metadata
from tier_utils.data.datasets import build_datasets
from tier_utils.engine.schedules import Schedule
from tier_utils.engine.step import make_optimizer
from tier_utils.models.loading import load_model
from tier_utils.training.loop import train


def hand_loop(model, dataset, precision: str, steps: int, batch_size: int, seed: int) -> list[float]:
    """The minimal loop a careful user writes; returns per-step milliseconds."""
    opt = make_optimizer(model, 3e-4, 0.1)
    sched = Schedule(warmup_steps=10).scheduler(opt, steps)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(seed))
    dtype = {"bf16": torch.bfloat16, "fp32": None}[precision]
    model.train()
    times, batches = [], iter(loader)
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(batches)
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            logits = model(batch["input_ids"])
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        loss.item()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore", SlowPrecisionWarning)

    torch.manual_seed(0)
    initial = load_model("tiny-gpt", d_model=args.d_model, n_layer=args.layers, n_head=4, max_len=args.seq_len)
    dataset = build_datasets(None, "causal-lm", args.seq_len).train
    step_ms = {(p, loop): [] for p in args.precisions for loop in ("train()", "hand")}
    call_s = {key: [] for key in step_ms}
    for r in range(args.repeats):
        for p in args.precisions:
            order = ("train()", "hand") if r % 2 == 0 else ("hand", "train()")
            for loop in order:
                model = copy.deepcopy(initial)
                t0 = time.perf_counter()
                if loop == "hand":
                    ms = hand_loop(model, dataset, p, args.steps, args.batch_size, seed=r)
                else:
                    res = train(model, precision=p, max_steps=args.steps, batch_size=args.batch_size,
                                seq_len=args.seq_len, log_every=1, eval_every=0, eval_batches=1, progress=False,
                                seed=r)
                    ms = res.history.query("kind == 'step'")["step_time_ms"].tolist()
                call_s[(p, loop)].append(time.perf_counter() - t0)
                step_ms[(p, loop)] += ms[args.warmup:]

    dev = torch.device("cpu")
    print(f"device: {device_name(dev)} · torch {torch.__version__} · threads {torch.get_num_threads()} · "
          f"tiny-gpt d_model={args.d_model} layers={args.layers} · batch {args.batch_size} x seq {args.seq_len} · "
          f"{args.repeats} interleaved repeats x {args.steps} steps ({args.warmup} warm-up dropped each)")
    print(f"{'precision':<9} {'loop':<8} {'n':>4} {'median ms':>10} {'IQR ms':>8} {'whole call s (median)':>22}")
    report = {"meta": run_metadata(dev), "args": vars(args), "rows": [], "ratios": {}}
    for p in args.precisions:
        stats = {}
        for loop in ("train()", "hand"):
            s = stats[loop] = summarize(step_ms[(p, loop)])
            whole = summarize(call_s[(p, loop)]).median
            print(f"{p:<9} {loop:<8} {s.n:>4} {s.median:>10.2f} {s.iqr:>8.2f} {whole:>22.2f}")
            report["rows"].append({"precision": resolve_precision(p, dev, warn=False).name, "loop": loop,
                                   "step_ms": s.to_dict(), "whole_call_s_median": whole})
        ratio = stats["train()"].median / stats["hand"].median
        # Half the larger relative IQR: a ratio closer to 1 than this is inside the noise.
        noise = max(s.iqr / s.median for s in stats.values()) / 2
        verdict = ("no measurable difference" if abs(ratio - 1) <= noise
                   else ("within target" if ratio <= 1.03 else "above target"))
        print(f"{p}: train()/hand median step time = {ratio:.3f} (target <= 1.03; noise +/- {noise:.3f}) -> {verdict}")
        report["ratios"][p] = {"ratio": ratio, "noise": noise, "verdict": verdict}
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
