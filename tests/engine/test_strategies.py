"""The distributed strategy as an object: one class per strategy owns its facts, nothing else in the package names
one, and a strategy defined here (a DDP whose gradient buckets are views of the gradients) works through `ranks`,
train and `bench --strategy` (under torchrun) once registered, with no edit in the package."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torchrun import TWO_BLOCK_ARGS, ok, text_file, torchrun, worker_script

import tier_utils
from tier_utils import TinyGPT, TrainConfig
from tier_utils.adapter.adapter import resolve_model
from tier_utils.core.errors import LaunchError
from tier_utils.core.memory_settings import MemorySettings
from tier_utils.core.precision import resolve_precision
from tier_utils.engine import strategies as S
from tier_utils.engine.step import TrainStep, make_optimizer
from tier_utils.planning.planner import static_bytes
from tier_utils.planning.ranks import plan_ranks

PACKAGE = Path(tier_utils.__file__).parent
# Where a strategy's name may be written: its class and the registry.
ALLOWED = {PACKAGE / "engine" / "strategies.py"}


class ViewsDDP(S.DDP):
    """DDP with gradient_as_bucket_view=True: the all-reduce buckets are the gradients themselves, so a rank holds
    no second copy of them (less memory, the same steps)."""

    name = "ddp-views"
    label = "DDP (bucket views)"
    gradient_as_bucket_view = True

    def setup_module(self, model, precision, allocator=None) -> str:
        return f"DDP with bucket views over {self.env.world_size} rank(s): no second copy of the gradients"


@pytest.fixture
def views(monkeypatch):
    monkeypatch.setattr(S, "_REGISTRY", S._REGISTRY.copy())  # registered for this test only
    return S.register_strategy(ViewsDDP)


def _constants(tree: ast.AST) -> list[ast.Constant]:
    """The string constants of a module, but its docstrings (module, class, function)."""
    docs = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body
            and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


def test_no_strategy_name_outside_its_class_and_the_registry():
    names = {s.lower() for cls in map(S.strategy_class, S.STRATEGIES) for s in (cls.name, *cls.aliases)}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path in ALLOWED:
            continue
        found += [f"{path.relative_to(PACKAGE)}:{c.lineno} {c.value!r}" for c in _constants(ast.parse(path.read_text()))
                  if c.value.strip().lower() in names]
    assert not found, found


def test_the_checker_sees_a_name_used_to_decide():
    tree = ast.parse('"""fsdp in a docstring is prose."""\nif strategy == "fsdp":\n    pass\n')
    assert [c.value for c in _constants(tree)] == ["fsdp"]


def test_names_resolve_to_classes_and_a_clash_or_an_unknown_name_is_one_line(views):
    assert S.strategy_class("DDP-Views") is ViewsDDP and S.launched_strategies() == ("ddp", "fsdp", "ddp-views")
    assert TrainConfig(strategy="FSDP").strategy == "fsdp"
    with pytest.raises(ValueError, match="unknown strategy 'dp'; use one of: single, ddp, fsdp, ddp-views"):
        TrainConfig(strategy="dp")
    with pytest.raises(ValueError, match=r"\['ddp-views'\] already name a strategy"):
        S.register_strategy(type("Other", (S.DDP,), {"name": "ddp-views"}))
    with pytest.raises(ValueError, match="consolidate .* needs a sharded strategy \\(fsdp\\)"):
        TrainConfig(strategy="ddp-views", consolidate=True, checkpoint_dir="x")


@pytest.mark.parametrize("settings, refusal", [
    (dict(memory=MemorySettings.qlora(4)), "a 4-bit base \\(QLoRA\\) cannot be sharded by fsdp: use strategy='ddp'"),
    (dict(memory=MemorySettings(lora=4), save_hf="hf"), "save_hf of a LoRA run under fsdp is not supported"),
    (dict(consolidate=True), "consolidate .* needs checkpoint_dir=DIR$"),
])
def test_fsdp_refuses_what_it_cannot_shard_or_write_and_ddp_runs_it(settings, refusal):
    with pytest.raises(ValueError, match=refusal):
        TrainConfig(strategy="fsdp", **settings)
    if "consolidate" not in settings:
        assert TrainConfig(strategy="ddp", **settings).strategy == "ddp"


def test_the_strategy_says_which_ranks_and_batch_a_resume_needs_the_same():
    state = {"strategy": "ddp", "world_size": 1, "global_batch": 8, "config": {"batch_size": 8}}
    single = S.Single()
    assert single.resume_differences(state, 8, 8) == []
    assert single.resume_differences(state, 4, 4) == ["batch_size=8 (this run: 4)"]
    assert single.resume_differences({**state, "world_size": 2}, 8, 16) == ["world size 2"]
    sharded = {**state, "strategy": "fsdp", "world_size": 2, "global_batch": 16}
    assert S.FSDP().resume_differences(sharded, 16, 16) == []  # DCP reshards: the global batch is what counts
    assert S.FSDP().resume_differences(sharded, 4, 4) == ["global batch 16"]
    assert single.resume_differences(sharded, 16, 16) == ["strategy='fsdp'"]


def test_one_process_decides_single_and_refuses_what_needs_torchrun():
    assert type(S.resolve_strategy("ddp", "cpu")) is S.Single  # DDP on one process is a single-process run
    with pytest.raises(LaunchError, match="torchrun --nproc_per_node N -m tier_utils train"):
        S.resolve_strategy("fsdp", "cpu")
    decided = S.FSDP(reshard_after_forward=False)
    assert S.resolve_strategy(decided) is decided  # decided once, passed down as it is


def test_the_strategy_gives_its_grad_scaler_as_the_step_is_built(monkeypatch):
    """fp16 steps through the strategy's GradScaler from the start (FSDP: the sharded one); the other modes through
    a disabled one, whose state a checkpoint holds as nothing."""
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "")
    model = TinyGPT(d_model=16, n_layer=1, n_head=2, max_len=8)
    adapter = resolve_model(model)
    fp16 = resolve_precision("fp16", "cpu", warn=False)
    sharded = TrainStep(adapter, fp16, make_optimizer(model, 1e-3, 0.0), strategy=S.FSDP())
    plain = TrainStep(adapter, fp16, make_optimizer(model, 1e-3, 0.0))
    assert isinstance(sharded.scaler, ShardedGradScaler) and sharded.scaler.is_enabled()
    assert type(plain.scaler) is torch.amp.GradScaler and plain.scaler.is_enabled()
    fp32 = TrainStep(adapter, resolve_precision("fp32", "cpu"), make_optimizer(model, 1e-3, 0.0))
    assert not fp32.scaler.is_enabled() and fp32.scaler.state_dict() == {}


def test_an_fp16_step_skips_on_overflow_and_its_scale_round_trips():
    model = TinyGPT(d_model=16, n_layer=1, n_head=2, max_len=8)
    adapter = resolve_model(model)
    fp16 = resolve_precision("fp16", "cpu", warn=False)
    first = TrainStep(adapter, fp16, make_optimizer(model, 1e-3, 0.0))
    with torch.no_grad():
        model.ln_f.weight.fill_(float("inf"))  # every logit overflows: the step is skipped, the scale halves
    out = first([adapter.example_batch(2, 8)])
    assert out.skipped is True and out.scale_after == out.scale_before / 2 == first.scaler.get_scale()
    second = TrainStep(adapter, fp16, make_optimizer(model, 1e-3, 0.0))
    second.scaler.load_state_dict(first.scaler.state_dict())
    assert second.scaler.get_scale() == first.scaler.get_scale()
    plain = TrainStep(adapter, resolve_precision("bf16", "cpu", warn=False), make_optimizer(model, 1e-3, 0.0))
    assert plain([adapter.example_batch(2, 8)]).skipped is None  # nothing scales: no skip is ever known


def test_ranks_plans_a_registered_strategy_by_its_own_formula(views):
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layer=2, n_head=2, max_len=32)
    result = plan_ranks(model, seq_len=16, precision="fp32", device="cpu", ranks=(2,), progress=False)
    t = result.table.set_index("mode")
    whole, grads = sum(static_bytes(model).values()), 4 * sum(p.numel() for p in model.parameters())
    assert t.loc["ddp", "static_per_rank_gib"] * 2**30 == whole + grads  # buckets: a copy of the gradients
    assert t.loc["ddp-views", "static_per_rank_gib"] * 2**30 == whole  # buckets: the gradients themselves
    assert t.loc["ddp-views", "this_device"] >= t.loc["ddp", "this_device"]
    assert "DDP (bucket views)" in result.summary_line() and "DDP (bucket views)" in result.headline()
    assert [r["mode"] for r in result.to_json()["smallest"]] == ["ddp", "fsdp", "ddp-views"]


_REGISTER = f"""
import importlib.util
from tier_utils.engine.strategies import register_strategy

_spec = importlib.util.spec_from_file_location("defined_here", {str(Path(__file__))!r})
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
register_strategy(_module.ViewsDDP)
"""


@pytest.mark.slow
def test_a_registered_strategy_trains_and_benchmarks_under_torchrun(tmp_path):
    text = text_file(tmp_path / "text.txt")
    worker = tmp_path / "worker.py"
    worker.write_text(worker_script(preamble=_REGISTER))
    common = ["--model", "tiny-gpt", *TWO_BLOCK_ARGS, "--device", "cpu", "--seq-len", "16", "--no-progress",
              "--data", str(text)]
    ok(torchrun([str(worker), "train", *common, "--strategy", "ddp-views", "--precision", "fp32", "--batch-size",
                 "2", "--max-steps", "2", "--eval-every", "0", "--eval-batches", "1", "--out", str(tmp_path / "run"),
                 "--json", str(tmp_path / "train.json"), "--next",
                 "bench", *common, "--strategy", "ddp,ddp-views", "--precisions", "fp32", "--batch-size", "2",
                 "--untimed-steps", "1", "--timed-steps", "2", "--repeats", "1", "--json",
                 str(tmp_path / "bench.json")]))
    summary = json.loads((tmp_path / "train.json").read_text())
    assert summary["strategy"] == "ddp-views" and summary["world_size"] == 2 and summary["steps"] == 2
    assert "DDP with bucket views over 2 rank(s)" in summary["sharding"]
    bench = json.loads((tmp_path / "bench.json").read_text())
    table = pd.DataFrame(bench["ranks"])
    assert sorted(zip(table["strategy"], table["rank"])) == [("ddp", 0), ("ddp", 1), ("ddp-views", 0),
                                                             ("ddp-views", 1)]
    assert table["ran"].all() and bench["config"]["compared"] == "DDP vs DDP (bucket views)"
    losses = table.groupby("strategy")["train_loss"].first()
    assert losses["ddp-views"] == pytest.approx(losses["ddp"], rel=1e-5)  # the same steps, less memory
    assert table[table["strategy"] == "ddp-views"]["detail"].str.contains("bucket views").all()
