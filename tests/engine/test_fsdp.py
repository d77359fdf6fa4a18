"""train(strategy="fsdp") under torchrun: CPU ranks with gloo, fp32, deterministic, a 2-block tiny GPT.

The loss curve equals a single process with the same global batch; each rank holds about half the parameter
bytes; a run killed mid-way and resumed ends bitwise equal to an uninterrupted one; a 2-rank checkpoint resumes
on 1 rank and a 1-rank one on 2 ranks (DCP reshards); the consolidated last.pt loads with load_model; bf16 names
its MixedPrecisionPolicy; 2 "nodes" meet through the c10d rendezvous. Each torchrun launch costs seconds on 2
cores, so the runs are shared by the tests through module fixtures.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings

import pandas as pd
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torchrun import TWO_BLOCK_ARGS, TWO_BLOCKS, free_port, ok, rank_env, text_file, torchrun, worker_script

from tier_utils import cli, load_model
from tier_utils.core.errors import CheckpointError, LaunchError
from tier_utils.core.files import LOCK_NAME
from tier_utils.core.seeding import seed_everything
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.models.sharded_checkpoint import check_complete, read_trainer
from tier_utils.training.loop import train

pytestmark = pytest.mark.slow
SIZES, SIZE_ARGS = TWO_BLOCKS, TWO_BLOCK_ARGS
PER_RANK_BATCH, ACCUM, STEPS = 4, 2, 6  # global batch 4 x 2 ranks x 2 micro-batches = 16
DETERMINISTIC = ["kind", "step", "epoch", "train_loss", "val_loss", "perplexity", "accuracy", "grad_norm", "lr"]

def _args(out, data, ranks=2, *extra, sizes=SIZE_ARGS):
    batch = PER_RANK_BATCH * 2 // ranks  # the same global batch on 1 or 2 ranks
    return ["train", "--model", "tiny-gpt", "--device", "cpu", "--batch-size", str(batch), "--grad-accum",
            str(ACCUM), "--seq-len", "16", "--max-steps", str(STEPS), "--log-every", "1", "--eval-every", "3",
            "--eval-batches", "2", "--checkpoint-every", "2", "--deterministic", "--no-progress", "--data",
            str(data), "--out", str(out), "--strategy", "fsdp", *extra, *sizes]


def _weights(folder, tmp_path) -> dict:
    """A sharded checkpoint's model weights, unsharded (DCP's own converter)."""
    file = tmp_path / f"{folder.parent.parent.name}-{folder.name}.pt"
    dcp_to_torch_save(folder, file)
    return torch.load(file, weights_only=True)["model"]


def _steps(history: pd.DataFrame) -> list[float]:
    return history.query("kind == 'step'")["train_loss"].tolist()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The uninterrupted 2-rank run (consolidated), a 2-rank and a 1-rank run killed at step 4 (checkpoint at
    step 2), and copies of those checkpoints to resume elsewhere."""
    root = tmp_path_factory.mktemp("fsdp")
    text = text_file(root / "text.txt")
    worker = root / "worker.py"
    worker.write_text(worker_script())
    whole = ok(torchrun(["-m", "tier_utils", *_args(root / "whole", text, 2, "--precision", "fp32", "--consolidate",
                                                       "--json", str(root / "whole.json"))]))
    killed = {}
    for ranks in (2, 1):
        out = root / f"killed{ranks}"
        run = torchrun([str(worker), *_args(out, text, ranks, "--precision", "fp32")], ranks, {"KILL_AT": "4"})
        assert run.returncode != 0
        assert read_trainer(out / "checkpoints" / "last")["step"] == 2
        copy = root / f"from{ranks}"
        shutil.copytree(out, copy)  # resumed on the other number of ranks
        killed[ranks] = (out, copy)
    return {"root": root, "text": text, "worker": worker, "whole": root / "whole", "whole_run": whole,
            "summary": json.loads((root / "whole.json").read_text()), "killed": killed}


def test_fsdp_matches_one_process_halves_parameter_bytes_and_consolidates(runs, tmp_path):
    summary, whole = runs["summary"], runs["whole"]
    assert summary["strategy"] == "fsdp" and summary["world_size"] == 2 and summary["model"] == "TinyGPT"
    assert "each of 2 Block blocks, then the root" in summary["sharding"]
    assert runs["whole_run"].stdout.count("trained TinyGPT") == 1  # rank 0 alone prints
    seed_everything(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = train("tiny-gpt", str(runs["text"]), model_kwargs=SIZES, precision="fp32", device="cpu",
                       batch_size=2 * PER_RANK_BATCH * ACCUM, seq_len=16, max_steps=STEPS, log_every=1,
                       eval_every=3, eval_batches=None, deterministic=True, progress=False)
    hist = pd.read_csv(whole / "metrics.csv")
    assert _steps(hist) == pytest.approx(_steps(single.history), rel=1e-5)
    evals = hist.query("kind != 'step'")["val_loss"].tolist()
    assert evals == pytest.approx(single.history.query("kind != 'step'")["val_loss"].tolist(), rel=1e-5)
    # The fine-tune against its base: each example's scores gathered from both ranks, as one process has them.
    scores = json.loads((whole / "checkpoints" / "scores.json").read_text())
    one = single.summary.versus_base["pairing"]
    assert scores["tuned"]["index"] == one["after"]["index"] == list(range(7))
    assert scores["base"]["metrics"]["loss"] == pytest.approx(one["before"]["metrics"]["loss"], rel=1e-5)
    assert scores["tuned"]["metrics"]["loss"] == pytest.approx(one["after"]["metrics"]["loss"], rel=1e-5)
    # A DDP rank holds the whole model, as the single process does; an FSDP rank about half of it.
    whole_bytes = single.summary.param_bytes_per_rank
    assert whole_bytes == sum(p.nbytes for p in single.model.parameters())
    assert summary["param_bytes_per_rank"] / whole_bytes == pytest.approx(0.5, rel=0.1)
    # The consolidated last.pt: load_model rebuilds the model with the sharded checkpoint's weights, exactly.
    model = load_model(str(whole / "checkpoints" / "last.pt")).eval()
    sharded = _weights(whole / "checkpoints" / "last", tmp_path)
    rebuilt = load_model("tiny-gpt", **SIZES).eval()
    rebuilt.load_state_dict(sharded)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids), rebuilt(ids))
        assert not torch.equal(model(ids), load_model("tiny-gpt", **SIZES).eval()(ids))  # trained: not the init


def test_fsdp_killed_and_resumed_is_bitwise_equal(runs, tmp_path):
    part, _ = runs["killed"][2]
    ok(torchrun([str(runs["worker"]), *_args(part, runs["text"], 2, "--precision", "fp32", "--resume")]))
    a, b = read_trainer(runs["whole"] / "checkpoints" / "last"), read_trainer(part / "checkpoints" / "last")
    assert a["step"] == b["step"] == STEPS and b["world_size"] == 2
    wa, wb = _weights(runs["whole"] / "checkpoints" / "last", tmp_path), _weights(part / "checkpoints" / "last",
                                                                                 tmp_path)
    for name, tensor in wa.items():
        assert torch.equal(wb[name], tensor), name
    ha = pd.DataFrame(a["history"]["rows"])[DETERMINISTIC]
    pd.testing.assert_frame_equal(ha, pd.DataFrame(b["history"]["rows"])[DETERMINISTIC], check_exact=True)


@pytest.mark.parametrize("saved, resumed", [(2, 1), (1, 2)])
def test_fsdp_resumes_on_another_number_of_ranks(runs, saved, resumed):
    _, copy = runs["killed"][saved]
    ok(torchrun([str(runs["worker"]), *_args(copy, runs["text"], resumed, "--precision", "fp32", "--resume")],
                  resumed))
    state = read_trainer(copy / "checkpoints" / "last")
    assert state["step"] == STEPS and state["world_size"] == resumed
    got = pd.read_csv(copy / "metrics.csv")
    assert got.query("kind == 'step'")["step"].tolist() == list(range(1, STEPS + 1))
    assert _steps(got) == pytest.approx(_steps(pd.read_csv(runs["whole"] / "metrics.csv")), rel=1e-5)


def test_bf16_fsdp_names_its_policy_and_a_model_without_blocks_shards_the_root(tmp_path, runs):
    one_block = [a for k, v in {**SIZES, "n_layer": 1}.items() for a in ("--model-arg", f"{k}={v}")]
    run = ok(torchrun(["-m", "tier_utils", *_args(tmp_path / "bf16", runs["text"], 2, "--precision", "bf16",
                                                    "--json", str(tmp_path / "s.json"), sizes=one_block)]))
    summary = json.loads((tmp_path / "s.json").read_text())
    assert "MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)" in summary["sharding"]
    assert "the root only" in summary["sharding"]
    assert "has no repeated blocks" in run.stderr and "shards the root only" in run.stderr
    assert summary["train_loss"] > 0


def test_two_nodes_meet_through_the_rendezvous(tmp_path, runs):
    """2 torchrun "nodes" of 1 process each on localhost: c10d rendezvous, as on two machines."""
    port = free_port()
    launcher = ["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "t33"]
    env = rank_env(GLOO_SOCKET_IFNAME="lo")
    # With activation checkpointing too: the recompute gives the same values, block by block under FSDP.
    target = ["-m", "tier_utils", *_args(tmp_path / "nodes", runs["text"], 2, "--precision", "fp32", "--json",
                                         str(tmp_path / "n.json"), "--checkpointing")]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc_per_node", "1", *target]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    outputs = [n.communicate(timeout=240) for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    summary = json.loads((tmp_path / "n.json").read_text())
    assert summary["world_size"] == 2 and summary["strategy"] == "fsdp" and summary["activation_checkpointing"]
    assert _steps(pd.read_csv(tmp_path / "nodes" / "metrics.csv")) == pytest.approx(
        _steps(pd.read_csv(runs["whole"] / "metrics.csv")), rel=1e-5)


def test_fsdp_without_torchrun_says_how_to_launch(tmp_path, capsys, runs):
    with pytest.raises(LaunchError, match="torchrun --nproc_per_node N"):
        train("tiny-gpt", str(runs["text"]), model_kwargs=SIZES, strategy="fsdp", device="cpu", progress=False)
    assert cli.main(_args(tmp_path / "no", runs["text"], 2)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torchrun" in err[0]
    assert not (tmp_path / "no").exists()  # nothing written
    assert load_checkpoint(runs["whole"] / "checkpoints" / "last.pt")["consolidated"]


def test_a_missing_shard_is_named_in_one_line_and_nothing_is_written(runs, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs["whole"], run)
    folder = run / "checkpoints" / "last"
    check_complete(folder)
    (folder / "__1_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"missing shard __1_0\.distcp \(1 of 2 missing\)"):
        read_trainer(folder)
    # A resume on it, as torchrun's one rank (its environment set here: a gloo group of one, in this process).
    port = free_port()
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    def files():  # every file and its time, but the run lock's (it holds the pid of the run that last held it)
        return sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")
                      if p.is_file() and p.name != LOCK_NAME)

    before = files()
    assert cli.main(_args(run, runs["text"], 1, "--precision", "fp32", "--resume")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing shard __1_0.distcp" in err[0], err
    assert files() == before


def test_analysis_refuses_to_run_sharded_in_one_line(monkeypatch, capsys):
    from tier_utils import analyze

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets them
    with pytest.raises(LaunchError, match="analyze does not run sharded"):
        analyze("tiny-gpt", model_kwargs=SIZES, device="cpu", progress=False)
    assert cli.main(["analyze", "--model", "tiny-gpt", *SIZE_ARGS, "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoints/last.pt" in err[0]


@pytest.mark.parametrize("name, param_dtype, reduce_dtype", [
    ("fp32", None, None), ("bf16", torch.bfloat16, torch.float32), ("fp16", torch.float16, torch.float32),
    ("bf16-true", None, None)])
def test_each_precision_is_one_mixed_precision_policy(name, param_dtype, reduce_dtype, monkeypatch):
    from tier_utils import resolve_precision

    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")  # bf16-true decided as native, whatever this CPU
    policy = resolve_precision(name, "cpu", warn=False).mixed_precision_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (param_dtype, reduce_dtype)
