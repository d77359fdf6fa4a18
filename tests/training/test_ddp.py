"""train() under torchrun: 2 CPU processes with gloo on a small text file.

Per-step losses equal a single process with the same global batch, and so do validation losses
over an odd-sized validation set (no example counted twice); only rank 0 writes; a DDP run killed
mid-way and resumed ends bitwise equal to an uninterrupted one.
"""
from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest
import torch
from tiny import TINY_ARGS, tiny
from torchrun import text_file, torchrun, worker_script

from tier_utils.core.paired import Pairing
from tier_utils.core.seeding import seed_everything
from tier_utils.engine.distributed import DistEnv, eval_shard
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.tasks import build_datasets
from tier_utils.training.loop import train

PER_RANK_BATCH, ACCUM, STEPS = 4, 2, 6  # global batch 4 x 2 ranks x 2 micro-batches = 16
DETERMINISTIC = ["kind", "step", "epoch", "train_loss", "val_loss", "perplexity", "accuracy", "grad_norm", "lr",
                 "loss_scale", "skipped_steps"]

def _train_args(out, data, *extra):
    args = ["train", "--model", "tiny-gpt", "--precision", "fp32", "--device", "cpu", "--batch-size",
            str(PER_RANK_BATCH), "--grad-accum", str(ACCUM), "--seq-len", "16", "--max-steps", str(STEPS),
            "--log-every", "1", "--eval-every", "3", "--eval-batches", "2", "--checkpoint-every", "2",
            "--deterministic", "--no-progress", "--data", str(data), "--out", str(out), *extra]
    return args + TINY_ARGS


def test_eval_shards_score_every_example_once():
    data = list(range(7))
    for world in (2, 3):
        shards = [list(eval_shard(data, DistEnv(rank=r, world_size=world))) for r in range(world)]
        assert sorted(sum(shards, [])) == data  # DistributedSampler would pad with repeats to 8 or 9
    assert eval_shard(data, DistEnv()) is data


def test_ddp_matches_single_process_only_rank0_writes_and_resumes_exactly(tmp_path):
    # About 68 train windows (4 steps an epoch, so 6 steps cross one) and 7 validation windows:
    # an odd count, so a padding sampler would score one twice and miss the single-process loss.
    text = text_file(tmp_path / "text.txt")
    assert len(build_datasets(str(text), seq_len=16).val) == 7
    # 1. As users launch it: torchrun -m tier_utils train ...
    whole = tmp_path / "whole"
    run = torchrun(["-m", "tier_utils", *_train_args(whole, text, "--json", str(tmp_path / "whole.json"))])
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("trained TinyGPT") == 1  # rank 0 alone prints
    assert sorted(p.name for p in whole.iterdir()) == ["checkpoints", "metrics.csv", "regressed.csv", "training.png",
                                                       "versus_base.csv"]
    summary = json.loads((tmp_path / "whole.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 2 * PER_RANK_BATCH * ACCUM and summary["rank"] == 0
    ddp_hist = pd.read_csv(whole / "metrics.csv")
    # The fine-tune against its base: every validation example scored once, gathered from both ranks in split order.
    scores = json.loads((whole / "checkpoints" / "scores.json").read_text())
    assert scores["tuned"]["index"] == scores["base"]["index"] == list(range(7))

    # 2. One process, same global batch in one micro-batch: the same losses step by step (no_sync on
    #    the first micro-batch must still leave every rank with the all-reduced gradient).
    seed_everything(0)
    model = tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single = train(model, str(text), precision="fp32", device="cpu", batch_size=2 * PER_RANK_BATCH * ACCUM,
                       seq_len=16, max_steps=STEPS, log_every=1, eval_every=3, eval_batches=None, deterministic=True,
                       progress=False)
    steps = ddp_hist.query("kind == 'step'")
    assert steps["step"].tolist() == list(range(1, STEPS + 1))
    ref = single.history.query("kind == 'step'")
    assert steps["train_loss"].tolist() == pytest.approx(ref["train_loss"].tolist(), abs=1e-5)
    assert steps["lr"].tolist() == pytest.approx(ref["lr"].tolist(), rel=1e-12)
    # Validation covers the same 7 examples: 4 on rank 0 and 3 on rank 1 vs 1 batch of 7.
    evals = ddp_hist.query("kind != 'step'")["val_loss"].tolist()
    assert evals == pytest.approx(single.history.query("kind != 'step'")["val_loss"].tolist(), abs=1e-5)
    one = Pairing.from_dict(single.summary.versus_base["pairing"])  # each example's scores as one process has them
    assert scores["tuned"]["metrics"]["loss"] == pytest.approx(one.after.metrics["loss"], abs=1e-5)
    assert scores["base"]["metrics"]["loss"] == pytest.approx(one.before.metrics["loss"], abs=1e-5)

    # 3. Killed at step 4 (last checkpoint: step 2), then resumed; rank 1 may write nothing in either.
    part = tmp_path / "part"
    worker = tmp_path / "worker.py"
    worker.write_text(worker_script(rank0_writes_only=True))
    killed = torchrun([str(worker), *_train_args(part, text)], env_extra={"KILL_AT": "4"})
    assert killed.returncode != 0
    assert load_checkpoint(part / "checkpoints" / "last.pt")["step"] == 2
    resumed = torchrun([str(worker), *_train_args(part, text, "--resume")])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "tried to write" not in resumed.stderr + killed.stderr

    a = load_checkpoint(whole / "checkpoints" / "last.pt")
    b = load_checkpoint(part / "checkpoints" / "last.pt")
    assert a["step"] == b["step"] == STEPS
    for name, tensor in a["model"].items():
        assert torch.equal(b["model"][name], tensor), name
    ha = pd.DataFrame(a["history"]["rows"])[DETERMINISTIC]
    hb = pd.DataFrame(b["history"]["rows"])[DETERMINISTIC]
    pd.testing.assert_frame_equal(ha, hb, check_exact=True)
