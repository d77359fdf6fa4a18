"""The benchmark run's log of outcomes: what was skipped or stopped, at which step and why, appended as it happens
and never edited; the records' `ran`/`stopped` and the SKIP rows' detail are read from it."""
import dataclasses

import pytest
import torch
from tiny import TINY, tiny

from tier_utils.benchmark import amp as bench
from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.benchmark.record import Outcome, OutcomeLog, Plan
from tier_utils.core.precision import resolve_precision
from tier_utils.models.builtins import TinyGPT

RUN = dict(batch_size=4, seq_len=16, untimed_steps=1, timed_steps=2, repeats=2, accuracy_steps=2, eval_batches=1,
           progress=False, device="cpu")


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in test_bench.py: two threads on a shared CPU spin-wait on each other
    yield
    torch.set_num_threads(threads)


def _nan_in(name: str, original):
    """timed_repeat, with `name`'s losses NaN: a precision that goes non-finite during the timed steps."""
    def timed(adapter, prec, start, batches, cfg, bar, step_adapter=None):
        ms, losses = original(adapter, prec, start, batches, cfg, bar, step_adapter)
        return ms, torch.full_like(losses, float("nan")) if prec.name == name else losses
    return timed


def _rec(result, name):
    return next(r for r in result.records if r.precision == name)


def test_a_skipped_precision_and_a_stopped_one_are_in_the_log_with_the_step_and_why(monkeypatch):
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")  # bf16 native, fp16 not: whatever runs the test
    monkeypatch.setattr(bench, "timed_repeat", _nan_in("bf16", bench.timed_repeat))
    result = amp_benchmark(tiny(seed=0), precisions=("fp32", "bf16", "fp16"), **RUN)
    skipped, stopped = result.outcomes
    assert (skipped.precision, skipped.mode, skipped.step, skipped.status) == ("fp16", "eager", "plan", "skipped")
    assert skipped.why.startswith("not native: ") and "force=True" in skipped.why
    assert (stopped.precision, stopped.step, stopped.status) == ("bf16", "time", "stopped")
    assert stopped.why == "bf16 loss is nan during the timed steps"
    # What the result says is read from the log.
    assert not _rec(result, "fp16").ran and _rec(result, "fp16").stopped is None
    assert _rec(result, "bf16").ran and _rec(result, "bf16").stopped == stopped.why
    assert _rec(result, "fp32").speed is not None and _rec(result, "fp32").accuracy is not None
    v = result.verdicts
    assert (v[v.precision == "fp16"].detail == skipped.why).all()
    assert v[v.precision == "bf16"].detail.str.contains("loss is nan").any()
    with pytest.raises(dataclasses.FrozenInstanceError):
        skipped.why = "edited"


def test_a_precision_the_cpu_cant_run_is_skipped_at_the_plan_step(monkeypatch):
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "")  # no native bf16 on this pretend CPU
    result = amp_benchmark(tiny(seed=0), precisions=("fp32", "bf16-true"), **{**RUN, "accuracy_steps": 0})
    (skipped,) = result.outcomes
    assert (skipped.precision, skipped.step, skipped.status) == ("bf16-true", "plan", "skipped")
    assert "not native" in skipped.why


def test_a_stopped_baseline_stops_every_precision_with_its_reason(monkeypatch):
    monkeypatch.setattr(bench, "timed_repeat", _nan_in("fp32", bench.timed_repeat))
    result = amp_benchmark(tiny(seed=0), precisions=("fp32", "bf16"), force=True, **RUN)
    why = "fp32 loss is nan during the timed steps"
    assert [(o.precision, o.step, o.status, o.why) for o in result.outcomes] == [
        ("fp32", "time", "stopped", why), ("bf16", "time", "stopped", why)]
    assert _rec(result, "bf16").stopped == why and _rec(result, "bf16").accuracy is None


class OOMUnderAutocast(TinyGPT):
    """A pretend GPU with room for fp32 only: bf16 runs out of memory at the benchmark's batch."""

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        if torch.is_autocast_enabled("cpu") and input_ids.size(0) >= 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return super().forward(input_ids, attention_mask, inputs_embeds)


def test_out_of_memory_is_a_skip_at_the_step_it_happened_in():
    result = amp_benchmark(OOMUnderAutocast(**TINY), precisions=("fp32", "bf16"), force=True, **RUN)
    (oom,) = result.outcomes
    assert (oom.precision, oom.step, oom.status) == ("bf16", "memory", "skipped")
    assert oom.why.startswith("B=4, T=16 ran out of memory on cpu") and "CUDA out of memory" in oom.why
    assert not _rec(result, "bf16").ran
    assert (result.verdicts.query("precision == 'bf16'").detail == oom.why).all()


def test_the_log_only_grows_and_its_last_word_decides():
    log = OutcomeLog()
    p = Plan("bf16", "eager", resolve_precision("bf16", "cpu", warn=False), None)
    assert log.runs(p) and log.skip_reason(p) is None and log.stopped(p) is None
    log.stop(p, "memory", "bf16 loss is nan on the second batch")
    log.skip(p, "time", "out of memory")
    log.skip(p, "accuracy", "fp32, the baseline, out of memory")
    assert not log.runs(p) and log.skip_reason(p) == "fp32, the baseline, out of memory"
    assert log.stopped(p) == "bf16 loss is nan on the second batch"
    assert log.outcomes[0] == Outcome("bf16", "eager", "memory", "stopped", "bf16 loss is nan on the second batch")
    assert isinstance(log.outcomes, tuple) and len(log.outcomes) == 3
