"""Seeding and RNG state: torch (CPU and CUDA), Python's random and numpy, saved and restored as tensors."""
from __future__ import annotations

import random

import numpy as np  # always installed: pandas and matplotlib need it
import torch


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python's random and numpy."""
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)


def rng_state() -> dict:
    """Every RNG state as tensors (ByteTensors for torch, int64 tensors for the Mersenne Twisters)."""
    version, mt, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"name": name, "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["mt"].tolist()), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    s = state["numpy"]  # every state has it: numpy is always installed
    np.random.set_state((s["name"], s["keys"].numpy().astype("uint32"), s["pos"], s["has_gauss"], s["cached"]))
