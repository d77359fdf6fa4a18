"""DDP vs FSDP2 on this CPU: GPT-2-small (hf:GPT2LMHeadModel, its default config, random weights), 2 gloo ranks
through torchrun, fp32; per-rank peak RSS increase and step time, side by side in one run, with the per-rank
planner's prediction (tier_utils.planning.ranks) for each.

Each strategy is one `train()` under `torchrun --nproc_per_node 2` on the bundled corpus (byte ids). A rank's
"peak RSS increase" is its peak resident memory (getrusage ru_maxrss) less its RSS just before train() starts
(torch, transformers and tier_utils imported): what training added. Step time is the run's per-step median with
its IQR over the step rows (the first steps, warm-up, included in n). Run it under the machine's heavy lock:

    flock /work/heavy.lock python bench/fsdp_cpu.py [--batch-size 1] [--seq-len 128] [--steps 6] [--json out.json]

`--model-arg n_layer=2` (repeatable) changes the config, e.g. for a quick check of the script itself. With
glibc's default (dynamic) mmap threshold, FSDP's freed per-unit buffers stay resident; run it with
`MALLOC_MMAP_THRESHOLD_=65536` (the ranks inherit it) to see what the tensors themselves need (bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

SPEC = "hf:GPT2LMHeadModel"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_main(args) -> None:
    """One rank: train, then write this rank's figures to OUT/rank<R>.json."""
    import torch  # noqa: F401  (imported before the baseline, as in any run)
    import transformers  # noqa: F401

    from tier_utils.training.loop import train

    before = _rss()
    result = train(SPEC, None, model_kwargs=_kwargs(args), strategy=args.strategy, precision="fp32", device="cpu",
                   batch_size=args.batch_size,
                   seq_len=args.seq_len, max_steps=args.steps, warmup_steps=0, log_every=1, eval_every=0,
                   eval_batches=1, deterministic=False, progress=False)
    s = result.summary
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    out = {"rank": s.rank, "strategy": s.strategy, "baseline_rss": before, "peak_rss": peak,
           "peak_increase": peak - before, "param_bytes": s.param_bytes_per_rank, "sharding": s.sharding,
           "step_ms": s.step_time_ms.to_dict(), "tokens_per_s": s.tokens_per_s.to_dict(), "loss": s.train_loss,
           "parameters": s.parameters, "device": s.device_name}
    Path(args.out, f"rank{s.rank}.json").write_text(json.dumps(out))


def _kwargs(args) -> dict:
    return {k: ast.literal_eval(v) for k, _, v in (a.partition("=") for a in args.model_arg)}


def launch(strategy: str, args, folder: Path) -> list[dict]:
    folder.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
           "--rank-worker", "--strategy", strategy, "--out", str(folder), "--batch-size", str(args.batch_size),
           "--seq-len", str(args.seq_len), "--steps", str(args.steps),
           *(x for a in args.model_arg for x in ("--model-arg", a))]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if run.returncode != 0:
        sys.exit(f"{strategy} run failed:\n{run.stderr[-3000:]}")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def predicted(args) -> dict:
    from tier_utils.planning.ranks import plan_ranks

    plan = plan_ranks(SPEC, model_kwargs=_kwargs(args), seq_len=args.seq_len, precision="fp32", device="cpu",
                      ranks=(2,), progress=False).plan
    return {mode: plan.step_bytes(mode, 2, args.batch_size) for mode in ("ddp", "fsdp")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step (default 1)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE", help="a GPT2Config field")
    ap.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--strategy", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank_worker:
        rank_main(args)
        return 0
    gib = 2**30
    prediction = predicted(args)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in ("ddp", "fsdp"):
            for r in launch(strategy, args, Path(tmp, strategy)):
                error = r["peak_increase"] / prediction[strategy] - 1
                rows.append({**r, "predicted": prediction[strategy], "prediction_error": error})
                print(f"{strategy} rank {r['rank']}: peak RSS +{r['peak_increase'] / gib:.3f} GiB (predicted "
                      f"{prediction[strategy] / gib:.3f} GiB, {error:+.1%}); params held {r['param_bytes'] / gib:.3f} "
                      f"GiB; step {r['step_ms']['median']:.0f} ms median (IQR {r['step_ms']['iqr']:.0f}, "
                      f"n={r['step_ms']['n']}); {r['tokens_per_s']['median']:.0f} tokens/s per rank")
    by = {s: [r for r in rows if r["strategy"] == s] for s in ("ddp", "fsdp")}
    mem = max(r["peak_increase"] for r in by["fsdp"]) / max(r["peak_increase"] for r in by["ddp"])
    step = max(r["step_ms"]["median"] for r in by["fsdp"]) / max(r["step_ms"]["median"] for r in by["ddp"])
    print(f"FSDP / DDP, slowest or largest rank: peak RSS increase x{mem:.2f}, step time x{step:.2f} "
          f"({rows[0]['parameters']:,} parameters, batch {args.batch_size} x {args.seq_len} per rank, fp32, "
          f"2 gloo ranks, {rows[0]['device']})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
