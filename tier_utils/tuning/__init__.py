"""Hyperparameter search: `search()` and `SearchConfig` (study.py), an Optuna study around training."""
