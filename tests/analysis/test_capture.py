"""Attention maps from hand-written models, unmodified: SDPA capture, softmax capture, names, bad input."""
import copy
from pathlib import Path

import pytest
import torch
from styles import GPT, LAYERS, MAX_LEN, VOCAB, FusedKernel, HandSoftmax, SdpaCausal, SdpaWindowGqa, Unnamed

from tier_utils import analyze
from tier_utils.analysis import capture_attention

SMALL = dict(batch_size=4, n_batches=1, seq_len=16, progress=False, device="cpu", precision="fp32")
PATHS = [f"transformer.h.{i}.attn" for i in range(LAYERS)]


def _ids(B=3, T=12):
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("style, source", [(SdpaCausal, "SDPA capture"), (SdpaWindowGqa, "SDPA capture"),
                                           (HandSoftmax, "softmax capture")])
def test_captured_maps_are_the_models_own_probabilities(style, source):
    torch.manual_seed(0)
    model = GPT(style).eval()
    reference = copy.deepcopy(model)  # the same weights, asked to return its probabilities
    ids = _ids()
    with torch.no_grad():
        plain = model(ids)
        with capture_attention(model, seq_len=ids.size(1)) as cap:
            captured = model(ids)
        _, want = reference(ids, return_maps=True)
    assert torch.equal(plain, captured)  # bitwise: the capture changes nothing the model computes
    assert [m.name for m in cap.maps] == PATHS and cap.source == source
    for found in cap.maps:
        assert found.weights.shape == want[found.name].shape == (3, 4, 12, 12)
        torch.testing.assert_close(found.weights, want[found.name], atol=1e-5, rtol=0)
        # the keys the model's own mask leaves visible (causal, or the sliding window)
        assert torch.equal(found.allowed, (want[found.name] > 0).any(1))
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert not torch.overrides._is_torch_function_mode_enabled()


def test_sliding_window_narrows_the_keys_each_query_is_scored_over():
    torch.manual_seed(0)
    heads = analyze(GPT(SdpaWindowGqa), analyses="attention", **SMALL).frames["attention"]
    assert list(heads.layer.unique()) == PATHS and len(heads) == LAYERS * 4
    # at most `window` keys: the mean distance stays under the window, where causal attention over 16 tokens
    # spreads to ~4 on fresh weights
    assert heads.mean_distance.max() < SdpaWindowGqa.window


@pytest.mark.parametrize("style", [SdpaCausal, HandSoftmax])
def test_analyze_names_maps_by_module_path_and_says_the_size(style):
    torch.manual_seed(0)
    report = analyze(GPT(style), analyses="attention", **SMALL)
    assert list(report.frames["attention"].layer.unique()) == PATHS
    detail = report.table.detail.iloc[0]
    assert "maps of 4 of 4 sequences per batch" in detail and "MiB per map" in detail
    fig = report.plot("attention")
    assert fig.axes[0].get_title() == "transformer.h.0.attn (causal self) h0"  # its role beside its path


def test_maps_are_cut_to_the_memory_budget(monkeypatch):
    # One sequence's map, 4 heads x 16 x 16 float32, is scored with 8 copies: 32 KiB. Half of 150 KiB fits 2.
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", "150KiB")
    torch.manual_seed(0)
    report = analyze(GPT(SdpaCausal), analyses="attention", **SMALL)
    assert "maps of 2 of 4 sequences per batch, largest 0.01 MiB" in report.table.detail.iloc[0]
    assert (report.frames["attention"].rows == 2 * 15).all()  # 2 sequences x the 15 queries with a choice


def test_sdpa_calls_outside_any_submodule_are_named_by_call_order():
    torch.manual_seed(0)
    with torch.no_grad(), capture_attention(model := Unnamed().eval(), seq_len=10) as cap:
        model(_ids(2, 10))
    assert [m.name for m in cap.maps] == ["sdpa call 0", "sdpa call 1"]
    assert analyze(Unnamed(), analyses="attention", **SMALL).table.status.iloc[0] in ("PASS", "WARN")


def test_attention_in_a_kernel_outside_sdpa_is_one_skip_row_naming_it():
    torch.manual_seed(0)
    model = GPT(FusedKernel)
    report = analyze(model, analyses="attention", **SMALL)
    assert len(report.table) == 1
    row = report.table.iloc[0]
    assert row.status == "SKIP" and "tier_utils_tests.fused_attention" in row.detail
    assert "set transformer.h.0.attn.use_flash = False" in row.detail
    for block in model.transformer.h:  # its fallback, as the row says
        block.attn.use_flash = False
    assert list(analyze(model, analyses="attention", **SMALL).frames["attention"].layer.unique()) == PATHS


def test_capture_is_off_outside_the_block_and_leaves_training_untouched():
    torch.manual_seed(0)
    model = GPT(SdpaCausal)
    with capture_attention(model, seq_len=8) as cap:
        pass
    model(_ids(2, 8)).sum().backward()  # after the block: nothing captured, gradients as usual
    assert cap.maps == [] and model.lm_head.weight.grad is not None
    assert MAX_LEN >= 16


@pytest.mark.parametrize("spec, sizes", [
    ("hf:GPT2LMHeadModel", dict(n_layer=2, n_head=2, n_embd=32, vocab_size=256, n_positions=64)),
    ("hf:BertForSequenceClassification", dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                              intermediate_size=64, vocab_size=256, max_position_embeddings=64))])
def test_sdpa_capture_of_a_transformers_model_equals_its_eager_attentions(spec, sizes):
    pytest.importorskip("transformers")
    from tier_utils import load_model

    torch.manual_seed(0)
    model = load_model(spec, attn_implementation="sdpa", **sizes).eval()
    eager = load_model(spec, attn_implementation="eager", **sizes).eval()
    eager.load_state_dict(model.state_dict())
    ids, mask = _ids(2, 10), torch.ones(2, 10, dtype=torch.long)
    mask[1, 7:] = 0  # padding: the mask HF builds reaches SDPA as attn_mask
    with torch.no_grad(), capture_attention(model, seq_len=10) as cap:
        model(input_ids=ids, attention_mask=mask)
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, output_attentions=True).attentions
    assert len(cap.maps) == len(want) == 2 and cap.source == "SDPA capture"
    for found, ref in zip(cap.maps, want):
        torch.testing.assert_close(found.weights[0], ref[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(found.weights[1, :, :7], ref[1, :, :7], atol=1e-5, rtol=0)  # real queries


def test_the_docs_example_model_file_gives_maps_by_module_path():
    example = Path(__file__).parents[2] / "docs" / "examples" / "hand_written_gpt.py"
    report = analyze(f"{example}:HandWrittenGPT", analyses="attention", **SMALL)
    assert list(report.frames["attention"].layer.unique()) == ["h.0.attn", "h.1.attn"]
