"""Tier 1: `smoke()` (suite.py), its check groups (checks.py) and its memory grid (memory_grid.py)."""
