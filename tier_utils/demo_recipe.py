"""The recipe that made the shipped demo model (`tier_utils.models.demo_model`): `train_demo` trains it again, seeded;
`python -m tier_utils.demo_recipe --out DIR` runs it from the command line."""
from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from .adapter.adapter import adapt
from .core.errors import TierError, one_line
from .core.files import atomic_write_bytes, write_json
from .core.inputs import writable_dir
from .core.precision import resolve_precision
from .core.results import run_metadata
from .data.datasets import BYTE_VOCAB, make_loader
from .engine.evaluation import evaluate
from .models.builtins import DEMO_MODEL
from .models.demo_model import CARD_NAME, MODEL_KWARGS, WEIGHTS_NAME, describe_demo, weights_bytes
from .tasks import build_datasets
from .training.config import TrainConfig
from .training.loop import train

EVAL_BATCH = 16
UNIFORM_LOSS = math.log(BYTE_VOCAB)  # a model that guesses every byte alike


def corpus_val_loss(model: torch.nn.Module) -> tuple[float, int]:
    """Mean cross-entropy (nats per byte) of a byte-level causal LM over the bundled corpus' whole
    validation split, in fp32 on the model's device, and the number of targets scored."""
    adapter = adapt(model)
    splits = adapter.datasets(None, adapter.fit_length(MODEL_KWARGS["max_len"]))
    loader = make_loader(splits.val, EVAL_BATCH, collate=splits.collate, shuffle=False, device=adapter.device)
    was_training = model.training
    metrics = evaluate(adapter, loader, resolve_precision("fp32", adapter.device))
    model.train(was_training)  # evaluate leaves it in train mode
    return metrics["val_loss"], metrics["targets"]


STEPS, SEED = 1200, 0
# Sized for about a minute on 2 idle CPU cores. Fewer steps leave layer 0's heads spread over the
# whole window; lr 6e-3 makes near one-hot heads that fix on a few bytes, and a worse val loss.
# Windows of max_len tokens, so every position row is trained; fp32 on the CPU, so the recipe
# reruns the same anywhere but for float rounding (AVX2 / AVX-512 / AMX differ).
RECIPE = TrainConfig(batch_size=16, seq_len=MODEL_KWARGS["max_len"], lr=3e-3, warmup_steps=20, eval_every=None,
                     eval_batches=5, precision="fp32", device="cpu", max_steps=STEPS, seed=SEED)


def train_demo(out_dir, steps: int = STEPS, seed: int = SEED, progress: bool = True) -> dict:
    """Train the demo model with RECIPE, write `tiny_gpt_trained.safetensors` and its JSON card into
    `out_dir`, and return the card (sizes, seed, steps, data, final train and val loss, torch version).
    `out_dir=tier_utils.models.demo_model.ASSETS` replaces the shipped model."""
    out = writable_dir(out_dir, "out_dir")  # before the minute of training, not after it
    config = replace(RECIPE, max_steps=steps, seed=seed, progress=progress)  # checks steps and seed
    start = time.perf_counter()
    result = train("tiny-gpt", None, config, model_kwargs=MODEL_KWARGS)
    seconds = time.perf_counter() - start
    model = result.model.eval()
    val_loss, targets = corpus_val_loss(model)
    blob = weights_bytes(model)
    splits = build_datasets(None, seq_len=RECIPE.seq_len)
    s = result.summary
    card = {
        "name": DEMO_MODEL, "model": type(model).__name__, "model_kwargs": MODEL_KWARGS,
        "parameters": s.parameters, "seed": seed, "steps": s.steps,
        "training": {k: config.to_dict()[k] for k in ("batch_size", "seq_len", "lr", "warmup_steps", "weight_decay",
                                                      "grad_clip", "precision")},
        "data": {"source": "corpus", "what": "CPython's pydoc topics (pydoc_data.topics), train/val split by topic",
                 "train_windows": len(splits.train), "val_windows": len(splits.val)},
        "train_loss": s.train_loss, "val_loss": val_loss, "val_targets": targets, "uniform_loss": UNIFORM_LOSS,
        "train_seconds": round(seconds, 1), "torch": torch.__version__,
        "weights": WEIGHTS_NAME, "weights_sha256": hashlib.sha256(blob).hexdigest(),
        "command": f"python -m tier_utils.demo_recipe --out tier_utils/assets --steps {steps} --seed {seed}",
        "run_metadata": run_metadata("cpu", torch.float32),
    }
    atomic_write_bytes(out / WEIGHTS_NAME, blob)
    write_json(out / CARD_NAME, card)
    return card


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tier_utils.demo_recipe",
                                     description="Train the demo model (tiny-gpt-trained) on the bundled corpus.")
    parser.add_argument("--out", required=True, help="folder for the weights and their JSON card "
                                                     "(tier_utils/assets replaces the shipped ones)")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"optimizer steps (default {STEPS})")
    parser.add_argument("--seed", type=int, default=SEED, help=f"initial weights and data order (default {SEED})")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        card = train_demo(args.out, steps=args.steps, seed=args.seed, progress=args.progress)
    except (TierError, ValueError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    print(f"{describe_demo(card)}; train loss {card['train_loss']:.3f}; {card['train_seconds']} s on "
          f"{card['run_metadata']['device_name']} -> {Path(args.out) / WEIGHTS_NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
