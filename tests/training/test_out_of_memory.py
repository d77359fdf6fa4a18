"""Out of memory in training is an answer: one line with what fits (the planner's prediction), exit 2, the last
checkpoint intact and named for --resume, and the memory and frames released so a retry runs in the same process
(and the same notebook kernel). The error is injected: a model whose forward raises torch.cuda.OutOfMemoryError at
a chosen training step (torch raises it on a CPU as well), under TIER_UTILS_FREE_MEMORY so the prediction has a
budget to answer from, and TIER_UTILS_CPU_FLAGS so which modes run natively does not depend on this CPU."""
import json
import re
import subprocess
import sys
import textwrap

import nbformat
import optuna
import pytest
import torch
from nbclient import NotebookClient

from tier_utils import TinyGPT, mainjob, search, train
from tier_utils.adapter.adapter import adapt
from tier_utils.core.budget import read_budget
from tier_utils.core.errors import TrainingOutOfMemory
from tier_utils.core.memory_settings import MemorySettings
from tier_utils.mainjob import _attempt, run_all
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.planning.planner import device_room, plan

SIZE = dict(d_model=32, n_layer=2, n_head=2, max_len=32)  # two blocks: checkpointing has something to save
RUN = dict(batch_size=8, seq_len=32, max_steps=6, eval_every=0, eval_batches=1, precision="fp32", progress=False)

# The model the tests inject with, as a file (the CLI and the notebook load it) and imported here.
OOM_MODEL = textwrap.dedent('''
    import weakref

    import torch

    from tier_utils import TinyGPT


    class OomAt(TinyGPT):
        """Raises CUDA's out-of-memory error in its `fail_at`-th training forward of a batch of `at_batch` or more
        (the planner's probes, at batch 1 and 2, and evaluation run as usual). `made` is a weakref to a tensor
        the failing forward made: it must be dead once the error has been answered."""

        made = None

        def __init__(self, fail_at: int = 3, at_batch: int = 8, **sizes):
            super().__init__(**sizes)
            self.fail_at, self.at_batch, self.calls = fail_at, at_batch, 0

        def forward(self, input_ids=None, **kwargs):
            if torch.is_grad_enabled() and self.training and input_ids.shape[0] >= self.at_batch:
                self.calls += 1
                if self.calls == self.fail_at:
                    held = torch.ones(256, 1024)
                    type(self).made = weakref.ref(held)
                    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            return super().forward(input_ids, **kwargs)
''')


@pytest.fixture
def oom_file(tmp_path):
    path = tmp_path / "oom_model.py"
    path.write_text(OOM_MODEL)
    return path


@pytest.fixture
def oom_class(oom_file):
    namespace = {}
    exec(compile(OOM_MODEL, str(oom_file), "exec"), namespace)
    return namespace["OomAt"]


def budget_for(mode: str, batch: int) -> int:
    """A TIER_UTILS_FREE_MEMORY under which `mode` just fits `batch` (a CPU's room is half the free memory)."""
    configs, _ = plan(adapt(TinyGPT(**SIZE)), ["fp32"], RUN["seq_len"], checkpointing=True)
    return 2 * next(c for c in configs if c.name == mode).step_bytes(batch, RUN["seq_len"]) + 64


@pytest.fixture
def budget(monkeypatch):
    """fp32 + checkpointing fits batch 8, plain fp32 does not; no CPU flags: bf16 and fp16 are emulated here."""
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "")
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(budget_for("fp32 + checkpointing", RUN["batch_size"])))
    configs, _ = plan(adapt(TinyGPT(**SIZE)), ["fp32"], RUN["seq_len"])
    largest = configs[0].largest_batch(RUN["seq_len"], device_room(read_budget("cpu")))
    assert 1 <= largest < RUN["batch_size"]
    return largest


def test_out_of_memory_is_one_line_with_what_fits_the_checkpoint_and_the_memory_back(oom_class, budget, tmp_path):
    model = oom_class(fail_at=3, **SIZE)
    with pytest.raises(TrainingOutOfMemory) as caught:
        train(model, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1, **RUN)
    error = caught.value
    line = str(error)
    assert "\n" not in line and error.exit_code == 2
    assert line.startswith("out of memory after 2 of 6 steps at B=8, T=32, fp32, full fine-tune, AdamW on ")
    assert "TIER_UTILS_FREE_MEMORY" in line
    assert f"fp32 up to B={budget};" in line  # the planner's largest batch in the mode that ran out
    assert "at B=8 the cheapest mode that fits is fp32 + checkpointing;" in line
    # The last checkpoint is whole, and a resume with checkpointing on keeps the run's trajectory.
    assert f"{tmp_path / 'ckpt' / 'last.pt'} is intact at step 2: --resume --checkpointing (resume=True, the " \
           "memory settings with checkpointing=True) continues from step 2" in line
    assert load_checkpoint(tmp_path / "ckpt" / "last.pt")["step"] == 2
    # Frames released: nothing holds the failing forward's tensors, nor the error's cause.
    assert error.__cause__ is None and error.__context__ is None and error.__suppress_context__
    assert oom_class.made is not None and oom_class.made() is None
    # A retry at the batch that fits runs in the same process, on the same module.
    again = train(model, **{**RUN, "batch_size": budget})
    assert again.summary.steps == RUN["max_steps"]
    # ... and the checkpointed run resumes from the step the line named, with checkpointing on.
    resumed = train(model, checkpoint_dir=tmp_path / "ckpt", resume=True,
                    memory=MemorySettings(checkpointing=True), **RUN)
    assert resumed.summary.resumed_from_step == 2 and resumed.summary.steps == RUN["max_steps"]


def test_out_of_memory_before_any_checkpoint_says_a_rerun_starts_over(oom_class, budget, tmp_path):
    with pytest.raises(TrainingOutOfMemory, match="after 0 of 6 steps .* no checkpoint was written before it"):
        train(oom_class(fail_at=1, **SIZE), checkpoint_dir=tmp_path / "ckpt", **RUN)
    assert not (tmp_path / "ckpt" / "last.pt").exists()


def test_cli_train_out_of_memory_exits_2_with_one_line(oom_file, budget, tmp_path):
    out = tmp_path / "run"
    args = [a for k, v in SIZE.items() for a in ("--model-arg", f"{k}={v}")]
    proc = subprocess.run([sys.executable, "-m", "tier_utils", "train", "--model", f"{oom_file}:OomAt", *args,
                           "--batch-size", "8", "--seq-len", "32", "--max-steps", "6", "--eval-every", "0",
                           "--checkpoint-every", "1", "--precision", "fp32", "--no-progress", "--out", str(out),
                           "--json", str(tmp_path / "train.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert f"fp32 up to B={budget};" in errors[0] and "cheapest mode that fits is fp32 + checkpointing" in errors[0]
    assert "is intact at step 2: --resume --checkpointing (" in errors[0]
    assert load_checkpoint(out / "checkpoints" / "last.pt")["step"] == 2
    assert not (tmp_path / "train.json").exists()  # no result to write: the one line is the answer


def test_out_of_memory_in_a_notebook_cell_is_one_line_and_the_next_cell_retries(oom_file, budget):
    setup = f"""
        import os, sys
        os.environ["TIER_UTILS_CPU_FLAGS"] = ""
        os.environ["TIER_UTILS_FREE_MEMORY"] = "{budget_for('fp32 + checkpointing', 8)}"
        exec(open({str(oom_file)!r}).read())
        import tier_utils
        model = OomAt(fail_at=3, **{SIZE!r})
        run = {RUN!r}
    """
    retry = f"""
        print("made alive:", OomAt.made is None or OomAt.made() is not None)
        result = tier_utils.train(model, **{{**run, "batch_size": {budget}}})
        print("steps:", result.summary.steps)
    """
    cells = [textwrap.dedent(setup), "tier_utils.train(model, **run)", textwrap.dedent(retry)]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True).execute()
    (error,) = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert error.ename == "TrainingOutOfMemory" and len(error.traceback) == 1, error.traceback
    assert f"fp32 up to B={budget};" in error.traceback[0] and "tier_utils.debug()" in error.traceback[0]
    printed = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert "made alive: False" in printed and f"steps: {RUN['max_steps']}" in printed, nb.cells[2].outputs


def test_a_search_trial_out_of_memory_is_failed_with_its_line_and_the_study_goes_on(oom_class, budget, caplog):
    model = oom_class(fail_at=1, at_batch=16, **SIZE)  # every trial's copy runs out at batch 16, not at 8
    fast = {**RUN, "max_steps": 4, "eval_every": 2}
    # Optuna's own handler keeps the stderr of the test that first logged (under xdist, another test's capture):
    # read its records through propagation instead.
    optuna.logging.enable_propagation()
    try:
        result = search(model, space={"batch_size": ("choice", [8, 16])}, n_trials=2,
                        start_with=[{"batch_size": 16}, {"batch_size": 8}], **fast)
    finally:
        optuna.logging.disable_propagation()
    table = result.table.sort_values("trial")
    assert list(table.state) == ["FAIL", "COMPLETE"]
    assert table.iloc[0].out_of_memory.startswith("out of memory after 0 of 4 steps at B=16")
    most = re.search(r"no mode fits B=16; the most is B=(\d+) in ", table.iloc[0].out_of_memory)
    assert most and 8 <= int(most.group(1)) < 16  # fp32 + checkpointing fits 8: some mode fits at least that
    assert f"fp32 up to B={budget};" in table.iloc[0].out_of_memory and result.best_config.batch_size == 8
    logged = caplog.text
    warned = [line for line in logged.splitlines() if "Trial 0 failed" in line]
    assert warned and "TrainingOutOfMemory('out of memory" in warned[0] and "Traceback" not in logged
    assert json.dumps(result.to_json()["trials"])  # the line goes to --json with the trial


def test_all_records_training_out_of_memory_as_its_train_row_and_goes_on(oom_class, budget, tmp_path, monkeypatch):
    from test_mainjob import TINY_SIZES
    from test_report import Fake

    monkeypatch.setattr(mainjob, "FAST", TINY_SIZES)  # training at batch 4
    for tier in ("smoke", "analyze", "amp_benchmark"):  # only training and what follows it matter here
        monkeypatch.setattr(mainjob, tier, lambda *a, **k: Fake(["PASS"]))
    result = run_all(oom_class(fail_at=2, at_batch=4, **SIZE), tmp_path, fast=True, progress=False,
                     precision="fp32")
    assert result.statuses["train"] == "FAIL" and {"fit", "ranks"} <= set(result.statuses)
    error = result.results["train"].error
    assert error.startswith("TrainingOutOfMemory: out of memory after 1 of 4 steps at B=4, T=16, fp32")
    assert re.search(r"fp32 up to B=\d+", error) and "cheapest mode that fits" in error


def test_all_records_the_out_of_memory_line_whole_as_the_train_row():
    line = "out of memory after 2 of 6 steps at B=8, T=32 ... " + "x" * 400 + " cheapest mode that fits is fp32"

    def train_step():
        raise TrainingOutOfMemory(line)

    outcome, _ = _attempt("train", train_step)
    assert outcome.status == "FAIL" and outcome.error.endswith("cheapest mode that fits is fp32")
    assert re.search("train raised TrainingOutOfMemory: out of memory", outcome.table.detail.iloc[0])


class _NoRoomForTheWeights(TinyGPT):
    def to(self, *args, **kwargs):  # moving the weights to the device is the first thing to run out
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 12.00 GiB")


def test_out_of_memory_before_the_first_step_says_so_and_points_at_fit():
    with pytest.raises(TrainingOutOfMemory) as caught:
        train(_NoRoomForTheWeights(**SIZE), **RUN)
    assert str(caught.value).startswith("out of memory before the first step at B=8, T=32, fp32, ")
    assert str(caught.value).endswith("; no step ran: fit (tier_utils.fit, python -m tier_utils fit) predicts what "
                                      "fits once memory is free")


def test_a_lora_run_out_of_memory_is_planned_as_lora(oom_class, budget):
    """The model already holds its adapters: the modes the line names are LoRA's, the base frozen."""
    with pytest.raises(TrainingOutOfMemory) as caught:
        train(oom_class(fail_at=2, **SIZE), memory=MemorySettings(lora="r=4", checkpointing=True), **RUN)
    line = str(caught.value)
    assert "LoRA r=4 over a fp32 base, fp32 adapters, AdamW, checkpointing on " in line
    assert re.search(r": LoRA r=4 · fp32 base · fp32 \+ checkpointing up to B=\d+;", line), line
    assert re.search(r"the cheapest mode that fits is LoRA r=4 · ", line), line


class _FullFromStepTwo(TinyGPT):
    """Every training forward from the second on runs out of memory, the prediction's small ones too (as when
    another process has taken the card)."""

    calls = 0

    def forward(self, input_ids=None, **kwargs):
        if torch.is_grad_enabled() and self.training:
            self.calls += 1
            if self.calls >= 3:  # from a training step on (the run's own checks may call it first)
                raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return super().forward(input_ids, **kwargs)


def test_a_prediction_that_runs_out_of_memory_too_is_said_and_the_checkpoint_still_named(budget, tmp_path):
    with pytest.raises(TrainingOutOfMemory) as caught:
        train(_FullFromStepTwo(**SIZE), checkpoint_dir=tmp_path / "ckpt", checkpoint_every=1, **RUN)
    line = str(caught.value)
    assert "; the prediction's small forwards ran out of memory too: fit (tier_utils.fit, python -m tier_utils " \
           "fit) predicts what fits once memory is free; " in line
    after = re.search(r"after (\d+) of 6 steps", line)
    assert after and int(after.group(1)) >= 1, line
    assert f"is intact at step {after.group(1)}: --resume (resume=True) with the same batch and precision " \
           f"continues from step {after.group(1)} " in line


@pytest.mark.slow  # the planner's probes of every mode, ~20 s here
def test_an_encoder_decoder_is_planned_with_its_own_target_length(budget, monkeypatch):
    """A seq2seq run with --target-len 4 at T=32: the answer plans the targets' own length, 4 tokens padded to a
    multiple of 8 as the collator pads them (it planned 32)."""
    from tier_utils.engine.step import TrainStep
    from tier_utils.training import out_of_memory

    planned, real_plan, step = [], out_of_memory.plan, TrainStep.__call__

    def recorded(*args, **kwargs):
        planned.append(kwargs.get("target_len"))
        return real_plan(*args, **kwargs)

    def runs_out(self, batches, *args, **kwargs):
        if len(batches[0]["input_ids"]) == RUN["batch_size"]:  # the run's steps, not the planner's probes
            raise torch.cuda.OutOfMemoryError("CUDA out of memory.")
        return step(self, batches, *args, **kwargs)

    monkeypatch.setattr(out_of_memory, "plan", recorded)
    monkeypatch.setattr(TrainStep, "__call__", runs_out)
    with pytest.raises(TrainingOutOfMemory) as caught:
        train("tiny-seq2seq", model_kwargs=dict(SIZE), target_len=4, **RUN)
    assert planned == [8] and "at B=8, T=32, target 4, fp32" in str(caught.value), str(caught.value)
    assert "target 8 (the longest 4)" in str(caught.value)
