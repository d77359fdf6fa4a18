"""The host-RAM pre-flight: a run predicted past the available RAM (TIER_UTILS_FREE_MEMORY stands in for it) is
refused in one line before anything loads or is written; the prediction sizes the model that will be built (from a
folder's or hub id's config, a checkpoint's recorded spec) without allocating it."""
import json
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
    # No config.json, so no model to build: its headers say what it holds.
    assert (folder.parameters, folder.stored_bytes, folder.module) == (35, 8 * 4 * 2 + 3 * 4, None)


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


LLAMA = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
LLAMA_70B = dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                 num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192)


def llama_folder(folder, dtype="bfloat16", weights="model.safetensors", **sizes):
    """A save_pretrained-style folder: its config.json (a Llama of `sizes`) beside a weights file holding one small
    tensor, as a partial or mismatched download leaves it. transformers builds the whole model from the config."""
    from transformers import LlamaConfig

    LlamaConfig(**{**LLAMA, **sizes}, architectures=["LlamaForCausalLM"], dtype=dtype).save_pretrained(folder)
    tensor = {"model.norm.weight": torch.ones(sizes.get("hidden_size", LLAMA["hidden_size"]))}
    if weights.endswith(".safetensors"):
        save_file(tensor, str(folder / weights))
    else:
        torch.save(tensor, folder / weights)
    return str(folder)


def llama_parameters(**sizes) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(**{**LLAMA, **sizes})).parameters())


@pytest.mark.parametrize("weights", ["model.safetensors", "pytorch_model.bin"])
def test_a_folder_is_sized_from_the_model_its_config_builds_not_its_files(tmp_path, weights):
    weights_ = weights_of(llama_folder(tmp_path, weights=weights), {})
    assert weights_.parameters == llama_parameters()  # the whole model, not the one tensor in the file
    assert weights_.stored_bytes == 2 * llama_parameters() + 4 * 8  # bf16 as its config says; rotary buffers fp32
    assert {p.device.type for p in weights_.module.parameters()} == {"meta"}
    # What the model arguments change (from_pretrained's config overrides) is what is built.
    assert weights_of(str(tmp_path), {"num_hidden_layers": 1}).parameters == llama_parameters(num_hidden_layers=1)
    adapters = tmp_path.parent / f"{tmp_path.name}-adapters"  # peft's folder: its base is what is built
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path)}))
    assert weights_of(str(adapters), {}).parameters == llama_parameters()
    # Neither config nor header says the dtype: the smallest it could load in, so the prediction stays a lower bound.
    unsaid = weights_of(llama_folder(tmp_path / "unsaid", dtype=None, weights="pytorch_model.bin"), {})
    assert next(unsaid.module.parameters()).dtype == torch.bfloat16


def test_a_hub_id_is_sized_from_its_config_and_offline_fails_in_one_line(monkeypatch):
    import transformers

    from tier_utils.core import hub
    from tier_utils.core.errors import ModelSpecError

    monkeypatch.setattr(hub, "hub_reachable", lambda: False)
    with pytest.raises(ModelSpecError) as caught:  # the line load_model gives, said before anything loads
        weights_of("hf:someone/some-model", {})
    assert "\n" not in str(caught.value) and "not reachable from here" in str(caught.value)
    config = transformers.LlamaConfig(**LLAMA, dtype="float16")
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", lambda name, **kw: config)
    sized = weights_of("hf:someone/some-model", {})
    assert (sized.parameters, next(sized.module.parameters()).dtype) == (llama_parameters(), torch.float16)


def test_a_checkpoint_file_is_sized_from_the_spec_it_records_or_else_its_tensors(tmp_path):
    from tier_utils.models.checkpoint import save_checkpoint
    from tier_utils.models.loading import ModelSource

    state = TinyGPT(**TINY).state_dict()
    save_checkpoint(tmp_path / "last.pt", {"source": ModelSource("tiny-gpt", dict(TINY)).record(None),
                                           "model": state})
    sized = weights_of(str(tmp_path / "last.pt"), {})
    held = sum(t.numel() * t.element_size() for t in state.values())
    # Rebuilt on the meta device; its tensors are read whole beside the rebuilt model as it loads.
    assert (sized.parameters, sized.stored_bytes) == (parameters(), weights_of("tiny-gpt", dict(TINY)).stored_bytes
                                                      + held)
    tied = {**state, "alias.weight": state["tok_emb.weight"]}  # one storage, saved and read once
    save_checkpoint(tmp_path / "gone.pt", {"source": ModelSource(str(tmp_path / "gone.py:Net"), {}).record(None),
                                           "model": tied})
    sized = weights_of(str(tmp_path / "gone.pt"), {})  # its spec no longer builds: its tensors say the size
    assert (sized.parameters, sized.stored_bytes, sized.module) == (sum(t.numel() for t in state.values()), held, None)


def test_a_70b_config_beside_a_small_file_is_refused_in_one_line_under_1_gib_of_rss(tmp_path):
    """The run the pre-flight exists to stop: refused before any weight is built, its whole process (torch and
    transformers imported, the model built on the meta device) under 1 GiB at its peak. An address-space cap
    makes a regression fail fast instead of building 280 GB."""
    folder = llama_folder(tmp_path / "llama-70b", **LLAMA_70B)
    # Its peak is VmHWM, its own memory's: Linux carries the parent's peak over exec into ru_maxrss, and the pytest
    # worker's after the modules before this one was 1.06 GiB (measured beside this child's 0.41 GiB).
    script = ("import resource, sys\n"
              "resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))\n"
              "from tier_utils.cli import main\n"
              "code = main(sys.argv[1:])\n"
              "hwm = next(line for line in open('/proc/self/status') if line.startswith('VmHWM:'))\n"
              "print(f'peak {int(hwm.split()[1]) * 1024}', file=sys.stderr)\n"
              "sys.exit(code)\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", script, "train", "--model", folder, "--precision", "fp32",
                           "--max-steps", "2", "--no-progress", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TIER_UTILS_FREE_MEMORY": "64GiB", "HF_HUB_OFFLINE": "1",
                                            "CUDA_VISIBLE_DEVICES": ""})  # a CUDA context would pass the cap
    assert proc.returncode == 2, proc.stderr[-2000:]
    line, peak = proc.stderr.splitlines()[-2:]
    assert line.startswith(f"error: training {folder} on the CPU in fp32") and "70,553,706,496 parameters" in line
    assert int(peak.removeprefix("peak ")) < 2**30, peak
    assert not out.exists()


def test_a_folder_whose_weights_are_cut_short_is_one_line_naming_the_file_before_anything_loads(tmp_path):
    from tier_utils.core.errors import ModelSpecError

    folder = llama_folder(tmp_path / "llama")
    file = tmp_path / "llama" / "model.safetensors"
    os.truncate(file, file.stat().st_size - 4)  # a download cut off after its header
    with pytest.raises(ModelSpecError) as caught:
        train(folder, checkpoint_dir=tmp_path / "ckpt", **RUN)
    line = str(caught.value)
    assert "\n" not in line and f"{file} is not a readable safetensors file (cut short" in line
    assert not (tmp_path / "ckpt").exists()


def _header_only(path, tensors: dict) -> None:
    """A .safetensors file whose header places `tensors` ({name: (dtype, shape)}), its data a sparse hole: the file
    is as long as the header says (not cut short), and takes no disk."""
    entries, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = 2 * int(torch.tensor(shape).prod())  # BF16
        entries[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
    os.truncate(path, 8 + len(header) + offset)


def test_a_header_larger_than_the_config_is_sized_and_refused_in_one_line(tmp_path, monkeypatch):
    """A tiny Llama config beside a header claiming a 128 GiB embedding: the pre-flight sizes the larger (transformers
    maps the whole file: `unable to mmap`, a traceback, past a pre-flight that sized the config)."""
    from tier_utils.cli import main

    folder = llama_folder(tmp_path / "llama")
    _header_only(tmp_path / "llama" / "model.safetensors", {"model.embed_tokens.weight": ("BF16", [2**26, 1024])})
    sized = weights_of(folder, {})
    assert (sized.parameters, sized.stored_bytes, sized.module) == (2**36, 2**37, None)
    assert sized.task is not None and sized.task.name == "causal-lm"
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", "64GiB")
    out = tmp_path / "run"
    assert main(["train", "--model", folder, "--max-steps", "2", "--no-progress", "--out", str(out)]) == 2
    assert not out.exists()


def test_only_the_files_the_index_names_are_summed(tmp_path):
    """A sharded folder beside a stale shard of an older save and a peft adapter's file: from_pretrained reads the
    index's shards only, and so does the pre-flight."""
    tensors = {"a.weight": torch.zeros(64, 64, dtype=torch.bfloat16), "b.weight": torch.zeros(32, dtype=torch.bfloat16)}
    save_file({"a.weight": tensors["a.weight"]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": tensors["b.weight"]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.weight": "model-00002-of-00002.safetensors"}}))
    stale = {"a.weight": torch.zeros(512, 512, dtype=torch.bfloat16)}
    save_file(stale, str(tmp_path / "model-00001-of-00003.safetensors"))  # an older save's shard
    save_file(stale, str(tmp_path / "adapter_model.safetensors"))
    sized = weights_of(str(tmp_path), {})
    assert (sized.parameters, sized.stored_bytes) == (64 * 64 + 32, 2 * (64 * 64 + 32))
