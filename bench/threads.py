"""Torch thread counts under a synthetic CPU load, side by side: the rule's choice against one thread
per core and against one thread.

For each load level K, K busy-looping processes share the cores (each stops by itself after
--max-seconds, and is stopped as soon as its level is done). Under that load, training steps of
tiny-gpt (forward, backward, AdamW) are timed at each thread count, repeats interleaved (the order
alternates) so drift hits every count alike. The rule (`tier_utils.core.measure.choose_threads`) is shown
for the load a run starting into that level would see once the 1-minute average has settled:
the outside load measured before the first level plus K (the live average climbs towards it over
about a minute, and is printed too).

    python bench/threads.py [--loads 0,1,2,4] [--steps 10] [--warmup 2] [--repeats 5]
                            [--batch-size 8] [--seq-len 64] [--max-seconds 180] [--json out.json]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from tier_utils.core.files import write_json
from tier_utils.core.measure import Load, choose_threads, load_average, summarize, usable_cores
from tier_utils.core.results import run_metadata
from tier_utils.models.loading import load_model

# A busy loop that ends itself: the load can't outlive the script, even if it is killed.
SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = usable_cores()
    ap.add_argument("--loads", default=f"0,{max(1, cores // 2)},{cores},{2 * cores}",
                    help="busy processes per level, comma-separated (default: 0, half, all and twice the cores)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps before each repeat")
    ap.add_argument("--repeats", type=int, default=5, help="repeats per thread count, interleaved")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--max-seconds", type=float, default=180, help="the longest a busy process lives")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    model = load_model("tiny-gpt", max_len=args.seq_len)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, 256, (args.batch_size, args.seq_len + 1))
    outside = load_average()
    meta = run_metadata("cpu")
    print(f"{meta['device_name']} · {cores} usable cores · torch {meta['torch']} · tiny-gpt training step, batch "
          f"{args.batch_size} x {args.seq_len} · {args.repeats} interleaved repeats x {args.steps} steps "
          f"({args.warmup} untimed before each) · outside load before the first level: {outside}")
    report = {"meta": meta, "args": vars(args), "outside_load_1m": outside, "levels": []}
    for k in (int(v) for v in args.loads.split(",")):
        settled = Load(None if outside is None else outside + k, cores)
        choice = choose_threads(cores, settled, {})
        counts = sorted({cores, choice.threads, 1}, reverse=True)
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN, str(args.max_seconds)]) for _ in range(k)]
        try:
            ms = {n: [] for n in counts}
            for r in range(args.repeats):
                for n in counts if r % 2 == 0 else counts[::-1]:
                    torch.set_num_threads(n)
                    ms[n].append(timed_steps(model, batch, opt, args.steps, args.warmup))
            live = load_average()
        finally:
            for p in spinners:
                p.terminate()
                p.wait()
        stats = {n: summarize(v) for n, v in ms.items()}
        fastest = min(stats, key=lambda n: stats[n].median)
        print(f"\n== {k} busy process(es): the rule at the settled {settled} -> {choice.threads} thread(s) "
              f"(live 1-minute load at the level's end: {live})")
        print(f"{'threads':>7} {'n':>3} {'median ms':>10} {'IQR ms':>8} {'vs the rule':>12}  range (IQR)")
        ruled = stats[choice.threads]
        for n in counts:
            s = stats[n]
            ratio, low, high = s.median / ruled.median, s.q1 / ruled.q3, s.q3 / ruled.q1
            mark = " <- the rule" if n == choice.threads else ""
            print(f"{n:>7} {s.n:>3} {s.median:>10.1f} {s.iqr:>8.1f} {ratio:>11.2f}x  {low:.2f}-{high:.2f}x{mark}")
        print(f"fastest median: {fastest} thread(s); "
              + ("the rule's choice" if fastest == choice.threads else
                 f"the rule's {choice.threads} is {ruled.median / stats[fastest].median:.2f}x its time"))
        report["levels"].append({"busy_processes": k, "settled_load": settled.average, "live_load_1m": live,
                                 "rule": choice.threads, "rule_reason": choice.reason,
                                 "step_ms": {str(n): {**stats[n].to_dict(), "samples": ms[n]} for n in counts}})
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
