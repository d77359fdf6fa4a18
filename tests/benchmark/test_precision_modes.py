"""The precision modes end to end on the CPU: each run holds its weights in the dtype its strategy object says
(fp32 master weights for the mixed modes, whatever dtype the model was stored in), the true modes halve static
memory and report the share of updates rounded away, and a mode defined outside the package trains and benchmarks
through the same object."""
import json
import warnings

import pytest
import torch
from tiny import TINY_ARGS, tiny

from tier_utils import amp_benchmark, export, fit, search, train
from tier_utils.cli import main
from tier_utils.core import precision as P
from tier_utils.core.device import CPU_FLAGS_ENV, GPU_PROFILE_ENV
from tier_utils.engine.step import TrainStep

QUICK = dict(batch_size=4, seq_len=16, untimed_steps=1, timed_steps=1, repeats=1, accuracy_steps=6, eval_batches=1,
             progress=False, device="cpu")
TRAIN = dict(max_steps=2, batch_size=4, seq_len=16, eval_every=0, eval_batches=1, progress=False, device="cpu")


@pytest.fixture(autouse=True)
def one_thread_quiet():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", P.SlowPrecisionWarning)  # emulated modes on this CPU: not the subject here
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def seen(monkeypatch):
    """(mode, parameter dtypes, gradient dtypes) at every optimizer step of every TrainStep: what each run really
    held, whatever it says."""
    steps = []
    original = TrainStep.__init__

    def init(self, adapter, precision, optimizer, *args, **kwargs):
        original(self, adapter, precision, optimizer, *args, **kwargs)

        def record(opt, args, kwargs):
            params = [p for g in opt.param_groups for p in g["params"]]
            steps.append((precision.name, {p.dtype for p in params},
                          {p.grad.dtype for p in params if p.grad is not None}))

        optimizer.register_step_pre_hook(record)  # runs only when the optimizer steps (not on a skipped fp16 step)

    monkeypatch.setattr(TrainStep, "__init__", init)
    return steps


def held(seen, name):
    params = set().union(*(p for n, p, _ in seen if n == name))
    grads = set().union(*(g for n, _, g in seen if n == name))
    return params, grads


def test_bench_runs_each_mode_in_its_own_weight_dtype_from_a_bf16_stored_model(seen, monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512_bf16")  # bf16 native: its modes run, not SKIP
    model = tiny(seed=0).to(torch.bfloat16)
    result = amp_benchmark(model, precisions=("fp32", "bf16", "bf16-true"), **QUICK)
    assert held(seen, "fp32") == held(seen, "bf16") == ({torch.float32}, {torch.float32})  # fp32 master weights
    assert held(seen, "bf16-true") == ({torch.bfloat16}, {torch.bfloat16})
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # the caller's model comes back as stored
    row = result.table.set_index("precision")
    # weights + gradients + AdamW state: half of fp32's (the AdamW step counters are the only fp32 left)
    assert row.loc["bf16-true", "static_reduction"] == pytest.approx(0.5, abs=0.01)
    assert row.loc["bf16", "static_reduction"] == pytest.approx(0.0, abs=1e-9)
    assert row.loc["bf16-true", "parity_max_rel_dev"] is not None and row.loc["bf16-true", "speedup"] > 0
    parity = result.verdicts.query("precision == 'bf16-true' and check == 'loss-curve parity'").detail.item()
    assert "rounded away" in parity


@pytest.mark.parametrize("lr,low,high", [(1e-6, 0.5, 1.0), (1e-3, 0.0, 0.15)])
def test_rounded_away_share_is_most_updates_at_a_tiny_lr_and_few_at_a_normal_one(monkeypatch, lr, low, high):
    """bf16 keeps 8 bits of mantissa: an update of 1e-6 on a weight of ~0.02 is below half its step and is lost;
    one of 1e-3 is not. Weight decay off: its lr*wd-sized pulls are below bf16's step at either lr."""
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512_bf16")
    result = amp_benchmark(tiny(seed=0), precisions=("bf16-true",), lr=lr, weight_decay=0.0, **QUICK)
    rec = {r.precision: r for r in result.records}
    share = rec["bf16-true"].accuracy["rounded_away_share"]
    assert low < share < high
    assert rec["fp32"].accuracy["rounded_away_share"] < 0.01  # fp32's 24 bits keep them
    assert rec["bf16-true"].accuracy["updates_counted"] > 0
    assert json.dumps(result.to_json()["precisions"][1]["accuracy"]["rounded_away_share"]) == json.dumps(share)


def test_train_fp16_on_an_fp16_stored_model_trains_fp32_master_weights(seen):
    """GradScaler refuses fp16 gradients ("Attempting to unscale FP16 gradients"): the mixed mode upcasts first."""
    result = train(tiny(seed=0).half(), precision="fp16", **TRAIN)
    assert held(seen, "fp16") == ({torch.float32}, {torch.float32})
    assert result.summary.steps == 2 and {p.dtype for p in result.model.parameters()} == {torch.float32}
    assert result.summary.skipped_steps is not None  # a GradScaler ran


def test_train_bf16_true_holds_bf16_weights_gradients_and_adamw_state(seen, monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512_bf16")
    result = train(tiny(seed=0), precision="bf16-true", **TRAIN)
    assert held(seen, "bf16-true") == ({torch.bfloat16}, {torch.bfloat16})
    assert result.summary.precision == "bf16-true" and result.summary.skipped_steps is None
    assert result.history.query("kind == 'step'").train_loss.notna().all()


def test_bf16_true_without_native_bf16_skips_in_bench_and_is_one_line_in_train(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, "")
    result = amp_benchmark(tiny(seed=0), precisions=("bf16-true",), **QUICK)
    rows = result.verdicts.query("precision == 'bf16-true'")
    assert set(rows.status) == {"SKIP"} and all("avx512_bf16" in d and "force=True" in d for d in rows.detail)
    out, ckpt = tmp_path / "train.json", tmp_path / "ckpt"
    code = main(["train", *TINY_ARGS, "--precision", "bf16-true", "--max-steps", "1", "--device", "cpu",
                 "--no-progress", "--out", str(ckpt), "--json", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "bf16-true needs native bf16" in err and "fp32" in err
    assert not out.exists() and not ckpt.exists()


class Fp64True(P.Precision):
    """A toy mode defined outside the package: everything in float64, counting its forwards; auto picks it first
    on a CPU (its own rule) and never on a GPU."""

    name = "fp64-true"
    param_dtype = compute_dtype = torch.float64
    forwards = 0
    auto_rank = 100

    @classmethod
    def auto_eligible(cls, facts):
        if facts.is_gpu:
            return False, f"fp64 has no tensor cores on {facts.describe()}"
        return True, "the test's rule: on a CPU, exact arithmetic first"

    def forward_context(self):
        Fp64True.forwards += 1
        return super().forward_context()


@pytest.fixture
def fp64(monkeypatch):
    monkeypatch.setattr(P, "_REGISTRY", P._REGISTRY.copy())  # registered for this test only
    P.register_precision(Fp64True)
    Fp64True.forwards = 0
    return Fp64True


def test_a_mode_defined_outside_the_package_trains_and_benchmarks(fp64, seen):
    """Nothing in tier_utils knows fp64-true: the strategy object alone says how it holds weights and steps."""
    result = train(tiny(seed=0), precision="fp64-true", **TRAIN)
    assert held(seen, "fp64-true") == ({torch.float64}, {torch.float64}) and fp64.forwards >= 2
    assert result.summary.precision == "fp64-true" and result.summary.steps == 2
    seen.clear()
    bench = amp_benchmark(tiny(seed=0), precisions=("fp64-true",), **QUICK)
    rec = {r.precision: r for r in bench.records}["fp64-true"]
    assert rec.ran and rec.dtype == "float64" and held(seen, "fp64-true")[0] == {torch.float64}
    assert rec.memory["reduction"]["static"] == pytest.approx(-1.0, abs=0.01)  # twice fp32's static bytes
    assert rec.accuracy["parity"]["max_rel_dev"] < 1e-3  # float64 follows fp32's curve


def test_a_mode_defined_outside_the_package_is_chosen_by_auto_under_its_own_rule(fp64, seen, tmp_path, monkeypatch):
    """auto ranks the registry by each class's auto_rank and auto_eligible(): the test's mode wins on a CPU, and
    under a T4 profile its rule declines and the reason says why; its tolerances come from its dtype."""
    p = P.resolve_precision("auto", "cpu")
    assert p.name == "fp64-true" and "the test's rule" in p.reason
    result = train(tiny(seed=0), precision="auto", **TRAIN)
    assert result.summary.precision == "fp64-true" and held(seen, "fp64-true")[0] == {torch.float64}
    monkeypatch.setenv(GPU_PROFILE_ENV, "T4")
    t4 = P.resolve_precision("auto", "cpu")
    assert t4.name == "fp16" and "not fp64-true: fp64 has no tensor cores on Tesla T4" in t4.reason
    monkeypatch.delenv(GPU_PROFILE_ENV)
    tol = fp64.tolerances()  # no table anywhere names fp64-true: the default rule from float64's eps
    assert tol.export == (1e-4, 1e-3) and tol.agreement == (1.0, 0.99)
    exported = export(tiny(seed=0), tmp_path / "m.pt2", format="pt2", precision="fp64-true", repeats=1)
    assert exported.config.rel_tolerance == tol.export and exported.config.argmax_agreement == tol.agreement
    parity = exported.table[exported.table.check.str.startswith("logits rel max")]
    assert len(parity) and (parity.threshold == tol.export[0]).all() and (parity.status == "PASS").all()


def test_fit_plans_each_mode_from_its_bytes_per_parameter_and_its_own_activations(monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512_bf16")
    model = tiny(seed=0)
    n = sum(p.numel() for p in model.parameters())
    result = fit(model, precisions=("fp32", "bf16", "bf16-true"), checkpointing=False, lora=0, optimizers="adamw",
                 seq_len=16, progress=False, device="cpu")
    configs = {c.precision: c for c in result.configs}
    for name, c in configs.items():
        per_param = sum(P.resolve_precision(name, "cpu").static_bytes_per_param().values())
        assert c.static == pytest.approx(n * per_param, rel=0.01)  # AdamW's step counters are the 1 %
    # bf16-true's activations are measured with its weights in bf16: no fp32 copies of them are saved
    assert configs["bf16-true"].per_sequence(16) < configs["bf16"].per_sequence(16)
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # planned in place, given back as it came


def test_search_trials_run_in_the_mode_asked(seen, monkeypatch):
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512_bf16")
    model = tiny(seed=0).to(torch.bfloat16)  # stored bf16: the bf16 trials still train fp32 master weights
    search(model, space={"precision": ("choice", ["bf16", "bf16-true"])}, n_trials=2,
           start_with=[{"precision": "bf16"}, {"precision": "bf16-true"}], **TRAIN)
    assert held(seen, "bf16") == ({torch.float32}, {torch.float32})
    assert held(seen, "bf16-true") == ({torch.bfloat16}, {torch.bfloat16})
