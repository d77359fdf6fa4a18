"""bench/sft_peers.py, train() beside TRL's SFTTrainer on chat rows: at tiny settings the two score the same tokens of
every example in each format (TRL's default on conversational prompt-completion differing only by the newline after
`<|end|>`, as issue 58 item 4 decides) and report the same first-step loss; the template it marks for TRL renders as
the demo's own; a missing TRL is one line."""
import importlib.util
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from tier_utils.data.chat_demo import demo_rows, demo_tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sft_peers.py"
TINY = ["--repeats", "1", "--steps", "1", "2", "--rows", "16"]
DEFAULT = "conversational-prompt-completion-trl-default"


@pytest.fixture(scope="module")
def sft_peers():
    spec = importlib.util.spec_from_file_location("bench_sft_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.slow
def test_trl_and_train_score_the_same_tokens_and_start_at_the_same_loss(sft_peers, tmp_path, capsys):
    if importlib.util.find_spec("trl") is None:
        pytest.skip("trl not installed (pip install .[bench])")
    assert sft_peers.main([*TINY, "--json", str(tmp_path / "sft.json")]) == 0
    report = json.loads((tmp_path / "sft.json").read_text())
    checked = {a["name"]: a for a in report["scored_tokens"]}
    assert set(checked) == set(sft_peers.VARIANTS)
    for name, found in checked.items():
        assert found["examples"] == [16, 16] and found["same_inputs"] == 16, name
        assert 0 < found["scored"] < found["targets"], name  # the answer only: some targets scored, not all
        if name != DEFAULT:
            assert found["agrees"] and found["same_scored"] == 16, (name, found["first"])
            assert report["first_step_loss"][name]["difference"] <= sft_peers.LOSS_TOLERANCE, name
    # TRL's completion mask alone: one more target per example, the newline after the answer's end token
    assert checked[DEFAULT]["only"] == {"TRL": {"'\\n' after '<|end|>'": 16}, "train()": {}}
    assert checked[DEFAULT]["scored"] == checked["conversational-prompt-completion"]["scored"]
    assert [(r["format"], r["runner"]) for r in report["rows"]] == [
        (f, r) for f in sft_peers.TIMED for r in sft_peers.RUNNERS]
    assert all(r["in_call_ms"]["median"] > 0 for r in report["rows"])  # both runners' steps 1 and 2 were marked
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in sft_peers.RUNNERS.values())


def test_the_marked_template_renders_as_the_demos_own(sft_peers, monkeypatch):
    rows = demo_rows(12)
    tokenizer = demo_tokenizer(rows)
    sft_peers.check_template(tokenizer, rows)
    # a newline written after a block tag: transformers renders templates with trim_blocks, which eats it
    monkeypatch.setattr(sft_peers, "MARKED_TEMPLATE", sft_peers.MARKED_TEMPLATE.replace(
        "{% endif %}{{ '\\n' }}{% endfor %}", "{% endif %}\n{% endfor %}"))
    with pytest.raises(AssertionError, match="renders"):
        sft_peers.check_template(tokenizer, rows)


def test_only_what_follows_the_end_token_is_an_expected_difference(sft_peers):
    def agreement(only_trl, after_end=True):
        return sft_peers.Agreement("x", (4, 4), same_inputs=4, same_scored=0, after_end=after_end,
                                   only={"TRL": Counter(only_trl), "train()": Counter()})

    assert agreement({"'\\n' after '<|end|>'": 4}).as_declared
    assert not agreement({"'\\n' after '<|end|>'": 4}, after_end=False).as_declared
    assert not agreement({"'red' after ':'": 1}).as_declared  # a prompt token TRL scores: a real difference
    assert "DIFFER:" in agreement({"'red' after ':'": 1}).line()


def test_a_missing_trl_is_one_line_naming_the_extra(sft_peers, monkeypatch, capsys):
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trl" else found(name, *a))
    assert sft_peers.main(TINY) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trl" in err and "pip install .[bench]" in err
