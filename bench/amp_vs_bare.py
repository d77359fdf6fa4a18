"""Does `amp_benchmark` under-read the AMP speedup? Its speedup next to a bare autocast loop's.

For each tiny-gpt size, every repeat runs both, in alternating order (harness first on even
repeats, bare loop first on odd ones), from the same initial weights on the same batches:

- the harness: `amp_benchmark(precisions=(fp32, P), repeats=1, accuracy_steps=0)`, its own
  timed optimizer steps (its full training step: autocast forward + loss, backward, gradient
  clipping, AdamW);
- the bare loop: autocast forward + cross-entropy, backward, AdamW step, zero_grad: nothing else
  (with --bare-clip, also the harness's gradient clipping, to see what is left once it is matched).

Each side's speedup is fp32's mean step over P's within the repeat; the ratio is harness speedup /
bare speedup, one per repeat, reported as median, IQR and n. Ratio 1 = no bias; below 1 the
harness under-reads what AMP buys. Step times come from the same timer (`StepTimer`: CUDA events
on a GPU, perf_counter on a CPU). The 1-minute load average is printed before and after each size.

    python bench/amp_vs_bare.py [--sizes 256,512] [--n-layer 4] [--batch-size 16] [--seq-len 128]
                                [--precision bf16] [--repeats 7] [--warmup-steps 2] [--timed-steps 5]
                                [--threads N] [--device cpu|cuda] [--force] [--bare-clip] [--clock wall|cpu]
                                [--json out.json]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import os
import time
import types

import torch
import torch.nn.functional as F

from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.core import measure
from tier_utils.core.files import write_json
from tier_utils.core.measure import StepTimer, summarize
from tier_utils.core.precision import resolve_device, resolve_precision
from tier_utils.core.results import run_metadata
from tier_utils.data.datasets import make_loader, to_device
from tier_utils.models.loading import load_model
from tier_utils.tasks import build_datasets


def batches(seq_len: int, batch_size: int, n: int, dev) -> list[dict]:
    """The first `n` training batches in the order amp_benchmark draws them (bundled corpus, seed 0)."""
    splits = build_datasets(None, "causal-lm", seq_len)
    out = []
    while len(out) < n:
        for batch in make_loader(splits.train, batch_size, collate=splits.collate, shuffle=True, seed=0, drop_last=True,
                                 device=dev):
            out.append(to_device(batch, dev))
            if len(out) == n:
                break
    return out


def bare_run(model, start, prec, data: list[dict], warmup: int, dev, clip: bool = False) -> float:
    """Mean ms of the timed steps of the plainest AMP training loop a user would write
    (`clip`: plus the gradient clipping at norm 1.0 that train() and the harness do)."""
    model.load_state_dict(start)
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    timer = StepTimer(dev)
    for i, batch in enumerate(data):
        region = timer.region() if i >= warmup else contextlib.nullcontext()
        with region:
            with prec.autocast():
                logits = model(batch["input_ids"])
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch["labels"].reshape(-1))
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    ms = timer.milliseconds()
    return sum(ms) / len(ms)


def harness_run(model, low: str, args, dev) -> dict[str, float]:
    """amp_benchmark's own mean timed step per precision, one repeat."""
    result = amp_benchmark(model, precisions=("fp32", low), batch_size=args.batch_size, seq_len=args.seq_len,
                           untimed_steps=args.warmup_steps, timed_steps=args.timed_steps, repeats=1,
                           accuracy_steps=0, force=args.force, device=dev, progress=False)
    return {r.precision: r.speed.samples_ms[0] for r in result.records if r.ran}


def load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def fmt(samples, unit: str = "") -> str:
    s = summarize(samples)
    return f"{s.median:.4g}{unit} (IQR {s.iqr:.3g}, range {s.min:.4g}-{s.max:.4g}, n={s.n})"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512", help="tiny-gpt d_model values (default 256,512)")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--precision", default="bf16", help="the low precision compared with fp32 (default bf16)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--force", action="store_true", help="run the low precision even where it is not native")
    ap.add_argument("--bare-clip", action="store_true",
                    help="clip gradients in the bare loop too (norm 1.0, as the harness does)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: time CPU steps by this process's CPU time (use with --threads 1 on a busy machine)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    if args.clock == "cpu":
        if dev.type != "cpu" or torch.get_num_threads() != 1:
            raise SystemExit("--clock cpu needs --device cpu and --threads 1")
        # On a busy machine wall time is mostly waiting for a core; the one thread's CPU time is the work
        # done. Both sides time through StepTimer, so swapping its clock changes both alike.
        measure.time = types.SimpleNamespace(perf_counter=time.process_time)
    low = resolve_precision(args.precision, dev)
    fp32 = resolve_precision("fp32", dev, warn=False)
    data = batches(args.seq_len, args.batch_size, args.warmup_steps + args.timed_steps, dev)
    pair = [fp32] if low.name == "fp32" else [fp32, low]  # --precision fp32: the harness's own cost alone
    names = [p.name for p in pair]
    runs = {}
    for d in (int(s) for s in args.sizes.split(",")):
        torch.manual_seed(0)
        model = load_model("tiny-gpt", d_model=d, n_layer=args.n_layer, max_len=args.seq_len).to(dev).train()
        start = copy.deepcopy(model.state_dict())
        load_before = load()
        ms = {f"{side} {n}": [] for side in ("harness", "bare") for n in names}
        for rep in range(args.repeats):
            order = ("harness", "bare") if rep % 2 == 0 else ("bare", "harness")
            for side in order:
                if side == "harness":
                    h = harness_run(model, low.name, args, dev)
                    for n in names:
                        ms[f"harness {n}"].append(h[n])
                else:
                    for prec in pair:
                        ms[f"bare {prec.name}"].append(bare_run(model, start, prec, data, args.warmup_steps, dev,
                                                                args.bare_clip))
            model.load_state_dict(start)
            print(f"  d_model={d} repeat {rep + 1}/{args.repeats}: "
                  + ", ".join(f"{k} {v[-1]:.4g} ms" for k, v in ms.items()) + f" (load {load()})", flush=True)
        # Where a bias would come from: the harness step's own cost over the bare step's, per precision.
        # A constant extra cost c lowers a speedup S to (F + c) / (F / S + c): it matters more as S grows.
        step_ratio = {n: [h / b for h, b in zip(ms[f"harness {n}"], ms[f"bare {n}"])] for n in names}
        meta = run_metadata(dev, low.dtype)
        run = runs[f"d_model={d}"] = {"step_ms": ms, "step_ratio": step_ratio, "load_average_1m_before": load_before,
                                      "load_average_1m_after": load(), "metadata": meta, "config": vars(args)}
        print(f"\n== tiny-gpt d_model={d}, {args.n_layer} layers "
              f"({sum(p.numel() for p in model.parameters()):,} parameters), batch {args.batch_size} x "
              f"{args.seq_len}, {meta['device_name']}, {meta['threads']} threads, torch {meta['torch']}, "
              f"load average {load_before} -> {load()}")
        for key, samples in ms.items():
            print(f"  {key:>14} step ms: {fmt(samples)}")
        if len(pair) == 2:
            sp_h = [f / b for f, b in zip(ms["harness fp32"], ms[f"harness {low.name}"])]
            sp_b = [f / b for f, b in zip(ms["bare fp32"], ms[f"bare {low.name}"])]
            run.update(speedup_harness=sp_h, speedup_bare=sp_b, ratio=[h / b for h, b in zip(sp_h, sp_b)])
            run["ratio_stats"] = summarize(run["ratio"]).to_dict()
            print(f"  harness {low.name} speedup: {fmt(sp_h, 'x')}")
            print(f"     bare {low.name} speedup: {fmt(sp_b, 'x')}")
            print(f"  ratio harness / bare: {fmt(run['ratio'])}")
        for n, r in step_ratio.items():
            print(f"  {n} step, harness / bare: {fmt(r)}")
    if args.json:
        write_json(args.json, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
