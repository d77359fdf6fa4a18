"""smoke --strategy fsdp under torchrun: 2 CPU ranks with gloo, a 2-block tiny GPT sharded as training shards it.

The gradient and memory checks run on every rank, their rows tagged with it, and the memory rows name the bytes a
rank holds (about half) next to the unsharded model's; the checks that read the whole model are SKIPped with the
reason; rank 0 alone prints and writes. Without torchrun: one line saying how to launch.
"""
from __future__ import annotations

import json

import pytest
from torchrun import TWO_BLOCK_ARGS, ok, torchrun, worker_script

from tier_utils import cli, smoke
from tier_utils.core.errors import LaunchError
from tier_utils.smoketest.suite import SmokeConfig

pytestmark = pytest.mark.slow


def test_gradient_and_memory_checks_run_per_rank(tmp_path):
    worker = tmp_path / "worker.py"
    worker.write_text(worker_script(rank0_writes_only=True))  # rank 1 writing anything fails the run
    out = tmp_path / "smoke.json"
    run = ok(torchrun([str(worker), "smoke", "--model", "tiny-gpt", *TWO_BLOCK_ARGS, "--device", "cpu", "--precision",
                       "fp32", "--strategy", "fsdp", "--batch-sizes", "1,2", "--seq-lens", "16", "--no-progress",
                       "--json", str(out)]))
    assert run.stdout.count("sharded over 2 ranks") == 1  # rank 0 alone prints
    got = json.loads(out.read_text())
    rows = {c["check"]: c for c in got["checks"]}
    assert "MixedPrecisionPolicy" in got["sharding"] and "each of 2 Block blocks" in got["sharding"]
    whole = got["model"]["parameter_bytes"]
    for rank in (0, 1):
        held = rows[f"memory: parameters held (bytes) [rank {rank}]"]
        assert held["value"] / whole == pytest.approx(0.5, rel=0.1)
        assert f"{whole / 2**20:.2f} MiB unsharded" in held["detail"]
        for check in ("gradients: finite", "gradients: every parameter gets one", "gradients: non-zero",
                      "memory: activations per sample (bytes)"):
            assert rows[f"{check} [rank {rank}]"]["status"] == "PASS", rows.get(f"{check} [rank {rank}]")
    assert rows["memory: parameters + buffers (bytes) [rank 0]"]["value"] >= whole  # the unsharded size, named
    for group in ("shapes", "stability", "init", "latency", "determinism"):
        assert rows[group]["status"] == "SKIP" and "sharded over 2 ranks" in rows[group]["detail"]
    assert got["status"] == "PASS"


def test_sharded_smoke_without_torchrun_says_how_to_launch(capsys, tmp_path):
    with pytest.raises(LaunchError, match="torchrun --nproc_per_node N -m tier_utils smoke"):
        smoke("tiny-gpt", strategy="fsdp", device="cpu", progress=False)
    out = tmp_path / "smoke.json"
    assert cli.main(["smoke", "--model", "tiny-gpt", *TWO_BLOCK_ARGS, "--strategy", "fsdp", "--no-progress", "--json",
                     str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchrun" in err[0] and not out.exists()
    with pytest.raises(ValueError, match="fsdp or none"):
        SmokeConfig(strategy="ddp")
