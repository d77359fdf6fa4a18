import copy
import json
import math
import re
import types

import pytest
import torch
import torch.nn as nn
from matplotlib.figure import Figure
from tiny import TINY, TINY_ARGS, tiny

from tier_utils.adapter.adapter import adapt
from tier_utils.benchmark import amp as bench
from tier_utils.benchmark.amp import amp_benchmark, interleave
from tier_utils.benchmark.config import BENCH_RUN_ONLY, BenchConfig
from tier_utils.benchmark.mainjob import batch_size as sizing
from tier_utils.benchmark.mainjob.batch_size import fp32_measure, grow_batch
from tier_utils.benchmark.verdicts import (
    Thresholds,
    accuracy_check,
    launch_bound,
    memory_check,
    parity,
    parity_check,
    reduction,
    skip_checks,
    speed_check,
    speedup,
)
from tier_utils.cli import main
from tier_utils.core.device import GPU_PROFILES
from tier_utils.core.errors import LoggerError, ModelSpecError
from tier_utils.core.measure import SavedTensorMeter, Stats
from tier_utils.core.precision import native_support, resolve_precision
from tier_utils.core.settings import precision_list
from tier_utils.models.builtins import TinyGPT
from tier_utils.tasks import build_datasets

CPU = torch.device("cpu")
BF16_NATIVE = native_support("bf16", CPU)[0]
FP16_NATIVE = native_support("fp16", CPU)[0]
RUN = dict(batch_size=4, seq_len=16, untimed_steps=1, timed_steps=2, repeats=3, accuracy_steps=4, eval_batches=2,
           progress=False, device="cpu")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # On a CPU shared with other jobs, two OpenMP threads spin-wait on each other and a tiny step
    # takes hundreds of ms instead of a few; one thread keeps this file fast and its timings sane.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def default_run():
    """The default precisions (the mixed and the true modes) without force; records the order the timed repeats
    ran in."""
    model = tiny(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    order = []
    original = bench.timed_repeat

    def recording(adapter, prec, start, batches, *args):
        order.append((prec.name, len(batches[0]["input_ids"])))
        return original(adapter, prec, start, batches, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "timed_repeat", recording)
        result = amp_benchmark(model, **RUN)
    return result, model, before, order


@pytest.fixture(scope="module")
def forced_fp16():
    return amp_benchmark(tiny(seed=0), precisions=("fp16",), force=True, **RUN)


def _rec(result, name):
    return next(r for r in result.records if r.precision == name)


# --- full path on CPU -------------------------------------------------------------------------

def test_precisions_run_or_skip_by_native_support(default_run):
    result = default_run[0]
    assert [r.precision for r in result.records] == ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"]
    assert _rec(result, "fp32").ran
    assert _rec(result, "bf16").ran == _rec(result, "bf16-true").ran == BF16_NATIVE
    assert _rec(result, "fp16-true").ran == FP16_NATIVE
    fp16 = _rec(result, "fp16")
    assert fp16.ran == FP16_NATIVE
    if not FP16_NATIVE:
        assert fp16.speed is None and fp16.memory is None and fp16.accuracy is None
        rows = result.verdicts[result.verdicts.precision == "fp16"]
        assert list(rows.status) == ["SKIP"] * 4
        assert all("avx512_fp16" in d and "force=True" in d for d in rows.detail)


def test_repeats_are_interleaved_across_precisions(default_run):
    result, _, _, order = default_run
    ran = [(r.precision, RUN["batch_size"]) for r in result.records if r.ran]
    assert order == (ran + [("fp32", 1)]) * RUN["repeats"]  # the 1-sequence floor step rides along
    assert interleave(["a", "b"], 2) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]


def test_speed_statistics_over_repeats(default_run):
    result = default_run[0]
    for rec in (r for r in result.records if r.ran):
        speed = rec.speed
        assert speed.step_ms.n == RUN["repeats"] == len(speed.samples_ms)
        assert speed.step_ms.q1 <= speed.step_ms.median <= speed.step_ms.q3
        assert speed.timed_steps == RUN["timed_steps"]
        assert rec.mfu["mfu"] == pytest.approx(rec.mfu["achieved_tflops"] / rec.mfu["peak_tflops"])
        assert rec.mfu["probe"]["tflops"]["n"] == bench._PROBE_REPS * RUN["repeats"]
        assert rec.mfu["peak_tflops"] == rec.mfu["probe"]["tflops"]["max"]
    bf16 = _rec(result, "bf16")
    if bf16.ran:
        fp32 = _rec(result, "fp32").speed.step_ms.median
        assert bf16.speed.speedup.median == pytest.approx(fp32 / bf16.speed.step_ms.median)


def test_flops_counted_once_including_cpu_attention(default_run):
    flops = default_run[0].flops
    assert flops["per_step"] == sum(flops["by_op"].values()) > 0
    assert any("scaled_dot_product" in op for op in flops["by_op"])


@pytest.mark.skipif(not BF16_NATIVE, reason="needs a CPU with native bf16")
def test_memory_split_amp_shrinks_activations_not_static(default_run):
    result = default_run[0]
    fp32, bf16 = _rec(result, "fp32").memory, _rec(result, "bf16").memory
    for key in ("weights_bytes", "grads_bytes", "optimizer_state_bytes"):
        assert fp32[key] == bf16[key] > 0  # AMP keeps fp32 master weights, grads and Adam state
    assert fp32["optimizer_state_bytes"] >= 2 * fp32["weights_bytes"]  # exp_avg + exp_avg_sq
    assert bf16["activation_bytes"] < fp32["activation_bytes"]
    assert bf16["reduction"]["activations"] == pytest.approx(1 - bf16["activation_bytes"] / fp32["activation_bytes"])
    assert 0 < bf16["reduction"]["total"] < bf16["reduction"]["activations"]
    assert bf16["peak_allocated_bytes"] is None  # CUDA only


@pytest.mark.skipif(not BF16_NATIVE, reason="needs a CPU with native bf16")
def test_accuracy_runs_share_start_and_batches(default_run):
    result = default_run[0]
    fp32, bf16 = _rec(result, "fp32").accuracy, _rec(result, "bf16").accuracy
    assert len(fp32["loss_curve"]) == len(bf16["loss_curve"]) == RUN["accuracy_steps"]
    # Same weights and batch at step 0: the losses differ only by bf16 rounding.
    assert bf16["loss_curve"][0] == pytest.approx(fp32["loss_curve"][0], rel=1e-2)
    assert bf16["val_accuracy_diff"] == pytest.approx(bf16["val_accuracy"] - fp32["val_accuracy"])
    assert bf16["parity"]["steps"] == RUN["accuracy_steps"]
    assert fp32["parity"]["max_rel_dev"] == 0.0
    assert bf16["loss_scale"] is None and bf16["skipped_steps"] is None


def test_model_weights_restored(default_run):
    _, model, before, _ = default_run
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_forced_fp16_runs_with_cpu_grad_scaler(forced_fp16):
    result = forced_fp16
    assert [r.precision for r in result.records] == ["fp32", "fp16"]  # fp32 added as the baseline
    fp16 = _rec(result, "fp16")
    assert fp16.ran and fp16.forced == (not FP16_NATIVE)
    acc = fp16.accuracy
    assert len(acc["loss_scale"]) == acc["attempts"] == RUN["accuracy_steps"] + acc["skipped_steps"]
    assert acc["steps"] == len(acc["loss_curve"]) == RUN["accuracy_steps"]
    assert acc["loss_scale"][0] == 65536.0  # GradScaler's initial scale
    assert isinstance(acc["skipped_steps"], int) and 0 <= acc["skipped_steps"] <= RUN["accuracy_steps"]
    rows = result.verdicts[result.verdicts.precision == "fp16"]
    assert "SKIP" not in set(rows.status)
    if not FP16_NATIVE:
        assert all("forced" in d for d in rows.detail)


def test_plot_has_the_four_panels(forced_fp16):
    fig = forced_fp16.plot()
    assert isinstance(fig, Figure)
    speed, memory, loss, scale = fig.axes
    assert len(speed.patches) == 2  # one throughput bar per precision
    assert len(memory.patches) == 2 * 4  # weights, grads, optimizer, activations per precision
    assert len(loss.lines) == 2
    assert len(scale.lines) == 1  # fp16's loss scale


_NO_BAR = types.SimpleNamespace(update=lambda n=1: None)


def _fp16_parts():
    adapter = adapt(tiny(seed=0))
    return adapter, resolve_precision("fp16", CPU, warn=False), copy.deepcopy(adapter.model.state_dict())


def test_timed_fp16_steps_read_no_loss_scale(monkeypatch):
    # Reading the scale is a host sync fp32/bf16 don't pay; the accuracy run keeps its trace instead.
    adapter, prec, start = _fp16_parts()
    batches = [adapter.example_batch(4, 16, seed=i) for i in range(3)]
    reads = []
    real = torch.amp.GradScaler.get_scale
    monkeypatch.setattr(torch.amp.GradScaler, "get_scale", lambda self: reads.append(1) or real(self))
    ms, losses = bench.timed_repeat(adapter, prec, start, batches, BenchConfig(untimed_steps=1), _NO_BAR)
    assert len(ms) == 2 and reads == [] and losses.shape == (3,)


def test_fp16_accuracy_run_stops_when_the_loss_scale_collapses():
    adapter, prec, start = _fp16_parts()
    adapter.model.head.weight.register_hook(lambda grad: grad * float("inf"))
    splits = build_datasets(None, adapter.task, 16, adapter.vocab_size)
    cfg = BenchConfig(accuracy_steps=20, batch_size=4, eval_batches=1)
    acc = bench._accuracy_run(adapter, prec, start, splits, cfg, _NO_BAR)
    # Every attempt at the first batch overflows: no update is applied, 17 skips halve the scale below 1.
    assert acc["diverged_at"] == 16 and acc["attempts"] == 17 and acc["skipped_steps"] == 17 and acc["steps"] == 0
    assert acc["diverged_reason"] == "fp16 loss scale fell below 1"
    assert acc["loss_scale"][-1] == 1.0  # the 17th skip takes it to 0.5, below the 1.0 floor


def test_benchmark_leaves_the_callers_rng_and_model_mode_alone():
    model = tiny(seed=0).eval()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    amp_benchmark(model, precisions=("fp32",), **{**RUN, "repeats": 1, "timed_steps": 1, "accuracy_steps": 1,
                                                   "eval_batches": 1})
    assert torch.equal(torch.rand(3), expected) and not model.training


# --- JSON schema: renaming a key must break a test --------------------------------------------

def test_json_schema_exact_keys(forced_fp16):
    doc = forced_fp16.to_json()
    json.dumps(doc, allow_nan=False)
    assert set(doc) == {"schema", "status", "config", "metadata", "flops", "overhead", "precisions", "verdicts",
                         "outcomes"}
    assert doc["outcomes"] == [{"precision": o.precision, "mode": o.mode, "step": o.step, "status": o.status,
                                "why": o.why} for o in forced_fp16.outcomes]
    assert doc["schema"] == "tier_utils.bench/1"
    assert set(doc["config"]) == {"model", "task", "parameters", "data", "source", "tokenizer", "validation",
                                  "train_examples", "val_examples", "precisions", "batch_size", "seq_len",
                                  "tokens_per_step", "untimed_steps", "timed_steps", "repeats", "accuracy_steps",
                                  "eval_batches", "lr", "weight_decay", "grad_clip", "seed", "force", "compile",
                                  "compile_mode", "thresholds", "fit", "activation_checkpointing", "memory",
                                  "lora_detail", "strategy", "memory_rows", "padding", "chat"}
    assert set(doc["config"]["thresholds"]) == {"speedup", "memory_reduction", "memory", "accuracy_diff",
                                                "parity_tolerance", "min_repeats", "max_fixed_share", "min_mfu"}
    assert {"device", "device_name", "torch", "float32_matmul_precision", "load_average_1m",
            "stored_dtype"} <= set(doc["metadata"])
    assert set(doc["flops"]) == {"per_step", "by_op"}
    assert set(doc["overhead"]) == {"floor_step_ms", "floor_shape", "launch_bound", "fixed_share", "mfu", "step_ms",
                                    "floor_ms", "suggest_batch", "reason"}
    assert doc["overhead"]["floor_shape"] == [1, 8] and doc["overhead"]["floor_step_ms"]["n"] == RUN["repeats"]
    rec = doc["precisions"][1]
    assert set(rec) == {"precision", "mode", "dtype", "native", "ran", "forced", "reason", "compile", "metadata",
                        "speed", "mfu", "memory", "accuracy", "stopped", "weights", "checkpointing", "vs_without",
                        "memory_row", "memory_settings"}
    assert {"device_name", "dtype", "torch"} <= set(rec["metadata"]) and rec["metadata"]["dtype"] == "float16"
    assert set(rec["speed"]) == {"step_ms", "tokens_per_s", "samples_ms", "timed_steps", "speedup", "speedup_vs_eager"}
    assert set(rec["speed"]["step_ms"]) == {"n", "median", "q1", "q3", "min", "max", "iqr"}
    assert set(rec["speed"]["speedup"]) == {"median", "low", "high", "no_measurable_difference",
                                              "spread_over_median"}
    assert set(rec["mfu"]) == {"achieved_tflops", "peak_tflops", "mfu", "probe"}
    assert set(rec["mfu"]["probe"]) == {"dtype", "size", "tflops"}
    assert set(rec["memory"]) == {"weights_bytes", "grads_bytes", "optimizer_state_bytes", "activation_bytes",
                                  "total_bytes", "steps_measured", "peak_allocated_bytes", "peak_reserved_bytes",
                                  "weights_dtype", "reduction"}
    assert set(rec["memory"]["reduction"]) == {"static", "activations", "total", "peak_allocated"}
    assert set(rec["accuracy"]) == {"steps", "attempts", "loss_curve", "val_loss", "val_accuracy", "val_targets",
                                    "diverged_at", "diverged_reason", "loss_scale", "skipped_steps", "val_loss_diff",
                                    "val_accuracy_diff", "parity", "rounded_away_share", "updates_counted"}
    assert set(rec["accuracy"]["parity"]) == {"steps", "max_rel_dev", "first_step_out", "trailing_out", "tolerance"}
    assert set(doc["verdicts"][0]) == {"precision", "mode", "check", "status", "value", "threshold", "detail"}
    assert doc["precisions"][0]["speed"]["speedup"] is None  # fp32 is the baseline


def test_table_one_row_per_precision(default_run):
    table = default_run[0].table
    assert list(table.precision) == ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"]
    assert {"step_ms_median", "step_ms_iqr", "tokens_per_s_median", "speedup", "mfu", "activations_mib",
            "total_mib", "static_reduction", "val_loss", "val_accuracy", "parity_max_rel_dev",
            "rounded_away_share"} <= set(table.columns)
    assert table.loc[0, "speedup"] == 1.0


# --- CLI -----------------------------------------------------------------------------------------

def test_cli_bench_writes_json_and_exit_code(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--precisions", "bf16", "--batch-size", "4", "--seq-len", "16", "--untimed-steps", "0",
            "--timed-steps", "1", "--repeats", "1", "--accuracy-steps", "0", "--eval-batches", "3", "--no-progress",
            "--json", str(out), *TINY_ARGS]
    code = main(args)
    doc = json.loads(out.read_text())
    assert code == (1 if doc["status"] == "FAIL" else 0)
    assert doc["config"]["precisions"] == ["fp32", "bf16"] and doc["config"]["repeats"] == 1
    assert doc["config"]["eval_batches"] == 3
    text = capsys.readouterr().out
    assert "speedup vs fp32" in text and "worst status" in text
    assert re.search(r"^(bf16|fp32) here: ", text, re.M)  # the answer, the mode first
    if BF16_NATIVE:
        rows = {(r["check"]): r for r in doc["verdicts"] if r["precision"] == "bf16"}
        accuracy = rows["val accuracy diff"]
        assert accuracy["status"] == "SKIP" and "accuracy_steps=0" in accuracy["detail"]
        assert rows["speedup vs fp32"]["status"] == "WARN"  # 1 repeat < min_repeats


def test_cli_bad_precision_exits_2(capsys):
    assert main(["bench", "--precisions", "fp32,fp8", "--no-progress"]) == 2
    assert "fp8" in capsys.readouterr().err


def test_bad_input_errors_name_the_fix():
    model = tiny(seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        amp_benchmark(model, batch_size=0, progress=False)
    with pytest.raises(ValueError, match="'auto' is not a precision"):
        precision_list(["auto"])


def test_the_entry_convention_spec_kwargs_config_and_overrides():
    quick = {**RUN, "precisions": ("fp32",), "repeats": 1, "timed_steps": 1, "accuracy_steps": 0}
    config = BenchConfig(**{k: v for k, v in quick.items() if k != "device"})
    result = amp_benchmark("tiny-gpt", None, config, model_kwargs=TINY, device="cpu")  # a spec built from kwargs
    assert result.config.parameters == adapt(tiny()).summary()["parameters"] and result.config.settings.repeats == 1
    assert not set(BENCH_RUN_ONLY) & set(result.to_json()["config"])  # how a run showed is no measurement
    with pytest.raises(ValueError, match="unknown benchmark setting.s. devices; valid: precisions"):
        amp_benchmark(tiny(), devices="cpu")
    with pytest.raises(ModelSpecError, match="d_model: an nn.Module instance is already built"):
        amp_benchmark(tiny(), config, model_kwargs={"d_model": 64})
    with pytest.raises(LoggerError, match="unknown logger 'neptune'"):
        BenchConfig(loggers="neptune")


def test_precision_list_adds_baseline_and_dedupes():
    assert precision_list(["bf16-mixed", "16", "bfloat16"]) == ("fp32", "bf16", "fp16")
    assert precision_list("fp16,fp32") == ("fp32", "fp16")


# --- verdict logic on synthetic measurements ------------------------------------------------------

def _stats(q1, median, q3, n=5):
    return Stats(n, median, q1, q3, q1, q3)


def test_overlapping_spread_is_no_measurable_difference():
    sp = speedup(_stats(95, 100, 105), _stats(92, 97, 102))
    assert sp.no_measurable_difference
    row = speed_check("bf16", sp, 5, Thresholds())
    assert row.status == "FAIL" and "no measurable difference" in row.detail
    assert row.value == pytest.approx(100 / 97, abs=1e-4) and row.precision == "bf16"


def test_clear_speedup_passes_and_spread_across_threshold_warns():
    sp = speedup(_stats(100, 105, 110), _stats(40, 42, 45))
    assert sp.low == pytest.approx(100 / 45) and sp.high == pytest.approx(110 / 40)
    assert not sp.no_measurable_difference
    assert speed_check("bf16", sp, 5, Thresholds()).status == "PASS"
    assert speed_check("bf16", sp, 5, Thresholds(speedup=3.0)).status == "FAIL"  # high 2.75 < 3
    assert speed_check("bf16", sp, 5, Thresholds(speedup=2.5)).status == "WARN"  # 2.22 < 2.5 <= 2.75
    few = speed_check("bf16", sp, 2, Thresholds())
    assert few.status == "WARN" and "repeats>=3" in few.detail


def test_memory_thresholds_and_basis():
    reds = {"activations": 0.5, "total": 0.1, "peak_allocated": None}
    row = memory_check("bf16", reds, Thresholds(memory_reduction=0.4))
    assert row.status == "PASS" and row.check == "activations memory reduction" and "total -10.0%" in row.detail
    assert memory_check("bf16", reds, Thresholds(memory_reduction=0.4, memory="total")).status == "FAIL"
    skip = memory_check("bf16", reds, Thresholds(memory_reduction=0.4, memory="peak_allocated"))
    assert skip.status == "SKIP" and "CUDA" in skip.detail
    assert reduction(200, 120) == pytest.approx(0.4) and reduction(None, 5) is None


def test_the_memory_threshold_is_the_tasks_unless_given():
    """A ViT's activations are mostly kept in fp32 around its bf16 matmuls: autocast saved 19.6% on a ViT-Small, a
    true figure the language models' 0.40 FAILed."""
    from tier_utils.tasks import CAUSAL_LM, IMAGE_CLASSIFICATION

    assert Thresholds().for_task(CAUSAL_LM).memory_reduction == 0.40
    vit = Thresholds().for_task(IMAGE_CLASSIFICATION)
    assert vit.memory_reduction == IMAGE_CLASSIFICATION.amp_memory_reduction < 0.196
    assert memory_check("bf16", {"activations": 0.196}, vit).status == "PASS"
    assert Thresholds(memory_reduction=0.3).for_task(IMAGE_CLASSIFICATION).memory_reduction == 0.3  # given: kept


def test_accuracy_and_parity_checks():
    t = Thresholds()
    assert accuracy_check("bf16", 0.005, None, t).status == "PASS"
    assert accuracy_check("bf16", -0.02, None, t).status == "FAIL"
    assert accuracy_check("bf16", 0.02, None, t).status == "WARN"
    diverged = accuracy_check("fp16", None, "at step 7: fp16 loss scale fell below 1", t)
    assert diverged.status == "FAIL" and diverged.detail == "training diverged at step 7: fp16 loss scale fell below 1"
    par = parity([2.0, 1.8, 1.6, 1.5], [2.0, 1.82, 1.8, float("nan")], 0.05)
    assert par["first_step_out"] == 2 and math.isinf(par["max_rel_dev"])
    nan = parity_check("fp16", par, None, t)
    assert nan.status == "FAIL" and nan.value is None and "NaN/inf" in nan.detail
    # Out of the band once, back in: a WARN. Out for the last quarter of the run: a real divergence.
    base = [2.0, 1.9, 1.8, 1.7, 1.6, 1.5, 1.4, 1.3]
    blip = parity(base, [2.0, 1.9, 2.0, 1.7, 1.6, 1.5, 1.4, 1.3], 0.05)
    assert blip["trailing_out"] == 0 and parity_check("bf16", blip, None, t).status == "WARN"
    away = parity(base, [2.0, 1.9, 1.8, 1.7, 1.6, 1.6, 1.6, 1.6], 0.05)
    assert away["first_step_out"] == 5 and away["trailing_out"] == 3
    row = parity_check("fp16", away, None, t, 0, [65536.0])
    assert row.status == "FAIL" and "stayed out for the last 3" in row.detail and "no skipped step" in row.detail
    close = parity([2.0, 1.8], [2.02, 1.8], 0.05)
    assert close["max_rel_dev"] == pytest.approx(0.01) and close["first_step_out"] is None
    assert parity_check("bf16", close, None, t).status == "PASS"
    assert parity_check("fp16", close, "at step 3: loss became nan", t).status == "FAIL"


def test_skip_rows_and_threshold_validation():
    rows = skip_checks("fp16", "not native", Thresholds())
    assert [r.status for r in rows] == ["SKIP"] * 4 and all(r.detail == "not native" for r in rows)
    with pytest.raises(ValueError, match="memory"):
        Thresholds(memory="vram")
    with pytest.raises(ValueError, match="memory_reduction"):
        Thresholds(memory_reduction=40)


# --- saved-tensor accounting against a hand-computed case -----------------------------------------

def test_saved_tensor_meter_single_linear():
    torch.manual_seed(0)
    lin = nn.Linear(8, 4)
    x = torch.randn(3, 8, requires_grad=True)  # an activation inside a network requires grad
    with SavedTensorMeter(lin) as meter:
        lin(x).sum()
    assert meter.bytes == x.numel() * 4  # x saved for the weight grad; W is a parameter, not counted
    with SavedTensorMeter(lin) as meter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lin(x).sum()
    # autocast saves bf16 copies of the input and of the weight: both are extra memory.
    assert meter.bytes == (x.numel() + lin.weight.numel()) * 2
    assert meter.tensors == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_timer_reads_gpu_time_from_events():
    from tier_utils.core.measure import StepTimer
    timer = StepTimer("cuda")
    with timer.region():
        pass
    with timer.region():
        torch.cuda._sleep(100_000_000)  # queued GPU work: a host clock would read ~0 here, events read the GPU
    empty, slept = timer.milliseconds()
    assert slept > 5 and slept > 10 * empty


# --- verdicts that stay true: skipped steps, NaN, launch-bound sizes -------------------------------

def test_a_skipped_fp16_step_is_retried_and_parity_still_passes():
    adapter, prec, start = _fp16_parts()
    splits = build_datasets(None, adapter.task, 16, adapter.vocab_size)
    cfg = BenchConfig(accuracy_steps=8, batch_size=4, eval_batches=1)
    fp32 = bench._accuracy_run(adapter, resolve_precision("fp32", CPU, warn=False), start, splits, cfg, _NO_BAR)
    calls = []

    def overflow_third_attempt(grad):
        calls.append(1)
        return grad * float("inf") if len(calls) == 3 else grad

    handle = adapter.model.head.weight.register_hook(overflow_third_attempt)
    acc = bench._accuracy_run(adapter, prec, start, splits, cfg, _NO_BAR)
    handle.remove()
    assert acc["skipped_steps"] == 1 and acc["attempts"] == 9 and acc["steps"] == len(acc["loss_curve"]) == 8
    assert acc["loss_scale"][2:4] == [65536.0, 32768.0] and acc["diverged_at"] is None
    # Update 3 ran on the same weights and batch as fp32's update 3, not one update behind.
    assert acc["loss_curve"][3] == pytest.approx(fp32["loss_curve"][3], rel=1e-2)
    row = parity_check("fp16", parity(fp32["loss_curve"], acc["loss_curve"], 0.05), None, Thresholds(),
                       acc["skipped_steps"], acc["loss_scale"])
    assert row.status == "PASS" and "1 skipped step(s)" in row.detail and "65536 -> 32768" in row.detail


class NaNGPT(TinyGPT):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        return super().forward(input_ids, attention_mask, inputs_embeds) * float("nan")


class NaNUnderFp16(TinyGPT):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        out = super().forward(input_ids, attention_mask, inputs_embeds)
        fp16 = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        return out * float("nan") if fp16 else out


def test_nan_model_gets_no_pass_and_no_speed_verdict():
    result = amp_benchmark(tiny(NaNGPT, seed=0), precisions=("fp32", "fp16"), force=True, **RUN)
    v = result.verdicts
    assert result.status == "FAIL" and "PASS" not in set(v.status)
    speed = v[v.check == "speedup vs fp32"]
    assert list(speed.status) == ["FAIL", "FAIL"] and speed.value.isna().all()
    assert all(d.startswith("fp32 loss is nan on the first batch") for d in speed.detail)
    assert all(r.speed is None and r.accuracy is None for r in result.records) and result.overhead is None
    assert isinstance(result.plot(), Figure)
    json.dumps(result.to_json(), allow_nan=False)


def test_a_precision_whose_loss_is_nan_stops_alone():
    result = amp_benchmark(tiny(NaNUnderFp16, seed=0), precisions=("fp32", "fp16"), force=True, **RUN)
    fp16 = result.verdicts[result.verdicts.precision == "fp16"]
    assert "PASS" not in set(fp16.status) and fp16.value.isna().all()
    assert all(d.startswith("fp16 loss is nan") for d in fp16.detail)
    assert _rec(result, "fp16").speed is None and _rec(result, "fp32").speed is not None
    assert result.overhead is not None


def test_launch_bound_rule_from_injected_timings():
    t = Thresholds()
    small = launch_bound(5.0, 4.0, 0.3, 8, t)  # a 1-sequence step is 80 % of the step
    assert small["launch_bound"] and small["fixed_share"] == pytest.approx(0.8)
    assert small["suggest_batch"] == 128  # per-sequence time 1 ms per 8 sequences; 16 ms of it makes 4.0 a fifth
    assert launch_bound(100.0, 10.0, 0.01, 8, t)["launch_bound"]  # 1 % of the peak: far from arithmetic
    big = launch_bound(100.0, 10.0, 0.6, 8, t)
    assert not big["launch_bound"]
    slower = speedup(_stats(4.9, 5.0, 5.1), _stats(5.5, 5.6, 5.7))  # 0.89x, as on an H100 at the default size
    assert speed_check("bf16", slower, 5, t).status == "FAIL"
    assert speed_check("bf16", slower, 5, t, big).status == "FAIL"
    row = speed_check("bf16", slower, 5, t, small)
    assert row.status == "WARN" and row.detail.startswith("launch-bound at this size")
    assert "try batch >= 128" in row.detail and "0.89x" in row.detail
    clear = speedup(_stats(100, 105, 110), _stats(40, 42, 45))
    assert speed_check("bf16", clear, 5, t, small).status == "PASS"


@pytest.mark.parametrize("floor_ms,fp32_ms,why", [
    (4.5, 5.0, "(90% fixed per-step cost)"),  # the 1-sequence step is nearly the whole step
    # Floor 10 %, but 1 s for ~12 MFLOP of tiny-gpt is far below any CPU's matmul peak: < 5 % MFU.
    (100.0, 1000.0, "of its measured matmul peak"),
], ids=["fixed-cost", "low-mfu"])
def test_benchmark_says_launch_bound_with_injected_step_times(monkeypatch, floor_ms, fp32_ms, why):
    def fake(adapter, prec, start, batches, cfg, bar, step_adapter=None):  # bf16 12 % slower, as on an H100
        ms = floor_ms if len(batches[0]["input_ids"]) == 1 else fp32_ms * (1.12 if prec.name == "bf16" else 1.0)
        return [ms] * (len(batches) - cfg.untimed_steps), torch.zeros(len(batches))

    monkeypatch.setattr(bench, "timed_repeat", fake)
    result = amp_benchmark(tiny(seed=0), precisions=("fp32", "bf16"), force=True, **{**RUN, "accuracy_steps": 0})
    assert result.overhead["launch_bound"] and result.overhead["fixed_share"] == pytest.approx(floor_ms / fp32_ms)
    row = result.verdicts[(result.verdicts.precision == "bf16") & (result.verdicts.check == "speedup vs fp32")].iloc[0]
    assert row.status == "WARN" and row.detail.startswith("launch-bound at this size") and why in row.detail
    assert "try batch >=" in row.detail and "0.89x" in row.detail


def _fake_gpu(fixed_ms=4.0, per_seq_ms=0.05, bytes_per_seq=2**20, oom_at=None):
    """fp32 on a pretend GPU: a fixed per-step cost plus a per-sequence cost; memory grows with the batch."""
    def measure(b):
        if oom_at is not None and b >= oom_at:
            return None
        return {"step_ms": fixed_ms + per_seq_ms * b, "floor_ms": fixed_ms + per_seq_ms,
                "peak_bytes": b * bytes_per_seq}
    return measure


def test_grow_batch_until_the_step_is_mostly_arithmetic():
    grown = grow_batch(8, _fake_gpu(), budget_bytes=2**40, max_batch=1024)
    assert [r["batch_size"] for r in grown["trail"]] == [8, 16, 32, 64, 128, 256, 512]
    assert grown["batch_size"] == 512 and grown["trail"][0]["fixed_share"] > 0.9 and not grown["capped"]
    assert grown["trail"][-1]["fixed_share"] <= 0.2 and "fixed per-step cost at batch 512" in grown["reason"]
    # Already compute-bound: measured once, kept.
    big = grow_batch(8, _fake_gpu(fixed_ms=1.0, per_seq_ms=10.0), budget_bytes=2**40)
    assert big["batch_size"] == 8 and len(big["trail"]) == 1


def test_grow_batch_stops_at_the_memory_budget_and_at_out_of_memory():
    capped = grow_batch(8, _fake_gpu(), budget_bytes=100 * 2**20)
    assert capped["batch_size"] == 64 and "growth budget" in capped["reason"]  # 128 MiB predicted at batch 128
    assert capped["capped"] and f"still {capped['fixed_share_left']:.0%} fixed cost" in capped["reason"]
    oom = grow_batch(8, _fake_gpu(oom_at=32), budget_bytes=None)
    assert oom["batch_size"] == 16 and oom["reason"] == "batch 32 ran out of memory" and not oom["capped"]


def test_grow_batch_stops_at_a_cap_that_does_not_grow_with_the_card_and_says_what_it_left():
    """The fake card never stops being launch-bound below 512: the default cap stops growth at 256 and the
    reason says the share of fixed cost left; a batch asked above the cap is measured as asked."""
    grown = grow_batch(8, _fake_gpu(), budget_bytes=None)
    assert grown["batch_size"] == sizing.GROWTH_MAX_BATCH == 256 and grown["capped"]
    share = grown["trail"][-1]["fixed_share"]
    assert share > 0.2 and f"cap of 256 sequences (the same on every card); fp32's step is still {share:.0%}" \
        in grown["reason"]
    asked = grow_batch(300, _fake_gpu(), budget_bytes=None)
    assert asked["batch_size"] == 300 and len(asked["trail"]) == 1
    # Half of a card, at most GROWTH_BUDGET_BYTES: a T4 and an H200 plan the same budget.
    t4, h200 = (sizing.growth_budget(GPU_PROFILES[k].memory_mib << 20) for k in ("T4", "H200"))
    assert t4 == h200 == sizing.GROWTH_BUDGET_BYTES and sizing.growth_budget(2 << 30) == 1 << 30


def test_fp32_measure_times_a_step_and_its_floor_and_restores_the_weights():
    model = tiny(seed=0)
    before = copy.deepcopy(model.state_dict())
    m = fp32_measure(adapt(model), 16)(2)
    assert m["step_ms"] > 0 and m["floor_ms"] > 0 and m["peak_bytes"] is None  # CUDA only
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# --- sized to the device: the fit planner and out-of-memory -------------------------------------

def test_the_comparison_runs_at_the_largest_batch_every_precision_fits(monkeypatch):
    from tier_utils.planning.planner import plan

    model = tiny(seed=0)
    configs = plan(adapt(model), ["fp32", "bf16"], 16)[0]
    need = max(c.step_bytes(2, 16) for c in configs)  # bf16's autocast weight copies may make it the bigger one
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(2 * need + 64))  # a safe share (half) that fits batch 2
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")  # a CPU with native bf16, whatever runs the test
    result = amp_benchmark(model, **{**RUN, "batch_size": 8, "precisions": ("fp32", "bf16")})
    fit, batch = result.config.fit, result.config.settings.batch_size
    assert batch == min(fit.largest_batch_predicted.values()) >= 2 and fit.batch_size_asked == 8
    assert fit.reason.startswith(f"batch 8 does not fit every compared precision here; run at {batch}, the largest "
                                 "all of them fit (predicted: fp32 ")
    assert result.to_json()["config"]["fit"]["reason"] == fit.reason
    assert _rec(result, "fp32").speed is not None and _rec(result, "bf16").speed is not None


def test_a_baseline_that_fits_nothing_skips_every_precision_with_the_reason(monkeypatch):
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", "64KiB")
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")  # bf16 native, so its own reason is the memory
    result = amp_benchmark(tiny(seed=0), **{**RUN, "precisions": ("fp32", "bf16")})
    assert not any(r.ran for r in result.records)
    rows = result.verdicts
    assert (rows.status == "SKIP").all()
    detail = rows[rows.precision == "bf16"].detail  # bf16 fits no more than fp32 here: its own reason
    assert detail.str.startswith("does not fit here: a training step at batch 1, T=16 predicted").all()
    assert "TIER_UTILS_FREE_MEMORY" in detail.iloc[0] and not result.records[0].ran


def test_when_fp32_does_not_fit_the_modes_that_fit_are_compared_with_the_best_fitting_baseline(monkeypatch):
    """fp32's activations don't fit, bf16's and fp16's do: fp32's row says so, bf16 (the first that fits, in the
    order asked) is the baseline, named in every comparison, and nothing runs out of memory."""
    from tier_utils.planning.planner import plan

    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layer=2, n_head=2, max_len=128)
    fp32, bf16 = (c.step_bytes(1, 128) for c in plan(adapt(model), ["fp32", "bf16"], 128)[0])
    assert bf16 < fp32  # at T=128 the activations, which autocast shrinks, outweigh bf16's weight copies
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(bf16 + fp32))  # the safe share (half) lies between them
    result = amp_benchmark(model, **{**RUN, "seq_len": 128, "precisions": ("fp32", "bf16", "fp16"), "force": True})
    assert [r.precision for r in result.records] == ["bf16", "fp32", "fp16"]
    assert not _rec(result, "fp32").ran and _rec(result, "bf16").speed and _rec(result, "fp16").speed
    rows = result.verdicts
    fp32_rows = rows[rows.precision == "fp32"]
    assert (fp32_rows.status == "SKIP").all()
    assert fp32_rows.detail.iloc[0].startswith("does not fit here: a training step at batch 1, T=128 predicted")
    assert fp32_rows.detail.iloc[0].endswith("; the modes that fit are compared with bf16, the best-fitting baseline")
    assert rows[rows.precision == "bf16"].detail.iloc[0] == "bf16 is the baseline the others are compared with"
    fp16_rows = rows[rows.precision == "fp16"]
    assert "speedup vs bf16" in set(fp16_rows.check) and not fp16_rows.check.str.contains("fp32").any()
    assert result.config.settings.batch_size == 1


class OOMUnderAutocast(TinyGPT):
    """A pretend GPU with room for fp32 only at the benchmark's batch: bf16 there runs out of memory (the
    planner's small measurements still run)."""

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        if torch.is_autocast_enabled("cpu") and input_ids.size(0) >= 4:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return super().forward(input_ids, attention_mask, inputs_embeds)


def test_out_of_memory_in_one_precision_skips_it_and_the_run_goes_on():
    result = amp_benchmark(OOMUnderAutocast(**dict(d_model=32, n_layer=1, n_head=2, max_len=32)),
                           **{**RUN, "precisions": ("fp32", "bf16"), "force": True})
    fp32, bf16 = _rec(result, "fp32"), _rec(result, "bf16")
    assert fp32.speed is not None and fp32.accuracy is not None  # the run went on
    assert not bf16.ran
    rows = result.verdicts.query("precision == 'bf16'")
    assert (rows.status == "SKIP").all()
    assert rows.detail.iloc[0].startswith("B=4, T=16 ran out of memory on cpu with") and "free" in rows.detail.iloc[0]
