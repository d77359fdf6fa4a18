"""Training engine: the full path per model/precision, parity with a hand loop, fp16 skips,
divergence, exact resume after SIGKILL, checkpoint safety, history shape, the CLI verb."""
from __future__ import annotations

import copy
import importlib
import json
import math
import os
import pickle
import random
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
from tiny import TINY, TINY_ARGS, tiny

from tier_utils import cli
from tier_utils.adapter.adapter import adapt
from tier_utils.core.errors import CheckpointError, TrainingDiverged
from tier_utils.core.precision import SlowPrecisionWarning, resolve_precision
from tier_utils.data.datasets import make_loader
from tier_utils.engine.evaluation import evaluate
from tier_utils.engine.schedules import Schedule
from tier_utils.engine.step import StepOutput, TrainStep, make_optimizer
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.models.loading import load_model
from tier_utils.tasks import build_datasets
from tier_utils.training.config import TrainConfig
from tier_utils.training.history import History, TrainResult
from tier_utils.training.loop import train

# The exact history schema: renaming or dropping a column must fail here.
EXPECTED_COLUMNS = ["kind", "step", "epoch", "train_loss", "val_loss", "perplexity", "accuracy", "grad_norm", "lr",
                    "loss_scale", "skipped_steps", "tokens_per_s", "step_time_ms", "max_memory_mb", "gpu_util_pct"]
# Columns that must come out identical from identical computation (the rest are timings).
DETERMINISTIC = ["kind", "step", "epoch", "train_loss", "val_loss", "perplexity", "accuracy", "grad_norm", "lr",
                 "loss_scale", "skipped_steps"]
FAST = dict(batch_size=4, seq_len=16, eval_batches=1, progress=False)


@pytest.fixture(autouse=True)
def _quiet_slow_precision():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPrecisionWarning)
        yield


MODELS = {
    "tiny-gpt": tiny,
    "tiny-encoder": lambda: tiny("tiny-encoder"),
    "hf-gpt2": lambda: load_model("hf:GPT2LMHeadModel", n_layer=1, n_head=2, n_embd=32, vocab_size=256,
                                  n_positions=64),
}


def token_rows(n=80, seq_len=16, seed=1):
    return torch.randint(0, 256, (n, seq_len + 1), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_full_path(name, precision):
    torch.manual_seed(0)
    model = MODELS[name]()
    # On the default device (the GPU where there is one): train() moves the model there, so the
    # "weights changed" check below compares on the CPU.
    before = [p.detach().cpu().clone() for p in model.parameters()]
    result = train(model, precision=precision, max_steps=4, log_every=2, eval_every=2, **FAST)
    h = result.history
    assert list(h.columns) == EXPECTED_COLUMNS
    assert list(h["kind"]) == ["step", "eval", "step", "epoch"]
    assert list(h["step"]) == [2, 2, 4, 4]
    assert result.summary.steps == 4 and result.summary.precision == precision
    assert result.summary.data.startswith("bundled corpus") and result.summary.tokenizer == "bytes"
    assert not result.interrupted
    steps = h[h["kind"] == "step"]
    assert steps["train_loss"].map(math.isfinite).all() and (steps["step_time_ms"] > 0).all()
    evals = h[h["kind"] != "step"]
    assert evals["val_loss"].map(math.isfinite).all() and evals["accuracy"].between(0, 1).all()
    causal = name != "tiny-encoder"
    assert evals["perplexity"].notna().all() == causal
    # fp16 records its loss scale; fp32/bf16 have no scaler.
    assert steps["loss_scale"].notna().all() == (precision == "fp16")
    assert result.model is model and model.training
    assert any(not torch.equal(b, p.detach().cpu()) for b, p in zip(before, model.parameters()))
    assert isinstance(result.table, pd.DataFrame) and "val_loss" in set(result.table["metric"])
    assert len(result.plot().axes) == 4
    assert json.dumps(result.to_json())  # JSON-safe


class Probe(nn.Module):
    """Wraps tiny-gpt: records mode/inference state per forward; can poison one training forward with NaN."""

    task = "causal-lm"

    def __init__(self, nan_at: int | None = None):
        super().__init__()
        self.inner = tiny()
        self.vocab_size, self.max_len = 256, 32
        self.nan_at, self.train_calls, self.calls = nan_at, 0, []

    def forward(self, input_ids, attention_mask=None):
        self.calls.append((self.training, torch.is_inference_mode_enabled()))
        logits = self.inner(input_ids)
        if self.training:
            self.train_calls += 1
            if self.train_calls == self.nan_at:
                logits = logits * float("nan")
        return logits


def test_eval_in_inference_mode_and_model_back_in_train_mode():
    probe = Probe()
    train(probe, precision="fp32", max_steps=3, eval_every=1, log_every=1, **FAST)
    assert probe.training
    training = [c for c in probe.calls if c[0]]
    evaluating = [c for c in probe.calls if not c[0]]
    assert len(training) == 3 and all(not inf for _, inf in training)
    # 3 evaluations, the base's before the first step (compare_base), plus train()'s one up-front forward that checks
    # the model runs at all
    assert len(evaluating) == 3 + 1 + 1 and all(inf for _, inf in evaluating)


def test_fp32_equals_hand_written_loop():
    torch.manual_seed(0)
    model = tiny()
    twin = copy.deepcopy(model)
    data, seed, steps, accum, b = token_rows(n=40), 3, 7, 2, 4
    # The hand loop runs on the CPU and is compared at 1e-6, so train() is pinned there too: a GPU's
    # kernels (TF32, other reduction orders) would differ by more than that for a legitimate reason.
    result = train(model, data, precision="fp32", device="cpu", max_steps=steps, grad_accum_steps=accum, seed=seed,
                   log_every=1, eval_every=0, warmup_steps=2, lr=1e-3, **{**FAST, "batch_size": b})

    # The hand loop: AdamW (decay on matrices), warm-up + cosine, clip 1.0, order = randperm(seed + epoch).
    train_ds = build_datasets(data, task="causal-lm", seq_len=16, seed=seed).train
    decay = [p for p in twin.parameters() if p.dim() >= 2]
    no_decay = [p for p in twin.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-3)
    sched = Schedule(warmup_steps=2).scheduler(opt, steps)
    per_epoch = len(train_ds) // b // accum
    losses = []
    for step in range(steps):
        epoch, pos = divmod(step, per_epoch)
        order = torch.randperm(len(train_ds), generator=torch.Generator().manual_seed(seed + epoch)).tolist()
        opt.zero_grad()
        total = 0.0
        for m in range(accum):
            idx = order[(pos * accum + m) * b:(pos * accum + m + 1) * b]
            batch = torch.utils.data.default_collate([train_ds[i] for i in idx])
            logits = twin(batch["input_ids"])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 256), batch["labels"].reshape(-1))
            (loss / accum).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(total / accum)

    got = result.history.query("kind == 'step'")["train_loss"].tolist()
    assert len(got) == steps and per_epoch < steps  # the run crossed an epoch boundary
    assert got == pytest.approx(losses, abs=1e-6)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])  # GradScaler("cpu") and GradScaler("cuda")
def test_fp16_inf_gradient_is_skipped_and_schedule_waits(device):
    model = tiny()
    backward_calls = []

    def poison(grad):
        backward_calls.append(1)
        return grad * float("inf") if len(backward_calls) == 3 else grad

    model.head.weight.register_hook(poison)
    result = train(model, precision="fp16", device=device, max_steps=6, log_every=1, eval_every=0, warmup_steps=2,
                   **FAST)
    assert result.summary.device.startswith(device)
    assert result.skipped_steps == 1 and result.summary.skipped_steps == 1
    (step, before, after), = [t for t in result.loss_scale_trace if t[2] < t[1]]
    assert step == 3 and after == before / 2
    rows = result.history.query("kind == 'step'").set_index("step")
    assert rows.loc[3, "skipped_steps"] == 1 and rows["skipped_steps"].sum() == 1
    assert rows.loc[3, "loss_scale"] == after
    lr = rows["lr"].tolist()
    assert lr[3] == lr[2]  # step 4 ran at step 3's LR: the skipped step did not advance the schedule
    assert all(a != b for i, (a, b) in enumerate(zip(lr, lr[1:])) if i != 2)


def test_fp16_loss_scale_collapse_raises_instead_of_a_nan_success():
    # Every gradient overflows: each step is skipped and the scale halves, 65536 -> 0.5 at step 17.
    model = tiny()
    model.head.weight.register_hook(lambda grad: grad * float("inf"))
    with pytest.raises(TrainingDiverged) as info:
        train(model, precision="fp16", max_steps=30, log_every=5, eval_every=0, **FAST)
    exc = info.value
    assert exc.step == 17 and exc.quantity == "loss scale" and exc.value == 0.5
    assert "loss scale became 0.5 at step 17 in fp16" in str(exc)
    # every step was skipped: the scaler's overflow is the cause, not the learning rate (issue 50)
    assert "likeliest cause: fp16's GradScaler skipped every step (17 of 17)" in str(exc)
    partial = exc.result
    assert partial.summary.diverged_at_step == 17 and partial.skipped_steps == 16
    assert partial.history.query("kind == 'step'")["skipped_steps"].sum() == 16


def test_track_scale_false_reads_no_loss_scale(monkeypatch):
    torch.manual_seed(0)
    adapter = adapt(tiny())
    prec = resolve_precision("fp16", "cpu", warn=False)
    batch = adapter.example_batch(2, 16)
    reads = []
    real = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: reads.append(1) or real(self))

    tracked = TrainStep(adapter, prec, make_optimizer(adapter.model, 1e-3, 0.1))([batch])
    assert len(reads) == 2 and tracked.skipped is False and tracked.scale_after == 65536.0
    reads.clear()
    before = [p.detach().clone() for p in adapter.model.parameters()]
    out = TrainStep(adapter, prec, make_optimizer(adapter.model, 1e-3, 0.1), track_scale=False)([batch])
    assert reads == [] and (out.skipped, out.scale_before, out.scale_after) == (None, None, None)
    assert any(not torch.equal(b, p) for b, p in zip(before, adapter.model.parameters()))  # it still stepped
    opt = make_optimizer(adapter.model, 1e-3, 0.1)
    with pytest.raises(ValueError, match="track_scale=False cannot hold a scheduler back"):
        TrainStep(adapter, prec, opt, Schedule(warmup_steps=0).scheduler(opt, 10), track_scale=False)


def test_evaluate_scores_every_target_and_restores_train_mode():
    torch.manual_seed(0)
    adapter = adapt(tiny())
    ds = build_datasets(token_rows(n=20), task="causal-lm", seq_len=16).train
    loader = make_loader(ds, 4, shuffle=False)
    got = evaluate(adapter, loader, resolve_precision("fp32", "cpu"), max_batches=2)
    assert adapter.model.training and got["targets"] == 2 * 4 * 16
    batches = [b for _, b in zip(range(2), loader)]
    with torch.no_grad():
        logits = torch.cat([adapter.model.eval()(b["input_ids"]) for b in batches])
    adapter.model.train()
    labels = torch.cat([b["labels"] for b in batches])
    want = nn.functional.cross_entropy(logits.reshape(-1, 256), labels.reshape(-1)).item()
    assert got["val_loss"] == pytest.approx(want, rel=1e-5) and got["perplexity"] == pytest.approx(math.exp(want))
    assert got["accuracy"] == pytest.approx((logits.argmax(-1) == labels).float().mean().item())


def test_max_memory_is_the_peak_of_each_row_not_of_the_process(monkeypatch):
    # CUDA's peak counter simulated on the CPU: "peak" is the high-water mark, a reset drops it to "now".
    mem = {"peak": 900.0, "now": 100.0, "resets": 0}

    def reset(device=None):
        mem["peak"] = mem["now"]
        mem["resets"] += 1

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: mem["peak"] * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "utilization", lambda device=None: 50)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    hist = History(torch.device("cuda"))
    assert mem["resets"] == 1 and mem["peak"] == 100  # the 900 from before the run is gone

    def step(n, peak):
        mem["peak"] = max(mem["peak"], peak)
        hist.record(n, StepOutput(torch.tensor(1.0), torch.tensor(1.0), None, None, None), 1e-3, 10)

    step(1, 300)
    hist.sync()
    first = hist.emit(1, 0.5)
    step(2, 200)
    hist.close_training_peak()  # what _evaluate does before evaluating
    mem["peak"] = max(mem["peak"], 500)  # the evaluation's own peak
    ev = hist.eval_row(2, 1.0, {"val_loss": 1.0}, 1e-3)
    hist.sync()
    second = hist.emit(2, 1.0)
    epoch = hist.epoch_row(2, 1.0, {"val_loss": 1.0})
    # Each row: its own window. The evaluation's 500 is its row's and its epoch's, not the step row's.
    assert (first["max_memory_mb"], ev["max_memory_mb"], second["max_memory_mb"]) == (300, 500, 200)
    assert epoch["max_memory_mb"] == 500 and first["gpu_util_pct"] == 50


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_max_memory_excludes_allocations_before_the_run():
    dev = torch.device("cuda")
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # 256 MiB peak before train()
    del big
    result = train(tiny(), precision="fp32", device="cuda", max_steps=2, log_every=1, eval_every=0, **FAST)
    peaks = result.history["max_memory_mb"]
    assert peaks.notna().all() and (peaks < 128).all()


def test_bf16_nan_loss_raises_at_its_step_and_keeps_last_good_checkpoint(tmp_path):
    probe = Probe(nan_at=5)
    with pytest.raises(TrainingDiverged) as info:
        train(probe, precision="bf16", max_steps=10, checkpoint_dir=tmp_path, checkpoint_every=2,
              log_every=10, eval_every=0, **FAST)
    exc = info.value
    assert exc.step == 5 and exc.precision == "bf16" and math.isnan(exc.value)
    assert exc.quantity == "loss" and "loss became nan at step 5 in bf16" in str(exc)
    partial = exc.result
    assert isinstance(partial, TrainResult) and partial.summary.diverged_at_step == 5
    assert partial.history["step"].max() == 4 and partial.history["train_loss"].dropna().map(math.isfinite).all()
    state = load_checkpoint(tmp_path / "last.pt")
    assert state["step"] == 4
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_history_is_bounded(monkeypatch):
    train_module = importlib.import_module("tier_utils.training.parts")
    monkeypatch.setattr(train_module, "MAX_STEP_ROWS", 4)
    result = train(tiny(), precision="fp32", max_steps=20, log_every=1, eval_every=0, **FAST)
    steps = result.history.query("kind == 'step'")
    assert len(steps) == 4 and steps["step"].tolist() == [5, 10, 15, 20]
    assert len(result.history.query("kind == 'epoch'")) == 1


def test_on_eval_sees_metrics_and_its_exceptions_propagate():
    seen = []

    class Prune(Exception):
        pass

    def on_eval(step, metrics):
        seen.append((step, metrics))
        if step == 4:
            raise Prune

    with pytest.raises(Prune):
        train(tiny(), precision="fp32", max_steps=8, eval_every=2, **FAST, on_eval=on_eval)
    assert [s for s, _ in seen] == [2, 4]
    assert all(math.isfinite(m["val_loss"]) and 0 <= m["accuracy"] <= 1 for _, m in seen)


def test_ctrl_c_returns_partial_result_marked_interrupted():
    def interrupt(step, metrics):
        if step == 3:
            raise KeyboardInterrupt

    model = tiny()
    result = train(model, precision="fp32", max_steps=8, eval_every=3, log_every=1, **FAST, on_eval=interrupt)
    assert result.interrupted and result.summary.interrupted
    assert result.summary.steps == 3 and result.history["step"].max() == 3
    assert model.training


def test_config_validation_messages():
    with pytest.raises(ValueError, match="unknown training setting.*batch_sise.*valid: precision, batch_size"):
        train(tiny(), batch_sise=4)
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        TrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="lr must be a number > 0"):
        TrainConfig(lr=0)
    with pytest.raises(ValueError, match="resume=True needs checkpoint_dir"):
        TrainConfig(resume=True)
    with pytest.raises(ValueError, match="unknown precision"):
        TrainConfig(precision="fp8")


_KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, torch
    from tier_utils.models.loading import load_model
    from tier_utils.engine.step import TrainStep
    from tier_utils.training.loop import train

    ckpt_dir, kill_at = sys.argv[1], int(sys.argv[2])
    real_call = TrainStep.__call__
    calls = [0]

    def call(self, micro):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-run, no cleanup
        return real_call(self, micro)

    TrainStep.__call__ = call
    data = torch.randint(0, 256, (80, 17), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    model = load_model("tiny-gpt", d_model=32, n_layer=1, n_head=2, max_len=32, dropout=0.1)
    train(model, data, **CONFIG, checkpoint_dir=ckpt_dir, resume=True)
""")
# 9 steps per epoch, so the 14 steps cross an epoch; dropout makes the RNG state matter.
RESUME_CONFIG = dict(precision="fp32", batch_size=8, seq_len=16, max_steps=14, checkpoint_every=2,
                     log_every=3, eval_every=4, eval_batches=1, deterministic=True, progress=False, seed=5)


def killed_and_resumed_vs_whole(tmp_path, config):
    """SIGKILL a run at a random step, resume it to the end, and run the same config uninterrupted."""
    kill_at = random.Random().randint(2, 13)
    script = tmp_path / "run.py"
    script.write_text(_KILL_SCRIPT.replace("**CONFIG", f"**{config!r}"))
    ckpt = tmp_path / "ckpt"
    # The thread count changes the last bits, and a fresh process picks its own from the load: this one's.
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    killed = subprocess.run([sys.executable, str(script), str(ckpt), str(kill_at)], capture_output=True, text=True,
                            env=env)
    assert killed.returncode == -9, (kill_at, killed.stderr[-2000:])
    resumed = subprocess.run([sys.executable, str(script), str(ckpt), "0"], capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    model = tiny(seed=0, dropout=0.1)  # same construction as the script
    whole = train(model, token_rows(), **config, checkpoint_dir=tmp_path / "whole")
    final = load_checkpoint(ckpt / "last.pt")
    assert final["step"] == 14, kill_at
    assert final["model"].keys() == whole.model.state_dict().keys()
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(final["model"][name], tensor.cpu()), (kill_at, name)
    resumed_history = pd.DataFrame(final["history"]["rows"], columns=EXPECTED_COLUMNS)
    pd.testing.assert_frame_equal(resumed_history[DETERMINISTIC], whole.history[DETERMINISTIC], check_exact=True)


@pytest.mark.slow  # two training processes (killed, then resumed) beside a whole run
def test_sigkill_at_random_step_then_resume_is_bitwise_equal(tmp_path):
    # Pinned to the CPU, where bitwise resume is the promise on any machine; the CUDA test follows.
    killed_and_resumed_vs_whole(tmp_path, {**RESUME_CONFIG, "device": "cpu"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_sigkill_then_resume_is_bitwise_equal_with_deterministic(tmp_path, precision):
    # deterministic=True on CUDA: deterministic kernels, CUBLAS_WORKSPACE_CONFIG and math attention.
    killed_and_resumed_vs_whole(tmp_path, {**RESUME_CONFIG, "device": "cuda", "precision": precision})


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))  # runs on unpickling


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_malicious_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    for i, write in enumerate((lambda f, obj: torch.save(obj, f), lambda f, obj: f.write_bytes(pickle.dumps(obj)))):
        ckpt_dir = tmp_path / f"run{i}"
        ckpt_dir.mkdir()
        write(ckpt_dir / "last.pt", {"format": 1, "step": 1, "payload": _Payload(marker)})
        with pytest.raises(CheckpointError, match="refused to load"):
            train(tiny(), checkpoint_dir=ckpt_dir, resume=True, max_steps=1, **FAST)
        assert not marker.exists()
    # The payload is real: an unrestricted unpickle would have run it.
    torch.load(tmp_path / "run0" / "last.pt", weights_only=False)
    assert marker.exists()


def test_resume_refuses_a_checkpoint_from_different_settings(tmp_path):
    train(tiny(), precision="fp32", max_steps=2, checkpoint_dir=tmp_path, eval_every=0, **FAST)
    with pytest.raises(CheckpointError) as info:
        train(tiny(), precision="bf16", max_steps=2, checkpoint_dir=tmp_path, resume=True, lr=1e-3,
              memory="adamw8bit" if importlib.util.find_spec("bitsandbytes") else None, **FAST)
    # Issue 50: the saved settings beside this run's, the memory settings in words rather than a raw dict.
    message = str(info.value)
    assert "is from a run with lr=0.0003 (this run: 0.001), " in message
    assert "precision='fp32' (this run: 'bf16')" in message and "{" not in message
    if importlib.util.find_spec("bitsandbytes"):
        assert "memory='full fine-tune, AdamW' (this run: 'full fine-tune, AdamW8bit')" in message


def test_resume_refuses_a_checkpoint_from_different_data(tmp_path):
    run = dict(precision="fp32", max_steps=2, checkpoint_dir=tmp_path, eval_every=0, **FAST)
    train(tiny(), token_rows(seed=1), **run)
    for other in (token_rows(seed=2), token_rows(n=100, seed=1)):  # same size other content; more rows
        with pytest.raises(CheckpointError, match="was trained on tensors data .* resume with the same data"):
            train(tiny(), other, resume=True, **run)
    assert train(tiny(), token_rows(seed=1), resume=True, **run).summary.resumed_from_step == 2


def _cli(tmp_path, *extra):
    return cli.main(["train", "--model", "tiny-gpt", *TINY_ARGS, "--precision", "fp32", "--batch-size", "4",
                     "--seq-len", "16", "--eval-batches", "1", "--no-progress", *extra])


def test_cli_train_writes_files_and_resumes(tmp_path, capsys):
    out = tmp_path / "out"
    assert _cli(tmp_path, "--max-steps", "3", "--out", str(out), "--json", str(tmp_path / "s.json")) == 0
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.csv", "regressed.csv", "training.png",
                                                     "versus_base.csv"]  # the fine-tune against its base
    assert (out / "checkpoints" / "last.pt").is_file()
    assert list(pd.read_csv(out / "metrics.csv").columns) == EXPECTED_COLUMNS
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["steps"] == 3 and summary["precision"] == "fp32" and summary["world_size"] == 1
    assert "trained TinyGPT" in capsys.readouterr().out
    # --resume on a finished run: nothing left to do, same final loss.
    assert _cli(tmp_path, "--max-steps", "3", "--out", str(out), "--resume", "--json", str(tmp_path / "r.json")) == 0
    again = json.loads((tmp_path / "r.json").read_text())
    assert again["resumed_from_step"] == 3 and again["val_loss"] == summary["val_loss"]


def test_cli_train_bad_input_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert _cli(tmp_path, "--max-steps", "2", "--lr", "-1", "--out", str(out)) == 2
    assert "lr must be a number > 0" in capsys.readouterr().err
    assert _cli(tmp_path, "--max-steps", "2", "--data", str(tmp_path / "missing.txt"), "--out", str(out)) == 2
    assert "not found" in capsys.readouterr().err
    assert not out.exists()
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert _cli(tmp_path, "--max-steps", "2", "--out", str(afile)) == 2
    with pytest.raises(SystemExit) as exit_info:
        _cli(tmp_path, "--epochs", "2", "--max-steps", "2", "--out", str(out))
    assert exit_info.value.code == 2 and not out.exists()


def test_summary_names_how_many_targets_validation_scored():
    torch.manual_seed(0)
    result = train(MODELS["tiny-gpt"](), precision="fp32", max_steps=2, eval_every=0, **FAST)
    cfg = result.config
    assert result.summary.val_targets == cfg.eval_batches * cfg.batch_size * cfg.seq_len


def test_model_kwargs_build_the_model_and_a_decided_precision_is_kept():
    prec = resolve_precision("auto", "cpu")  # its reason says auto; deciding "fp32" again would not
    result = train("tiny-gpt", precision=prec, device=torch.device("cpu"), max_steps=1, eval_every=0, **FAST,
                   model_kwargs=TINY)
    assert result.summary.parameters == sum(p.numel() for p in tiny().parameters())
    assert result.summary.precision_reason == prec.reason and result.summary.precision_reason.startswith("auto: ")
    assert result.config.precision is prec and result.config.to_dict()["precision"] == prec.name
    assert result.to_json()["config"]["device"] == "cpu"


def test_a_model_keyword_among_the_settings_is_refused_by_name():
    """Settings and the model's arguments travel apart: a model argument given as a setting is a typo to name,
    not something to pass on to the model."""
    with pytest.raises(ValueError, match="unknown training setting.s. d_model; valid: precision, batch_size"):
        train("tiny-gpt", max_steps=1, d_model=32)


@pytest.mark.parametrize("bad", [np.int64(4), 4.0, True])
def test_sizes_must_be_python_ints_with_a_clear_message(bad):
    with pytest.raises(ValueError, match="batch_size must be a whole number >= 1"):
        train(MODELS["tiny-gpt"](), batch_size=bad, max_steps=1, **{k: v for k, v in FAST.items() if k != "batch_size"})
