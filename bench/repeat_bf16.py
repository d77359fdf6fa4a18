"""Are identical `deterministic=True` CPU training runs bitwise equal? Each run is a fresh process.

Trains tiny-gpt from the same seed on the bundled corpus in each precision, with each thread
count, `--runs` times, and hashes the final weights (SHA-1 of every tensor's bytes). Prints, per
(precision, threads, oneDNN on/off), how many distinct hashes the runs gave: 1 means bitwise
repeatable. Runs with different thread counts are compared too: reductions split across threads
add in a different order, so they may differ in the last bits.

    python bench/repeat_bf16.py [--runs 10] [--threads 1 4 0] [--precisions bf16 fp32] [--steps 60] [--json out.json]

--threads 0 means torch's default. --mkldnn-off adds runs with torch.backends.mkldnn disabled.
"""
from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys

CHILD = r'''
import hashlib, json, sys, warnings
import torch
warnings.simplefilter("ignore")
cfg = json.loads(sys.argv[1])
if cfg["threads"]:
    torch.set_num_threads(cfg["threads"])
torch.backends.mkldnn.enabled = not cfg["mkldnn_off"]
import tier_utils.core.seeding
tier_utils.core.seeding.seed_everything(0)  # as the CLI does: the initial weights follow the seed too
model = tier_utils.load_model("tiny-gpt", d_model=cfg["d_model"], n_layer=2, n_head=4, max_len=64)
r = tier_utils.train(model, None, precision=cfg["precision"], batch_size=16, seq_len=64, max_steps=cfg["steps"],
                     eval_every=0, eval_batches=1, deterministic=True, progress=False, device="cpu")
h = hashlib.sha1()
for name, t in sorted(r.model.state_dict().items()):
    h.update(name.encode()); h.update(t.detach().float().contiguous().numpy().tobytes())
print(json.dumps({"hash": h.hexdigest(), "threads": torch.get_num_threads(), "precision": r.summary.precision,
                  "val_loss": r.summary.val_loss}))
'''


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--threads", type=int, nargs="+", default=[0])
    ap.add_argument("--precisions", nargs="+", default=["bf16"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--mkldnn-off", action="store_true", help="also run with torch.backends.mkldnn disabled")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    wanted = ("amx", "avx512_bf16", "avx512_fp16")
    flags = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith(wanted)})
    print(f"torch {torch.__version__} · CPU bf16/AMX flags: {', '.join(flags) or 'none'} · "
          f"oneDNN ISA: {torch.backends.cpu.get_cpu_capability()}", flush=True)
    results = collections.defaultdict(list)
    for mkldnn_off in ([False, True] if args.mkldnn_off else [False]):
        for precision in args.precisions:
            for threads in args.threads:
                for _ in range(args.runs):
                    cfg = dict(threads=threads, precision=precision, steps=args.steps, d_model=args.d_model,
                               mkldnn_off=mkldnn_off)
                    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True,
                                          text=True)
                    if proc.returncode:
                        sys.exit(proc.stderr.strip().splitlines()[-1])
                    out = json.loads(proc.stdout.strip().splitlines()[-1])
                    results[(precision, out["threads"], mkldnn_off)].append(out["hash"])
                key = (precision, out["threads"], mkldnn_off)
                hashes = collections.Counter(results[key])
                print(f"{precision} threads={out['threads']:>2} oneDNN={'off' if mkldnn_off else 'on '}: "
                      f"{len(hashes)} distinct of n={len(results[key])} runs "
                      f"({', '.join(f'{h[:8]} x{c}' for h, c in hashes.most_common())})", flush=True)
    by_prec = collections.defaultdict(set)
    for (precision, _, _), hs in results.items():
        by_prec[precision] |= set(hs)
    for precision, hs in by_prec.items():
        print(f"{precision}: {len(hs)} distinct result(s) across every thread count / oneDNN setting")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({f"{p}|{t}|{m}": hs for (p, t, m), hs in results.items()}, fh, indent=1)


if __name__ == "__main__":
    main()
