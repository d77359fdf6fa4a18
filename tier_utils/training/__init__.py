"""Tier 3's training run: `train()` (loop.py), `TrainConfig` (config.py), the history and `TrainResult`,
fine-tuning's best checkpoint and early stop, torchrun helpers."""
