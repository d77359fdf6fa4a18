"""Real models in: a trained save_pretrained folder with its own BPE tokenizer through every tier, a model in the
convention of GPT training code, own checkpoints, --weights, user data (tables, datasets), and bad input."""
import math
import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from real import BPE_VOCAB, nano_gpt_files
from tiny import TINY, TINY_ARGS

import tier_utils as tu
from tier_utils.cli import main as cli_main
from tier_utils.core.errors import DataError, ModelSpecError


def run_cli(*args, cwd=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "tier_utils", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=env)


def test_folder_loads_with_its_own_tokenizer(trained_hf_folder):
    model = tu.load_model(str(trained_hf_folder))
    adapter = tu.adapt(model)
    assert type(model).__name__ == "GPT2LMHeadModel" and adapter.task.name == "causal-lm"
    assert adapter.tokenizer.name == str(trained_hf_folder.resolve()) and adapter.tokenizer.vocab_size == BPE_VOCAB
    ids = adapter.tokenizer.encode("def f(x):\n    return x")
    assert 0 < len(ids) < len("def f(x):\n    return x")  # BPE merges: fewer ids than bytes
    assert adapter.tokenizer.decode(ids) == "def f(x):\n    return x"


def test_training_starts_at_the_models_own_loss_and_bytes_give_todays_behaviour(trained_hf_folder, tmp_path):
    text = tmp_path / "notes.txt"
    corpus = tu.corpus_topics()
    text.write_text("\n\n".join(corpus[t] for t in tu.corpus_split()[1]))  # held-out topics: text it never saw
    uniform = math.log(BPE_VOCAB)

    def first_val_loss(**kwargs):
        result = tu.train(str(trained_hf_folder), str(text), max_steps=1, lr=1e-9, batch_size=4, seq_len=64,
                          progress=False, device="cpu", model_kwargs=kwargs)
        return result.summary
    own, as_bytes = first_val_loss(), first_val_loss(tokenizer="bytes")
    assert own.val_loss < uniform - 0.5, own.val_loss  # its own tokens: what it learned
    assert as_bytes.val_loss > uniform, as_bytes.val_loss  # byte ids: noise to it
    assert own.tokenizer == str(trained_hf_folder.resolve()) and as_bytes.tokenizer == "bytes"
    assert own.data == "text file notes.txt" and "last 10% of the text" in own.validation


def test_every_tier_runs_on_the_folder(trained_hf_folder, tmp_path):
    spec = str(trained_hf_folder)
    smoke = tu.smoke(spec, batch_sizes=(1, 2), seq_lens=(32,), progress=False, device="cpu")
    assert "FAIL" not in set(smoke.table["status"]), smoke.table
    report = tu.analyze(spec, batch_size=2, n_batches=1, seq_len=32, progress=False, device="cpu")
    assert report.data.described.tokenizer == str(trained_hf_folder.resolve()) and report.status != "FAIL"
    attribution = report.frames["attribution"] if hasattr(report, "frames") else None
    if attribution is not None:  # labels are decoded BPE tokens, not byte guesses
        assert attribution["text"].str.len().max() > 1
    bench = tu.amp_benchmark(spec, None, precisions=("fp32",), batch_size=2, seq_len=32, repeats=1, timed_steps=1,
                             untimed_steps=0, accuracy_steps=1, eval_batches=1, progress=False, device="cpu")
    assert bench.config.described.tokenizer == str(trained_hf_folder.resolve())
    exported = tu.export(spec, tmp_path / "m.pt2", format="pt2", repeats=1)
    assert exported.status == "PASS"


def test_targets_convention_model_from_another_folder(tmp_path, monkeypatch):
    code = tmp_path / "gpt_repo"
    code.mkdir()
    spec = nano_gpt_files(code)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # its `from model import GPT` must still resolve
    kwargs = dict(block_size=32, vocab_size=256, n_layer=1, n_head=2, n_embd=32)
    adapter = tu.adapt(tu.load_model(spec, **kwargs))
    assert adapter.targets_keyword == "targets" and adapter.max_len == 32
    assert adapter.logits(torch.zeros(1, 8, dtype=torch.long)).shape == (1, 8, 256)
    smoke = tu.smoke(spec, batch_sizes=(1, 2), seq_lens=(16,), progress=False, device="cpu", model_kwargs=kwargs)
    assert "FAIL" not in set(smoke.table["status"]), smoke.table[smoke.table["status"] == "FAIL"]
    report = tu.analyze(spec, batch_size=2, n_batches=1, seq_len=16, progress=False, device="cpu",
                        model_kwargs=kwargs)
    assert "FAIL" not in set(report.table["status"]), report.table[report.table["status"] == "FAIL"]
    result = tu.train(spec, None, max_steps=3, batch_size=2, seq_len=16, progress=False, device="cpu",
                      model_kwargs=kwargs)
    assert result.summary.steps == 3 and math.isfinite(result.summary.val_loss)


def test_train_then_analyze_the_checkpoint(trained_hf_folder, tmp_path):
    out = tmp_path / "run"
    done = run_cli("train", "--model", trained_hf_folder, "--out", out, "--max-steps", 2, "--batch-size", 2,
                   "--seq-len", 32, "--no-progress", "--device", "cpu")
    assert done.returncode == 0, done.stderr
    ckpt = out / "checkpoints" / "last.pt"
    model = tu.load_model(str(ckpt))
    state = tu.load_checkpoint(ckpt)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state["model"].items())
    assert tu.adapt(model).tokenizer.name == str(trained_hf_folder.resolve())
    json_path = tmp_path / "a.json"
    done = run_cli("analyze", "--model", ckpt, "--batch-size", 2, "--n-batches", 1, "--seq-len", 32,
                   "--analyses", "attention", "--no-progress", "--device", "cpu", "--json", json_path)
    assert done.returncode in (0, 1), done.stderr
    assert pd.read_json(json_path, typ="series")["data"]["tokenizer"] == str(trained_hf_folder.resolve())


def test_weights_file_loads_and_a_mismatch_is_one_line(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(1)
    source = tu.load_model("tiny-gpt", **TINY)
    save_file(source.state_dict(), tmp_path / "w.safetensors")
    torch.save({"model": {f"_orig_mod.{k}": v for k, v in source.state_dict().items()}}, tmp_path / "ckpt.pt")
    for weights in ("w.safetensors", "ckpt.pt"):  # a compiled run's names are matched too
        loaded = tu.load_model("tiny-gpt", weights=tmp_path / weights, **TINY)
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in source.state_dict().items())
    for other, message in (({"n_layer": 2}, r"does not fit TinyGPT: missing 12 \(blocks\.1\."),
                           ({"d_model": 64}, "does not fit TinyGPT .*size mismatch")):
        with pytest.raises(ModelSpecError, match=message) as info:
            tu.load_model("tiny-gpt", weights=tmp_path / "w.safetensors", **{**TINY, **other})
        assert "\n" not in str(info.value)


def test_csv_with_labels_trains_the_classifier(tmp_path):
    rows = [{"review": f"{word} " * (3 + i % 5), "stars": word} for i in range(60)
            for word in ("good", "bad", "fine")]
    pd.DataFrame(rows).to_csv(tmp_path / "reviews.csv", index=False)
    data = tu.DataSource(str(tmp_path / "reviews.csv"), text_column="review", label_column="stars")
    result = tu.train("tiny-encoder", data, max_steps=4, batch_size=8, seq_len=16, progress=False, device="cpu",
                      model_kwargs={**TINY, "num_classes": 3})
    s = result.summary
    assert s.steps == 4 and s.accuracy is not None and "seeded random 10% of the rows" in s.validation
    with pytest.raises(DataError, match="outside the classifier's 2 classes"):
        tu.train("tiny-encoder", data, max_steps=1, progress=False, device="cpu",
                 model_kwargs={**TINY, "num_classes": 2})
    with pytest.raises(DataError, match="no column 'body'; its columns are review, stars"):
        tu.train("tiny-encoder", tu.DataSource(str(tmp_path / "reviews.csv"), text_column="body"), max_steps=1,
                 progress=False, device="cpu", model_kwargs={**TINY, "num_classes": 3})


def test_hf_dataset_saved_to_disk_uses_its_own_validation_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    corpus = tu.corpus_topics()
    train_topics, val_topics = tu.corpus_split()
    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": [corpus[t] for t in train_topics]}),
                               "validation": datasets.Dataset.from_dict({"text": [corpus[t] for t in val_topics]})})
    ds.save_to_disk(tmp_path / "docs")
    result = tu.train("tiny-gpt", f"hf-dataset:{tmp_path / 'docs'}", max_steps=2, batch_size=2, seq_len=32,
                      progress=False, device="cpu", model_kwargs=TINY)
    assert result.summary.validation == "the dataset's own 'validation' split"
    assert result.summary.data == "dataset docs [train]"


BAD_LOCAL_INPUT = [
    (lambda d, f: ["smoke", "--model", d], "no config.json"),
    (lambda d, f: ["smoke", *TINY_ARGS, "--tokenizer", f], "vocabulary has 256"),
    (lambda d, f: ["train", "--out", d / "run", "--model", "tiny-encoder", *TINY_ARGS, "--data", d / "t.csv",
                   "--text-column", "body"], "no column 'body'"),
]
# The hub's: in a process started offline (HF_HUB_OFFLINE is read once, as huggingface_hub is imported).
BAD_HUB_INPUT = [
    (lambda d, f: ["smoke", "--model", "hf:gpt2"], "not reachable from here"),
    (lambda d, f: ["smoke", "--model", "gpt2"], "a hub model is written hf:gpt2"),
]


@pytest.mark.parametrize("make_args,message", BAD_LOCAL_INPUT + BAD_HUB_INPUT)
def test_bad_real_model_input_is_one_line_exit_2(trained_hf_folder, tmp_path, capsys, make_args, message):
    (tmp_path / "t.csv").write_text("text,label\nhello,0\n")
    args = [str(a) for a in make_args(tmp_path, trained_hf_folder)]
    if (make_args, message) in BAD_LOCAL_INPUT:  # the CLI's own entry, in this process: the same exit and stderr
        code, stderr = cli_main(args), capsys.readouterr().err
    else:
        done = run_cli(*args)
        code, stderr = done.returncode, done.stderr
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], stderr
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_all_keeps_going_when_a_tier_raises(tmp_path):
    class BreaksInTraining(tu.TinyGPT):
        def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None):
            if self.training and torch.is_grad_enabled() and input_ids is not None and input_ids.size(0) > 2:
                raise RuntimeError("Expected input batch_size (4) to match target batch_size (128)")
            return super().forward(input_ids, attention_mask, inputs_embeds)

    torch.manual_seed(0)
    result = tu.run_all(BreaksInTraining(**TINY), tmp_path / "report", fast=True, batch_size=4, progress=False,
                        device="cpu")
    assert result.statuses["train"] == "FAIL" and result.index.is_file()
    assert "train: FAIL, it raised RuntimeError: Expected input batch_size" in result.summary_text()
    assert "train" in result.index.read_text()


def test_a_tokenizer_made_in_memory_is_kept_beside_the_checkpoints(tmp_path):
    from real import GPT2_SIZES, bpe_tokenizer
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = bpe_tokenizer()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), **GPT2_SIZES))
    tu.train(tu.load_model(model, tokenizer=tokenizer), None, max_steps=1, batch_size=2, seq_len=16, progress=False,
             device="cpu", checkpoint_dir=tmp_path / "ck")
    # A module built in Python has no spec to rebuild it from; give its spec and the weights instead.
    with pytest.raises(ModelSpecError, match="records no model spec"):
        tu.load_model(str(tmp_path / "ck" / "last.pt"))
    spec_built = tu.load_model("hf:GPT2LMHeadModel", tokenizer=tokenizer, vocab_size=len(tokenizer), **GPT2_SIZES)
    tu.train(spec_built, None, max_steps=1, batch_size=2, seq_len=16, progress=False, device="cpu",
             checkpoint_dir=tmp_path / "ck2")
    again = tu.adapt(tu.load_model(str(tmp_path / "ck2" / "last.pt")))
    assert again.tokenizer.name == str((tmp_path / "ck2" / "tokenizer").resolve())
    assert again.tokenizer.encode("def f(x):").tolist() == tokenizer("def f(x):")["input_ids"]
