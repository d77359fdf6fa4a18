"""The trained demo model shipped in the package: a small TinyGPT trained on the bundled corpus.

Tier 2 analyses it where the user left the default model (`all`, the tier-2 notebook), so the first
picture is a trained model's attention (previous-token and local heads), not the uniform maps of
fresh weights. The weights are safetensors (loading them runs no code); the JSON card beside them records
how they were made (`tier_utils.demo_recipe`, the recipe) and what they scored.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from ..core.errors import ModelSpecError, one_line
from ..data.datasets import BYTE_VOCAB
from .builtins import DEMO_MODEL, TinyGPT

ASSETS = Path(__file__).parents[1] / "assets"  # tier_utils/assets, the package data
WEIGHTS_NAME, CARD_NAME = "tiny_gpt_trained.safetensors", "tiny_gpt_trained.json"
MODEL_KWARGS = {"vocab_size": BYTE_VOCAB, "max_len": 128, "d_model": 128, "n_layer": 2, "n_head": 4, "dropout": 0.0}
def weights_bytes(model: torch.nn.Module) -> bytes:
    """The weights as the shipped safetensors file holds them (what the card's hash is taken over)."""
    return save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})


def provenance_of(model: torch.nn.Module) -> dict | None:
    """The demo model's provenance (name, steps, seed, val loss) while `model` still holds the shipped weights;
    None for any other model, and for the demo once trained further or given other weights, which the
    card no longer describes. Checked by hashing the weights (2 MB: milliseconds)."""
    provenance = getattr(model, "provenance", None)
    if provenance is None or hashlib.sha256(weights_bytes(model)).hexdigest() != provenance["weights_sha256"]:
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
                             "regenerate them: python -m tier_utils.demo_recipe --out tier_utils/assets") from exc
    model.provenance = {"name": card["name"], "training_steps": card["steps"], "seed": card["seed"],
                        "val_loss": card["val_loss"], "data": card["data"]["source"], "summary": describe_demo(card),
                        "weights_sha256": card["weights_sha256"]}
    return model
