import json
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from tiny import TINY

import tier_utils
from tier_utils import SmokeConfig, TinyEncoder, TinyGPT, load_model, smoke
from tier_utils.cli import main
from tier_utils.core import budget
from tier_utils.core.precision import precision_class
from tier_utils.core.results import CHECK_COLUMNS
from tier_utils.smoketest import checks as smoke_checks

HF_GPT2 = dict(n_layer=1, n_head=2, n_embd=32, vocab_size=256, n_positions=64)
HF_BERT = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64, vocab_size=256,
               max_position_embeddings=64, num_labels=4)
GROUPS = ("shapes", "gradients", "stability", "init", "memory", "latency", "determinism")
# SKIPs a healthy model may get on a CPU: a low precision this CPU does not run natively, no CUDA allocator.
JUSTIFIED_SKIPS = {"stability: bf16 vs fp32 logits", "stability: fp16 vs fp32 logits", "memory: peak CUDA"}


@pytest.fixture(autouse=True)
def quick_latency(monkeypatch):
    # Fewer timed runs keep the suite fast; the statistics code is the same.
    monkeypatch.setattr(smoke_checks, "LATENCY_WARMUP", 1)
    monkeypatch.setattr(smoke_checks, "LATENCY_MAX_RUNS", 3)


class UnusedParamGPT(TinyGPT):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.spare = nn.Linear(4, 4)  # never called in forward


class NaNGPT(TinyGPT):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        return super().forward(input_ids, attention_mask, inputs_embeds) * float("nan")


class BrokenGPT(TinyGPT):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        raise RuntimeError("boom in forward")


class MaskIgnoringEncoder(TinyEncoder):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        return super().forward(input_ids, None, inputs_embeds)  # pools over the padding too


@pytest.mark.parametrize("spec,kwargs", [
    ("tiny-gpt", TINY),
    ("tiny-encoder", dict(TINY, num_classes=3)),
    ("hf:GPT2LMHeadModel", HF_GPT2),
    ("hf:BertForSequenceClassification", HF_BERT),
], ids=["tiny-gpt", "tiny-encoder", "hf-gpt2", "hf-bert"])
def test_healthy_models_pass_every_check(spec, kwargs):
    report = smoke(load_model(spec, **kwargs), batch_sizes=(1, 2), device="cpu", progress=False)
    table = report.table
    assert list(table.columns) == ["check", "status", "value", "threshold", "detail"]
    assert {c.split(":")[0] for c in table.check} == set(GROUPS)
    bad = table[table.status.isin(["FAIL", "WARN"])]
    assert bad.empty, bad.to_string()
    assert set(table.check[table.status == "SKIP"]) <= JUSTIFIED_SKIPS
    assert report.passed and report.status == "PASS"
    assert len(report.latency) == 2 and all(len(r["samples_ms"]) == 3 for r in report.latency)
    assert [m["batch_size"] for m in report.memory] == [1, 2]
    assert report.grad_norms and all(v > 0 for v in report.grad_norms.values())


def test_unused_parameter_fails_gradient_flow_by_name():
    report = smoke(UnusedParamGPT(**TINY), checks=["gradients"], device="cpu", progress=False)
    row = report.table.set_index("check").loc["gradients: every parameter gets one"]
    assert row.status == "FAIL"
    assert "spare.weight" in row.detail and "spare.bias" in row.detail
    assert row.value == 2
    assert not report.passed


def test_nan_output_fails_stability():
    report = smoke(NaNGPT(**TINY), checks="stability", device="cpu", progress=False)
    finite_rows = report.table[report.table.check.str.contains("token|max length")]
    assert len(finite_rows) == 4 and (finite_rows.status == "FAIL").all()
    assert finite_rows.detail.str.contains("NaN").all()
    assert report.status == "FAIL"


def test_forward_that_raises_gives_fail_rows_not_a_crash():
    report = smoke(BrokenGPT(**TINY), batch_sizes=(1,), device="cpu", progress=False)
    table = report.table
    failed = table[table.status == "FAIL"]
    groups_failed = {c.split(":")[0] for c in failed.check}
    assert groups_failed == set(GROUPS) - {"init"}  # init reads the weights only
    assert failed.detail.str.contains("RuntimeError: boom in forward").all()
    assert (table[table.check.str.startswith("init")].status == "PASS").all()
    assert report.to_json()["passed"] is False


def test_padding_leak_is_caught():
    report = smoke(MaskIgnoringEncoder(**TINY), checks=["shapes"], device="cpu", progress=False)
    row = report.table.set_index("check").loc["shapes: padded batch + attention_mask"]
    assert row.status == "FAIL" and "attention_mask" in row.detail


def test_init_flags_constant_matrix_and_dead_rows_but_not_layernorm():
    model = TinyGPT(**TINY)
    with torch.no_grad():
        model.blocks[0].attn.proj.weight.fill_(0.5)
        model.blocks[0].mlp[0].weight[3].zero_()
    report = smoke(model, checks=["init"], device="cpu", progress=False)
    rows = report.table.set_index("check")
    assert rows.loc["init: constant weight matrices"].status == "WARN"
    assert "blocks.0.attn.proj.weight" in rows.loc["init: constant weight matrices"].detail
    assert "ln" not in rows.loc["init: constant weight matrices"].detail  # LayerNorm 1/0 are expected
    assert "blocks.0.mlp.0.weight (1 of 128 rows)" in rows.loc["init: dead units (all-zero rows)"].detail
    params = report.parameters.set_index("name")
    assert params.loc["blocks.0.ln1.weight", "std"] == 0 and not params.loc["blocks.0.ln1.weight", "constant"]


class BoostedGPT(TinyGPT):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.boost = nn.Parameter(torch.zeros(self.vocab_size))

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        return super().forward(input_ids, attention_mask, inputs_embeds) + 1e6 * self.boost


def test_exploding_layer_is_flagged_by_name():
    report = smoke(BoostedGPT(**TINY), checks=["gradients"], device="cpu", progress=False)
    rows = report.table.set_index("check")
    assert rows.loc["gradients: exploding layers"].status == "FAIL"
    assert "boost is exploding" in rows.loc["gradients: exploding layers"].detail
    assert rows.loc["gradients: vanishing layers"].status == "PASS"


def test_vanishing_layers_are_flagged():
    model = TinyGPT(**TINY)
    with torch.no_grad():  # residual branches scaled to nothing: what feeds them gets ~no gradient
        model.blocks[0].attn.proj.weight.mul_(1e-9)
        model.blocks[0].mlp[2].weight.mul_(1e-9)
    report = smoke(model, checks=["gradients"], device="cpu", progress=False)
    row = report.table.set_index("check").loc["gradients: vanishing layers"]
    # judged over weight matrices (1-d norm weights apart): the attention input projection behind the branch
    assert row.status == "FAIL" and float(row.value) < 1e-7 and "blocks.0.attn.qkv is vanishing" in row.detail


class OOMAbove64TokensGPT(TinyGPT):
    """A pretend GPU that runs out of memory past 64 tokens in a batch (the activation fit needs 64)."""

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        if input_ids.numel() > 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(input_ids, attention_mask, inputs_embeds)


def test_memory_sweep_stops_cleanly_at_out_of_memory():
    report = smoke(OOMAbove64TokensGPT(**TINY), checks=["memory"], batch_sizes=(1, 2, 4), device="cpu",
                   progress=False)
    rows = report.table.set_index("check")
    oom = rows.loc["memory: B=4, T=32 (bytes)"]
    assert oom.status == "WARN" and "B=4, T=32 ran out of memory on cpu with" in oom.detail
    assert "GiB free" in oom.detail or "MiB free" in oom.detail
    assert "the largest batch that fit was 2" in oom.detail
    assert [m["batch_size"] for m in report.memory] == [1, 2]  # and the sweep stopped there
    assert rows.loc["memory: activations per sample (bytes)"].status == "PASS"


def test_out_of_memory_injected_through_the_free_memory_reading(monkeypatch):
    """A pretend machine with little free RAM: the sizes over the safe share are refused before they allocate,
    batch 1 runs at the longest length that fits, and every row says what was measured and what predicted."""
    model = TinyGPT(d_model=64, n_layer=2, n_head=2, max_len=256)
    full = smoke(model, checks=["memory"], batch_sizes=(1,), seq_lens=(256,), device="cpu", progress=False)
    per_sample = full.memory[0]["activation_bytes"]  # measured: about 4.5 MiB at T=256
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(3 * per_sample))  # safe share: 1.5 samples
    monkeypatch.setattr(budget, "CPU_PROBE_BYTES", per_sample // 2)  # a probe may hold half a sample
    report = smoke(model, checks=["memory", "latency"], batch_sizes=(1, 4), seq_lens=(256,), device="cpu",
                   progress=False)
    rows = report.table.set_index("check")
    refused = rows.loc["memory: B=4, T=256 (bytes)"]
    assert refused.status == "WARN" and refused.detail.startswith("not run: B=4, T=256 predicted")
    assert "TIER_UTILS_FREE_MEMORY" in refused.detail and "measured at B=1, T=32" in refused.detail
    assert refused.value > 3 * per_sample / 2  # over the safe share (half of free)
    (ran, pred1, pred4) = report.memory
    assert not ran["predicted"] and ran["batch_size"] == 1 and ran["seq_len"] < 256
    assert ran["activation_bytes"] <= per_sample // 2  # the probe held what it was allowed, no more
    assert pred1["predicted"] and (pred1["batch_size"], pred1["seq_len"]) == (1, 256)
    assert pred4["predicted"] and pred4["batch_size"] == 4
    # The fit is exact enough to stand in for the size it did not run (saved-tensor counts are linear in B).
    assert abs(pred1["activation_bytes"] - per_sample) / per_sample < 0.02
    detail = rows.loc["memory: activations per sample (bytes)"].detail
    assert "(predicted;" in detail and f"B=1, T={ran['seq_len']} measured" in detail
    assert "B=4, T=256 predicted" in detail
    latency = rows.loc["latency: B=4 T=256 (median ms)"]  # the output alone fits: latency still runs
    assert latency.status == "PASS"
    assert report.to_json()["budget"]["source"] == "TIER_UTILS_FREE_MEMORY"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_peak_memory_per_batch_size():
    report = smoke(TinyGPT(**TINY), checks=["memory", "latency"], batch_sizes=(1, 8), device="cuda", progress=False)
    rows = report.table.set_index("check")
    assert rows.loc["memory: peak CUDA B=8 (bytes)"].status == "PASS"
    assert report.memory[1]["peak_bytes"] > report.memory[0]["peak_bytes"] > 0
    assert all(r["samples_ms"] and min(r["samples_ms"]) > 0 for r in report.latency)


def test_leaves_model_mode_grads_and_rng_as_found():
    model = TinyGPT(dropout=0.1, **TINY).eval()
    marker = torch.ones_like(model.head.weight)
    model.head.weight.grad = marker
    rng = torch.get_rng_state()
    report = smoke(model, checks=["gradients", "determinism"], device="cpu", progress=False)
    assert not model.training
    assert model.head.weight.grad is marker and model.tok_emb.weight.grad is None
    assert torch.equal(torch.get_rng_state(), rng)
    drop = report.table.set_index("check").loc["determinism: train vs eval mode"]
    assert float(drop.value) > 1e-5 and "dropout" in drop.detail


def test_forced_precision_runs_instead_of_skipping():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = smoke(TinyGPT(**TINY), checks=["stability"], precision="fp16", device="cpu", progress=False)
    row = report.table.set_index("check").loc["stability: fp16 vs fp32 logits"]
    if smoke_checks.native_support("fp16", torch.device("cpu"))[0]:
        assert "forced" not in row.detail
    else:
        assert "forced" in row.detail
    # fp16 rounding moves this model's logits by about 5e-4 of their range: measurable, and well inside 1e-2.
    assert row.status == "PASS" and 0 < float(row.value) < precision_class("fp16").tolerances().logits


def test_bad_arguments_raise_value_errors_naming_the_fix():
    with pytest.raises(ValueError, match="shapes, gradients, stability, init, memory, latency, determinism"):
        smoke(TinyGPT(**TINY), checks=["shapes", "speed"], progress=False)
    with pytest.raises(ValueError, match="batch_sizes must be a whole number >= 1, got 0"):
        smoke(TinyGPT(**TINY), batch_sizes=[1, 0], progress=False)
    with pytest.raises(ValueError, match="no check group given"):
        smoke(TinyGPT(**TINY), checks=[], progress=False)


def test_keywords_are_settings_and_model_kwargs_build_the_model():
    # A typo of batch_sizes, or a model argument given as a keyword, is refused: it used to build the model.
    with pytest.raises(ValueError, match=r"unknown smoke setting\(s\) batch_size; valid: batch_sizes, seq_lens"):
        smoke(TinyGPT(**TINY), batch_size=2, progress=False)
    with pytest.raises(ValueError, match=r"unknown smoke setting\(s\) d_model"):
        smoke("tiny-gpt", d_model=32, progress=False)
    report = smoke("tiny-gpt", checks="shapes", device="cpu", progress=False, model_kwargs={**TINY, "max_len": 16})
    assert report.model["max_len"] == 16 and report.passed


def test_a_config_a_dict_and_overrides_say_the_same():
    config = SmokeConfig(batch_sizes=[2, 1], seq_lens=[16], checks="memory,shapes", device="cpu", progress=False)
    assert (config.batch_sizes, config.seq_lens, config.checks) == ((1, 2), (16,), ("shapes", "memory"))
    from_config = smoke(TinyGPT(**TINY), config)
    from_dict = smoke(TinyGPT(**TINY), {"batch_sizes": (1, 2), "seq_lens": (16,), "checks": "shapes,memory",
                                         "device": "cpu", "progress": False})
    overridden = smoke(TinyGPT(**TINY), config, checks="shapes")  # a keyword wins over the config's field
    assert from_config.table["check"].tolist() == from_dict.table["check"].tolist()
    assert from_config.batch_sizes == [1, 2] and from_config.seq_lens == [16]
    assert set(overridden.table["check"].str.split(":").str[0]) == {"shapes"}


def test_multi_line_exception_becomes_a_one_line_fail_detail():
    class MultiLineError(TinyGPT):
        def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
            raise RuntimeError("shape mismatch:\n  expected (2, 8)\n\tgot (2, 9)")

    report = smoke(MultiLineError(**TINY), checks="shapes,stability", device="cpu", progress=False)
    fails = report.table[report.table.status == "FAIL"]
    assert len(fails) == len(report.table) > 1  # every row calls forward, so every row fails
    assert (fails.detail == "raised RuntimeError: shape mismatch: expected (2, 8) got (2, 9)").all()


def test_json_plot_and_table_formats(tmp_path):
    report = smoke(TinyGPT(**TINY), checks=["gradients", "memory", "latency"], batch_sizes=(1, 2), seq_lens=(8, 16),
                   device="cpu", progress=False)
    data = json.loads(json.dumps(report.to_json()))
    assert data["run_metadata"]["torch"] == torch.__version__ and data["run_metadata"]["dtype"]
    assert [list(r) for r in data["checks"]][0] == CHECK_COLUMNS
    assert {(r["batch_size"], r["seq_len"]) for r in data["latency"]} == {(1, 8), (2, 8), (1, 16), (2, 16)}
    assert all(r["n"] == 3 and r["p95_ms"] >= r["median_ms"] > 0 for r in data["latency"])
    assert data["memory"][0]["seq_len"] == 16
    fig = report.plot()
    grad_ax, latency_ax, memory_ax = fig.axes
    assert grad_ax.get_yscale() == "log"
    assert len(latency_ax.get_xticklabels()) == 4
    assert len(memory_ax.patches) == 2
    report.save_json(tmp_path / "smoke.json")
    assert json.loads((tmp_path / "smoke.json").read_text())["status"] == report.status


MODEL_FILE = textwrap.dedent('''
    from tier_utils.models.builtins import TinyGPT

    class NaNGPT(TinyGPT):
        def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
            return super().forward(input_ids, attention_mask, inputs_embeds) * float("nan")
''')
SMALL = ["--model-arg", "d_model=32", "--model-arg", "n_layer=1", "--model-arg", "n_head=2",
         "--model-arg", "max_len=16", "--no-progress", "--device", "cpu"]


def test_cli_exit_codes(tmp_path, capsys):
    out = tmp_path / "ok.json"
    assert main(["smoke", "--batch-sizes", "1,2", "--checks", "shapes,init", "--json", str(out)] + SMALL) == 0
    printed = capsys.readouterr().out
    assert "shapes: max length 16" in printed and "PASS" in printed
    assert json.loads(out.read_text())["passed"] is True

    (tmp_path / "nan_model.py").write_text(MODEL_FILE)
    bad = tmp_path / "bad.json"
    code = main(["smoke", "--model", f"{tmp_path / 'nan_model.py'}:NaNGPT", "--checks", "stability",
                 "--json", str(bad)] + SMALL)
    assert code == 1
    assert json.loads(bad.read_text())["status"] == "FAIL"
    capsys.readouterr()

    assert main(["smoke", "--checks", "shapes,speed"] + SMALL) == 2
    assert "unknown check group 'speed'; choose from: shapes," in capsys.readouterr().err
    assert main(["smoke", "--model", f"{tmp_path / 'missing.py'}:Net"] + SMALL) == 2
    assert main(["smoke", "--batch-sizes", "1,0", "--no-progress"] + SMALL) == 2


def test_tied_embedding_is_judged_as_an_embedding_with_its_padding_row():
    model = TinyGPT(**TINY)
    model.tok_emb.padding_idx = 0
    with torch.no_grad():
        model.tok_emb.weight[0] = 0
    model.head.weight = model.tok_emb.weight  # tied: named_parameters() reports it once, the head owns it last
    report = smoke(model, checks="init", progress=False)
    rows = report.table.set_index("check")
    assert rows.loc["init: dead units (all-zero rows)", "status"] == "PASS"
    assert report.parameters.set_index("name").loc["tok_emb.weight", "kind"] == "embedding"


# Checks that read the model's outputs, loss or gradients. The rest read shapes, bytes, weights or time,
# which a NaN output doesn't change.
READS_OUTPUTS = ("shapes: padded", "gradients: loss", "gradients: finite", "gradients: non-zero",
                 "gradients: layer", "gradients: vanishing", "gradients: exploding", "stability", "determinism")


def test_nan_model_gets_no_pass_on_any_check_that_reads_a_number():
    report = smoke(NaNGPT(**TINY), device="cpu", precision="fp16", progress=False)  # fp16 asked for: runs, forced
    rows = report.table[report.table.check.str.startswith(READS_OUTPUTS)]
    assert len(rows) >= 12 and "PASS" not in set(rows.status)
    det = rows[rows.check.str.startswith("determinism")]
    assert list(det.status) == ["FAIL", "FAIL"] and det.detail.str.contains("NaN/inf").all()
    fp16 = rows[rows.check == "stability: fp16 vs fp32 logits"].iloc[0]
    assert fp16.status == "FAIL" and "fp32 logits are already NaN/inf" in fp16.detail
    assert rows[rows.check == "gradients: non-zero"].status.iloc[0] == "FAIL"


class OOMAtMaxLengthGPT(TinyGPT):
    """A pretend GPU that runs out of memory on any batch at the model's max length."""

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        if input_ids.size(1) == self.max_len:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                                              "capacity of 14.74 GiB of which 1.10 GiB is free.")
        return super().forward(input_ids, attention_mask, inputs_embeds)


def test_out_of_memory_in_any_check_is_a_warn_row_naming_the_size_and_the_rest_runs():
    report = smoke(OOMAtMaxLengthGPT(**TINY), checks="shapes,stability,determinism", seq_lens=(16,),
                   device="cpu", progress=False)
    rows = report.table.set_index("check")
    for name in ("shapes: max length 32", "stability: random, max length 32"):
        assert rows.loc[name].status == "WARN" and "ran out of memory: OutOfMemoryError" in rows.loc[name].detail
        assert "of which 1.10 GiB is free" in rows.loc[name].detail
    assert rows.loc["shapes: batch 1"].status == "PASS"  # the rest ran
    group = rows.loc["determinism"]  # a whole group that runs at the max length: one WARN row, the free memory said
    assert group.status == "WARN" and group.detail.startswith("ran out of memory (") and "GiB free" in group.detail


def test_logit_sized_checks_are_sized_to_the_budget_and_name_the_size_that_ran(monkeypatch):
    """Shapes at max length and the stability rows hold (batch, length, vocabulary) outputs: under a small
    injected budget they run one sequence, then a shorter length, and each row says what ran and why."""
    model = TinyGPT(d_model=32, n_layer=1, n_head=2, max_len=64, vocab_size=512)
    per_token = 4 * 512  # fp32 logits per token
    # The safe share (half of free) holds 3.5 full-length logits: stability (3 copies) and shapes (2) run B=1.
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(7 * per_token * 64))
    report = smoke(model, checks=["shapes", "stability"], device="cpu", progress=False)
    rows = report.table.set_index("check")
    assert rows.loc["shapes: max length 64"].value == "(1, 64, 512)"
    finite = rows.loc["stability: random, max length 64"]
    assert finite.status == "PASS" and "(1, 64, 512)" in finite.detail
    assert "ran at B=1, T=64, not B=2, T=64" in finite.detail and "TIER_UTILS_FREE_MEMORY" not in finite.detail
    # A quarter of a sequence: a shorter length, named in the row's name and detail.
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(2 * 3 * per_token * 16))
    rows = smoke(model, checks=["stability"], device="cpu", progress=False).table.set_index("check")
    finite = rows.loc["stability: random, length 16"]
    assert finite.status == "PASS" and "ran at B=1, T=16, not B=2, T=64" in finite.detail
    for low in ("bf16", "fp16"):
        row = rows.loc[f"stability: {low} vs fp32 logits"]
        assert row.status == "SKIP" or "ran at B=1, T=16" in row.detail
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", "1KiB")  # not one token's logits: refused, not run
    rows = smoke(model, checks=["shapes", "stability"], device="cpu", progress=False).table.set_index("check")
    assert rows.loc["shapes: max length 64"].status == "SKIP"
    assert rows.loc["stability: random, max length 64"].status == "SKIP"


def test_relative_deviation_in_slices_equals_the_whole_and_keeps_nan(monkeypatch):
    ref = torch.randn(3, 5, 7)
    low = ref + 0.01 * torch.randn(3, 5, 7)
    whole = smoke_checks._rel_dev(low, ref)
    monkeypatch.setattr(budget, "CHUNK_BYTES", 4 * 7 * 2)  # two rows per slice
    assert smoke_checks._rel_dev(low, ref) == pytest.approx(whole, rel=1e-6)
    low[2, 4, 6] = float("nan")
    assert torch.isnan(torch.tensor(smoke_checks._rel_dev(low, ref)))


BF16_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, n_positions=64)),
}


@pytest.mark.parametrize("family", sorted(BF16_CONFIGS))
def test_a_bf16_stored_model_passes_smoke_and_analysis(family, tmp_path):
    """As nearly every recent hub model is stored: padding, determinism and the analysis' comparisons are judged
    against bf16's rounding, not fp32's (two kernel paths differ by ~3e-3 in bf16: a FAIL on every such model)."""
    transformers = pytest.importorskip("transformers")
    config_name, model_name, sizes = BF16_CONFIGS[family]
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=64) if family != "gpt2" else dict(vocab_size=256)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**shape, **sizes))
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    warnings.filterwarnings("ignore", ".*holds no tokenizer files")  # byte ids are what this model was made for
    report = smoke(str(tmp_path), batch_sizes=(1,), device="cpu", progress=False)
    rows = report.table.set_index("check")
    assert rows.loc["init: weights dtype"].value == "bf16"
    padding = rows.loc["shapes: padded batch + attention_mask"]
    assert padding.status == "PASS" and padding.threshold == "<= 0.05" and "bf16 rounding" in padding.detail
    bad = report.table[report.table.status == "FAIL"]
    assert bad.empty, bad.to_string()
    findings = tier_utils.analyze(str(tmp_path), device="cpu", progress=False, n_batches=1)
    assert "FAIL" not in set(findings.table.status), findings.table.to_string()


class MaskIgnoringGPT(TinyGPT):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        return super().forward(input_ids, None, inputs_embeds)  # left padding leaks into the real tokens


@pytest.mark.parametrize("cls", [MaskIgnoringEncoder, MaskIgnoringGPT], ids=["encoder", "decoder"])
def test_padding_leak_fails_in_bf16_too(cls):
    """The bound follows the dtype, and a real leak stays far outside bf16's rounding."""
    torch.manual_seed(0)
    model = cls(**TINY, **({"num_classes": 3} if cls is MaskIgnoringEncoder else {})).to(torch.bfloat16)
    model.padding_side = "left" if cls is MaskIgnoringGPT else "right"
    report = smoke(model, checks=["shapes"], device="cpu", progress=False)
    row = report.table.set_index("check").loc["shapes: padded batch + attention_mask"]
    assert row.status == "FAIL" and row.threshold == "<= 0.05" and "attention_mask" in row.detail


def test_the_report_is_built_whole_from_what_the_groups_yield():
    """Issue 51: no group writes to the report; what it finds for the plots and the JSON it yields, and the report
    is built once, complete (frozen). The latency group alone measures the activation fit the memory group shares."""
    import dataclasses

    report = smoke("tiny-gpt", model_kwargs=TINY, checks="latency,gradients", batch_sizes=(1,), progress=False,
                   device="cpu")
    assert report.activation_fit is not None and report.grad_norms and report.memory == []
    assert [r["batch_size"] for r in report.latency] == [1] and report.seconds > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        report.seconds = 0.0
