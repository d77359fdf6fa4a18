"""What tier 2's attention capture costs: a plain forward next to the same forward with capture on.

GPT-2 small (transformers' GPT2Config defaults: 12 layers, 12 heads, 768 wide, fresh weights; no hub) at
batch 8 x 256 tokens, eval mode, no grad, its default SDPA attention. Each repeat runs both, alternating
which goes first. "capture" is `capture_attention` as the attention analysis installs it: the module stack,
the TorchFunctionMode seeing every call, and each SDPA call's probabilities recomputed in float32 and
handed to a sink (here one that drops them, so the figure is the capture's, not the scoring's). The
"analysis" column adds the scoring: the attention analysis' own `_score` on every map.

    python bench/attention_capture.py [--batch-size 8] [--seq-len 256] [--repeats 7] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import os
import time
from functools import partial

import torch

from tier_utils.analysis.attention import _HeadStats, _score
from tier_utils.analysis.capture import capture_attention
from tier_utils.core.measure import summarize
from tier_utils.core.results import run_metadata


def timed(fn, sync) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return (time.perf_counter() - start) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    dev = torch.device(args.device)
    model = GPT2LMHeadModel(GPT2Config()).to(dev).eval()
    ids = torch.randint(0, 50257, (args.batch_size, args.seq_len), device=dev)
    mask = torch.ones_like(ids, dtype=torch.bool)
    sync = partial(torch.cuda.synchronize, dev) if dev.type == "cuda" else (lambda: None)

    def plain():
        model(ids)

    def captured(score: bool):
        stats = _HeadStats()
        with capture_attention(model, args.seq_len) as cap:
            cap.on_map = partial(_score, stats, None, mask, True) if score else (lambda found: None)
            model(ids)
        assert cap.calls == model.config.n_layer, cap.calls

    runs = {"plain": plain, "capture": partial(captured, False), "analysis": partial(captured, True)}
    samples = {name: [] for name in runs}
    with torch.no_grad():
        for fn in runs.values():  # warm-up
            fn()
        for r in range(args.repeats):
            order = list(runs) if r % 2 == 0 else list(reversed(runs))
            for name in order:
                samples[name].append(timed(runs[name], sync))
    meta = run_metadata(dev, torch.float32)
    print(f"GPT-2 small (fresh weights, {model.config._attn_implementation}) B={args.batch_size} "
          f"T={args.seq_len} fp32 on {meta['device_name']}, torch {meta['torch']}, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    base = summarize(samples["plain"])
    for name, xs in samples.items():
        s = summarize(xs)
        ratios = summarize([x / p for x, p in zip(xs, samples["plain"])])
        print(f"{name:9s} median {s.median:8.1f} ms  IQR {s.q3 - s.q1:6.1f} ms  (n={s.n}, min {s.min:.1f}, "
              f"max {s.max:.1f})   / plain: median {ratios.median:.2f} (IQR {ratios.q1:.2f}-{ratios.q3:.2f})")
    print(f"plain forward median {base.median:.1f} ms")


if __name__ == "__main__":
    main()
