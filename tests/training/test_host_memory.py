"""The host-RAM pre-flight: a run predicted past the available RAM (TIER_UTILS_FREE_MEMORY stands in for it) is
refused in one line before anything loads or is written; the prediction sizes the model without allocating it."""
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file
from tiny import TINY, TINY_ARGS

from tier_utils import TinyGPT, train
from tier_utils.core.errors import HostMemoryShort
from tier_utils.core.memory_settings import MemorySettings
from tier_utils.training.host_memory import weights_of

RUN = dict(max_steps=2, seq_len=32, batch_size=4, eval_every=0, eval_batches=1, precision="fp32", progress=False)


def parameters() -> int:
    return sum(p.numel() for p in TinyGPT(**TINY).parameters())


def fp32_training_bytes() -> int:
    """fp32 on the CPU: weights, gradients and AdamW's two states, and its float32 step count per tensor."""
    return 16 * parameters() + 4 * len(list(TinyGPT(**TINY).parameters()))


def test_a_spec_is_sized_on_the_meta_device_and_a_folder_from_its_headers(tmp_path):
    weights = weights_of("tiny-gpt", dict(TINY))
    assert weights.parameters == parameters() and weights.resident == 0
    assert {p.device.type for p in weights.module.parameters()} == {"meta"}  # nothing allocated
    save_file({"a.weight": torch.zeros(8, 4, dtype=torch.bfloat16), "b.bias": torch.zeros(3)},
              str(tmp_path / "model.safetensors"))
    folder = weights_of(str(tmp_path), {})
    assert (folder.parameters, folder.stored_bytes, folder.module) == (35, 8 * 4 * 2 + 3 * 4, None)
    assert weights_of("hf:someone/some-model", {}) is None  # a hub id would download: not sized here


def test_a_run_past_the_available_ram_is_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch):
    need = fp32_training_bytes()
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(need - 1))
    with pytest.raises(HostMemoryShort) as caught:
        train("tiny-gpt", model_kwargs=dict(TINY), checkpoint_dir=tmp_path / "ckpt", **RUN)
    line = str(caught.value)
    assert "\n" not in line and caught.value.exit_code == 2
    assert line.startswith("training tiny-gpt on the CPU in fp32 (weights, gradients and AdamW state; activations "
                           f"come on top) needs at least {need / 1024:.0f} KiB more host RAM (predicted from its "
                           f"{parameters():,} parameters), over the ")
    assert "TIER_UTILS_FREE_MEMORY" in line and "LoRA (--lora r=8)" in line
    assert not (tmp_path / "ckpt").exists()
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(need))  # just enough: not refused
    assert train("tiny-gpt", model_kwargs=dict(TINY), **RUN).summary.steps == 2


def test_a_module_in_memory_counts_only_what_training_adds(monkeypatch):
    model = TinyGPT(**TINY)
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(fp32_training_bytes() - held - 1))
    with pytest.raises(HostMemoryShort, match="training TinyGPT on the CPU in fp32"):
        train(model, **RUN)
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(fp32_training_bytes() - held))
    assert train(model, **RUN).summary.steps == 2


def test_lora_is_predicted_with_its_frozen_base(monkeypatch):
    """With LoRA the base is frozen (its weights only): a budget that refuses full training lets LoRA run."""
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(8 * parameters()))
    with pytest.raises(HostMemoryShort):
        train("tiny-gpt", model_kwargs=dict(TINY), **RUN)
    assert train("tiny-gpt", model_kwargs=dict(TINY), memory=MemorySettings(lora="r=4"), **RUN).summary.steps == 2


def test_cli_refuses_with_exit_2_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "tier_utils", "train", "--model", "tiny-gpt", *TINY_ARGS,
                           "--max-steps", "2", "--no-progress", "--out", str(out), "--json", str(out / "t.json")],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TIER_UTILS_FREE_MEMORY": "64KiB"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: training tiny-gpt on the CPU")
    assert not out.exists()


def test_a_module_on_a_gpu_adds_no_host_memory_to_load():
    from tier_utils.training.config import TrainConfig
    from tier_utils.training.host_memory import _peak

    weights = weights_of(TinyGPT(**TINY).to("meta"), {})  # held off the host, as on a GPU
    assert weights.stored_bytes == weights.resident == 0
    assert _peak(weights, None, TrainConfig(), torch.device("cuda"))[0] == 0
