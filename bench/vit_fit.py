"""fit's predicted training step for image classifiers against a real step's peak, side by side in one run.

For each model (tiny-vit at two resolutions; ViT, DeiT, Swin and ResNet shapes built from transformers' configs
with random weights, no hub), fit's predicted step at batch B (full fine-tune, fp32 and bf16 autocast, no
checkpointing) and the most bytes the CPU allocator held during one real training step (torch.profiler's record of
every allocation and free: the gradients, AdamW's state and the activations it made; the weights and the batch,
made before it and held through it, are added), and their ratio. fit measures an image model at its own side, on
one and two images, and spreads the bytes per image over the tokens the model makes (tasks/vision.image_tokens),
which the tokens column says.

    python bench/vit_fit.py [--batch-size 8] [--json out.json]
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import tier_utils
from tier_utils.core.device import cpu_name
from tier_utils.core.files import write_json
from tier_utils.core.measure import load_average
from tier_utils.core.precision import resolve_precision
from tier_utils.engine.step import TrainStep, make_optimizer
from tier_utils.tasks.vision import image_tokens

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=224,
             patch_size=16)


def models() -> dict:
    """name -> a fresh module: small widths, real resolutions (the token counts are the real models')."""
    import transformers as t

    return {
        "tiny-vit 64 x 64, patch 4": lambda: tier_utils.load_model("tiny-vit", image_size=64, patch_size=4, d_model=32,
                                                                   n_layer=1, n_head=2),
        "tiny-vit 224 x 224, patch 16": lambda: tier_utils.load_model("tiny-vit", image_size=224, patch_size=16,
                                                                      d_model=64, n_layer=2, n_head=2),
        "ViT 224 x 224, patch 16": lambda: t.ViTForImageClassification(t.ViTConfig(**SMALL, num_labels=4)),
        "DeiT 224 x 224, patch 16": lambda: t.DeiTForImageClassificationWithTeacher(t.DeiTConfig(**SMALL,
                                                                                                  num_labels=4)),
        "Swin 224 x 224, patch 4": lambda: t.SwinForImageClassification(t.SwinConfig(
            image_size=224, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2], window_size=7, num_labels=4)),
        "ResNet 224 x 224": lambda: t.ResNetForImageClassification(t.ResNetConfig(
            embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=4)),
    }


def step_peak(adapter, precision: str, batch: dict) -> int:
    """The weights and the batch (made before the step, and held through it: the first layer saves the pixels), and
    the most the allocator held above them during one training step."""
    adapter.model.zero_grad(set_to_none=True)
    step = TrainStep(adapter, resolve_precision(precision, "cpu", warn=False), make_optimizer(adapter.model, 1e-3, 0.1))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step([batch])
    held = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += e.self_cpu_memory_usage
        peak = max(peak, held)
    held_before = [*adapter.model.parameters(), *batch.values()]
    return sum(t.numel() * t.element_size() for t in held_before) + peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    for name, build in models().items():
        torch.manual_seed(0)
        adapter = tier_utils.adapt(build())
        plan = tier_utils.fit(adapter, precisions="fp32,bf16", lora=0, optimizers="adamw", checkpointing=False,
                              device="cpu", progress=False)
        batch = adapter.example_batch(args.batch_size)
        tokens = image_tokens(adapter.model, plan.seq_len)
        for row in plan.configs:
            predicted, measured = row.step_bytes(args.batch_size, plan.seq_len), step_peak(adapter, row.precision,
                                                                                            batch)
            rows.append({"model": name, "tokens": "none (pixels)" if tokens is None else sum(tokens),
                         "precision": row.precision, "predicted_mib": predicted / 2**20,
                         "measured_mib": measured / 2**20, "ratio": predicted / measured})
            print(f"{name:30} tokens {rows[-1]['tokens']!s:>13}  {row.precision:5} B={args.batch_size}  predicted "
                  f"{predicted / 2**20:8.1f} MiB  measured peak {measured / 2**20:8.1f} MiB  "
                  f"{predicted / measured:.3f}x", flush=True)
    print(f"{cpu_name()} · torch {torch.__version__} · 1-minute load {load_average()}")
    if args.json:
        write_json(args.json, {"rows": rows, "cpu": cpu_name(), "torch": torch.__version__})


if __name__ == "__main__":
    main()
