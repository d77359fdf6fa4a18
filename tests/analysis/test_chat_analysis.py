"""Tier 2 on chat data (issue 58): attribution of the scored answer over the prompt's tokens, chosen from the batch's
labels (never a format's name), and attention maps labelled with the tokens of the template's rendering."""
import itertools

import pytest
import torch
from matplotlib.figure import Figure

from tier_utils.analysis.attribution import scored_answers
from tier_utils.analysis.suite import analyze
from tier_utils.data.chat_demo import END_OF_TURN, QUESTIONS, chat_demo
from tier_utils.tasks.language import CausalLM

pytest.importorskip("transformers")
ANSWERS = {answer for _, answer in QUESTIONS}


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    demo = chat_demo(tmp_path_factory.mktemp("chat"), n=40)
    torch.manual_seed(0)
    return analyze(str(demo.model), data=str(demo.data), analyses=["attribution", "attention"], batch_size=4,
                   n_batches=1, progress=False)


def test_attribution_names_the_answer_and_the_prompt_tokens(report):
    table = report.frames["attribution"]
    assert set(table.part) == {"prompt", "answer"}
    prompt = table[table.part == "prompt"].text.tolist()
    assert prompt[:2] == ["<s>", "<|user|>"] and "<|assistant|>" in prompt
    # each run of answer tokens is one of the demo's answers and its end-of-turn marker
    runs = ["".join(r.text for r in g).replace("␣", " ")
            for part, g in itertools.groupby(table.itertuples(), lambda r: r.part) if part == "answer"]
    assert runs and all(run.endswith(END_OF_TURN) and run[: -len(END_OF_TURN)] in ANSWERS for run in runs)
    row = report.table[report.table.analysis == "attribution"].iloc[0]
    assert row.status == "PASS" and row.threshold == "share on the prompt's tokens" and 0 < row.value < 1
    assert f"the answer {''.join(table[table.part == 'answer'].text)!r}" in row.detail  # the tokens attributed
    assert table.share.sum() == pytest.approx(1.0)
    assert isinstance(report.plot("attribution"), Figure)


def test_attention_maps_are_labelled_with_the_rendered_template_tokens(report):
    tokens = report.outcomes["attention"].artifacts["tokens"]
    (rows, row_tokens), (columns, column_tokens) = next(iter(tokens.values()))
    assert rows == columns == "source" and row_tokens == column_tokens
    assert row_tokens[:2] == ["<s>", "<|user|>"] and "<|assistant|>" in row_tokens and END_OF_TURN in row_tokens
    assert row_tokens == report.frames["attribution"].text.tolist()


def test_the_answer_rule_reads_the_labels_not_the_format():
    mask = torch.tensor([[1, 1, 1, 1, 0]], dtype=torch.bool)
    plain = {"labels": torch.tensor([[5, 6, 7, 8, -100]])}  # every real position scored: plain text
    chat = {"labels": torch.tensor([[-100, -100, 7, 8, -100]])}
    task = CausalLM()
    assert scored_answers(task, plain, mask) is None
    assert scored_answers(task, chat, mask).tolist() == [[False, False, True, True, False]]
