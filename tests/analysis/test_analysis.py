import json

import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from matplotlib.figure import Figure
from styles import GPT, HandSoftmax
from tiny import TINY

from tier_utils import TinyGPT, adapt, analyze, load_model
from tier_utils.analysis import ANALYSES, AnalysisConfig, attention, capture_attention, suite
from tier_utils.analysis.common import Context
from tier_utils.analysis.dtypes import op_dtypes
from tier_utils.cli import main
from tier_utils.core.errors import ModelSpecError
from tier_utils.core.precision import Precision, resolve_precision

HF_BERT = dict(num_hidden_layers=1, num_attention_heads=2, hidden_size=32, intermediate_size=64, vocab_size=256,
               max_position_embeddings=64, num_labels=4)
SMALL = dict(batch_size=4, n_batches=1, seq_len=32, progress=False)


class Planted(nn.Module):
    """No attention at all, and one layer (`boom`) whose outputs are ~1e6: far past fp16's 65504."""

    task = "causal-lm"
    max_len = 32

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.boom = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 256)
        with torch.no_grad():
            self.boom.weight.mul_(1e6)

    def forward(self, input_ids):
        return self.head(self.norm(self.boom(self.emb(input_ids))))


class DropoutInEval(TinyGPT):
    """Dropout on the logits that stays on in eval mode: the same input gives different predictions."""

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        return F.dropout(super().forward(input_ids, attention_mask, inputs_embeds), p=0.5, training=True)


@pytest.fixture(scope="module")
def gpt_report():
    torch.manual_seed(0)
    model = TinyGPT(**TINY)
    return model, analyze(model, precision="fp32", **SMALL)


def _ctx(model, precision="fp32", batch_size=2, seq_len=16):
    adapter = adapt(model)
    batches, _ = suite.real_batches(adapter, None, batch_size, 1, seq_len, "cpu")
    return Context(adapter, batches, resolve_precision(precision, "cpu", warn=False))


def test_table_and_frame_columns_are_exact(gpt_report):
    _, report = gpt_report
    assert list(report.table.columns) == ["analysis", "check", "status", "value", "threshold", "detail"]
    assert list(report.table.analysis.unique()) == list(ANALYSES)
    assert set(report.table.status) <= {"PASS", "WARN", "FAIL", "SKIP"}
    f = report.frames
    assert list(f["attention"].columns) == ["layer", "role", "layer_index", "head", "entropy", "max_weight",
                                            "mean_distance", "pattern", "rows"]
    assert list(f["attention_layers"].columns) == ["layer", "role", "heads", "collapsed_heads", "head_similarity_tv",
                                                   "collapsed"]
    assert list(f["attention_distance"].columns) == ["layer", "head", "distance", "weight"]
    assert list(f["robustness"].columns) == ["perturbation", "level", "n", "agreement", "kl", "logit_drift",
                                             "n_correct", "flip_rate"]
    assert list(f["attribution"].columns) == ["position", "token", "text", "saliency", "share"]
    assert list(f["headroom"].columns) == ["layer", "type", "calls", "abs_max", "fp16_headroom", "below_fp16_normal",
                                           "bf16_rel_dev", "fp16_rel_dev", "fp16_nonfinite",
                                           "fp32_nonfinite"]
    assert list(f["dtypes"].columns) == ["autocast", "op", "dtype", "count"]


def test_attention_on_builtin_gpt_scores_every_head_and_leaves_no_hook(gpt_report):
    model, report = gpt_report
    heads = report.frames["attention"]
    assert len(heads) == TINY["n_layer"] * TINY["n_head"]
    assert heads.entropy.between(0, 1.0001).all() and heads.max_weight.between(0, 1).all()
    # each query row's mass over distances sums to 1
    per_head = report.frames["attention_distance"].groupby(["layer", "head"]).weight.sum()
    assert per_head.to_numpy() == pytest.approx(1.0, abs=1e-4)
    assert list(heads.layer.unique()) == ["blocks.0.attn"]  # its SDPA call, named by module path
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert model.training  # left in the mode it came in (a fresh module trains)


def test_attention_capture_on_transformer_encoder_in_eval_mode(tiny_model):
    model = tiny_model("tiny-encoder", seed=0).eval()
    ids = torch.randint(0, 256, (3, 10))
    with torch.no_grad():
        plain = model(ids)
        # Eval + no_grad is when TransformerEncoderLayer takes its fused path that skips self_attn.
        with capture_attention(model) as cap:
            captured = model(ids)
    assert cap.source == "nn.MultiheadAttention hooks"
    assert [m.name for m in cap.maps] == ["encoder.layers.0.self_attn"]
    weights = cap.maps[0].weights
    assert weights.shape == (3, TINY["n_head"], 10, 10)
    assert weights.sum(-1) == pytest.approx(torch.ones(3, 2, 10), abs=1e-5)
    assert torch.allclose(plain, captured, atol=1e-5)  # capturing does not change the model's output
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    report = analyze(model, analyses=["attention"], **SMALL)
    assert report.table.status.iloc[0] in ("PASS", "WARN")
    assert len(report.frames["attention"]) == TINY["n_head"]


@pytest.mark.parametrize("implementation, source", [("sdpa", "SDPA capture"), ("eager", "HF output_attentions")])
def test_attention_capture_on_hf_bert_keeps_its_attention_implementation(implementation, source):
    layer = "bert.encoder.layer.0.attention.self"  # named by module path either way
    pytest.importorskip("transformers")
    model = load_model("hf:BertForSequenceClassification", attn_implementation=implementation, **HF_BERT).eval()
    report = analyze(model, analyses="attention", **SMALL)
    heads = report.frames["attention"]
    assert list(heads["head"]) == [0, 1] and (heads.rows > 0).all() and list(heads.layer.unique()) == [layer]
    assert f"captured via {source}," in report.table.detail.iloc[0]
    assert model.config._attn_implementation == implementation and model.config.output_attentions is False


def test_model_without_attention_is_skipped_with_a_reason():
    report = analyze(Planted(), analyses=["attention"], **SMALL)
    row = report.table.iloc[0]
    assert row.status == "SKIP" and "exposes no attention" in row.detail
    assert "attention" not in report.frames
    assert isinstance(report.plot("attention"), Figure)  # says why, instead of raising


@pytest.mark.filterwarnings("ignore::tier_utils.core.precision.SlowPrecisionWarning")  # fp16 on a CPU without it
def test_headroom_names_the_layer_that_overflows_fp16():
    torch.manual_seed(0)
    report = analyze(Planted(), analyses=["headroom"], precision="fp32", **SMALL)
    layers = report.frames["headroom"].set_index("layer")
    assert layers.loc["boom", "abs_max"] > 65504 and layers.loc["emb", "abs_max"] < 65504
    assert layers.loc["boom", "fp16_nonfinite"] > 0
    rec = report.table[report.table.check == "recommendation"].iloc[0]
    assert rec.value == "prefer bf16" and rec.status == "WARN"
    assert rec.detail.startswith("boom ") and "norm" not in rec.detail.split("output")[0]
    fp16 = analyze(Planted(), analyses=["headroom"], precision="fp16", **SMALL)
    assert fp16.table[fp16.table.check == "recommendation"].status.iloc[0] == "FAIL"  # fp16 asked for: it overflows


def test_headroom_calls_a_healthy_model_fp16_safe(gpt_report):
    _, report = gpt_report
    rec = report.table[report.table.check == "recommendation"].iloc[0]
    assert (rec.value, rec.status) == ("fp16 safe", "PASS")
    drift = report.frames["headroom"]
    assert (drift.bf16_rel_dev.dropna() < 0.05).all() and (drift.bf16_rel_dev.dropna() > 0).any()


def test_dtype_report_follows_cpu_bf16_autocast_rules():
    torch.manual_seed(0)
    model = GPT(HandSoftmax).eval()  # the explicit q @ k^T path, so bmm shows up
    df = op_dtypes(_ctx(model), _ctx(model).batches[0], "bf16")
    dtypes = df.groupby("op").dtype.agg(set)
    for matmul in ("addmm", "mm", "bmm"):  # on autocast's lower-precision list
        assert dtypes[matmul] == {"bfloat16"}, matmul
    # cross-entropy is on CPU autocast's fp32 list; layer_norm here reads the fp32 residual stream
    for op in ("_log_softmax", "nll_loss_forward", "native_layer_norm"):
        assert dtypes[op] == {"float32"}, op
    assert "view" not in dtypes.index and "transpose" not in dtypes.index  # views compute nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dtype_report_on_cuda_keeps_softmax_in_fp32():
    model = GPT(HandSoftmax).cuda().eval()
    adapter = adapt(model)
    batches, _ = suite.real_batches(adapter, None, 2, 1, 16, "cuda")
    df = op_dtypes(Context(adapter, batches, resolve_precision("fp32", "cuda")), batches[0], "fp16")
    dtypes = df.groupby("op").dtype.agg(set)
    assert dtypes["bmm"] == {"float16"} and dtypes["_softmax"] == {"float32"}


def test_robustness_agreement_is_exactly_one_at_zero_perturbation(gpt_report):
    _, report = gpt_report
    df = report.frames["robustness"]
    zero = df[df.level == 0]
    assert set(zero.perturbation) == {"substitution", "deletion", "embedding_noise"}
    assert (zero.agreement == 1.0).all() and (zero.kl == 0).all()
    strong = df[(df.level == df.level.max()) & (df.perturbation == "substitution")]
    assert strong.agreement.iloc[0] < 1.0  # 20% of tokens replaced does change predictions
    rows = report.table[report.table.analysis == "robustness"]
    assert not rows.status.eq("FAIL").any()


def test_robustness_fails_a_model_that_is_not_deterministic_in_eval_mode(tiny_model):
    model = tiny_model(DropoutInEval, seed=0)
    report = analyze(adapt(model), analyses="robustness", precision="fp32", **SMALL)  # an adapter is accepted
    zero = report.frames["robustness"].query("level == 0")
    assert (zero.agreement < 0.9).all() and (zero.kl > 0).all()  # level 0 reruns the clean input
    rows = report.table
    assert list(rows.status) == ["FAIL"] * 3 and rows.detail.str.contains("not deterministic in eval mode").all()
    with pytest.raises(ModelSpecError, match="not to an adapter"):
        analyze(adapt(model), analyses="robustness", model_kwargs={"d_model": 64}, **SMALL)


def test_attribution_for_lm_and_classifier():
    torch.manual_seed(0)
    for spec in ("tiny-gpt", "tiny-encoder"):
        report = analyze(spec, analyses="attribution", model_kwargs=TINY, **SMALL)
        table = report.frames["attribution"]
        assert len(table) == 32 and table.saliency.abs().sum() > 0
        assert table.share.sum() == pytest.approx(1.0)
        assert report.table.status.iloc[0] == "PASS"
        assert isinstance(report.plot("attribution"), Figure)


def test_a_raising_analysis_becomes_a_fail_row_and_the_rest_still_run(monkeypatch):
    def broken(ctx):
        raise RuntimeError("planted failure\n  on a second line")

    monkeypatch.setitem(ANALYSES, "attribution", suite.Analysis(broken, None, None))
    report = analyze("tiny-gpt", analyses=["attribution", "robustness"], model_kwargs=TINY, **SMALL)
    failed = report.table[report.table.analysis == "attribution"].iloc[0]
    assert failed.status == "FAIL" and failed.detail == "raised RuntimeError: planted failure on a second line"
    assert (report.table[report.table.analysis == "robustness"].status != "FAIL").all()
    assert report.status == "FAIL"
    assert "planted failure" in report.to_json()["errors"]["attribution"]
    assert isinstance(report.plot(), Figure)


def test_unknown_analysis_names_the_valid_ones():
    with pytest.raises(ValueError, match="choose from: attention, robustness, attribution, headroom, dtypes"):
        analyze("tiny-gpt", analyses="attention,vibes", model_kwargs=TINY, **SMALL)


def test_keywords_are_settings_and_model_kwargs_build_the_model():
    # A model argument given as a keyword used to build the model; now it is refused, naming the valid settings.
    with pytest.raises(ValueError, match=r"unknown analysis setting\(s\) d_model; valid: analyses, precision"):
        analyze("tiny-gpt", d_model=32)
    config = AnalysisConfig(analyses="robustness", precision="fp32", **{**SMALL, "seq_len": 16})
    report = analyze("tiny-gpt", None, config, model_kwargs={**TINY, "max_len": 16})
    assert report.model["max_len"] == 16 and report.data.seq_len == 16
    assert list(report.outcomes) == ["robustness"]


def test_attention_maps_are_drawn_with_example_0s_tokens():
    torch.manual_seed(0)
    ctx = _ctx(TinyGPT(**{**TINY, "max_len": 40}), seq_len=40)
    outcome = attention.run(ctx)
    expected = [ctx.adapter.tokenizer.label(int(t)) for t in ctx.batches[0]["input_ids"][0]]
    (rows, queries), (columns, keys) = outcome.artifacts["tokens"]["blocks.0.attn"]
    assert (rows, columns) == ("source", "source") and queries == keys == expected
    ax = attention.plot(outcome).axes[0]
    every = -(-40 // attention.TICKS_SHOWN)  # 40 tokens: every third one labelled
    assert [t.get_text() for t in ax.get_yticklabels()] == expected[::every] and every == 3
    assert ax.get_xlabel() == "key (source token)"


def test_the_precision_is_the_decision_its_json_unchanged(gpt_report):
    _, report = gpt_report
    assert isinstance(report.precision, Precision) and report.precision.name == "fp32"
    assert report.to_json()["precision"] == report.precision.to_dict()
    decided = resolve_precision("fp32", "cpu")  # run_all decides once and passes the decision down
    assert analyze(TinyGPT(**TINY), analyses="robustness", precision=decided, device="cpu", **SMALL).precision \
        is decided


def test_plots_and_json(gpt_report):
    _, report = gpt_report
    for name in ANALYSES:
        assert report.plot(name).axes, name
    assert len(report.plot().axes) >= len(ANALYSES)
    assert len(report.plot("attention", layers=[0], heads=[1]).axes) >= 2
    with pytest.raises(ValueError, match="has: attention"):
        report.plot("nope")
    data = json.loads(json.dumps(report.to_json()))
    assert data["run_metadata"]["dtype"] == "float32" and data["run_metadata"]["torch"] == torch.__version__
    assert pd.DataFrame(data["findings"]).shape == report.table.shape


def test_cli_analyze(tmp_path, capsys):
    out = tmp_path / "a.json"
    args = ["analyze", "--model", "tiny-gpt", "--model-arg", "d_model=32", "--model-arg", "n_layer=1",
            "--model-arg", "max_len=32", "--analyses", "robustness,headroom", "--batch-size", "2", "--n-batches", "1",
            "--precision", "fp32", "--json", str(out), "--no-progress"]
    assert main(args) == 0
    data = json.loads(out.read_text())
    assert {r["analysis"] for r in data["findings"]} == {"robustness", "headroom"}
    assert "fp16 safe" in capsys.readouterr().out
    assert main(["analyze", "--analyses", "vibes", "--no-progress"]) == 2


def test_headroom_subnormal_outputs_that_fp16_kept_close_do_not_contradict_the_drift():
    from tier_utils.analysis.headroom import recommend

    columns = ["layer", "type", "calls", "abs_max", "fp16_headroom", "below_fp16_normal", "bf16_rel_dev",
               "fp16_rel_dev", "fp16_nonfinite", "fp32_nonfinite"]

    def table(dev, abs_max=1.0):  # one layer with 20% of its outputs below fp16's smallest normal
        return pd.DataFrame([["attn.drop", "Dropout", 1, abs_max, 65504 / abs_max, 0.2, 0.004, dev, 0, 0]],
                            columns=columns)

    assert recommend(table(0.001))[0] == "fp16 safe"  # measured: the underflow cost nothing
    assert recommend(table(0.2)) == ("fp16 needs scaling care", ["attn.drop"], "WARN")  # measured: it did
    assert recommend(table(float("nan")))[0] == "fp16 needs scaling care"  # not measured: keep the caution
    assert recommend(table(0.001, abs_max=10000.0))[0] == "fp16 needs scaling care"  # range is never cleared


class NaNOutputGPT(TinyGPT):
    """Finite in every layer, NaN only in the returned logits (outside any leaf module)."""

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
        return super().forward(input_ids, attention_mask, inputs_embeds) * float("nan")


def test_nan_models_get_no_pass_from_any_analysis_that_reads_outputs(tiny_model):
    model = tiny_model(NaNOutputGPT, seed=0)
    out = analyze(model, analyses=["robustness", "headroom"], precision="fp32", **SMALL).table
    assert "PASS" not in set(out.status) and (out.status == "FAIL").all()
    rec = out[out.check == "recommendation"].iloc[0]
    assert rec.value == "fp32 is not finite" and "model output" in rec.detail
    assert out[out.analysis == "robustness"].detail.str.contains("NaN/inf log-probabilities").all()
    inner = tiny_model(TinyGPT, seed=0)
    with torch.no_grad():
        inner.blocks[0].attn.qkv.bias.fill_(float("nan"))  # NaN attention weights, NaN in fp32 layers
    table = analyze(inner, analyses=["attention", "headroom"], precision="fp32", **SMALL).table
    assert "PASS" not in set(table.status)
    att = table[table.analysis == "attention"]
    assert (att.status == "FAIL").all() and att.detail.str.contains("NaN/inf weights in blocks.0.attn").all()
    rec = table[table.check == "recommendation"].iloc[0]
    assert rec.status == "FAIL" and "first in blocks.0.attn.qkv" in rec.detail


def test_robustness_compares_as_many_sequences_as_its_time_budget_allows(monkeypatch):
    from tier_utils.analysis import robustness

    monkeypatch.setattr(robustness, "BUDGET_S", 0.0)  # a model so big one sequence is all the budget holds
    report = analyze("tiny-gpt", analyses="robustness", model_kwargs=TINY, **SMALL)
    df = report.frames["robustness"]
    assert (df.n <= SMALL["seq_len"]).all()  # one sequence's predictions, not 4
    rows = report.table
    assert rows.detail.str.contains("1 of 4 sequences, as many as fit the 0 s budget").all()
    assert (rows.status != "FAIL").all()


def test_headroom_compares_emulated_precisions_on_one_sequence_and_dtypes_on_a_short_one(monkeypatch):
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "")  # a CPU with neither bf16 nor fp16: both emulated
    torch.manual_seed(0)
    report = analyze(TinyGPT(**TINY), analyses=["headroom", "dtypes"], precision="fp32", **SMALL)
    drift = report.table.set_index("check").loc["fp16 drift"]
    assert "(on 1 of the first batch's 4 sequences: bf16 and fp16 emulated on cpu (slow))" in drift.detail
    assert drift.status == "PASS"
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16,avx512_fp16")  # both native: the whole batch
    report = analyze(TinyGPT(**TINY), analyses=["headroom"], precision="fp32", **SMALL)
    assert "sequences:" not in report.table.set_index("check").loc["fp16 drift"].detail
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", "64KiB")  # too little for 3 copies of every layer's output
    report = analyze(TinyGPT(**TINY), analyses=["headroom"], precision="fp32", **SMALL)
    assert "sequences: every layer's output in 3 precisions, at most" in \
        report.table.set_index("check").loc["fp16 drift"].detail


def test_attribution_attributes_as_many_sequences_as_its_time_budget_allows(monkeypatch):
    from tier_utils.analysis import attribution

    monkeypatch.setattr(attribution, "BUDGET_S", 0.0)
    row = analyze("tiny-gpt", analyses="attribution", model_kwargs=TINY, **SMALL).table.iloc[0]
    assert row.status == "PASS" and "(mean over 1 sequences); 1 of 4 sequences, as many as fit the 0 s budget" \
        in row.detail


def test_attribution_attributes_as_many_sequences_as_the_memory_budget_holds(monkeypatch):
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", "1KiB")  # less than one sequence's saved activations
    row = analyze("tiny-gpt", analyses="attribution", model_kwargs=TINY, **SMALL).table.iloc[0]
    assert row.status == "PASS" and "(mean over 1 sequences); 1 of 4 sequences: one holds" in row.detail
    assert "for backward, 0 MiB may be held here" in row.detail


def test_headroom_statistics_in_slices_equal_the_whole_tensor(monkeypatch):
    """The range statistics and drift walk big outputs in slices: the figures are the ones of the whole."""
    from tier_utils.analysis import headroom
    from tier_utils.core import budget

    torch.manual_seed(0)
    whole = analyze(TinyGPT(**TINY), analyses="headroom", precision="fp32", **SMALL).frames["headroom"]
    monkeypatch.setattr(budget, "CHUNK_BYTES", 4 * 32 * 3)  # three rows of a 32-wide output per slice
    torch.manual_seed(0)
    sliced = analyze(TinyGPT(**TINY), analyses="headroom", precision="fp32", **SMALL).frames["headroom"]
    pd.testing.assert_frame_equal(whole, sliced, rtol=1e-5)
    assert headroom._deviation([torch.ones(5, 7)], [torch.full((5, 7), float("inf"))])[0] == float("inf")
