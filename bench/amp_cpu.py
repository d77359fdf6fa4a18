"""fp32 vs bf16 vs fp16 training on this CPU with `amp_benchmark`, tiny-gpt at two sizes, side by side.

Each size is one `amp_benchmark` run: same initial weights and batches for every precision, repeats
interleaved across precisions, warm-up excluded, only optimizer steps timed. fp16 is SKIPPED where
the CPU has no native fp16 (pass --force to run it emulated: expect it to be very slow).

    python bench/amp_cpu.py [--sizes 256,512] [--batch-size 16] [--seq-len 128] [--repeats 5]
                            [--timed-steps 5] [--accuracy-steps 50] [--threads N] [--force] [--json out.json]
"""
from __future__ import annotations

import argparse

import pandas as pd
import torch

from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.core.files import write_json
from tier_utils.models.loading import load_model

COLUMNS = ["n_repeats", "step_ms_median", "step_ms_iqr", "tokens_per_s_median", "speedup", "speedup_low",
           "speedup_high", "mfu", "peak_tflops", "activations_mib", "total_mib", "activation_reduction",
           "total_reduction", "val_loss", "val_accuracy", "parity_max_rel_dev"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="256,512", help="tiny-gpt d_model values (default 256,512)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--warmup-steps", type=int, default=2)
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--accuracy-steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--force", action="store_true", help="run fp16 even without native support")
    ap.add_argument("--json", help="write every run's to_json() here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    runs, speedups = {}, []
    for d in (int(s) for s in args.sizes.split(",")):
        model = load_model("tiny-gpt", d_model=d, max_len=args.seq_len)
        result = amp_benchmark(model, batch_size=args.batch_size, seq_len=args.seq_len,
                               untimed_steps=args.warmup_steps, timed_steps=args.timed_steps, repeats=args.repeats,
                               accuracy_steps=args.accuracy_steps, force=args.force, device="cpu")
        runs[f"d_model={d}"] = result.to_json()
        m = result.metadata
        print(f"\n== tiny-gpt d_model={d} ({result.config.parameters:,} parameters), batch {args.batch_size} x "
              f"{args.seq_len}, {m['device_name']}, {m['threads']} threads, torch {m['torch']}, "
              f"load average {m['load_average_1m']}")
        table = result.table.set_index("precision")[COLUMNS]
        with pd.option_context("display.width", 200, "display.max_colwidth", 110):
            print(table.map(lambda v: f"{v:.4g}" if isinstance(v, float) else v).T.to_string())
            print(result.verdicts.to_string(index=False))
        for rec in result.records:
            sp = rec.speed and rec.speed.speedup
            if sp:
                speedups.append(f"d_model={d}: {rec.precision} {sp.median:.2f}x fp32 "
                                f"(IQR range {sp.low:.2f}-{sp.high:.2f}x, n={args.repeats} repeats"
                                f"{', no measurable difference' if sp.no_measurable_difference else ''})")
    print("\nspeedup vs fp32 (ratio of median step times):")
    print("\n".join(f"  {line}" for line in speedups))
    if args.json:
        write_json(args.json, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
