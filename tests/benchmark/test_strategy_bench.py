"""bench --strategy ddp,fsdp under torchrun: 2 CPU ranks with gloo, a 2-block tiny GPT, fp32, one repeat.

Every rank's figures reach rank 0, which alone prints and writes; FSDP's ranks hold about half the parameter bytes
DDP's do; the spread across ranks spans every rank's median. Without torchrun: one line saying how to launch.
"""
from __future__ import annotations

import json

import pandas as pd
import pytest
from torchrun import TWO_BLOCK_ARGS, ok, text_file, torchrun, worker_script

import tier_utils
from tier_utils import cli
from tier_utils.benchmark.strategies import StrategyBenchResult

pytestmark = pytest.mark.slow
TIMED = 3


def _args(data, *extra):
    return ["bench", "--model", "tiny-gpt", *TWO_BLOCK_ARGS, "--device", "cpu", "--precisions", "fp32",
            "--batch-size", "2", "--seq-len", "16", "--untimed-steps", "1", "--timed-steps", str(TIMED), "--repeats",
            "1", "--no-progress", "--data", str(data), *extra]


def test_ddp_and_fsdp_per_rank_gathered_to_rank0(tmp_path):
    text = text_file(tmp_path / "text.txt")
    worker = tmp_path / "worker.py"
    worker.write_text(worker_script(rank0_writes_only=True))  # rank 1 writing anything fails the run
    out = tmp_path / "bench.json"
    run = ok(torchrun([str(worker), *_args(text, "--strategy", "ddp,fsdp", "--json", str(out))]))
    assert run.stdout.count("DDP vs FSDP on 2 ranks") == 1  # rank 0 alone prints
    got = json.loads(out.read_text())
    assert got["config"]["model"] == "TinyGPT" and "text file" in got["config"]["data"]
    assert got["config"]["settings"]["strategy"] == ["ddp", "fsdp"]
    table = pd.DataFrame(got["ranks"])
    assert sorted(zip(table["strategy"], table["rank"])) == [("ddp", 0), ("ddp", 1), ("fsdp", 0), ("fsdp", 1)]
    assert (table["n"] == TIMED).all() and table["ran"].all()
    params = table.groupby("strategy")["param_mib"].mean()
    assert params["fsdp"] / params["ddp"] == pytest.approx(0.5, rel=0.1)
    for name, column in (("step_ms", "step_ms_median"), ("peak_mib", "peak_memory_mib"),
                         ("tokens_per_s", "tokens_per_s_median")):
        assert (table[f"{name}_rank_max"] >= table[column]).all() and (table[column] >= table[f"{name}_rank_min"]).all()
        assert (table[f"{name}_rank_ratio"] >= 1).all()
    fsdp = table[table["strategy"] == "fsdp"]
    assert fsdp["detail"].str.contains("MixedPrecisionPolicy").all()
    assert "peak RSS increase" in got["memory"]
    assert [s["strategy"] for s in got["strategies"]] == ["ddp", "fsdp"]
    # The result rebuilt from what rank 0 wrote: its plot has the two panels.
    result = StrategyBenchResult(got["ranks"], got["config"], got["metadata"], got["memory"], rank=0)
    assert len(result.plot().axes) == 2 and "2 ranks" in result.headline()


def test_strategy_without_torchrun_says_how_to_launch_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(_args(tmp_path / "none.txt", "--strategy", "fsdp", "--json", str(out))) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchrun --nproc_per_node N -m tier_utils bench" in err[0], err
    assert not out.exists()
    assert cli.main(_args(tmp_path / "none.txt", "--strategy", "dp")) == 2
    assert "unknown strategy 'dp'" in capsys.readouterr().err


def test_amp_benchmark_refuses_a_strategy_in_one_line():
    """The single-process benchmark never silently drops a strategy: it names the benchmark that runs one."""
    with pytest.raises(tier_utils.LaunchError, match="strategy=ddp,fsdp is measured by tier_utils.strategy_benchmark"):
        tier_utils.amp_benchmark("tiny-gpt", strategy="ddp,fsdp")
