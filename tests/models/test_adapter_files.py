"""Adapter folders and hub ids as a new user brings them (issue 42): any peft adapter folder loads without running
code, a refused file is one line, and a gated hub id says how to give a token."""
import os

import pytest
import torch

from tier_utils.cli import main
from tier_utils.core import hub
from tier_utils.engine.lora import LoraSettings, apply_lora
from tier_utils.models.loading import load_model

peft = pytest.importorskip("peft")
LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
             max_position_embeddings=32, vocab_size=256)
IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A base folder and a LoRA model over it whose adapters are not zero (B starts at 0)."""
    base = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    load_model("hf:LlamaForCausalLM", **LLAMA).save_pretrained(base)
    model = apply_lora(load_model(str(base)), LoraSettings(r=4, alpha=8))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.1)
    return model.eval()


def _cli(args, capsys):
    capsys.readouterr()  # what the test's own setup printed
    code = main(args)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("warning")]
    return code, err


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pickled-bin"])
def test_an_adapter_folder_loads_as_safetensors_or_as_a_pickled_bin(adapter, tmp_path, safe):
    adapter.save_pretrained(tmp_path / "adapter", safe_serialization=safe)
    name = "adapter_model.safetensors" if safe else "adapter_model.bin"
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir() if p.name.startswith("adapter_model")) == [name]
    loaded = load_model(str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=IDS).logits, adapter(input_ids=IDS).logits)


def test_a_pickled_adapter_that_would_run_code_is_refused_in_one_line(adapter, tmp_path, capsys):
    folder = tmp_path / "adapter"
    adapter.save_pretrained(folder, safe_serialization=False)
    torch.save({"base_model.model.lm_head.weight": Evil()}, folder / "adapter_model.bin")
    code, err = _cli(["info", "--model", str(folder), "--device", "cpu"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "refused to load the adapter" in err[0] and "posix.system" in err[0] and "safetensors" in err[0]


def test_a_damaged_adapter_file_is_one_line(adapter, tmp_path, capsys):
    folder = tmp_path / "adapter"
    adapter.save_pretrained(folder)
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    code, err = _cli(["info", "--model", str(folder), "--device", "cpu"], capsys)
    assert code == 2 and len(err) == 1 and "cannot read the adapter" in err[0], err


def test_a_gated_hub_id_without_a_token_names_hf_token(monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    from huggingface_hub.errors import GatedRepoError

    def gated(name, **kwargs):  # what transformers raises for a gated repo read without a token
        error = GatedRepoError.__new__(GatedRepoError)  # its __init__ wants the hub's HTTP response
        Exception.__init__(error, "401 Client Error. Cannot access gated repo")
        try:
            raise error
        except GatedRepoError as exc:
            raise OSError(f"You are trying to access a gated repo. Make sure to have access to it at "
                          f"https://huggingface.co/{name}.") from exc

    monkeypatch.setattr(hub, "hub_reachable", lambda: True)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", gated)
    code, err = _cli(["info", "--model", "hf:meta-llama/Llama-3.2-1B", "--device", "cpu"], capsys)
    assert code == 2 and len(err) == 1, err
    assert "gated" in err[0] and "HF_TOKEN" in err[0] and "hf auth login" in err[0]
