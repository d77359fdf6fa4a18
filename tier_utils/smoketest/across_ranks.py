"""smoke with a sharded strategy under torchrun: the model sharded as training shards it (engine/strategies.py), its
gradient and memory checks run on every rank, every rank's rows gathered into the report.

Each rank checks its own shards: its gradients (finite, non-zero, layer norms over its part of each layer) after
one forward and backward that every rank runs together, and its memory rows, which name the bytes the rank holds
next to the unsharded model's. The checks that read the whole model at once (shapes, stability, init, latency,
determinism) are SKIPped with the reason: they run in one process. Every rank runs the same forwards, so the memory
sweep is sized to the smallest budget of any rank.
"""
from __future__ import annotations

from dataclasses import replace

from ..core.budget import Budget
from ..core.results import Check


def shared_budget(budget: Budget, env) -> Budget:
    """The smallest free memory of any rank: every rank then sizes its forwards alike."""
    return min(env.gather(budget), key=lambda b: b.free_bytes)


def per_rank_groups(groups: dict, strategy) -> dict:
    """The check groups as they run under `strategy`: its per-rank ones (Strategy.smoke_per_rank) with rank-tagged
    rows and a first row naming the rank's share; the others one SKIP row each."""
    env = strategy.env

    def per_rank(name, group):
        def run(adapter, smoke_run):
            if name == "memory":
                yield _held_row(adapter, smoke_run, strategy)
            for row in group(adapter, smoke_run):  # a group's data for the report (a Found) passes as it is
                yield replace(row, check=f"{row.check} [rank {env.rank}]") if isinstance(row, Check) else row
        return run

    def skipped(name):
        def run(adapter, smoke_run):
            yield Check(name, "SKIP", None, None, f"reads the whole model at once, and the model is sharded over "
                                                  f"{env.world_size} ranks: run smoke in one process (without "
                                                  "--strategy) for it")
        return run

    return {name: per_rank(name, group) if name in strategy.smoke_per_rank else skipped(name)
            for name, group in groups.items()}


def _held_row(adapter, smoke_run, strategy) -> Check:
    env = strategy.env
    held, whole = strategy.held_bytes(adapter.model), smoke_run.model["parameter_bytes"]
    return Check(f"memory: parameters held (bytes) [rank {env.rank}]", "PASS", held, None,
                 f"{held / 2**20:.2f} MiB of the {whole / 2**20:.2f} MiB unsharded ({held / whole:.0%}; 1/"
                 f"{env.world_size} is {1 / env.world_size:.0%}): {smoke_run.sharding}")


def gathered(ran: list[tuple[str, list[Check]]], strategy) -> list[Check]:
    """Every rank's rows, group by group: a per-rank group's rows from rank 0, 1, ...; the others' from rank 0."""
    every = strategy.env.gather(ran)
    rows = []
    for i, (name, own) in enumerate(ran):
        rows += [row for ranks in every for row in ranks[i][1]] if name in strategy.smoke_per_rank else own
    return rows
