"""Chat and instruction data (issue 58): each format read as one example per row with only the answer scored (the
masks checked token by token), unusable rows counted, truncation, the end token scored with pad == EOS, a seq2seq
model's Alpaca pairs, message lists never read as their Python text, bad inputs through the CLI."""
import json
import warnings

import pytest
from tiny import without_template

from tier_utils.cli import main
from tier_utils.core.errors import DataError
from tier_utils.data.chat import chat_examples
from tier_utils.data.chat_demo import END_OF_TURN, TEMPLATE, chat_demo, demo_rows, demo_tokenizer
from tier_utils.data.chat_formats import ChatOptions
from tier_utils.data.collate import PadCollator
from tier_utils.data.tokenizer import HFTokenizer
from tier_utils.data.userdata import DataSource
from tier_utils.tasks import build_datasets
from tier_utils.training.finetune import save_hf

pytest.importorskip("transformers")
SYSTEM = {"role": "system", "content": "You answer in a few words."}
TURNS = [{"role": "user", "content": "repeat: red cat"}, {"role": "assistant", "content": "red cat"},
         {"role": "user", "content": "reverse: sun moon"}, {"role": "assistant", "content": "moon sun"}]


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer(demo_rows())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return chat_demo(tmp_path_factory.mktemp("chat"))


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def scored_runs(example) -> list[list[int]]:
    """The runs of scored targets, each a list of token ids."""
    runs, run = [], []
    for label in example["labels"].tolist():
        if label == -100:
            runs, run = (runs + [run]) if run else runs, []
        else:
            run.append(label)
    return runs + [run] if run else runs


def test_messages_score_each_answer_and_its_end_token_not_the_newline_after_it(tok):
    data = chat_examples([{"messages": [SYSTEM, *TURNS]}], tok)
    example, end = data.examples[0], tok.convert_tokens_to_ids(END_OF_TURN)
    # Hand-checked: the template renders <s><|system|>\n...<|end|>\n<|user|>\n...<|end|>\n<|assistant|>\nANSWER<|end|>\n
    # per turn; the targets scored are each answer's tokens and its <|end|>, nothing else.
    prefix = ids(tok, tok.apply_chat_template([SYSTEM, TURNS[0]], tokenize=False, add_generation_prompt=True))
    middle = ids(tok, f"{END_OF_TURN}\n<|user|>\nreverse: sun moon{END_OF_TURN}\n<|assistant|>\n")
    first, second = ids(tok, "red cat") + [end], ids(tok, "moon sun") + [end]
    row = prefix + ids(tok, "red cat") + middle + ids(tok, "moon sun") + ids(tok, f"{END_OF_TURN}\n")
    expected = [-100] * (len(prefix) - 1) + first + [-100] * (len(middle) - 1) + second + [-100]
    assert example["input_ids"].tolist() == row[:-1]
    assert example["labels"].tolist() == expected
    assert data.format.name == "messages" and row[0] == tok.bos_token_id and row[1] != tok.bos_token_id  # one BOS
    everything = chat_examples([{"messages": [SYSTEM, *TURNS]}], tok, loss_on="all").examples[0]
    assert everything["labels"].tolist() == row[1:]


@pytest.mark.parametrize("row, name, answers", [
    ({"conversations": [{"from": "human", "value": "repeat: red cat"}, {"from": "gpt", "value": "red cat"}]},
     "sharegpt", ["red cat"]),
    ({"prompt": [{"role": "user", "content": "repeat: red cat"}],
      "completion": [{"role": "assistant", "content": "red cat"}]}, "prompt-completion", ["red cat"]),
    ({"instruction": "reverse", "input": "sun moon", "output": "moon sun"}, "alpaca", ["moon sun"]),
    ({"instruction": "say hi", "input": "", "output": "hi"}, "alpaca", ["hi"]),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "repeat: "}, {"type": "text", "text": "red"}]},
                   {"role": "assistant", "content": "red"}]}, "messages", ["red"]),
])
def test_each_templated_format_scores_only_its_answers(tok, row, name, answers):
    data = chat_examples([row], tok)
    end = tok.convert_tokens_to_ids(END_OF_TURN)
    assert data.format.name == name
    assert scored_runs(data.examples[0]) == [ids(tok, a) + [end] for a in answers]


def test_alpaca_renders_the_instruction_a_blank_line_and_the_input(tok):
    data = chat_examples([{"instruction": "reverse", "input": "sun moon", "output": "moon sun"}], tok)
    assert "<|user|>\nreverse\n\nsun moon<|end|>" in tok.decode(data.examples[0]["input_ids"])


def test_string_prompt_completion_is_not_templated_and_scores_the_completion_and_eos(tok):
    data = chat_examples([{"prompt": "repeat: red cat =", "completion": " red cat"}], tok)
    example, eos = data.examples[0], tok.eos_token_id
    text = tok.decode(example["input_ids"])
    assert "<|user|>" not in text and "<|assistant|>" not in text and not data.templated
    prompt = tok("repeat: red cat =")["input_ids"]
    assert scored_runs(example) == [tok("repeat: red cat = red cat")["input_ids"][len(prompt):] + [eos]]


def test_unusable_rows_are_counted_with_their_numbers_and_none_left_is_one_line(tok):
    good = {"messages": TURNS[:2]}
    rows = [good, {"messages": TURNS[:1]}, {"messages": [{"role": "wizard", "content": "x"}, TURNS[1]]},
            {"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]}, TURNS[1]]},
            {"messages": [TURNS[0], {"role": "assistant", "content": " "}]}, good]
    data = chat_examples(rows, tok)
    assert len(data.examples) == 2
    assert list(data.unusable) == [2, 3, 4, 5]  # numbered from 1, as the table readers number them
    said = data.counts()
    assert "4 unusable rows" in said and "first rows: 2 (no assistant turn)" in said and "'wizard'" in said
    assert "not text" in said and "empty answer" in said
    with pytest.raises(DataError, match="no usable messages row.*row 1: a message cell that is not a list"):
        chat_examples([{"messages": "hello"}, {"messages": 3}], tok)


def test_long_conversations_lose_whole_turns_after_the_system_prompt_and_too_long_answers_drop(tok):
    long_answer = {"messages": [{"role": "user", "content": "say"}, {"role": "assistant", "content": "red " * 40}]}
    last = chat_examples([{"messages": [SYSTEM, *TURNS[2:]]}], tok).examples.ids[0]  # what is left: 1 exchange
    data = chat_examples([{"messages": [SYSTEM, *TURNS]}, long_answer], tok, seq_len=len(last) - 1)
    assert len(data.examples) == 1 and data.truncated == 1 and data.dropped == 1
    text = tok.decode(data.examples.ids[0])
    assert text.startswith("<s><|system|>\nYou answer in a few words.") and "repeat: red cat" not in text
    assert "reverse: sun moon" in text and data.examples.ids[0].tolist() == last.tolist()
    assert "1 conversations lost turns" in data.counts() and "1 examples dropped" in data.counts()


def test_the_end_token_is_scored_when_the_pad_token_is_the_eos(tok):
    same = demo_tokenizer(demo_rows())
    same.pad_token = same.eos_token  # as many Llama notebooks set it
    request_tok = HFTokenizer(same)
    splits = build_datasets([{"messages": TURNS[:2]}, {"messages": TURNS}] * 4, "causal-lm", seq_len=64,
                            vocab_size=len(same), tokenizer=request_tok, val_fraction=0)
    assert splits.collate.pad_id == same.eos_token_id
    batch = PadCollator(request_tok.pad_id)([splits.train[i] for i in range(2)])
    for labels in batch["labels"]:
        scored = labels[labels != -100]
        assert scored[-1] == same.eos_token_id  # the answer's end is a target, not masked as padding
    assert splits.chat.ends_scored and splits.chat.end_markers == [END_OF_TURN]


def test_a_message_column_is_never_read_as_its_python_text(tok, tmp_path):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"chat": TURNS[:2]}) + "\n" for _ in range(8)))
    request = dict(vocab_size=len(tok), tokenizer=HFTokenizer(tok), val_fraction=0)
    # --text-column naming the message lists: read as a conversation
    splits = build_datasets(DataSource(str(data), text_column="chat"), "causal-lm", **request)
    assert splits.chat.format == "messages" and "{'role'" not in tok.decode(splits.train[0]["input_ids"])
    # forced to running text, or read by a classifier: one line, never str() of the list
    with pytest.raises(DataError, match="missing, empty or not text"):
        build_datasets(DataSource(str(data), text_column="chat"), "causal-lm", **request,
                       chat=ChatOptions("text"))
    with pytest.raises(DataError, match="holds chat or instruction rows, which a classifier cannot read"):
        build_datasets(DataSource(str(data), text_column="chat", label_column="chat"), "classification",
                       **request)


def test_a_seq2seq_model_reads_alpaca_rows_as_instruction_and_input_to_output(tok, tmp_path):
    rows = [{"instruction": "reverse", "input": f"sun {w}", "output": f"{w} sun"} for w in ("red", "cat", "dog")] * 4
    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    splits = build_datasets(str(data), "seq2seq", vocab_size=len(tok), tokenizer=HFTokenizer(tok), val_fraction=0)
    source, target = (tok.decode(splits.train[0][k]) for k in ("input_ids", "labels"))
    word = target.split()[0]
    assert source == f"reverse\n\nsun {word}" and target == f"{word} sun" and "alpaca" in splits.name
    messages = tmp_path / "chat.jsonl"
    messages.write_text(json.dumps({"messages": TURNS}) + "\n")
    with pytest.raises(DataError, match="sequence-to-sequence model cannot read"):
        build_datasets(str(messages), "seq2seq", vocab_size=len(tok), tokenizer=HFTokenizer(tok))


def test_a_template_whose_prefixes_are_not_prefixes_is_one_line(tok):
    odd = demo_tokenizer(demo_rows())
    # the last turn is written differently from the others: prefixes do not render as the whole begins
    odd.chat_template = ("{% for m in messages %}{% if loop.last %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
                         "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    with pytest.raises(DataError, match="renders the first 1 turns differently"):
        chat_examples([{"messages": TURNS[:2]}], odd)


def test_a_tokenizer_without_a_template_names_chat_template(tok, tmp_path):
    bare = demo_tokenizer(demo_rows())
    bare.chat_template = None
    with pytest.raises(DataError, match="has no chat template; give one with --chat-template FILE"):
        chat_examples([{"messages": TURNS[:2]}], bare)
    plain = tmp_path / "plain.txt"
    plain.write_text("no jinja here")
    with pytest.raises(DataError, match="holds no Jinja"):
        chat_examples([{"messages": TURNS[:2]}], bare, chat_template=str(plain))


def test_a_chat_template_file_leaves_the_callers_tokenizer_as_it_was_and_the_saved_folder_keeps_it(demo, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bare = demo_tokenizer(demo_rows())
    bare.chat_template = None  # the caller's, passed in from Python
    splits = build_datasets([{"messages": TURNS[:2]}] * 4, "causal-lm", seq_len=64, vocab_size=len(bare),
                            tokenizer=HFTokenizer(bare), val_fraction=0, chat=ChatOptions(chat_template=str(TEMPLATE)))
    assert len(splits.train) == 4 and bare.chat_template is None  # rendered by a copy carrying the template
    model = AutoModelForCausalLM.from_pretrained(demo.model)
    said = save_hf(model, HFTokenizer(bare), tmp_path / "hf", "final weights", chat_template=str(TEMPLATE))
    assert "saved" in said and bare.chat_template is None
    assert AutoTokenizer.from_pretrained(tmp_path / "hf").chat_template == TEMPLATE.read_text()


@pytest.mark.parametrize("args, needle", [
    (["--data", "{rows_not_lists}"], "no usable messages row"),
    (["--data", "{chat}", "--chat-template", "{plain}"], "holds no Jinja"),
    (["--data", "{chat}", "--loss-on", "half"], "invalid choice: 'half'"),
    (["--data", "{chat}", "--data-format", "yaml"], "invalid choice: 'yaml'"),
    (["--data", "{chat}", "--model", "tiny-seq2seq"], "sequence-to-sequence model cannot read"),
    (["--data", "{chat}", "--model", "tiny-gpt", "--model-arg", "max_len=32"], "byte-level built-ins have none"),
])
def test_bad_chat_input_through_the_cli_is_one_line_and_writes_nothing(demo, tmp_path, capsys, args, needle):
    files = {"rows_not_lists": tmp_path / "bad.jsonl", "chat": demo.data, "plain": tmp_path / "plain.txt"}
    files["rows_not_lists"].write_text("".join(json.dumps({"messages": "hi"}) + "\n" for _ in range(4)))
    files["plain"].write_text("no jinja here")
    args = [a.format(**files) for a in args]
    model = [] if "--model" in args else ["--model", str(demo.model)]
    out = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            code = main(["train", *model, *args, "--max-steps", "1", "--device", "cpu", "--no-progress",
                         "--out", str(out)])
        except SystemExit as exc:  # argparse's own refusal of a choice
            code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err, err
    assert not out.exists() or not any(out.rglob("*.pt"))
    assert len([line for line in err.splitlines() if line.startswith(("error", "usage"))]) >= 1


# Each verb that reads --data, at its cheapest: the chat flags are the ones `train` takes, passed to its data reading.
RUNS_HERE = ["--device", "cpu", "--no-progress"]
READING_VERBS = {
    "smoke": [*RUNS_HERE, "--checks", "memory", "--batch-sizes", "1"],
    "analyze": [*RUNS_HERE, "--analyses", "attention", "--n-batches", "1", "--batch-size", "2"],
    "fit": [*RUNS_HERE, "--precisions", "fp32", "--no-checkpointing", "--lora", "0", "--optimizers", "adamw"],
    "bench": [*RUNS_HERE, "--precisions", "fp32", "--repeats", "1", "--timed-steps", "1", "--untimed-steps", "0",
              "--accuracy-steps", "1", "--eval-batches", "1", "--batch-size", "2"],
    "export": ["--format", "pt2", "--repeats", "1"],  # its --out is added where it runs: the artifact's path
    "search": [*RUNS_HERE, "--trials", "1", "--max-steps", "1", "--batch-size", "2", "--eval-batches", "1",
               "--precision", "fp32"],
}
SLOW_VERBS = ("bench", "export")  # seconds of repeats, a capture and its parity timings


@pytest.fixture(scope="module")
def bare_demo(demo, tmp_path_factory):
    """The demo's model, its tokenizer without a chat template (its rows read only with --chat-template), and 24 of
    its rows."""
    folder = tmp_path_factory.mktemp("bare")
    data = folder / "chat.jsonl"
    data.write_text("".join(demo.data.read_text().splitlines(keepends=True)[:24]))
    return without_template(demo.model, folder / "model"), data


@pytest.mark.parametrize("verb", [pytest.param(v, marks=pytest.mark.slow) if v in SLOW_VERBS else v
                                  for v in READING_VERBS])
def test_every_verb_reading_data_takes_the_chat_flags(demo, bare_demo, tmp_path, capsys, verb):
    model, data = bare_demo
    data = demo.data if verb == "search" else data  # a trial's batch may be 32: more rows than the 24
    artifact = ["--out", str(tmp_path / "model.pt2")] if verb == "export" else []
    common = [verb, "--model", str(model), "--data", str(data), *artifact, *READING_VERBS[verb]]
    plain = tmp_path / "plain.txt"
    plain.write_text("no jinja here")
    report = tmp_path / "out.json"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        refused = [main([*common, "--json", str(report), *bad]) for bad in (["--chat-template", str(plain)], [])]
        err = capsys.readouterr().err
        assert refused == [2, 2] and "holds no Jinja" in err and "has no chat template" in err, err
        assert not report.exists()  # refused in one line each, nothing written
        code = main([*common, "--json", str(report), "--chat-template", str(TEMPLATE), "--loss-on", "all",
                     "--data-format", "messages"])
    said = report.read_text()
    assert code == 0 and str(TEMPLATE) in said and "messages format, every token scored" in said, said[-2000:]
    with pytest.raises(SystemExit) as exc:
        main([*common, "--loss-on", "half"])
    assert exc.value.code == 2 and "invalid choice: 'half'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_demo_learns_its_answers_in_seconds(demo):
    from tier_utils import train

    result = train(str(demo.model), str(demo.data), max_steps=100, batch_size=16, seq_len=64, lr=1e-2,
                   eval_every=100, progress=False, device="cpu", precision="fp32")
    generation = result.summary.generation
    assert generation["exact_match"] >= 0.5, result.more_tables()["samples"]


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "datasets"])
def test_chat_rows_are_recognised_in_every_table_kind_and_a_datasets_folder(tok, tmp_path, kind):
    rows = [{"messages": TURNS[:2]}, {"messages": TURNS}] * 5
    where = tmp_path / f"chat.{kind}"
    if kind == "jsonl":
        where.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "json":
        where.write_text(json.dumps(rows))
    elif kind == "parquet":
        pytest.importorskip("pyarrow")
        __import__("pandas").DataFrame(rows).to_parquet(where)
    else:
        datasets = pytest.importorskip("datasets")
        datasets.Dataset.from_list(rows).save_to_disk(str(where))
    splits = build_datasets(str(where), "causal-lm", vocab_size=len(tok), tokenizer=HFTokenizer(tok), val_fraction=0)
    end = tok.convert_tokens_to_ids(END_OF_TURN)
    assert splits.chat.format == "messages" and len(splits.train) == 10
    runs = sorted(scored_runs(splits.train[i]) for i in range(10))
    assert runs[0] == [ids(tok, "red cat") + [end]]


def test_a_template_without_an_end_token_is_refused_before_a_run(tok):
    plain = demo_tokenizer(demo_rows())
    plain.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant: {% endif %}")
    splits = build_datasets([{"messages": TURNS}] * 4, "causal-lm", seq_len=64, vocab_size=len(plain),
                            tokenizer=HFTokenizer(plain), val_fraction=0)
    with pytest.raises(DataError, match="the answers' end token is not scored, so the model would never learn to stop"):
        splits.chat.check()
