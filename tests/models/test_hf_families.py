"""The models users actually bring: tiny-config Hugging Face families (random weights, built from a
config, no download) through smoke and analyze, and train / bench for a few. A healthy model gets no
FAIL and no WARN beyond what an untrained model should get, and those say so."""
import os

import pytest
import torch
import torch.nn as nn

from tier_utils import AdapterError, adapt, amp_benchmark, analyze, load_model, smoke, train
from tier_utils.adapter.adapter import DEFAULT_MAX_LEN
from tier_utils.cli import main

pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

T = 32  # max length where the family has a position table
DEC = dict(vocab_size=256, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
           max_position_embeddings=T)
ENC = dict(DEC, num_labels=4)
FAMILIES = {  # class -> config; comments: what the family brings
    "GPT2LMHeadModel": dict(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=T),  # learned, tied
    "OPTForCausalLM": dict(DEC, ffn_dim=64, word_embed_proj_dim=32, pad_token_id=1),  # offset 2, tied, padding row
    "LlamaForCausalLM": dict(DEC, num_key_value_heads=1),  # rotary, untied
    "Qwen2ForCausalLM": dict(DEC, num_key_value_heads=1, tie_word_embeddings=True),  # rotary, tied
    "GemmaForCausalLM": dict(DEC, num_key_value_heads=1, head_dim=16),  # tied, padding row
    "GPTNeoXForCausalLM": dict(DEC),  # partial rotary
    "FalconForCausalLM": dict(DEC),  # refuses config.output_attentions under SDPA
    "BloomForCausalLM": dict(vocab_size=256, hidden_size=32, n_layer=1, n_head=2),  # ALiBi: no position table
    "MambaForCausalLM": dict(vocab_size=256, hidden_size=32, num_hidden_layers=1, state_size=4),  # state space
    "BertForSequenceClassification": dict(ENC),  # learned, encoder
    "RobertaForSequenceClassification": dict(ENC, max_position_embeddings=T + 2, pad_token_id=1),  # offset
    "DistilBertForSequenceClassification": dict(vocab_size=256, dim=32, n_layers=1, n_heads=2, hidden_dim=64,
                                                max_position_embeddings=T, num_labels=4),
    "ModernBertForSequenceClassification": dict(ENC, pad_token_id=0, global_attn_every_n_layers=1),  # rotary
}
NO_POSITION_TABLE = {"BloomForCausalLM", "MambaForCausalLM"}
# Latency and robustness cost the most and depend least on the family (robustness does go through
# inputs_embeds, hence one of each kind of position handling): run them for these only, to stay fast.
EVERY_CHECK = {"BloomForCausalLM", "MambaForCausalLM", "RobertaForSequenceClassification"}
UNTRAINED = "untrained model"  # the only WARN a healthy random-init model may get says this


def build(name: str, **config) -> nn.Module:
    torch.manual_seed(0)
    return load_model(f"hf:{name}", **{**FAMILIES[name], **config})


def _problems(rows) -> list[str]:
    return [f"{r['status']} {r['check']}: {r['detail']}" for r in rows
            if r["status"] == "FAIL" or (r["status"] == "WARN" and UNTRAINED not in str(r["detail"]))]


@pytest.mark.parametrize("name", FAMILIES)
def test_healthy_family_is_clean_through_smoke_and_analyze(name):
    model = build(name)
    adapter = adapt(model)
    length = DEFAULT_MAX_LEN if name in NO_POSITION_TABLE else T
    assert adapter.max_len == length
    assert adapter.task.name == ("classification" if name.endswith("Classification") else "causal-lm")
    full = name in EVERY_CHECK
    report = smoke(adapter, batch_sizes=(1,), seq_lens=(16,), device="cpu", progress=False,
                   checks=None if full else "shapes,gradients,stability,init,memory,determinism")
    rows = report.to_json()["checks"]
    assert _problems(rows) == []
    assert not [r for r in rows if r["status"] == "WARN"]  # smoke knows no untrained-model WARN
    by_check = {r["check"]: r for r in rows}
    padding = by_check["shapes: padded batch + attention_mask"]
    assert padding["status"] == "PASS"
    assert ("left padding" if adapter.task.name == "causal-lm" else "right padding") in padding["detail"]
    default_row = by_check.get("shapes: max length (default)")
    assert (default_row is not None) == (name in NO_POSITION_TABLE)
    found = analyze(adapter, device="cpu", n_batches=1, batch_size=2, seq_len=16, progress=False,
                    analyses=None if full else "attention,attribution,headroom,dtypes")
    assert _problems(found.table.to_dict("records")) == []


def test_an_encoder_decoder_runs_as_seq2seq_and_no_other_task(capsys):
    t5 = dict(vocab_size=256, d_model=32, num_layers=1, num_heads=2, d_ff=64, d_kv=16)
    with pytest.raises(AdapterError, match="runs as the seq2seq task; drop task=causal-lm"):
        adapt(load_model("hf:T5ForConditionalGeneration", **t5), task="causal-lm")
    code = main(["smoke", "--model", "hf:T5ForConditionalGeneration", *[f"--model-arg={k}={v}" for k, v in t5.items()],
                 "--checks", "shapes", "--device", "cpu", "--no-progress"])
    assert code == 0, capsys.readouterr().err


def test_an_encoder_decoder_that_reads_no_text_is_refused_in_one_line(capsys):
    code = main(["smoke", "--model", "hf:WhisperForConditionalGeneration",
                 "--model-arg", "d_model=32", "--model-arg", "encoder_layers=1", "--model-arg", "decoder_layers=1",
                 "--model-arg", "encoder_attention_heads=2", "--model-arg", "decoder_attention_heads=2",
                 "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "whisper is an encoder-decoder whose encoder does not read text" in err
    assert len(err.splitlines()) == 1


def test_model_without_position_table_runs_from_the_cli(capsys):
    code = main(["smoke", "--model", "hf:BloomForCausalLM", "--model-arg", "vocab_size=256", "--model-arg",
                 "hidden_size=32", "--model-arg", "n_layer=1", "--model-arg", "n_head=2", "--checks",
                 "shapes,init", "--device", "cpu", "--no-progress"])
    assert code == 0, capsys.readouterr().err


def test_roberta_length_excludes_the_padding_offset():
    model = build("RobertaForSequenceClassification")
    table = model.roberta.embeddings.position_embeddings
    assert adapt(model).max_len == table.num_embeddings - table.padding_idx - 1 == T
    # Longer than the model serves: train caps it at the usable length instead of an index error inside it.
    result = train(model, precision="fp32", max_steps=2, batch_size=2, seq_len=128, eval_every=0, eval_batches=1,
                   progress=False, device="cpu")
    assert result.summary.steps == 2 and result.summary.train_loss > 0


def test_padding_check_catches_a_decoder_lm_that_drops_the_mask():
    class DropsMask(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids=None, attention_mask=None):
            return self.inner(input_ids=input_ids).logits  # the mask never reaches the model

    report = smoke(DropsMask(build("LlamaForCausalLM")), checks="shapes", device="cpu", progress=False)
    row = report.table.set_index("check").loc["shapes: padded batch + attention_mask"]
    assert row.status == "FAIL" and "left padding" in row.detail


def test_falcon_attention_is_captured_and_its_implementation_restored():
    model = build("FalconForCausalLM")
    assert model.config._attn_implementation == "sdpa"
    found = analyze(model, analyses="attention", device="cpu", n_batches=1, batch_size=2, seq_len=16, progress=False)
    assert found.frames["attention"].shape[0] == 2  # 1 layer x 2 heads
    assert model.config._attn_implementation == "sdpa"


def test_mamba_attention_skip_says_it_has_none():
    found = analyze(adapt(build("MambaForCausalLM"), max_len=16), analyses="attention", device="cpu", n_batches=1,
                    batch_size=2, seq_len=16, progress=False)
    row = found.table.iloc[0]
    assert row.status == "SKIP" and "no attention layers" in row.detail


@pytest.mark.parametrize("name", ["LlamaForCausalLM", "BloomForCausalLM", "BertForSequenceClassification"])
def test_family_trains_and_benchmarks(name):
    model = build(name)
    result = train(model, precision="fp32", max_steps=2, batch_size=2, seq_len=16, eval_every=0, eval_batches=1,
                   progress=False, device="cpu")
    assert result.summary.steps == 2 and 0 < result.summary.train_loss < float("inf")
    bench = amp_benchmark(model, precisions=("fp32",), batch_size=2, seq_len=16, untimed_steps=0, timed_steps=1,
                          repeats=1, accuracy_steps=2, eval_batches=1, device="cpu", progress=False)
    record = bench.records[0] if isinstance(bench.records, list) else bench.records["fp32"]
    assert "FAIL" not in set(bench.verdicts.status) and record
