"""torch.compile in train(): compiled fp32 matches eager, checkpoints move between compiled and eager
runs, an uncompilable model falls back with a warning, and the optimizer choice is named.

Inductor compiles on the CPU, about 20 s for the tiny model on a cold cache (a few seconds once
its graphs are cached), so the real compiles are few and shared through one module fixture.
"""
from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest
import torch
from tiny import TINY_ARGS, tiny

from tier_utils import cli
from tier_utils.benchmark import amp as bench
from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.benchmark.config import BenchConfig
from tier_utils.core.optimizers import AdamW
from tier_utils.engine import compiling
from tier_utils.engine.compiling import CompileFallbackWarning
from tier_utils.engine.step import make_optimizer
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.training.config import TrainConfig
from tier_utils.training.loop import train

STEPS, CUT = 10, 5
RUN = dict(precision="fp32", batch_size=4, seq_len=16, max_steps=STEPS, log_every=1, eval_every=0, eval_batches=1,
           deterministic=True, progress=False, seed=3, device="cpu")


def losses(result, first=1):
    steps = result.history.query("kind == 'step'")
    return steps.loc[steps["step"] >= first, "train_loss"].tolist()


class _Stop(Exception):
    pass


def _stop_after_checkpoint(step, metrics):
    raise _Stop(step)  # eval_every=CUT + 1: the checkpoint at CUT is the last one written


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("compiled")
    eager = train(tiny(seed=0), **RUN)
    compiled = train(tiny(seed=0), **RUN, compile=True)
    with pytest.raises(_Stop):
        train(tiny(seed=0), **{**RUN, "eval_every": CUT + 1}, compile=True, checkpoint_dir=ckpt, checkpoint_every=CUT,
              on_eval=_stop_after_checkpoint)
    return eager, compiled, ckpt


def test_compiled_fp32_matches_eager_within_1e4(runs):
    eager, compiled, _ = runs
    s = compiled.summary
    assert s.compiled and s.compile_s > 0 and s.compile_reason.startswith("compiled (mode default)")
    assert not eager.summary.compiled and eager.summary.compile_s is None
    assert compiled.config.compile is True and compiled.model is not None
    assert len(losses(compiled)) == STEPS
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
    # The trained module handed back is the eager one: plain parameter names.
    assert not any(k.startswith("_orig_mod.") for k in compiled.model.state_dict())


def test_compiled_checkpoint_loads_into_eager_model_and_resumes_either_way(runs):
    eager, compiled, ckpt = runs
    state = load_checkpoint(ckpt / "last.pt")
    assert state["step"] == CUT and not any(k.startswith("_orig_mod.") for k in state["model"])
    fresh = tiny(seed=0)
    fresh.load_state_dict(state["model"])  # strict: every key matches an eager model's

    (ckpt / "again").mkdir()  # a copy for the compiled resume: the eager one overwrites last.pt
    (ckpt / "again" / "last.pt").write_bytes((ckpt / "last.pt").read_bytes())

    resumed_eager = train(fresh, **RUN, checkpoint_dir=ckpt, resume=True)
    assert resumed_eager.summary.resumed_from_step == CUT and not resumed_eager.summary.compiled
    assert losses(resumed_eager, CUT + 1) == pytest.approx(losses(eager, CUT + 1), rel=1e-4)

    # Resuming compiled repeats the uninterrupted compiled run exactly: the warm-up that compiles
    # leaves weights, gradients and RNG states as they were.
    resumed_compiled = train(tiny(seed=0), **RUN, compile=True, checkpoint_dir=ckpt / "again", resume=True)
    assert resumed_compiled.summary.compiled
    assert losses(resumed_compiled, CUT + 1) == losses(compiled, CUT + 1)
    for name, tensor in compiled.model.state_dict().items():
        assert torch.equal(resumed_compiled.model.state_dict()[name], tensor), name


def test_uncompilable_model_falls_back_to_eager_with_one_warning(monkeypatch):
    # A real compile failure, cheaply: inductor finds no working C++ compiler.
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", ("/nonexistent/c++",))
    torch._dynamo.reset()  # code compiled earlier in this process would otherwise be reused, not compiled
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = train(tiny(seed=0), **{**RUN, "max_steps": 3}, compile=True)
    fallbacks = [w for w in caught if issubclass(w.category, CompileFallbackWarning)]
    assert len(fallbacks) == 1 and "could not compile" in str(fallbacks[0].message)
    s = result.summary
    assert not s.compiled and s.compile_s is None and s.steps == 3
    assert "ran eager" in s.compile_reason and "\n" not in s.compile_reason
    # It ran the eager steps exactly: the failed warm-up left weights and RNG untouched.
    assert losses(result) == losses(train(tiny(seed=0), **{**RUN, "max_steps": 3}))


def test_compile_settings_are_validated_and_the_optimizer_is_named():
    with pytest.raises(ValueError, match="compile_mode must be one of default, reduce-overhead, max-autotune"):
        TrainConfig(compile=True, compile_mode="fast")
    with pytest.raises(ValueError, match="compile must be True or False"):
        TrainConfig(compile="yes")
    with pytest.raises(ValueError, match="compile must be one of off, on, both, got 'sometimes'"):
        BenchConfig(compile="sometimes")
    with pytest.raises(ValueError, match="compile_mode must be one of default, reduce-overhead, max-autotune"):
        BenchConfig(compile_mode="fast")  # the one declaration (compiling.compile_mode_setting), checked alike
    assert BenchConfig(compile=True).compile == "on" and BenchConfig(compile=False).compile == "off"
    with pytest.raises(ValueError, match="compile must be one of off, on, both"):
        BenchConfig(compile="sometimes")
    cpu = make_optimizer(tiny(seed=0), 1e-3, 0.1)
    assert AdamW.implementation(cpu) == "foreach"  # fused is for CUDA parameters
    if torch.cuda.is_available():
        assert AdamW.implementation(make_optimizer(tiny(seed=0).cuda(), 1e-3, 0.1)) == "fused"
    result = train(tiny(seed=0), **{**RUN, "max_steps": 1})
    assert result.summary.optimizer == "AdamW (foreach)"
    assert isinstance(result.table, pd.DataFrame) and "compile_reason" in set(result.table["metric"])


# --- amp_benchmark(compile=...) ------------------------------------------------------------------
BENCH = dict(batch_size=4, seq_len=16, untimed_steps=1, timed_steps=2, repeats=3, accuracy_steps=3, eval_batches=1,
             progress=False, device="cpu")


@pytest.fixture
def cheap_compile(monkeypatch):
    """Dynamo + AOTAutograd without inductor's code generation: the same wrapping and fallback
    paths in a second, not 20 s per precision (inductor itself is covered by the train tests)."""
    monkeypatch.setattr(compiling, "_compile", lambda module, mode: torch.compile(module, backend="aot_eager"))
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")  # bf16 counts as native: it runs on any CPU
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in test_bench.py: two threads on a shared CPU spin-wait on each other
    yield
    torch.set_num_threads(threads)


def test_benchmark_both_runs_every_precision_eager_and_compiled_interleaved(cheap_compile, monkeypatch):
    order, original = [], bench.timed_repeat

    def recording(adapter, prec, *args):
        order.append((prec.name, args[-1] is not adapter))  # the last argument is the adapter the steps call
        return original(adapter, prec, *args)

    monkeypatch.setattr(bench, "timed_repeat", recording)
    model = tiny(seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = amp_benchmark(model, precisions=("fp32", "bf16"), compile="both", **BENCH)
    # Each repeat: every precision eager then compiled, then the eager fp32 floor step (launch-bound check).
    assert order == [("fp32", False), ("fp32", True), ("bf16", False), ("bf16", True), ("fp32", False)] * 3
    table = result.table
    assert list(zip(table["precision"], table["mode"])) == [("fp32", "eager"), ("fp32", "compiled"),
                                                            ("bf16", "eager"), ("bf16", "compiled")]
    compiled = table[table["mode"] == "compiled"]
    assert (compiled["compile_s"] > 0).all() and compiled["speedup_vs_eager"].notna().all()
    assert table.loc[0, "speedup"] == 1.0 and table["speedup"].notna().all()
    assert table[table["mode"] == "eager"]["speedup_vs_eager"].isna().all()
    v = result.verdicts
    rows = v[(v["check"] == "compile speedup vs eager")]
    assert list(zip(rows["precision"], rows["mode"])) == [("fp32", "compiled"), ("bf16", "compiled")]
    assert rows["status"].isin(["PASS", "WARN", "FAIL"]).all() and rows["detail"].str.contains("n=3 repeats").all()
    fp32_compiled = set(v[(v["precision"] == "fp32") & (v["mode"] == "compiled")]["check"])
    assert fp32_compiled == {"compile speedup vs eager", "val accuracy diff", "loss-curve parity"}
    parity_row = v[(v["mode"] == "compiled") & (v["check"] == "loss-curve parity") & (v["precision"] == "fp32")]
    assert parity_row["status"].item() == "PASS"  # compiled fp32 tracks eager fp32's loss curve
    doc = json.loads(json.dumps(result.to_json()))
    assert result.config.settings.compile == "both" and doc["config"]["compile"] == "both"
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())
    assert len(result.plot().axes) == 3  # bf16 and fp32 only: no loss-scale panel without an fp16 trace


def test_benchmark_compile_failure_is_a_warn_row_and_runs_eager(cheap_compile, monkeypatch):
    def broken(module, mode):
        def call(*args, **kwargs):
            raise RuntimeError("unsupported op\nsecond line")
        return call

    monkeypatch.setattr(compiling, "_compile", broken)
    with pytest.warns(CompileFallbackWarning):
        both = amp_benchmark(tiny(seed=0), precisions=("fp32",), compile="both", **{**BENCH, "accuracy_steps": 0})
    warn = both.verdicts.query("check == 'compile'")
    assert warn["status"].tolist() == ["WARN"] and "unsupported op second line" in warn["detail"].item()
    assert both.table["ran"].tolist() == [True, False]  # measured once, eager
    with pytest.warns(CompileFallbackWarning):
        only = amp_benchmark(tiny(seed=0), precisions=("fp32",), compile=True, **{**BENCH, "accuracy_steps": 0})
    assert only.table["mode"].tolist() == ["eager"] and only.table["ran"].tolist() == [True]


def test_cli_compile_options(cheap_compile, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--precisions", "fp32", "--batch-size", "4", "--seq-len", "16", "--untimed-steps", "0",
                     "--timed-steps", "1", "--repeats", "1", "--accuracy-steps", "0", "--no-progress",
                     "--compile", "both", "--json", str(out), *TINY_ARGS])
    doc = json.loads(out.read_text())
    assert code in (0, 1) and doc["config"]["compile"] == "both"
    assert [(r["precision"], r["mode"]) for r in doc["precisions"]] == [("fp32", "eager"), ("fp32", "compiled")]
    assert "compiled" in capsys.readouterr().out
    run = tmp_path / "run"
    assert cli.main(["train", "--precision", "fp32", "--batch-size", "4", "--seq-len", "16", "--max-steps", "2",
                     "--eval-batches", "1", "--no-progress", "--compile", "--out", str(run), *TINY_ARGS]) == 0
    printed = capsys.readouterr().out
    assert "AdamW (foreach)" in printed and "compiled (mode default)" in printed
    for bad in (["bench", "--compile", "maybe"], ["train", "--out", str(tmp_path / "t"), "--compile-mode", "fast"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(bad)
        assert exc.value.code == 2 and "--compile" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()
