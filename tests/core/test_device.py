"""core/device.py: the one reader of the hardware. TIER_UTILS_GPU_PROFILE makes every decision read a named card
(auto precision and its reason, native and SKIP decisions, the planner's budget and columns, the notebook preset)
while the tensors stay on this CPU; without it, a CPU is decided as before."""
import re
import warnings
from pathlib import Path

import pytest
import torch
from tiny import TINY_ARGS, tiny

import tier_utils
from tier_utils import amp_benchmark, fit, info, train
from tier_utils.cli import main
from tier_utils.core import precision as P
from tier_utils.core.budget import CUDA_CONTEXT, FREE_MEMORY_ENV, SAFE_SHARE, read_budget
from tier_utils.core.device import CPU_FLAGS_ENV, GPU_PROFILE_ENV, GPU_PROFILES, device_facts
from tier_utils.core.results import run_metadata
from tier_utils.planning.planner import GPU_COLUMNS
from tier_utils.presets import NOTEBOOK, notebook_preset
from tier_utils.widgets import RunConfig

QUICK = dict(batch_size=2, seq_len=16, untimed_steps=1, timed_steps=1, repeats=1, accuracy_steps=4, eval_batches=1,
             progress=False, device="cpu")


@pytest.fixture
def profile(monkeypatch):
    """Set TIER_UTILS_GPU_PROFILE for this test; the CPU's own flags say nothing (no native bf16/fp16)."""
    monkeypatch.setenv(CPU_FLAGS_ENV, "")
    monkeypatch.setattr(P, "_slow_warned", set())

    def use(key):
        monkeypatch.setenv(GPU_PROFILE_ENV, key)
    return use


def test_t4_decides_fp16_with_a_gradscaler_and_emulated_bf16_while_tensors_stay_on_the_cpu(profile):
    profile("T4")
    auto = P.resolve_precision("auto", "cpu")
    assert (auto.name, auto.needs_scaler, auto.device.type) == ("fp16", True, "cpu")
    assert "Tesla T4" in auto.reason and "GradScaler" in auto.reason and "not bf16" in auto.reason
    assert f"{GPU_PROFILE_ENV}=T4" in auto.reason  # the decision says where its card came from
    with pytest.warns(P.SlowPrecisionWarning, match="no bf16 tensor cores"):
        bf16 = P.resolve_precision("bf16", "cpu")
    assert not bf16.native and "emulated" in bf16.reason
    with pytest.raises(ValueError, match="bf16-true needs native bf16"):
        P.resolve_precision("bf16-true", "cpu", warn=False).check_runnable()
    assert P.supported_precisions("cpu") == ["fp32", "fp16", "fp16-true"]
    with auto.autocast():  # autocast on the tensors' device type, in the card's dtype
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float16


def test_t4_benchmark_skips_bf16_with_the_reason_and_runs_fp16_with_a_scaler_on_cpu_tensors(profile):
    profile("T4")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", P.SlowPrecisionWarning)
        result = amp_benchmark(tiny(seed=0), precisions=("fp32", "bf16", "fp16"), **QUICK)
    bf16 = result.verdicts.query("precision == 'bf16'")
    assert set(bf16.status) == {"SKIP"} and all("Tesla T4" in d and "no bf16 tensor cores" in d for d in bf16.detail)
    fp16 = {r.precision: r for r in result.records}["fp16"]
    assert fp16.ran and fp16.dtype == "float16"
    trained = train(tiny(seed=0), precision="auto", max_steps=2, batch_size=2, seq_len=16, eval_every=0,
                    eval_batches=1, progress=False, device="cpu")
    assert trained.summary.precision == "fp16" and trained.summary.steps == 2  # GradScaler steps on the CPU


def test_t4_notebook_preset_is_the_gpu_one_and_a_plain_cpu_keeps_its_own(profile, monkeypatch):
    profile("T4")
    assert notebook_preset("cpu") is NOTEBOOK["cuda"] is RunConfig(device="cpu").preset
    monkeypatch.delenv(GPU_PROFILE_ENV)
    assert notebook_preset("cpu") is NOTEBOOK["cpu"]


@pytest.mark.parametrize("key", ["L4", "H100"])
def test_l4_and_h100_run_bf16_natively_and_list_fp8_tensor_cores(profile, key):
    profile(key)
    auto = P.resolve_precision("auto", "cpu")
    assert (auto.name, auto.native, auto.needs_scaler) == ("bf16", True, False)
    assert GPU_PROFILES[key].name in auto.reason and "bf16 tensor cores" in auto.reason
    assert P.resolve_precision("bf16-true", "cpu").native  # a true mode runs there, not SKIPped
    facts = device_facts("cpu")
    assert facts.gpu.has("fp8") and "fp8" in facts.to_dict()["tensor_cores"]
    env = info(tiny(seed=0), device="cpu").environment
    assert env["native_bf16"] and env["native_fp16"] and "fp8" in env["tensor_cores"]
    assert env["device"] == "cpu" and env["device_name"] == device_facts("cpu").measured_on  # measured on this CPU
    assert not GPU_PROFILES["T4"].has("fp8") and not GPU_PROFILES["A100-80GB"].has("fp8")


def test_h200_budget_and_the_planners_columns_follow_the_card(profile, monkeypatch):
    profile("H200")
    budget = read_budget("cpu")
    card = GPU_PROFILES["H200"]
    assert (budget.device, budget.free_bytes) == ("cuda", (card.memory_mib << 20) - CUDA_CONTEXT)
    assert budget.limit == int(SAFE_SHARE["cuda"] * budget.free_bytes) and "H200" in budget.source
    assert budget.probe_limit < budget.limit  # a measuring forward on this CPU is still a CPU's
    result = fit(tiny(seed=0), precisions=("fp32", "bf16"), checkpointing=False, lora=0, seq_len=16, progress=False,
                 device="cpu")
    table = result.table
    column = f"{card.label} (predicted)"
    assert column in GPU_COLUMNS and column in table and (table.this_device == table[column]).all()
    assert result.to_json()["gpus_mib"][card.label] == card.memory_mib
    monkeypatch.setenv(FREE_MEMORY_ENV, "1GiB")  # the override still wins, in the card's kind
    assert (read_budget("cpu").free_bytes, read_budget("cpu").device) == (1 << 30, "cuda")


def test_an_unknown_profile_is_a_one_line_error_naming_the_profiles(profile, capsys):
    profile("T5")
    with pytest.raises(ValueError, match=r"unknown GPU profile 'T5'; use one of: T4, L4, .*H200") as err:
        P.resolve_precision("auto", "cpu")
    assert "\n" not in str(err.value)
    assert main(["info", *TINY_ARGS, "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "unknown GPU profile 'T5'" in lines[0]


@pytest.mark.parametrize("flags,auto", [("", "fp32"), ("avx512_bf16", "bf16")])
def test_a_plain_cpu_is_decided_as_before(monkeypatch, flags, auto):
    monkeypatch.delenv(GPU_PROFILE_ENV, raising=False)
    monkeypatch.setenv(CPU_FLAGS_ENV, flags)
    facts = device_facts("cpu")
    assert (facts.kind, facts.gpu, facts.profiled, facts.total_bytes) == ("cpu", None, False, None)
    assert P.resolve_precision("auto", "cpu").name == auto
    assert read_budget("cpu").device == "cpu" and read_budget("cpu").source == "available RAM"
    assert "gpu_profile" not in run_metadata("cpu")


def test_a_precision_decided_under_a_profile_is_decided_again_without_it(profile, monkeypatch):
    profile("T4")
    t4 = P.resolve_precision("auto", "cpu")
    monkeypatch.delenv(GPU_PROFILE_ENV)
    again = P.resolve_precision(t4, "cpu")
    assert again.name == "fp32" and again is not t4  # this CPU (no flags) decides fp32


def test_only_core_device_reads_the_card():
    """The hardware is read in one place: no other module asks torch.cuda for a card's capability, name or
    properties."""
    root = Path(tier_utils.__file__).parent
    reads = re.compile(r"torch\.cuda\.get_device_(capability|name|properties)")
    found = [str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "device.py" or p.parent.name != "core"
             if reads.search(p.read_text())]
    assert found == []
