import warnings
from unittest import mock

import pytest
import torch

from tier_utils.core import precision as P
from tier_utils.core.precision import Precision, canonical_precision, resolve_precision, supported_precisions

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
    with pytest.raises(ValueError, match="use one of: .*bf16-mixed.*fp32"):
        canonical_precision(bad)


def fake_gpu(cc, name):
    """Pretend there is a CUDA device with compute capability `cc` (no GPU needed)."""
    return mock.patch.multiple(
        torch.cuda, is_available=lambda: True, get_device_capability=lambda d=None: cc,
        get_device_name=lambda d=None: name, is_bf16_supported=lambda *a, **k: True,
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
    assert (p.name, p.native, p.needs_scaler) == ("fp32", True, False) and "< 7.0" in p.reason


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
def test_auto_on_cpu_follows_native_bf16(flags, expected):
    with mock.patch.object(P, "cpu_flags", lambda: frozenset(flags)):
        assert resolve_precision("auto", "cpu").name == expected


def test_fp16_on_cpu_without_native_fp16_warns_and_is_not_native():
    P._slow_warned.clear()
    with mock.patch.object(P, "cpu_flags", lambda: frozenset({"avx512_bf16"})), \
            pytest.warns(P.SlowPrecisionWarning, match="fp16"):
        p = resolve_precision("16-mixed", "cpu")
    assert not p.native and p.needs_scaler and p.grad_scaler().is_enabled()
    with mock.patch.object(P, "cpu_flags", lambda: frozenset({"avx512_bf16"})):
        assert supported_precisions("cpu") == ["fp32", "bf16"]


def test_fp32_has_no_autocast_and_a_disabled_scaler():
    p = resolve_precision("fp32", "cpu")
    x = torch.randn(4, 4)
    with p.autocast():
        assert (x @ x).dtype == torch.float32
    assert not p.grad_scaler().is_enabled()


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
    assert set(d) == {"requested", "precision", "dtype", "device", "device_name", "native", "needs_scaler", "reason"}
    assert d["dtype"] == "float32" and d["reason"]


@pytest.mark.parametrize("env,auto,supported", [
    ("", "fp32", ["fp32"]),
    ("avx512_bf16", "bf16", ["fp32", "bf16"]),
    ("amx_bf16, avx512_fp16", "bf16", ["fp32", "bf16", "fp16"]),
    ("avx512_fp16", "fp32", ["fp32", "fp16"]),
])
def test_cpu_flags_env_replaces_the_detected_flags(monkeypatch, env, auto, supported):
    monkeypatch.setenv(P.CPU_FLAGS_ENV, env)
    assert P.cpu_flags() == frozenset(f.strip() for f in env.split(",") if f.strip())
    assert resolve_precision("auto", "cpu").name == auto
    assert supported_precisions("cpu") == supported
    monkeypatch.delenv(P.CPU_FLAGS_ENV)
    assert P.cpu_flags() == P._detected_cpu_flags()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_the_real_gpu_follows_its_compute_capability():
    cc = torch.cuda.get_device_capability()
    expected = "bf16" if cc >= (8, 0) else "fp16" if cc >= (7, 0) else "fp32"
    p = resolve_precision("auto", "cuda")
    assert p.name == expected and p.device.type == "cuda" and f"{cc[0]}.{cc[1]}" in p.reason
    assert p.grad_scaler().is_enabled() == (expected == "fp16")
    x = torch.randn(8, 8, device="cuda")
    with p.autocast():
        assert (x @ x).dtype == p.dtype


def test_a_precision_decided_for_another_device_is_decided_again_from_what_was_asked():
    """auto stays auto: a decision made elsewhere is redone from the request, not from the name it came to."""
    elsewhere = Precision("auto", "fp16", torch.device("meta"), True, "auto: decided on another device")
    again = resolve_precision(elsewhere, "cpu")
    assert again.device == torch.device("cpu") and again.requested == "auto" and again.reason.startswith("auto: ")
    here = resolve_precision("auto", "cpu")
    assert resolve_precision(here, torch.device("cpu")) is here  # decided here: kept whole
