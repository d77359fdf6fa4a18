"""Weights stored in bf16 / fp16 (as transformers 5 loads modern checkpoints: in the dtype they were saved in):
every loader records the stored dtype, smoke and analysis run the model as loaded and compare against an fp32
copy, and every training-side result names stored and master dtype. The folders are made here with
save_pretrained (a tiny Llama in bf16, a tiny OPT in fp16), loaded by folder as users do."""
import json
import warnings

import pytest
import torch

from tier_utils import adapt, analyze, load_model, smoke
from tier_utils.models.stored_dtype import as_loaded, fp32_copy, parameters_dtype, safetensors_dtype

LLAMA = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
OPT = dict(vocab_size=300, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
           max_position_embeddings=64, word_embed_proj_dim=32)
BOTH_NATIVE = "avx512_bf16,avx512_fp16"  # so smoke runs its bf16 and fp16 comparisons on any CPU


def _saved(folder, model, dtype):
    torch.manual_seed(0)
    model.to(dtype).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _saved(tmp_path_factory.mktemp("llama-bf16"), LlamaForCausalLM(LlamaConfig(**LLAMA)), torch.bfloat16)


@pytest.fixture(scope="module")
def opt_fp16(tmp_path_factory):
    from transformers import OPTConfig, OPTForCausalLM

    return _saved(tmp_path_factory.mktemp("opt-fp16"), OPTForCausalLM(OPTConfig(**OPT)), torch.float16)


def loaded(spec, **kwargs):
    with warnings.catch_warnings():  # the folders hold no tokenizer: byte ids, said in a warning
        warnings.simplefilter("ignore")
        return load_model(spec, **kwargs)


@pytest.mark.parametrize("fixture, dtype", [("llama_bf16", torch.bfloat16), ("opt_fp16", torch.float16)])
def test_a_folder_loads_as_stored_and_records_it(fixture, dtype, request):
    model = loaded(request.getfixturevalue(fixture))
    assert model.tier_utils_source.stored_dtype == dtype
    assert parameters_dtype(model) == dtype  # as stored, decided here (dtype= passed), not transformers' default
    summary = adapt(model).summary()
    assert summary["stored_dtype"] == summary["weights_dtype"] == {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def test_a_dtype_the_user_passes_wins_and_the_stored_one_is_still_recorded(llama_bf16):
    model = loaded(llama_bf16, dtype=torch.float32)
    assert parameters_dtype(model) == torch.float32
    assert adapt(model).stored_dtype == torch.bfloat16


def test_a_folder_whose_config_names_no_dtype_is_read_from_the_safetensors_header(llama_bf16, tmp_path):
    import shutil

    folder = shutil.copytree(llama_bf16, tmp_path / "no-dtype")
    config = json.loads((folder / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (folder / "config.json").write_text(json.dumps(config))
    assert safetensors_dtype(folder / "model.safetensors") == torch.bfloat16
    assert adapt(loaded(str(folder))).stored_dtype == torch.bfloat16


def test_weights_file_built_ins_and_instances_record_their_dtype(tmp_path, tiny_kwargs):
    from safetensors.torch import save_file

    fp16 = {k: v.half() for k, v in load_model("tiny-gpt", **tiny_kwargs).state_dict().items()}
    fp16.pop("lm_head.weight", None)  # tied to the embedding: saved once
    save_file(fp16, tmp_path / "w.safetensors")
    model = load_model("tiny-gpt", weights=tmp_path / "w.safetensors", **tiny_kwargs)
    adapter = adapt(model)
    # The file stores fp16 (its header says so); its values went into the built-in's fp32 parameters.
    assert (adapter.stored_dtype, adapter.weights_dtype) == (torch.float16, torch.float32)
    assert as_loaded(adapter.stored_dtype, adapter.weights_dtype).startswith("weights stored fp16, held fp32")
    assert adapt(load_model("tiny-gpt", **tiny_kwargs)).stored_dtype == torch.float32
    instance = load_model("tiny-gpt", **tiny_kwargs).to(torch.bfloat16)
    del instance.tier_utils_source  # a module built in Python: its parameters say it
    assert adapt(instance).stored_dtype == torch.bfloat16


def test_fp32_copy_gives_back_the_same_tensors_and_rounds_no_fp32_buffer(llama_bf16):
    model = loaded(llama_bf16)
    before = {n: t.clone() for n, t in [*model.named_parameters(), *model.named_buffers()]}
    buffers = {n: b.dtype for n, b in model.named_buffers()}
    assert torch.float32 in buffers.values()  # the rotary table stays fp32 in a bf16 Llama
    with fp32_copy(model):
        assert {p.dtype for p in model.parameters()} == {torch.float32}
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert {n: b.dtype for n, b in model.named_buffers()} == buffers
    assert all(after[n].dtype == t.dtype and torch.equal(after[n], t) for n, t in before.items())
    assert model.lm_head.weight.dtype == torch.bfloat16


def test_smoke_runs_as_loaded_and_compares_with_an_fp32_copy(llama_bf16, monkeypatch):
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", BOTH_NATIVE)
    model = loaded(llama_bf16)
    report = smoke(model, checks="stability,init", device="cpu", progress=False)
    rows = report.table.set_index("check")
    weights = rows.loc["init: weights dtype"]
    assert weights.value == "bf16" and "weights stored bf16, run as loaded (bf16)" in weights.detail
    for low in ("bf16", "fp16"):
        row = rows.loc[f"stability: {low} vs fp32 logits"]
        assert row.status == "PASS", row.detail
        assert "an fp32 copy of the bf16-stored weights" in row.detail
    assert report.model["stored_dtype"] == "bf16" and parameters_dtype(model) == torch.bfloat16  # given back as is
    assert json.loads(json.dumps(report.to_json()))["model"]["stored_dtype"] == "bf16"


def test_smoke_on_fp32_weights_names_no_copy(tiny_model, monkeypatch):
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", BOTH_NATIVE)
    rows = smoke(tiny_model(), checks="stability,init", device="cpu", progress=False).table.set_index("check")
    assert "copy" not in rows.loc["stability: bf16 vs fp32 logits"].detail
    assert rows.loc["init: weights dtype"].detail == "weights stored fp32, run as loaded (fp32)"


def test_analysis_compares_on_an_fp32_copy_and_names_it(opt_fp16):
    model = loaded(opt_fp16)
    report = analyze(model, analyses="headroom,dtypes", device="cpu", batch_size=2, n_batches=1, seq_len=16,
                     progress=False)
    table = report.table
    assert set(table.status) <= {"PASS", "WARN"}, table.detail.tolist()
    assert table.detail.str.endswith("(on an fp32 copy of the fp16-stored weights)").all()
    assert report.model["stored_dtype"] == report.model["weights_dtype"] == "fp16"
    assert parameters_dtype(model) == torch.float16
