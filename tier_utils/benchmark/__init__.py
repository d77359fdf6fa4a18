"""Tier 3's AMP benchmark: `amp_benchmark()` (amp.py), `BenchConfig` and `Thresholds` (config.py), its records,
verdicts and plot, and the GPU batch sizing of the main job."""
