"""Weights stored in bf16 / fp16 (as transformers 5 loads modern checkpoints: in the dtype they were saved in):
every loader records the stored dtype, smoke and analysis run the model as loaded and compare against an fp32
copy, and every training-side result names stored and master dtype. The folders are made here with
save_pretrained (a tiny Llama in bf16, a tiny OPT in fp16), loaded by folder as users do."""
import json
import os
import warnings

import pytest
import torch

from tier_utils import TinyGPT, adapt, analyze, load_model, smoke
from tier_utils.models.loading import source_of
from tier_utils.models.stored_dtype import as_loaded, fp32_copy, parameters_dtype, safetensors_counts, safetensors_dtype

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
    assert source_of(model).stored_dtype == dtype
    assert parameters_dtype(model) == dtype  # as stored, decided here (dtype= passed), not transformers' default
    summary = adapt(model).summary()
    assert summary["stored_dtype"] == summary["weights_dtype"] == {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def test_a_hub_id_records_its_configs_dtype_and_loads_in_it(llama_bf16, monkeypatch):
    from tier_utils.models import loading

    asked = []

    def from_hub(load, hub_id, what, **kwargs):  # the hub, played by the folder: no network in tests
        asked.append(kwargs)
        return load(llama_bf16, **kwargs)

    monkeypatch.setattr(loading, "from_hub", from_hub)
    model = loaded("hf:org/tiny-llama")
    # decided here, from the config: never transformers' default; the loading report is read for dropped weights
    assert asked[-1] == {"dtype": torch.bfloat16, "output_loading_info": True}
    assert source_of(model).stored_dtype == parameters_dtype(model) == torch.bfloat16


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
    instance = TinyGPT(**tiny_kwargs).to(torch.bfloat16)  # a module built in Python: its parameters say it
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


# --- train, the benchmark, all: master weights the precision decides, stated ----------------------------------

TRAIN = dict(batch_size=4, seq_len=16, eval_batches=1, warmup_steps=1, progress=False, device="cpu")


def test_train_holds_fp32_master_weights_and_says_so(llama_bf16, tmp_path):
    from tier_utils import train

    result = train(loaded(llama_bf16), None, precision="fp32", max_steps=2, checkpoint_dir=tmp_path / "ckpt", **TRAIN)
    s = result.summary
    assert (s.stored_dtype, s.master_dtype) == ("bf16", "fp32")
    assert parameters_dtype(result.model) == torch.float32
    assert s.weights_detail.startswith("weights stored bf16 → fp32")
    assert result.table.set_index("metric").loc["weights_dtype", "value"] == s.weights_detail
    saved = json.loads(json.dumps(result.to_json()))["summary"]
    assert (saved["stored_dtype"], saved["master_dtype"]) == ("bf16", "fp32")
    # The run's checkpoint holds fp32 master weights, and loads back in fp32: not rounded to the folder's bf16.
    again = loaded(str(tmp_path / "ckpt" / "last.pt"))
    assert adapt(again).stored_dtype == parameters_dtype(again) == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), result.model.parameters()))


def test_cli_train_fp16_on_fp16_stored_weights_runs_without_the_unscale_error(opt_fp16, tmp_path):
    from tier_utils import cli

    out = tmp_path / "s.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 emulated on this CPU; no tokenizer in the folder
        code = cli.main(["train", "--model", opt_fp16, "--precision", "fp16", "--max-steps", "2", "--batch-size",
                         "4", "--seq-len", "16", "--eval-batches", "1", "--no-progress", "--out", str(tmp_path / "run"),
                         "--json", str(out)])
    assert code == 0  # GradScaler's "Attempting to unscale FP16 gradients" would be a crash here
    summary = json.loads(out.read_text())  # the CLI writes the summary itself
    assert (summary["stored_dtype"], summary["master_dtype"]) == ("fp16", "fp32")
    assert summary["weights_detail"] == "weights stored fp16 → fp32 master weights, fp16 autocast"
    assert summary["train_loss"] is not None


def _spy_on_forward_contexts(monkeypatch, model, names):
    """Each named precision's forward context records the parameters' dtypes and the autocast it opens:
    read inside the run, through the strategy object."""
    from tier_utils.core.precision import resolve_precision

    seen = []
    for cls in {type(resolve_precision(n, "cpu", warn=False)) for n in names}:
        def forward_context(self, original=cls.forward_context):
            context = original(self)
            autocast = context.fast_dtype if isinstance(context, torch.autocast) else None
            seen.append((self.name, parameters_dtype(model), autocast))
            return context
        monkeypatch.setattr(cls, "forward_context", forward_context)
    return seen


@pytest.mark.parametrize("fixture, stored", [("llama_bf16", "bf16"), ("opt_fp16", "fp16")])
def test_bench_fp32_row_runs_fp32_weights_and_bf16_row_fp32_masters_under_autocast(fixture, stored, request,
                                                                                     monkeypatch):
    from tier_utils import amp_benchmark

    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")
    model = loaded(request.getfixturevalue(fixture))
    seen = _spy_on_forward_contexts(monkeypatch, model, ("fp32", "bf16"))
    result = amp_benchmark(model, precisions=("fp32", "bf16"), batch_size=2, seq_len=16, untimed_steps=0,
                           timed_steps=1, repeats=1, accuracy_steps=1, eval_batches=1, progress=False, device="cpu")
    assert {(name, held, autocast) for name, held, autocast in seen} == {
        ("fp32", torch.float32, None), ("bf16", torch.float32, torch.bfloat16)}
    rows = result.table.set_index("precision")
    assert list(rows.weights_dtype) == ["fp32", "fp32"]
    assert rows.loc["fp32", "weights"].startswith(f"weights stored {stored} → fp32")
    assert rows.loc["bf16", "weights"] == f"weights stored {stored} → fp32 master weights, bf16 autocast"
    assert result.metadata["stored_dtype"] == stored
    saved = json.loads(json.dumps(result.to_json()))
    assert saved["metadata"]["stored_dtype"] == stored and saved["precisions"][1]["weights"] == rows.loc["bf16",
                                                                                                         "weights"]


@pytest.mark.slow  # the main job with its report page and PNGs
def test_all_names_stored_and_master_dtype_in_summary_page_and_json(llama_bf16, tmp_path, capsys):
    from tier_utils import cli

    out, summary = tmp_path / "report", tmp_path / "all.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = cli.main(["all", "--model", llama_bf16, "--out", str(out), "--fast", "--precision", "fp32",
                         "--no-progress", "--json", str(summary)])
    assert code in (0, 1), capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "LlamaForCausalLM · weights stored bf16" in printed
    assert "fp32 (weights stored bf16 → fp32" in printed  # the train line
    assert "weights stored bf16, held in the runs as fp32 eager: fp32" in printed
    assert json.loads(summary.read_text())["run_metadata"]["stored_dtype"] == "bf16"
    assert json.loads((out / "train.json").read_text())["summary"]["master_dtype"] == "fp32"
    assert "stored_dtype: bf16" in (out / "index.html").read_text()
    assert "weights stored bf16, run as loaded (bf16)" in (out / "smoke.csv").read_text()


def _safetensors(path, header: dict, data: int) -> str:
    """A .safetensors file with `header`, `data` bytes of tensors after it (sparse: truncate writes no bytes)."""
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    os.truncate(path, 8 + len(text) + data)
    return str(path)


def test_a_header_is_read_without_mapping_the_file_however_large(tmp_path, monkeypatch):
    """128 GiB of bf16 in a sparse file, past any RAM + swap: mapping it fails where overcommit is strict, so the
    reader takes the 8-byte length and the JSON header with plain reads, and nothing may map it."""
    import mmap

    import safetensors

    elements = 2**36
    file = _safetensors(tmp_path / "model.safetensors",
                        {"__metadata__": {"format": "pt"}, "w": {"dtype": "BF16", "shape": [2**18, 2**18],
                                                                 "data_offsets": [0, 2 * elements]}}, 2 * elements)

    def refused(*args, **kwargs):
        raise AssertionError("the header reader mapped the file")

    monkeypatch.setattr(mmap, "mmap", refused)
    monkeypatch.setattr(safetensors, "safe_open", refused)
    assert safetensors_counts(file) == {torch.bfloat16: elements}
    assert safetensors_dtype(file) == torch.bfloat16


def _headed(header) -> bytes:
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text


ENTRY = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}


@pytest.mark.parametrize("content, why", [
    (b"", "shorter than its 8-byte header length"),
    (b"\x05\x00\x00", "shorter than its 8-byte header length"),
    ((2**40).to_bytes(8, "little") + b"{}", "over safetensors' 100 MB limit"),
    ((500).to_bytes(8, "little") + b"{}", "past the file's end"),
    ((5).to_bytes(8, "little") + b"{nope", "not JSON"),
    ((2).to_bytes(8, "little") + b"[]", "not a table of tensors"),
    (_headed(ENTRY) + bytes(10), "cut short"),  # 16 bytes of tensors named, 10 there
    (_headed({"w": {"dtype": "F32", "shape": 4}}), "not a table of tensors"),
])
def test_a_damaged_or_short_file_is_one_line_naming_it(tmp_path, content, why):
    from tier_utils.core.errors import ModelSpecError

    file = tmp_path / "model.safetensors"
    file.write_bytes(content)
    with pytest.raises(ModelSpecError) as caught:
        safetensors_counts(file)
    line = str(caught.value)
    assert "\n" not in line and str(file) in line and why in line, line
