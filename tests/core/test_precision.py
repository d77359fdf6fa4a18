import warnings
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from tier_utils.core import precision as P
from tier_utils.core.device import CPU_FLAGS_ENV, _detected_cpu_flags, cpu_flags
from tier_utils.core.dtype_contexts import kept_dtypes
from tier_utils.core.precision import canonical_precision, resolve_precision, supported_precisions

ALIASES = {
    "fp32": "fp32", "32": "fp32", "32-true": "fp32", "float32": "fp32",
    "fp16": "fp16", "16": "fp16", "16-mixed": "fp16", "float16": "fp16", "half": "fp16",
    "bf16": "bf16", "bf16-mixed": "bf16", "bfloat16": "bf16", "auto": "auto", "BF16": "bf16", 16: "fp16",
}


@pytest.mark.parametrize("spelling,expected", ALIASES.items())
def test_every_spelling_maps_to_its_name(spelling, expected):
    assert canonical_precision(spelling) == expected


@pytest.mark.parametrize("bad", ["fp8", "", "mixed", "tf32", None])
def test_unknown_precision_lists_valid_names(bad):
    with pytest.raises(ValueError, match="use one of: auto, fp32, bf16, fp16, bf16-true, fp16-true$"):
        canonical_precision(bad)


def fake_gpu(cc, name):
    """Pretend there is a CUDA device with compute capability `cc` (no GPU needed): what core.device reads."""
    props = SimpleNamespace(name=name, major=cc[0], minor=cc[1], total_memory=16 << 30)
    return mock.patch.multiple(
        torch.cuda, is_available=lambda: True, get_device_properties=lambda d=None: props,
        is_bf16_supported=lambda *a, **k: True,
    )


def test_auto_on_t4_is_fp16_with_scaler_even_though_torch_claims_bf16():
    with fake_gpu((7, 5), "Tesla T4"):
        assert torch.cuda.is_bf16_supported()  # the trap: True on a T4, where bf16 is emulated
        p = resolve_precision("auto", "cuda")
    assert (p.name, p.dtype, p.needs_scaler) == ("fp16", torch.float16, True)
    assert "7.5" in p.reason and "fp16" in p.reason and "GradScaler" in p.reason


def test_auto_below_volta_is_fp32_not_unsupported_fp16():
    with fake_gpu((6, 0), "Tesla P100"):
        p = resolve_precision("auto", "cuda")
    assert (p.name, p.native, p.needs_scaler) == ("fp32", True, False) and "7.0" in p.reason


@pytest.mark.parametrize("cc,name", [((8, 0), "NVIDIA A100"), ((9, 0), "NVIDIA H100")])
def test_auto_on_ampere_or_newer_is_bf16(cc, name):
    with fake_gpu(cc, name):
        p = resolve_precision("auto", "cuda")
    assert (p.name, p.needs_scaler, p.native) == ("bf16", False, True)
    assert name in p.reason


def test_explicit_bf16_on_t4_runs_but_warns_once():
    P._slow_warned.clear()
    with fake_gpu((7, 5), "Tesla T4"), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = resolve_precision("bf16", "cuda")
        resolve_precision("bf16-mixed", "cuda")
    slow = [w for w in caught if issubclass(w.category, P.SlowPrecisionWarning)]
    assert len(slow) == 1 and "emulated" in str(slow[0].message)
    assert first.name == "bf16" and not first.native


@pytest.mark.parametrize("flags,expected", [
    ({"avx512_bf16", "avx512f"}, "bf16"), ({"amx_bf16"}, "bf16"), ({"avx2"}, "fp32"), (set(), "fp32"),
])
def test_auto_on_cpu_follows_native_bf16(monkeypatch, flags, expected):
    monkeypatch.setenv(CPU_FLAGS_ENV, ",".join(flags))
    assert resolve_precision("auto", "cpu").name == expected


def test_fp16_on_cpu_without_native_fp16_warns_and_is_not_native(monkeypatch):
    P._slow_warned.clear()
    monkeypatch.setenv(CPU_FLAGS_ENV, "avx512_bf16")
    with pytest.warns(P.SlowPrecisionWarning, match="fp16"):
        p = resolve_precision("16-mixed", "cpu")
    assert not p.native and p.needs_scaler
    assert supported_precisions("cpu") == ["fp32", "bf16", "bf16-true"]


def test_fp32_has_no_autocast_and_no_scaler():
    p = resolve_precision("fp32", "cpu")
    x = torch.randn(4, 4)
    with p.forward_context():
        assert (x @ x).dtype == torch.float32
    assert not p.needs_scaler


def test_bf16_autocast_runs_matmul_in_bf16_on_cpu():
    p = resolve_precision("bf16", "cpu", warn=False)
    x = torch.randn(4, 4)
    with p.autocast():
        assert (x @ x).dtype == torch.bfloat16
    assert not p.needs_scaler


def test_asking_for_cuda_without_a_gpu_names_the_fix():
    with mock.patch.object(torch.cuda, "is_available", lambda: False):
        with pytest.raises(ValueError, match="use --device cpu"):
            resolve_precision("auto", "cuda")


def test_to_dict_has_the_decision_and_reason():
    d = resolve_precision("fp32", "cpu").to_dict()
    assert set(d) == {"requested", "precision", "dtype", "param_dtype", "device", "device_name", "native",
                      "needs_scaler", "reason"}
    assert d["dtype"] == "float32" and d["reason"]


@pytest.mark.parametrize("env,auto,supported", [
    ("", "fp32", ["fp32"]),
    ("avx512_bf16", "bf16", ["fp32", "bf16", "bf16-true"]),
    ("amx_bf16, avx512_fp16", "bf16", ["fp32", "bf16", "fp16", "bf16-true", "fp16-true"]),
    ("avx512_fp16", "fp32", ["fp32", "fp16", "fp16-true"]),
])
def test_cpu_flags_env_replaces_the_detected_flags(monkeypatch, env, auto, supported):
    monkeypatch.setenv(CPU_FLAGS_ENV, env)
    assert cpu_flags() == frozenset(f.strip() for f in env.split(",") if f.strip())
    assert resolve_precision("auto", "cpu").name == auto
    assert supported_precisions("cpu") == supported
    monkeypatch.delenv(CPU_FLAGS_ENV)
    assert cpu_flags() == _detected_cpu_flags()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_the_real_gpu_follows_its_compute_capability():
    cc = torch.cuda.get_device_capability()
    expected = "bf16" if cc >= (8, 0) else "fp16" if cc >= (7, 0) else "fp32"
    p = resolve_precision("auto", "cuda")
    assert p.name == expected and p.device.type == "cuda" and f"{cc[0]}.{cc[1]}" in p.reason
    assert p.needs_scaler == (expected == "fp16")
    x = torch.randn(8, 8, device="cuda")
    with p.autocast():
        assert (x @ x).dtype == p.dtype


def test_a_precision_decided_for_another_device_is_decided_again_from_what_was_asked():
    """auto stays auto: a decision made elsewhere is redone from the request, not from the name it came to."""
    elsewhere = P.Fp16Mixed("auto", torch.device("meta"), True, "auto: decided on another device")
    again = resolve_precision(elsewhere, "cpu")
    assert again.device == torch.device("cpu") and again.requested == "auto" and again.reason.startswith("auto: ")
    here = resolve_precision("auto", "cpu")
    assert resolve_precision(here, torch.device("cpu")) is here  # decided here: kept whole


# -- the strategy objects -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spelling,name", [("bf16-true", "bf16-true"), ("16-true", "fp16-true"),
                                           ("fp16-true", "fp16-true"), ("32-true", "fp32")])
def test_lightning_true_spellings_map_to_the_true_modes(spelling, name):
    assert canonical_precision(spelling) == name


@pytest.mark.parametrize("name,param,compute,per_param", [
    ("fp32", torch.float32, torch.float32, 16), ("bf16", torch.float32, torch.bfloat16, 16),
    ("fp16", torch.float32, torch.float16, 16), ("bf16-true", torch.bfloat16, torch.bfloat16, 8),
    ("fp16-true", torch.float16, torch.float16, 8),
])
def test_each_mode_converts_a_module_to_its_weight_dtype(name, param, compute, per_param):
    """A bf16-stored model becomes fp32 master weights for fp32 and the mixed modes, the 2-byte type for the
    true ones; the static bytes per parameter follow."""
    p = resolve_precision(name, "cpu", warn=False)
    stored = torch.nn.Linear(4, 4).to(torch.bfloat16)
    assert p.convert_module(stored) is stored and stored.weight.dtype == param
    assert (p.param_dtype, p.compute_dtype, p.dtype) == (param, compute, compute)
    assert sum(p.static_bytes_per_param().values()) == per_param
    with p.forward_context():
        assert stored(torch.ones(2, 4, dtype=param)).dtype == compute


def test_describe_weights_names_stored_and_held_dtypes():
    bf16 = resolve_precision("bf16", "cpu", warn=False)
    assert bf16.describe_weights(torch.bfloat16) == "weights stored bf16 → fp32 master weights, bf16 autocast"
    true = resolve_precision("bf16-true", "cpu", warn=False)
    assert true.describe_weights(torch.float32) == ("weights stored fp32 → bf16 weights, gradients and AdamW state "
                                                    "(bf16-true)")
    assert resolve_precision("fp32", "cpu").describe_weights(None) == "fp32 weights, gradients and AdamW state"


def test_fp16_true_says_it_has_no_loss_scaling_and_keeps_adamw_eps_representable():
    p = resolve_precision("16-true", "cpu", warn=False)
    assert not p.needs_scaler
    assert "no loss scaling" in p.reason and "GradScaler" in p.reason
    assert torch.tensor(p.adamw_eps, dtype=torch.float16) > 0 and torch.tensor(1e-8, dtype=torch.float16) == 0


@pytest.mark.parametrize("env,native", [("", False), ("avx512_bf16", True)])
def test_true_modes_follow_the_hardware_rule_of_their_dtype(monkeypatch, env, native):
    monkeypatch.setenv(CPU_FLAGS_ENV, env)
    p = resolve_precision("bf16-true", "cpu", warn=False)
    assert p.native is native and ("avx512_bf16" in p.reason)
    with fake_gpu((7, 5), "Tesla T4"):
        t4 = resolve_precision("bf16-true", "cuda", warn=False)
        assert not t4.native and "compute capability 8.0" in t4.reason
        assert resolve_precision("fp16-true", "cuda", warn=False).native
        assert resolve_precision("auto", "cuda").name == "fp16"  # auto never picks a true mode


def test_kept_dtypes_puts_every_parameter_and_buffer_back():
    m = torch.nn.BatchNorm1d(3).to(torch.bfloat16)
    with kept_dtypes(m):
        resolve_precision("fp32", "cpu").convert_module(m)
        assert m.weight.dtype == m.running_mean.dtype == torch.float32
    assert m.weight.dtype == m.running_mean.dtype == torch.bfloat16


def test_register_precision_adds_a_mode_and_refuses_a_taken_name(monkeypatch):
    monkeypatch.setattr(P, "_REGISTRY", P._REGISTRY.copy())

    class Fp64(P.Precision):
        name = "fp64-true"
        aliases = ("64-true",)
        param_dtype = compute_dtype = torch.float64

    P.register_precision(Fp64)
    p = resolve_precision("64-true", "cpu")
    assert type(p) is Fp64 and p.native and sum(p.static_bytes_per_param().values()) == 32

    class Clash(P.Precision):
        name = "bf16-mixed"

    with pytest.raises(ValueError, match="already name a precision"):
        P.register_precision(Clash)


def test_a_mode_says_where_it_runs_its_ranks_and_its_range():
    from tier_utils.core.device import GPU_PROFILES, predicted_facts

    t4, l4 = predicted_facts(GPU_PROFILES["T4"]), predicted_facts(GPU_PROFILES["L4"])  # bf16 emulated; native
    bf16, bf16_true = resolve_precision("bf16", "cpu", warn=False), resolve_precision("bf16-true", "cpu", warn=False)
    assert bf16.runs_here(t4) and not bf16.native_on(t4) and bf16.native_on(l4)  # a mixed mode runs emulated
    assert not bf16_true.runs_here(t4) and bf16_true.runs_here(l4)  # a true mode does not
    assert bf16.speed_rank(l4) < resolve_precision("fp32", "cpu").speed_rank(l4) < bf16.speed_rank(t4)
    assert bf16.cost_rank(l4) < bf16_true.cost_rank(l4)  # the true mode's rounded-away updates cost first
    fp16 = P.precision_class("fp16")
    assert fp16.range_max() == 65504 and fp16.smallest_normal() == pytest.approx(6.1e-5, rel=1e-2)
    weights = {"small": torch.tensor([1.0, -6e4]), "big": torch.tensor([7e4]), "ids": torch.tensor([10**6])}
    assert fp16.out_of_range(weights.items()) == ["big"]  # an integer buffer is no weight fp16 holds
    assert P.precision_class("bf16").out_of_range(weights.items()) == []


def test_the_baseline_and_where_a_mode_runs_are_decided_on_the_class_alone():
    """No module compares a precision name with "fp32" (BASELINE names it) or reads runs_emulated (runs_here
    does), but core/precision.py and core/errors.py (below it: it imports nothing of the package)."""
    import ast
    from pathlib import Path

    import tier_utils

    package = Path(tier_utils.__file__).parent
    allowed = {package / "core" / "precision.py", package / "core" / "errors.py"}
    found = []
    for path in sorted(set(package.rglob("*.py")) - allowed):
        for node in ast.walk(ast.parse(path.read_text())):
            compared = isinstance(node, ast.Compare) and any(
                isinstance(c, ast.Constant) and c.value == P.BASELINE for c in [node.left, *node.comparators])
            if compared or (isinstance(node, ast.Attribute) and node.attr == "runs_emulated"):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
    assert not found, found
