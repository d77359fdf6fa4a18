"""Torch thread counts chosen two ways, side by side, in the two cases that matter:

1. right after a previous run (a CPU-bound process on every core that has just ended: nothing else runs now,
   but the 1-minute load average still counts it);
2. under a synthetic load (K busy-looping processes running now).

In each case the old rule (one thread per core the 1-minute load average leaves free) and the new one
(`tier_utils.core.threads.choose_threads`: one per core other processes leave free in a 0.2 s sample of the
machine's CPU time, minus this process's own) pick a count; then tiny-gpt training steps (forward, backward,
AdamW) are timed at one thread per core and at one thread, repeats interleaved (the order alternates) so
drift hits both alike. The ratio says what each rule's pick costs against the faster count.

    python bench/threads.py [--previous-seconds 20] [--loads 1,2] [--steps 5] [--warmup 1] [--repeats 5]
                            [--batch-size 8] [--seq-len 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from tier_utils.core.files import write_json
from tier_utils.core.measure import load_average, summarize, usable_cores
from tier_utils.core.results import run_metadata
from tier_utils.core.threads import choose_threads
from tier_utils.models.loading import load_model

# A busy loop that ends itself: the load can't outlive the script, even if it is killed.
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


def load_average_rule(cores: int) -> tuple[int, str]:
    """The rule before this change: one thread per core the 1-minute load average leaves free."""
    average = load_average()
    free = cores if average is None else max(0, int(cores - average + 0.5))
    return max(1, min(cores, free)), f"load average {average} on {cores} cores"


def timed_steps(model, batch, opt, steps: int, warmup: int) -> float:
    """Mean milliseconds of `steps` training steps after `warmup` untimed ones."""
    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) * 1e3 / steps


def spinners(k: int, seconds: float) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)]) for _ in range(k)]


def measure_case(name: str, cores: int, args, work) -> dict:
    """Both rules' picks now, then both counts timed; `work` holds model, batch and optimizer."""
    old, old_why = load_average_rule(cores)
    # The new rule as a run would see it: torch's own count, no thread variable.
    new = choose_threads(cores, {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")})
    counts = sorted({cores, 1}, reverse=True)
    ms = {n: [] for n in counts}
    for r in range(args.repeats):
        for n in counts if r % 2 == 0 else counts[::-1]:
            torch.set_num_threads(n)
            ms[n].append(timed_steps(*work, args.steps, args.warmup))
    stats = {n: summarize(v) for n, v in ms.items()}
    fastest = min(stats, key=lambda n: stats[n].median)
    print(f"\n== {name}\nload-average rule: {old} thread(s) ({old_why})\nsample rule:       {new.threads} "
          f"thread(s) ({new.reason})")
    print(f"{'threads':>7} {'n':>3} {'median ms':>10} {'IQR ms':>8} {'vs fastest':>11}  range (IQR)")
    best = stats[fastest]
    for n in counts:
        s = stats[n]
        marks = [w for w, pick in (("load-average rule", old), ("sample rule", new.threads)) if pick == n]
        print(f"{n:>7} {s.n:>3} {s.median:>10.1f} {s.iqr:>8.1f} {s.median / best.median:>10.2f}x  "
              f"{s.q1 / best.q3:.2f}-{s.q3 / best.q1:.2f}x" + (f"  <- {', '.join(marks)}" if marks else ""))
    return {"case": name, "load_average_rule": old, "load_average_reason": old_why, "sample_rule": new.threads,
            "sample_reason": new.reason, "fastest": fastest,
            "step_ms": {str(n): {**stats[n].to_dict(), "samples": ms[n]} for n in counts}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--previous-seconds", type=float, default=20, help="how long the previous run kept every core busy")
    ap.add_argument("--loads", default="1,2", help="busy processes per synthetic-load level, comma-separated")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps before each repeat")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per thread count, interleaved")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    cores = usable_cores()
    torch.manual_seed(0)
    model = load_model("tiny-gpt", max_len=args.seq_len)
    work = (model, torch.randint(0, 256, (args.batch_size, args.seq_len + 1)),
            torch.optim.AdamW(model.parameters(), lr=1e-4))
    meta = run_metadata("cpu")
    print(f"{meta['device_name']} · {cores} usable cores · torch {meta['torch']} · tiny-gpt training step, batch "
          f"{args.batch_size} x {args.seq_len} · {args.repeats} interleaved repeats x {args.steps} steps "
          f"({args.warmup} untimed before each) · load average at the start: {load_average()}")
    cases = []
    for p in spinners(cores, args.previous_seconds):  # the previous run: every core, then it ends
        p.wait()
    cases.append(measure_case(f"right after a previous run ({cores} busy processes for {args.previous_seconds:.0f} "
                              "s, ended now)", cores, args, work))
    for k in (int(v) for v in args.loads.split(",")):
        running = spinners(k, 600)
        try:
            time.sleep(1)  # the spinners are up
            cases.append(measure_case(f"under a synthetic load: {k} busy process(es)", cores, args, work))
        finally:
            for p in running:
                p.kill()
                p.wait()
    if args.json:
        write_json(args.json, {"meta": meta, "args": vars(args), "cases": cases})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
