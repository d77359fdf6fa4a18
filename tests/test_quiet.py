"""No library warning a user can't act on: tiers 2 and 3 on a transformers folder, from the CLI, print nothing on
stderr but tier_utils' own lines (transformers' attention-mask warning and loading bar included)."""
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 300


def _cli(*args, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "tier_utils", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow  # two CLI runs on a small GPT-2: ~20 s on 2 cores
def test_tiers_2_and_3_on_a_transformers_folder_print_only_their_own_lines(trained_hf_folder, tmp_path):
    from transformers import AutoTokenizer

    folder = shutil.copytree(trained_hf_folder, tmp_path / "gpt2")
    (tmp_path / "notes.txt").write_text(TEXT)
    # A pad token that the windows start and end with: transformers then warns unless it is given a mask.
    ids = AutoTokenizer.from_pretrained(folder)(TEXT)["input_ids"]
    config = json.loads((folder / "config.json").read_text())
    config["pad_token_id"] = Counter(ids).most_common(1)[0][0]
    (folder / "config.json").write_text(json.dumps(config))
    sizes = ["--model", "gpt2", "--data", "notes.txt", "--batch-size", "2", "--seq-len", "32", "--device", "cpu"]
    runs = {"analyze": _cli("analyze", *sizes, "--n-batches", "1", cwd=tmp_path),
            "train": _cli("train", *sizes, "--max-steps", "3", "--eval-every", "3", "--eval-batches", "1",
                          "--out", "run", cwd=tmp_path)}
    for verb, run in runs.items():
        assert run.returncode in (0, 1), (verb, run.stderr[-2000:])
        foreign = [line for line in run.stderr.splitlines()
                   if line.strip() and not line.startswith((f"{verb}:", "warning:", "tier_utils"))]
        assert foreign == [], (verb, foreign)


def test_the_adapter_gives_a_transformers_model_the_mask_it_knows(monkeypatch):
    """An unpadded window's mask is all ones: transformers gets it rather than warning, on every call, that the
    ids may be padded (it checks for its pad id at the ends)."""
    import torch
    import transformers

    from tier_utils import adapt, load_model

    seen = []
    monkeypatch.setattr(transformers.PreTrainedModel, "warn_if_padding_and_no_attention_mask",
                        lambda self, ids, mask: seen.append(mask))
    model = load_model("hf:GPT2LMHeadModel", vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                       pad_token_id=3)
    adapt(model).logits(torch.full((2, 8), 3))
    assert seen and all(mask is not None and bool(mask.all()) for mask in seen)


def test_an_adapter_folder_loads_from_the_cli_without_peft_or_bitsandbytes_lines(tmp_path, capsys, caplog, monkeypatch):
    """Issue 50: loading an adapter folder printed transformers' FutureWarning for the `is_gradient_checkpointing`
    peft reads, and bitsandbytes' import-time hint that `kernels` would speed its CPU path (on CPUs with AVX512-BF16)
    was often stderr's last line. The CLI runs every verb without either; its own warnings still show."""
    import logging
    import warnings

    import torch

    from tier_utils import cli
    from tier_utils.engine.lora import LoraSettings, apply_lora, quiet_peft
    from tier_utils.models.loading import load_model

    with quiet_peft():  # its first import in this process: bitsandbytes' hint would land in caplog
        pytest.importorskip("peft")
    torch.manual_seed(0)
    load_model("hf:LlamaForCausalLM", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, max_position_embeddings=32, vocab_size=256).save_pretrained(tmp_path / "base")
    apply_lora(load_model(str(tmp_path / "base")), LoraSettings(r=4, alpha=8)).save_pretrained(tmp_path / "adapter")

    def info(args):
        # as bitsandbytes logs it when first imported (by peft, or anyone), on a CPU with AVX512-BF16
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("Failed to load CPU gemm_4bit_forward from "
                                                                   "kernels-community: No module named 'kernels'")
        load_model(str(tmp_path / "adapter"))
        warnings.warn("tier_utils' own warning", stacklevel=1)
        return None, 0

    monkeypatch.setattr(cli, "_run_info", info)
    capsys.readouterr()
    with caplog.at_level(logging.WARNING):
        assert cli.main(["info", "--model", str(tmp_path / "adapter"), "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "is_gradient_checkpointing" not in err and "gemm_4bit_forward" not in err + caplog.text, err
    assert "warning: tier_utils' own warning" in err
