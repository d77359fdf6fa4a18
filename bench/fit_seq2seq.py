"""fit's prediction for an encoder-decoder against the peak a real training step holds (issue 48): a T5-small shape
(60 M parameters, random weights, `bench/scale.py`'s sizes), fp32 with AdamW, at batch B and each source x target
length given, and what the one-length model it replaced (the target as long as the source) predicts for the same.

The peak is measured as `tests/planning/test_fit_seq2seq.py` measures it (imported from there, so the figure here is
the test's method at a real size): the weights, gradients and AdamW's state a first step made, plus the CPU
allocator's peak during the second step (torch.profiler's record of every allocation and free).

    python bench/fit_seq2seq.py [--batch 16] [--lengths 128x32,32x128] [--threads 2] [--json out.json]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import transformers

TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(TESTS), str(TESTS / "planning")]

from scale import CONFIGS  # noqa: E402  (bench/scale.py: the T5-small shape, defined once)
from test_fit_seq2seq import measured_peak  # noqa: E402

from tier_utils import adapt, fit  # noqa: E402
from tier_utils.core.files import write_json  # noqa: E402


def predicted(model, batch: int, source: int, target: int | None) -> int:
    plan = fit(model, batch_size=batch, seq_len=source, target_len=target, precisions="fp32", lora=0,
               optimizers="adamw", checkpointing=False, device="cpu", progress=False, validate=False)
    return plan.configs[0].step_bytes(batch, source)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lengths", default="128x32,32x128", help="source x target pairs, comma-separated (T5 "
                        "reads as 128 tokens at most here: tier_utils' default for a model with no position table)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cls, sizes, *_ = CONFIGS["t5-small"]
    model = getattr(transformers, cls)(getattr(transformers, cls.replace("ForConditionalGeneration", "Config"))(
        **sizes))
    adapter = adapt(model)
    rows = []
    for pair in args.lengths.split(","):
        source, target = (int(n) for n in pair.split("x"))
        start = time.perf_counter()
        peak = measured_peak(adapter, args.batch, source, target)
        two, one = predicted(model, args.batch, source, target), predicted(model, args.batch, source, None)
        rows.append({"batch": args.batch, "source": source, "target": target, "measured_peak": peak,
                     "predicted": two, "error": two / peak - 1, "one_length_predicted": one,
                     "one_length_error": one / peak - 1, "seconds": time.perf_counter() - start})
        print(f"B={args.batch}, S={source}, U={target}: measured peak {peak / 2**30:.3f} GiB, predicted "
              f"{two / 2**30:.3f} GiB ({two / peak - 1:+.1%}); the one-length model {one / 2**30:.3f} GiB "
              f"({one / peak - 1:+.1%}); {rows[-1]['seconds']:.0f} s", flush=True)
    if args.json:
        write_json(args.json, {"model": "T5-small-shaped", "parameters": sum(p.numel() for p in model.parameters()),
                               "threads": args.threads, "rows": rows})


if __name__ == "__main__":
    main()
