"""Export: tiny-gpt, tiny-encoder and a tiny HF GPT-2 to ONNX and pt2 with PASSing parity rows,
the one-line error for an unexportable construct, and the CLI verb."""
import json

import pytest
import torch
from tiny import TINY, TINY_ARGS, tiny

from tier_utils import ExportError, export
from tier_utils.cli import main

MODELS = {
    "tiny-gpt": TINY,
    "tiny-encoder": TINY,
    "hf:GPT2LMHeadModel": dict(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=32,
                               bos_token_id=0, eos_token_id=0),
}


@pytest.mark.slow  # one torch.export (+ ONNX translation) per case: a few seconds each
@pytest.mark.parametrize("fmt", ["onnx", "pt2"])
@pytest.mark.parametrize("spec", list(MODELS))
def test_export_parity_passes(spec, fmt, tmp_path):
    path = tmp_path / f"model.{fmt}"
    result = export(spec, path, format=fmt, repeats=2, model_kwargs=MODELS[spec])
    assert path.is_file() and path.stat().st_size == result.config.bytes
    table = result.table
    assert len(table) == 4  # two batch shapes x (relative max |Δ|, argmax agreement)
    assert set(table["status"]) == {"PASS"}, table.to_string()
    assert result.status == "PASS"
    # The parity shapes differ from the traced one in batch and length: the axes really are dynamic.
    assert result.config.trace_shape == [2, 16] and result.config.parity_shapes == ["1x8", "4x32"]
    lat = result.latency_table
    assert set(lat.index.get_level_values("runner")) == {"eager", "onnxruntime" if fmt == "onnx" else "torch.export"}
    assert (lat["n"] == 2).all() and (lat["median_ms"] > 0).all()
    summary = result.to_json()
    assert summary["metadata"]["dtype"] == "float32" and summary["metadata"]["torch"] == torch.__version__
    json.dumps(summary)


def test_reloaded_pt2_matches_the_model_and_the_model_is_untouched(tmp_path):

    torch.manual_seed(0)
    model = tiny().train()
    result = export(model, tmp_path / "m.pt2", format="pt2", precision="bf16", repeats=1)
    assert result.config.precision == "bf16" and result.metadata["dtype"] == "bfloat16"
    assert model.training and model.head.weight.dtype == torch.float32  # a copy was cast and exported
    assert len(result.plot().axes) == 1
    program = torch.export.load(str(tmp_path / "m.pt2")).module()
    ids = torch.randint(0, 256, (3, 11))
    with torch.inference_mode():
        expected = model.to(torch.bfloat16).eval()(ids)
        assert torch.allclose(program(ids).float(), expected.float(), atol=1e-2)


BRANCHY = """
import torch.nn as nn


class Branchy(nn.Module):
    \"\"\"A Python branch on a tensor's value: torch.export cannot capture it.\"\"\"

    max_len = 32

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.head = nn.Linear(16, 256)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        if x.sum() > 0:
            x = x * 2
        return self.head(x)
"""


def branchy_file(tmp_path):
    src = tmp_path / "branchy.py"
    src.write_text(BRANCHY)
    return src


@pytest.mark.parametrize("fmt", ["pt2", "onnx"])
def test_unexportable_construct_is_one_line_naming_it(fmt, tmp_path):
    path = tmp_path / f"m.{fmt}"
    with pytest.raises(ExportError) as info:
        export(f"{branchy_file(tmp_path)}:Branchy", path, format=fmt, repeats=1)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"cannot export Branchy to {fmt}: torch.export stopped on GuardOnDataDependentSymNode")
    assert "branchy.py:17 in forward()" in message and "torch.cond" in message
    assert not path.exists()


def test_bad_format_and_missing_runtime_name_the_fix(monkeypatch, tmp_path):
    with pytest.raises(ExportError, match="unknown export format 'tflite'; use one of: onnx, pt2"):
        export("tiny-gpt", tmp_path / "m", format="tflite")
    with pytest.raises(ValueError, match=r"unknown export setting\(s\) d_model; valid: format, precision"):
        export("tiny-gpt", tmp_path / "m.pt2", d_model=32)  # model arguments go in model_kwargs
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    with pytest.raises(ExportError, match=r'needs onnxruntime: pip install "tier_utils\[export\]"'):
        export("tiny-gpt", tmp_path / "m.onnx", format="onnx")


def test_cli_export_writes_artifact_and_json(tmp_path, capsys):
    out, summary = tmp_path / "m.pt2", tmp_path / "export.json"
    args = ["export", "--model", "tiny-gpt", "--format", "pt2", "--out", str(out), "--repeats", "2", "--json",
            str(summary), *TINY_ARGS]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "parity: PASS" in printed and "n=2" in printed
    assert out.is_file() and json.loads(summary.read_text())["status"] == "PASS"


def test_cli_export_unexportable_exits_2_and_writes_nothing(tmp_path, capsys):
    src = branchy_file(tmp_path)
    out = tmp_path / "m.onnx"
    assert main(["export", "--model", f"{src}:Branchy", "--out", str(out), "--json", str(tmp_path / "j.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot export Branchy to onnx")
    assert not out.exists() and not (tmp_path / "j.json").exists()


def test_a_4bit_qlora_model_exports_merged_and_dequantised(tmp_path):
    """torch.export refuses bitsandbytes' Params4bit (the tier-3 notebook's Run All stopped on it under QLoRA): the
    export is the merged, dequantised model, checked against eager; the caller's model stays 4-bit."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    from tier_utils.core.memory_settings import DecidedMemory, MemorySettings
    from tier_utils.engine.quantization import apply_memory, quantized_layers

    qlora = apply_memory(tiny(seed=0), DecidedMemory(MemorySettings.qlora(), torch.float32, "test"), torch.float32)
    result = export(qlora, tmp_path / "model.pt2", format="pt2", repeats=1)
    assert result.status == "PASS", result.table
    assert quantized_layers(qlora) and (tmp_path / "model.pt2").stat().st_size > 0
