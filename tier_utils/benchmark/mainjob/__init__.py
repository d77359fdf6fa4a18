"""The main job's own benchmark work: its GPU batch sizing (batch_size.py) and the check that training's
step time agrees with the benchmark's (consistency.py)."""
