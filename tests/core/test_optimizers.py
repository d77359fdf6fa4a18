"""The optimizer as an object (issue 51): the registry's spellings, an optimizer defined in a test running through
train, the benchmark and fit by its class alone, and (issue 50) paged AdamW8bit refused off CUDA in one line naming
the one that runs here, every field of a result naming what ran."""
import json

import pytest
import torch
from tiny import TINY_ARGS, tiny

from tier_utils import amp_benchmark, fit, train
from tier_utils.cli import main
from tier_utils.core import optimizers as O
from tier_utils.core.device import GPU_PROFILE_ENV, device_facts
from tier_utils.core.errors import MemorySettingError
from tier_utils.core.measure import static_memory
from tier_utils.core.memory_settings import MemorySettings, resolve_memory
from tier_utils.core.precision import resolve_precision
from tier_utils.planning.planner import cost_rank

TRAIN = dict(max_steps=2, batch_size=4, seq_len=16, eval_every=0, eval_batches=1, progress=False, device="cpu")
QUICK = dict(batch_size=4, seq_len=16, untimed_steps=1, timed_steps=1, repeats=1, accuracy_steps=3, eval_batches=1,
             progress=False, device="cpu")


class HeavyBall(O.Optimizer):
    """SGD with momentum: one buffer per trained parameter, in its dtype. Nothing in tier_utils knows it."""

    name, label = "heavy-ball", "HeavyBall"
    aliases = ("sgd_momentum",)
    description = "one momentum buffer"
    accuracy_cost = 1
    built: list = []

    @classmethod
    def build(cls, groups, lr, eps):
        cls.built.append(torch.optim.SGD(groups, lr=lr, momentum=0.9))
        return cls.built[-1]

    @classmethod
    def state_bytes_per_param(cls, numel, trained_size=4):
        return trained_size


@pytest.fixture
def heavy_ball(monkeypatch):
    monkeypatch.setattr(O, "_REGISTRY", O._REGISTRY.copy())  # registered for this test only
    O.register_optimizer(HeavyBall)
    HeavyBall.built = []
    return HeavyBall


def test_the_registry_reads_every_spelling_and_refuses_a_taken_name(heavy_ball):
    assert O.canonical_optimizer("Paged_AdamW_8bit") == "paged-adamw8bit"
    assert O.optimizer_class("adamw_bnb_8bit") is O.AdamW8bit and O.optimizer_class(" SGD_momentum ") is heavy_ball
    assert MemorySettings(optimizer=heavy_ball).optimizer == "heavy-ball"  # a class is kept as its name
    with pytest.raises(ValueError, match="unknown optimizer 'lion'; use one of: adamw, adamw8bit, "
                                         "paged-adamw8bit, heavy-ball"):
        O.canonical_optimizer("lion")

    class Clash(HeavyBall):
        name = "clash"
        aliases = ("adamw_torch",)

    with pytest.raises(ValueError, match=r"\['adamw_torch'\] already name an optimizer"):
        O.register_optimizer(Clash)
    with pytest.raises(ValueError, match="not a named Optimizer subclass"):
        O.register_optimizer(torch.optim.SGD)


def test_an_optimizer_defined_in_a_test_trains_and_fit_predicts_what_it_holds(heavy_ball):
    result = train(tiny(seed=0), memory=MemorySettings(optimizer="heavy-ball"), **TRAIN)
    s = result.summary
    assert len(heavy_ball.built) == 1 and s.optimizer == "HeavyBall (torch)"
    assert s.memory["decided_optimizer"] == "heavy-ball" and s.memory["describe"] == "full fine-tune, HeavyBall"
    held = static_memory(result.model, heavy_ball.built[0])
    trained = sum(p.numel() for p in result.model.parameters())
    assert held["optimizer_state_bytes"] == 4 * trained  # its own rule, the momentum buffers SGD made

    plan = fit(tiny(seed=0), seq_len=16, precisions="fp32", checkpointing=False, lora=0,
               optimizers="adamw,sgd_momentum", device="cpu", progress=False, validate=False)
    by = {c.name: c for c in plan.configs}
    assert set(by) == {"fp32", "fp32 · HeavyBall"}
    assert by["fp32 · HeavyBall"].static == sum(held.values())
    assert by["fp32"].static - by["fp32 · HeavyBall"].static == 4 * trained + 4 * len(list(result.model.parameters()))
    rank, base = cost_rank(by["fp32 · HeavyBall"]), cost_rank(by["fp32"])
    assert rank[0] == base[0] + heavy_ball.accuracy_cost  # its accuracy cost, read from its class


def test_an_optimizer_defined_in_a_test_is_benchmarked(heavy_ball):
    result = amp_benchmark(tiny(seed=0), precisions=("fp32",), memory=MemorySettings(optimizer="heavy-ball"), **QUICK)
    rec = next(r for r in result.records if r.precision == "fp32" and r.ran)
    trained = sum(p.numel() for p in tiny(seed=0).parameters())
    assert heavy_ball.built and {type(o) for o in heavy_ball.built} == {torch.optim.SGD}
    assert rec.memory["optimizer_state_bytes"] == 4 * trained
    assert result.to_json()["config"]["memory"]["optimizer"] == "heavy-ball"


def test_the_cli_trains_with_a_registered_optimizer_and_every_field_names_it(heavy_ball, tmp_path, capsys):
    out, summary = tmp_path / "run", tmp_path / "summary.json"
    code = main(["train", *TINY_ARGS, "--max-steps", "1", "--batch-size", "2", "--seq-len", "16", "--eval-every",
                 "0", "--device", "cpu", "--no-progress", "--out", str(out), "--optimizer", "heavy-ball",
                 "--json", str(summary)])
    assert code == 0, capsys.readouterr().err
    said = json.loads(summary.read_text())
    assert said["optimizer"] == "HeavyBall (torch)" and said["memory"]["decided_optimizer"] == "heavy-ball"
    assert "HeavyBall" in said["memory"]["describe"]


# -- paged AdamW8bit needs CUDA: refused elsewhere, naming the one that runs -------------------------------------------
@pytest.mark.parametrize("profile", [None, "T4"])  # a GPU profile decides for a card, but the tensors stay here
def test_paged_adamw8bit_off_cuda_is_refused_naming_adamw8bit(profile, monkeypatch):
    if profile:
        monkeypatch.setenv(GPU_PROFILE_ENV, profile)
    fp32 = resolve_precision("fp32", "cpu", warn=False)
    with pytest.raises(MemorySettingError, match="PagedAdamW8bit needs CUDA and this run's tensors are on cpu; use "
                                                 "--optimizer adamw8bit .*which runs here") as info:
        resolve_memory(MemorySettings(optimizer="paged-adamw8bit"), fp32, device_facts("cpu"), None)
    assert "\n" not in str(info.value)
    ran = resolve_memory(MemorySettings(optimizer="adamw8bit"), fp32, device_facts("cpu"), None)
    assert ran.optimizer is O.AdamW8bit and ran.to_dict()["decided_optimizer"] == "adamw8bit"
    assert ran.describe() == "full fine-tune, AdamW8bit"


def test_cli_paged_adamw8bit_on_a_cpu_is_one_line_exit_2_nothing_written(tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    out, summary = tmp_path / "run", tmp_path / "summary.json"
    code = main(["train", *TINY_ARGS, "--max-steps", "1", "--device", "cpu", "--no-progress", "--out", str(out),
                 "--optimizer", "paged-adamw8bit", "--json", str(summary)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "use --optimizer adamw8bit" in err, err
    assert not summary.exists() and (not out.exists() or not any(p.is_file() for p in out.rglob("*")))
