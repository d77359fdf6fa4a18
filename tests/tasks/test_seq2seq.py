"""Encoder-decoders as users bring them: T5 and BART folders with their own tokenizer (trained here: no hub), pairs
files, a hand-written nn.Transformer; never loaded as another head."""
import io
import json
import warnings

import pytest
import torch
import torch.nn as nn
from tiny import TINY, TINY_ARGS

import tier_utils
import tier_utils.models.builtins
from tier_utils.cli import main
from tier_utils.core.errors import AdapterError, DataError, ModelSpecError
from tier_utils.data.tokenizer import is_tokenizer_folder
from tier_utils.tasks import SEQ2SEQ, build_datasets, task_named
from tier_utils.tasks.seq2seq import decoder_inputs

transformers = pytest.importorskip("transformers")
SMALL = dict(d_model=32, n_layer=1, n_head=2, max_len=32)
PAIRS = [{"input": f"item {i} of the list", "target": f"ITEM {i} OF THE LIST"} for i in range(40)]


def pairs_tokenizer():
    """A word-level tokenizer over the pairs' words, with T5's specials: pad 0, end of sequence 1 appended."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for p in PAIRS for side in p.values() for w in side.split()})
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("seq2seq")
    tok = pairs_tokenizer()
    vocab = len(tok)
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, pad_token_id=0, eos_token_id=1,
        decoder_start_token_id=0))
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=vocab, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, decoder_start_token_id=1, forced_eos_token_id=1))
    made = {}
    for name, model in (("t5", t5), ("bart", bart)):
        model.to(torch.bfloat16).save_pretrained(root / name)  # stored in bf16, as hub models are
        tok.save_pretrained(root / name)
        made[name] = root / name
    data = root / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PAIRS))
    made["pairs"] = data
    return made


def test_a_t5_folder_whose_tokenizer_is_its_sentencepiece_model_alone_loads_and_trains(folders, tmp_path):
    """T5's spiece.model, trained here on the pairs' text (a tiny unigram vocabulary): the folder holds no other
    tokenizer file, and still loads with its own tokenizer (T5's end of sequence appended) and trains."""
    sentencepiece = pytest.importorskip("sentencepiece")
    folder = tmp_path / "t5-spm"
    folder.mkdir()
    written = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter([side for p in PAIRS for side in p.values()]), model_writer=written, vocab_size=40,
        model_type="unigram", pad_id=0, eos_id=1, unk_id=2, bos_id=-1, hard_vocab_limit=False, minloglevel=2)
    (folder / "spiece.model").write_bytes(written.getvalue())
    assert is_tokenizer_folder(folder)  # the model file alone names the folder a tokenizer's
    config = dict(d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, pad_token_id=0, eos_token_id=1,
                  decoder_start_token_id=0)
    transformers.T5Config(**config).save_pretrained(folder)  # which tokenizer class reads spiece.model
    vocab = tier_utils.load_tokenizer(str(folder)).vocab_size  # its pieces and T5's 100 sentinel ids
    torch.manual_seed(0)
    transformers.T5ForConditionalGeneration(transformers.T5Config(vocab_size=vocab, **config)).save_pretrained(folder)
    assert not {"tokenizer.json", "tokenizer_config.json"} & {p.name for p in folder.iterdir()}
    adapter = tier_utils.adapt(tier_utils.load_model(str(folder)))
    assert adapter.tokenizer.name == str(folder.resolve()) and adapter.task is SEQ2SEQ
    ids = adapter.tokenizer.hf("ITEM 3 OF THE LIST").input_ids
    assert ids[-1] == 1 and "▁" in "".join(adapter.tokenizer.hf.convert_ids_to_tokens(ids))  # SentencePiece's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # sources cut to seq_len
        result = tier_utils.train(str(folder), str(folders["pairs"]), max_steps=2, batch_size=4, seq_len=16,
                                  eval_batches=1, progress=False, device="cpu")
    assert result.summary.task == "seq2seq" and 0 < result.summary.train_loss < float("inf")


@pytest.mark.parametrize("name,architecture", [("t5", "T5ForConditionalGeneration"),
                                               ("bart", "BartForConditionalGeneration")])
def test_a_folder_loads_as_its_own_encoder_decoder_and_passes_smoke(folders, name, architecture):
    adapter = tier_utils.adapt(tier_utils.load_model(str(folders[name])))
    assert type(adapter.model).__name__ == architecture and adapter.task is SEQ2SEQ
    assert adapter.tokenizer.name == str(folders[name].resolve())
    report = tier_utils.smoke(adapter, checks=["shapes", "gradients", "stability", "determinism"], device="cpu",
                              progress=False)
    failed = report.table[report.table.status == "FAIL"]
    assert failed.empty, failed.to_string()
    assert report.model["task"] == "seq2seq"


def test_pairs_are_encoded_as_the_tokenizer_does_with_unscored_padding(folders):
    tok = tier_utils.load_tokenizer(str(folders["t5"]))
    splits = build_datasets(str(folders["pairs"]), SEQ2SEQ, seq_len=8, vocab_size=tok.vocab_size, tokenizer=tok)
    row = splits.train[0]
    target = row["labels"][row["labels"] != -100]
    assert target[-1].item() == 1  # T5's end of sequence, which a plain encode leaves out
    assert row["labels"][len(target):].eq(-100).all() and row["attention_mask"].sum() == len(
        row["input_ids"][row["attention_mask"] == 1])
    assert "a seeded random 10% of the pairs" in splits.validation


def test_the_bundled_pairs_are_cut_without_a_warning_and_the_users_are_not(folders):
    """The tier-2 demo cell printed four red "were cut; raise seq_len" lines about tier_utils' own snippets."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        demo = build_datasets(None, SEQ2SEQ, seq_len=12)
    assert not [w for w in caught if "cut" in str(w.message)] and "cut to the lengths asked" in demo.name
    tok = tier_utils.load_tokenizer(str(folders["t5"]))
    with pytest.warns(UserWarning, match="were cut to it"):
        build_datasets(str(folders["pairs"]), SEQ2SEQ, seq_len=2, vocab_size=tok.vocab_size, tokenizer=tok)


def test_a_t5_folder_without_tokenizer_files_names_the_tokenizer_as_the_fix(folders, tmp_path, capsys):
    """Its vocabulary is smaller than byte ids': the line said only vocab_size>=256, where the fix is --tokenizer."""
    import shutil

    bare = tmp_path / "t5-bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(folders["t5"] / name, bare / name)
    code = main(["train", "--model", str(bare), "--data", str(folders["pairs"]), "--max-steps", "1", "--no-progress",
                 "--out", str(tmp_path / "run")])
    lines = capsys.readouterr().err.strip().splitlines()
    err = [line for line in lines if not line.startswith("warning:")]
    assert code == 2 and len(err) == 1 and "--tokenizer PATH" in err[0], lines
    assert not (tmp_path / "run").exists()


def test_a_t5_folder_trains_on_a_pairs_file_through_the_cli(folders, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["train", "--model", str(folders["t5"]), "--data", str(folders["pairs"]), "--target-column", "target",
                 "--max-steps", "6", "--batch-size", "8", "--seq-len", "12", "--eval-batches", "1", "--device", "cpu",
                 "--no-progress", "--out", str(out), "--json", str(tmp_path / "t.json")])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "t.json").read_text())
    assert summary["task"] == "seq2seq" and summary["model"] == "T5ForConditionalGeneration"
    assert 0 < summary["val_loss"] < 20 and 0 <= summary["accuracy"] <= 1 and summary["perplexity"] is None
    # the targets scored: the pairs' real tokens, never the padding past their end
    assert 0 < summary["val_targets"] <= 4 * 12


def test_train_cuts_the_targets_to_their_own_length_and_a_causal_lm_refuses_one(folders, tmp_path, capsys):
    args = ["--max-steps", "2", "--batch-size", "8", "--seq-len", "12", "--target-len", "3", "--eval-batches", "1",
            "--device", "cpu", "--no-progress"]
    code = main(["train", "--model", str(folders["t5"]), "--data", str(folders["pairs"]), *args,
                 "--out", str(tmp_path / "run"), "--json", str(tmp_path / "t.json")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "targets in table pairs.jsonl" in err  # every target (6 tokens) cut to 3, said
    summary = json.loads((tmp_path / "t.json").read_text())
    assert summary["val_targets"] == 4 * 3  # the 4 validation pairs, 3 target tokens each
    out = tmp_path / "lm"
    assert main(["train", *TINY_ARGS, *args, "--out", str(out)]) == 2
    assert "drop target_len (--target-len)" in capsys.readouterr().err and not out.exists()


def test_bart_as_a_causal_lm_is_refused_in_one_line_and_nothing_is_written(folders, tmp_path, capsys):
    """transformers would load BartForCausalLM, drop the encoder and start the decoder's head at random."""
    out = tmp_path / "run"
    code = main(["smoke", "--model", str(folders["bart"]), "--model-arg", "task=causal-lm", "--no-progress",
                 "--json", str(tmp_path / "s.json")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert "as BartForCausalLM would drop" in err[0] and "holds a BartForConditionalGeneration" in err[0]
    assert not (tmp_path / "s.json").exists() and not out.exists()


def test_t5_as_a_causal_lm_is_refused_naming_its_own_architecture(folders):
    with pytest.raises(ModelSpecError, match="holds a T5ForConditionalGeneration, which has no causal-lm head"):
        tier_utils.load_model(str(folders["t5"]), task="causal-lm")


def test_every_text_to_text_encoder_decoder_in_transformers_loads_as_seq2seq():
    """The mapping walked, config by config: every encoder-decoder AutoModelForSeq2SeqLM takes loads through it,
    never through AutoModelForCausalLM, which for BART, Marian, Pegasus and others builds a decoder alone."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    from tier_utils.models.loading import auto_class

    walked = 0
    for kind in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
        config = CONFIG_MAPPING[kind]()
        if not config.is_encoder_decoder:
            continue  # an audio LM in the mapping: a decoder, not an encoder-decoder
        assert auto_class(config, None, kind) is transformers.AutoModelForSeq2SeqLM, kind
        walked += 1
    assert walked >= 25


@pytest.mark.parametrize("rows,needle", [
    ([{"input": "a", "answer_text": "b"}], "has no target column"),
    ([{"input": "a b", "target": ""}, {"input": "c", "target": " "}], "has no usable row"),
])
def test_bad_pairs_are_one_line(tmp_path, rows, needle):
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=needle):
        build_datasets(str(data), SEQ2SEQ, seq_len=8)


def test_text_given_to_a_seq2seq_model_and_pairs_given_to_a_causal_lm_are_one_line(folders, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("running text " * 50)
    with pytest.raises(DataError, match="has no source-target pairs, which a sequence-to-sequence model needs"):
        build_datasets(str(text), SEQ2SEQ, seq_len=8)
    with pytest.raises(DataError, match="holds source-target pairs .* which a sequence-to-sequence model reads"):
        build_datasets(str(folders["pairs"]), "causal-lm", seq_len=8)


# the sources' cut, said beside the targets' this test checks
@pytest.mark.filterwarnings("ignore:.*sources in .* were cut to it")
def test_targets_longer_than_the_target_length_are_cut_and_counted(folders):
    with pytest.warns(UserWarning, match="40 of 40 targets in .* are longer than 3 tokens and were cut"):
        splits = build_datasets(str(folders["pairs"]), SEQ2SEQ, seq_len=16, target_len=3)
    assert splits.train[0]["labels"].shape == (3,)


def test_the_decoder_reads_the_models_own_shift(folders):
    bart = tier_utils.load_model(str(folders["bart"]))
    labels = torch.tensor([[5, 6, 7, -100]])
    assert torch.equal(decoder_inputs(bart, labels), bart.prepare_decoder_input_ids_from_labels(labels=labels))
    assert decoder_inputs(bart, labels)[0, 0].item() == 1  # BART's decoder_start_token_id
    mine = tier_utils.load_model("tiny-seq2seq", **SMALL)
    assert decoder_inputs(mine, labels).tolist() == [[0, 5, 6, 7]]


class HandWritten(nn.Module):
    """A user's own encoder-decoder on nn.Transformer: no declared task, a forward that takes decoder inputs."""

    def __init__(self, vocab=256, d=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(32, d)
        self.net = nn.Transformer(d, 2, 1, 1, 64, dropout=0.0, batch_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None):
        src = self.embed(input_ids) + self.pos.weight[:input_ids.size(1)]
        tgt = self.embed(decoder_input_ids) + self.pos.weight[:decoder_input_ids.size(1)]
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), dtype=torch.bool)
        pad = None if attention_mask is None else attention_mask == 0
        return self.out(self.net(src, tgt, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad))


def test_a_hand_written_nn_transformer_is_recognised_and_trains():
    torch.manual_seed(0)
    model = HandWritten()
    assert tier_utils.adapt(model).task is SEQ2SEQ
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tier_utils.train(model, None, max_steps=30, batch_size=8, seq_len=32, lr=3e-3, eval_every=10,
                                  eval_batches=2, progress=False, device="cpu")
    evals = result.history[result.history.kind == "eval"]
    assert result.summary.task == "seq2seq"
    assert evals.val_loss.iloc[-1] < evals.val_loss.iloc[0]  # it learns the capitals


def test_a_forced_other_task_on_an_encoder_decoder_is_one_line():
    with pytest.raises(AdapterError, match="runs as the seq2seq task; drop task=classification"):
        tier_utils.adapt(tier_utils.load_model("tiny-seq2seq", **SMALL), task="classification")
    assert task_named("text2text") is SEQ2SEQ
    assert tier_utils.adapt(tier_utils.TinyGPT(**TINY)).task is not SEQ2SEQ


def test_each_evaluation_scores_what_the_model_writes(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = tier_utils.train("tiny-seq2seq", None, model_kwargs=SMALL, max_steps=4, batch_size=8, seq_len=16,
                                  eval_batches=1, progress=False, device="cpu")
    made = result.summary.generation
    assert made["n"] == 16 and len(made["samples"]) == 16 and 0 <= made["exact_match"] <= 1
    assert made["decoding"] == "greedy, at most 16 new tokens" and made["seconds"] > 0
    first = made["samples"][0]
    assert first["reference"] == first["prompt"].upper()  # the bundled demo: the snippet in capitals
    if made["skipped"] is None:
        assert 0 <= made["chrf"] <= 100 and 0 <= made["bleu"] <= 100
    row = result.table.set_index("metric").loc["generation", "value"]
    assert "exact match" in row and "on 16 validation sources (greedy" in row
    from tier_utils.engine import generation

    monkeypatch.setitem(__import__("sys").modules, "sacrebleu", None)  # as if the extra were not installed
    assert generation._sacrebleu(["a"], ["a"]) == (None, None, "sacrebleu is not installed: pip install "
                                                               "'tier_utils[seq2seq]'")


class LeakyDecoder(tier_utils.models.builtins.TinySeq2Seq):
    """Its decoder has no causal mask: each target position reads the answers after it."""

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, inputs_embeds=None):
        return self.head(self.transformer(self.embed(input_ids, inputs_embeds), self.embed(decoder_input_ids)))


def test_smoke_checks_both_lengths_and_fails_a_decoder_that_reads_the_future():
    rows = tier_utils.smoke(LeakyDecoder(**SMALL), checks=["shapes"], device="cpu", progress=False).table
    rows = rows.set_index("check")
    assert rows.loc["shapes: source 12, target 4", "status"] == "PASS"
    assert rows.loc["shapes: source 4, target 12", "value"] == "(2, 12, 256)"
    leak = rows.loc["decoder: a later target token changes no earlier logit"]
    assert leak.status == "FAIL" and "the decoder sees future targets" in leak.detail
    healthy = tier_utils.smoke("tiny-seq2seq", model_kwargs=SMALL, checks=["shapes"], device="cpu", progress=False)
    assert healthy.table.set_index("check").loc["decoder: a later target token changes no earlier logit",
                                                "status"] == "PASS"


@pytest.mark.filterwarnings("ignore:.*were cut to it")  # the bundled pairs at this test's short lengths
def test_t5s_fp16_overflow_shows_in_headroom_with_its_reason():
    """A feed-forward scaled as T5's grow in training: outputs past fp16's 65504, on any CPU."""
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, decoder_start_token_id=0))
    with torch.no_grad():
        t5.encoder.block[0].layer[-1].DenseReluDense.wo.weight.mul_(3e4)
    found = tier_utils.analyze(t5, analyses=("headroom",), device="cpu", progress=False).table.set_index("check")
    advice = found.loc["recommendation"]
    assert advice.status == "WARN" and advice.value == "prefer bf16"
    assert "encoder.block.0.layer.1.DenseReluDense.wo" in advice.detail and "> fp16 max 65504" in advice.detail


def test_attention_maps_encoder_decoder_and_cross_attention_with_their_own_shapes(folders):
    """Cross-attention is rectangular (target queries x source keys); the decoder's self-attention is causal."""
    g = torch.Generator().manual_seed(0)
    vocab = tier_utils.load_tokenizer(str(folders["bart"])).vocab_size
    pairs = (torch.randint(3, vocab, (16, 10), generator=g), torch.randint(3, vocab, (16, 4), generator=g))
    found = tier_utils.analyze(str(folders["bart"]), pairs, analyses=("attention",), n_batches=1, device="cpu",
                               progress=False)
    maps = found.outcomes["attention"].artifacts["maps"]
    shapes = {name.split(".", 1)[1]: tuple(m.shape[1:]) for name, m in maps.items()}
    assert shapes == {"encoder.layers.0.self_attn": (10, 10), "decoder.layers.0.self_attn": (4, 4),
                      "decoder.layers.0.encoder_attn": (4, 10)}
    decoder = maps["model.decoder.layers.0.self_attn"]
    assert decoder.triu(1).abs().max() == 0  # no target position reads a later one
    fig = found.plot("attention", layers=["model.decoder.layers.0.encoder_attn"])
    assert fig.axes[0].images[0].get_array().shape == (4, 10)
    # Drawn with the tokens: cross-attention's rows are what the decoder reads (its start token, then the targets
    # shifted right), its columns the source's tokens.
    tokens = found.outcomes["attention"].artifacts["tokens"]
    (rows, targets), (columns, sources) = tokens["model.decoder.layers.0.encoder_attn"]
    label = tier_utils.load_tokenizer(str(folders["bart"])).label
    assert (rows, columns) == ("target", "source") and targets[0] == label(1)  # BART's decoder_start_token_id
    assert sources in [[label(int(t)) for t in row] for row in pairs[0]]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == targets
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == sources
    assert fig.axes[0].get_ylabel() == "query (target token)" and fig.axes[0].get_xlabel() == "key (source token)"
    assert [side for side, _ in tokens["model.encoder.layers.0.self_attn"]] == ["source", "source"]
    assert tokens["model.decoder.layers.0.self_attn"] == ((rows, targets), (rows, targets))
    # Each map's role named in its frames (the JSON's too) and its plot titles: nothing else says which is cross.
    layers = found.frames["attention_layers"].set_index("layer").role
    assert layers.to_dict() == {"model.encoder.layers.0.self_attn": "encoder self",
                                "model.decoder.layers.0.self_attn": "decoder self",
                                "model.decoder.layers.0.encoder_attn": "cross"}
    assert set(found.frames["attention"].role) == {"encoder self", "decoder self", "cross"}
    assert fig.axes[0].get_title() == "model.decoder.layers.0.encoder_attn (cross) h0"
    frames = found.to_json()["frames"]
    assert {r["role"] for r in frames["attention_layers"]} == {"encoder self", "decoder self", "cross"}


@pytest.mark.filterwarnings("ignore:.*were cut to it")  # the bundled pairs at this test's short lengths
def test_export_takes_the_decoder_inputs_with_their_own_dynamic_length(tmp_path):
    written = tier_utils.export("tiny-seq2seq", tmp_path / "s2s.pt2", model_kwargs=SMALL, format="pt2", repeats=1)
    assert written.status == "PASS" and written.config.inputs == ["input_ids", "attention_mask", "decoder_input_ids"]
    program = torch.export.load(str(tmp_path / "s2s.pt2")).module()
    ids, target = torch.randint(0, 256, (3, 10)), torch.randint(0, 256, (3, 4))
    assert program(ids, torch.ones_like(ids), target).shape == (3, 4, 256)  # a source of 10, a target of 4


def test_a_hand_written_seq2seq_whose_forward_raises_is_one_line(tmp_path, capsys):
    (tmp_path / "broken.py").write_text(
        "import torch.nn as nn\n\n"
        "class Broken(nn.Module):\n"
        "    task = 'seq2seq'\n\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed = nn.Embedding(256, 8)\n\n"
        "    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None):\n"
        "        raise RuntimeError('my decoder is not written yet')\n")
    out = tmp_path / "run"
    code = main(["train", "--model", f"{tmp_path / 'broken.py'}:Broken", "--max-steps", "2", "--no-progress",
                 "--device", "cpu", "--out", str(out)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code in (1, 2) and len(err) == 1 and "my decoder is not written yet" in err[0], err
    assert not (out / "metrics.csv").exists()


@pytest.mark.slow  # the main job: all three tiers and the benchmark
@pytest.mark.parametrize("name", ["t5", "bart"])
def test_the_main_job_reports_an_encoder_decoder_with_what_it_wrote(folders, name, tmp_path, capsys):
    out = tmp_path / "report"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(["all", "--fast", "--model", str(folders[name]), "--data", str(folders["pairs"]), "--out", str(out),
                     "--no-progress", "--json", str(tmp_path / "all.json")])
    assert code == 0, capsys.readouterr().err  # a healthy model passes its own checks
    samples = (out / "train_samples.csv").read_text().splitlines()
    assert samples[0] == "prompt,reference,generated" and len(samples) > 1
    page = (out / "index.html").read_text()
    assert "train_samples" in page and ("ForConditionalGeneration") in page
    summary = json.loads((tmp_path / "all.json").read_text())
    assert {t["tier"] for t in summary["tiers"]} >= {"smoke", "analysis", "train", "amp_benchmark"}


def test_a_translation_column_of_dicts_reads_the_two_languages_named(tmp_path, capsys):
    data = tmp_path / "wmt.jsonl"
    data.write_text("".join(json.dumps({"translation": {"de": f"Haus {i}", "en": f"house {i}", "fr": f"maison {i}"}})
                            + "\n" for i in range(20)))
    splits = build_datasets(tier_utils.DataSource(str(data), "de", "en"), SEQ2SEQ, seq_len=12)
    row = splits.train[0]
    assert bytes(row["input_ids"][row["attention_mask"].bool()].tolist()).decode().startswith("Haus ")
    assert bytes(row["labels"][row["labels"] != -100].tolist()).decode().startswith("house ")
    with pytest.raises(DataError, match=r"translation column \(de, en, fr\); name its two languages with "
                                        "--source-lang and --target-lang"):
        build_datasets(str(data), SEQ2SEQ, seq_len=12)
    code = main(["train", "--model", "tiny-seq2seq", "--model-arg", "d_model=32", "--model-arg", "n_layer=1",
                 "--data", str(data), "--source-lang", "de", "--target-lang", "es", "--max-steps", "1",
                 "--no-progress", "--out", str(tmp_path / "run")])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "translation column has no es; its languages are de, en, fr" in err[0]


@pytest.mark.slow  # two torchrun ranks
def test_two_fsdp_ranks_write_and_score_the_targets_in_step(tmp_path):
    """A sharded encoder-decoder's ranks generate in step (each forward needs every shard): the built-in greedy loop
    runs its whole length on every rank, and the run scores what it wrote as one process does."""
    import json

    from torchrun import ok, torchrun

    args = ["train", "--model", "tiny-seq2seq", *[a for k, v in SMALL.items() for a in ("--model-arg", f"{k}={v}")],
            "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1", "--batch-size", "4", "--seq-len", "16",
            "--precision", "fp32", "--device", "cpu", "--no-progress", "--strategy", "fsdp", "--out",
            str(tmp_path / "run"), "--json", str(tmp_path / "run.json")]
    ok(torchrun(["-m", "tier_utils", *args]))
    made = json.loads((tmp_path / "run.json").read_text())["generation"]
    assert made["n"] == 16 and len(made["samples"]) == 16 and made["seconds"] > 0
    assert all(s["reference"] == s["prompt"].upper() for s in made["samples"])  # the bundled pairs, in capitals
