"""The trained demo model: a small TinyGPT trained on the bundled corpus, shipped in the package.

Tier 2 analyses it where the user left the default model (`all`, the tier-2 notebook), so the first
picture is a trained model's attention (previous-token and local heads), not the uniform maps of
fresh weights. `train_demo` is the seeded recipe that made the shipped weights;
`python -m tier_utils.demo --out DIR` runs it again. The weights are safetensors (loading them runs
no code); the JSON beside them records how they were made and what they scored.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from .adapter import adapt
from .data import BYTE_VOCAB, build_datasets, make_loader
from .errors import ModelSpecError, TierError, one_line
from .files import atomic_write_bytes, write_json
from .metrics import evaluate
from .models import DEMO_MODEL, TinyGPT
from .precision import resolve_precision
from .results import run_metadata
from .settings import TrainConfig
from .validation import writable_dir

ASSETS = Path(__file__).parent / "assets"
WEIGHTS_NAME, CARD_NAME = "tiny_gpt_trained.safetensors", "tiny_gpt_trained.json"
MODEL_KWARGS = {"vocab_size": BYTE_VOCAB, "max_len": 128, "d_model": 128, "n_layer": 2, "n_head": 4, "dropout": 0.0}
STEPS, SEED = 1200, 0
# Sized for about a minute on 2 idle CPU cores. Fewer steps leave layer 0's heads spread over the
# whole window; lr 6e-3 makes near one-hot heads that fix on a few bytes, and a worse val loss.
# Windows of max_len tokens, so every position row is trained; fp32 on the CPU, so the recipe
# reruns the same anywhere but for float rounding (AVX2 / AVX-512 / AMX differ).
RECIPE = {"batch_size": 16, "seq_len": MODEL_KWARGS["max_len"], "lr": 3e-3, "warmup_steps": 20,
          "eval_every": None, "eval_batches": 5, "precision": "fp32", "device": "cpu"}
EVAL_BATCH = 16
UNIFORM_LOSS = math.log(BYTE_VOCAB)  # a model that guesses every byte alike


def corpus_val_loss(model: torch.nn.Module) -> tuple[float, int]:
    """Mean cross-entropy (nats per byte) of a byte-level causal LM over the bundled corpus' whole
    validation split, in fp32 on the model's device, and the number of targets scored."""
    adapter = adapt(model)
    splits = adapter.datasets(None, adapter.fit_length(MODEL_KWARGS["max_len"]))
    loader = make_loader(splits.val, EVAL_BATCH, shuffle=False, device=adapter.device)
    was_training = model.training
    metrics = evaluate(adapter, loader, resolve_precision("fp32", adapter.device))
    model.train(was_training)  # evaluate leaves it in train mode
    return metrics["val_loss"], metrics["targets"]


def train_demo(out_dir, steps: int = STEPS, seed: int = SEED, progress: bool = True) -> dict:
    """Train the demo model with RECIPE, write `tiny_gpt_trained.safetensors` and its JSON card into
    `out_dir`, and return the card (sizes, seed, steps, data, final train and val loss, torch version).
    `out_dir=tier_utils.demo.ASSETS` replaces the shipped model."""
    from .train import train  # here: tier 2 imports this module (provenance_of), and tiers don't import upwards

    out = writable_dir(out_dir, "out_dir")  # before the minute of training, not after it
    config = TrainConfig(max_steps=steps, seed=seed, progress=progress, **RECIPE)  # checks steps and seed
    start = time.perf_counter()
    result = train("tiny-gpt", None, config, model_kwargs=MODEL_KWARGS)
    seconds = time.perf_counter() - start
    model = result.model.eval()
    val_loss, targets = corpus_val_loss(model)
    blob = _serialized(model)
    splits = build_datasets(None, seq_len=RECIPE["seq_len"])
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
        "command": f"python -m tier_utils.demo --out tier_utils/assets --steps {steps} --seed {seed}",
        "run_metadata": run_metadata("cpu", torch.float32),
    }
    atomic_write_bytes(out / WEIGHTS_NAME, blob)
    write_json(out / CARD_NAME, card)
    return card


def _serialized(model: torch.nn.Module) -> bytes:
    return save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})


def provenance_of(model: torch.nn.Module) -> dict | None:
    """The demo model's provenance (name, steps, seed, val loss) while `model` still holds the shipped weights;
    None for any other model, and for the demo once trained further or given other weights, which the
    card no longer describes. Checked by hashing the weights (2 MB: milliseconds)."""
    provenance = getattr(model, "provenance", None)
    if provenance is None or hashlib.sha256(_serialized(model)).hexdigest() != provenance["weights_sha256"]:
        return None
    return provenance


def demo_card() -> dict:
    """The shipped model's card (the JSON train_demo wrote)."""
    path = ASSETS / CARD_NAME
    if not path.is_file():
        raise ModelSpecError(f"{path} is missing from this install of tier_utils; reinstall it (pip install .)")
    return json.loads(path.read_text())


def describe_demo(card: dict) -> str:
    """One line naming the demo model and how it was trained, for reports and notebooks."""
    return (f"{card['name']}: {card['model']} trained {card['steps']} steps (seed {card['seed']}) on the bundled "
            f"corpus, val loss {card['val_loss']:.3f} nats/byte (uniform {card['uniform_loss']:.2f})")


def load_demo(**kwargs) -> TinyGPT:
    """The shipped trained model (what `load_model("tiny-gpt-trained")` returns), in train mode like every
    freshly built model. Its `.provenance` names it (name, steps, seed, val loss); tier 2's report shows it
    while the weights are still these (`provenance_of`)."""
    if kwargs:
        raise ModelSpecError(f"{DEMO_MODEL} is trained at fixed sizes, so it takes no keyword arguments "
                             f"({', '.join(kwargs)} given); use tiny-gpt for fresh weights at other sizes")
    card = demo_card()
    model = TinyGPT(**card["model_kwargs"])
    try:
        model.load_state_dict(load_file(ASSETS / card["weights"]))
    except (OSError, RuntimeError) as exc:  # a missing or truncated file, or weights for other sizes
        raise ModelSpecError(f"cannot load {DEMO_MODEL}'s weights ({one_line(exc)}); reinstall tier_utils or "
                             "regenerate them: python -m tier_utils.demo --out tier_utils/assets") from exc
    model.provenance = {"name": card["name"], "training_steps": card["steps"], "seed": card["seed"],
                        "val_loss": card["val_loss"], "data": card["data"]["source"], "summary": describe_demo(card),
                        "weights_sha256": card["weights_sha256"]}
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tier_utils.demo",
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
