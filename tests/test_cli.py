"""CLI conventions shared by every verb: exit codes, one-line errors, no --json file on bad input."""
import argparse
import dataclasses
import inspect
import json
import re
import subprocess
import sys
import textwrap
import warnings

import pytest

import tier_utils
from tier_utils.benchmark.config import BenchConfig, Thresholds
from tier_utils.cli import build_parser, main
from tier_utils.core.device import CPU_FLAGS_ENV
from tier_utils.planning.ranks import RanksConfig
from tier_utils.training.config import TrainConfig
from tier_utils.tuning.study import SearchConfig


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tier_utils", *args], capture_output=True, text=True, timeout=120)


def test_info_prints_decision_and_writes_json(tmp_path):
    out = tmp_path / "info.json"
    assert main(["info", "--model", "tiny-encoder", "--model-arg", "num_classes=3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"environment", "precision", "model"}
    assert data["model"]["task"] == "classification" and data["model"]["num_classes"] == 3
    assert data["precision"]["reason"] and data["environment"]["torch"]
    # The device once (environment), and the torch threads with the reason for their count.
    assert "device" not in data["precision"] and data["environment"]["device"]
    assert data["environment"]["threads_reason"].startswith(f"{data['environment']['threads']} torch thread")


@pytest.mark.parametrize("args,needle", [
    (["info", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["info", "--model", "missing.py:Net"], "not found"),
    (["info", "--model-arg", "oops"], "expected KEY=VALUE"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    out = tmp_path / "x.json"
    result = run_cli(*args, "--json", str(out)) if args[0] == "info" else run_cli(*args)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error:")
    assert not out.exists()  # nothing half-written


def test_slow_precision_warning_is_one_line(capsys, monkeypatch):
    from tier_utils.core import precision

    monkeypatch.setenv(CPU_FLAGS_ENV, "avx2")  # a CPU without native fp16
    monkeypatch.setattr(precision, "_slow_warned", set())
    assert main(["info", "--precision", "fp16", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: fp16 requested: runs, but this CPU has no avx512_fp16") and err.count("\n") == 1


PLANTED = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Planted(nn.Module):
        """One layer whose outputs are ~1e6: far past fp16's 65504."""

        task = "causal-lm"
        max_len = 16

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 16)
            self.boom = nn.Linear(16, 16)
            self.head = nn.Linear(16, 256)
            with torch.no_grad():
                self.boom.weight.mul_(1e6)

        def forward(self, input_ids):
            return self.head(self.boom(self.emb(input_ids)))

    class NaNGPT(nn.Module):
        """Finite weights, NaN logits."""

        task = "causal-lm"
        max_len = 16

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 256)

        def forward(self, input_ids, attention_mask=None):
            return self.emb(input_ids) * float("nan")
''')


@pytest.mark.parametrize("verb,args", [
    ("smoke", ["--model", "{models}:NaNGPT", "--checks", "stability"]),
    ("analyze", ["--model", "{models}:Planted", "--analyses", "headroom", "--precision", "fp16", "--batch-size", "2",
                 "--n-batches", "1", "--seq-len", "16"]),
], ids=["smoke", "analyze"])
def test_a_fail_exits_1_and_still_writes_json(tmp_path, capsys, verb, args):
    (tmp_path / "models.py").write_text(PLANTED)
    out = tmp_path / "out.json"
    args = [a.format(models=tmp_path / "models.py") for a in args]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU without it warns; not what this test is about
        assert main([verb, *args, "--device", "cpu", "--no-progress", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    if verb == "smoke":
        assert data["status"] == "FAIL" and data["passed"] is False
    else:  # fp16 asked for on a model that overflows it
        assert data["status"] == "FAIL"
        rec = next(r for r in data["findings"] if r["check"] == "recommendation")
        assert rec["status"] == "FAIL" and rec["detail"].startswith("boom")
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("args", [
    ["smoke", "--checks", "shapes,speed"],
    ["analyze", "--analyses", "attention,vibes"],
    ["smoke", "--model", "missing.py:Net"],
])
def test_bad_input_writes_no_json(tmp_path, capsys, args):
    out = tmp_path / "out.json"
    assert main([*args, "--device", "cpu", "--no-progress", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not out.exists()


def _defaults(verb: str) -> dict:
    """Each option's default in `verb`'s parser, by destination."""
    sub = next(a for a in build_parser()._subparsers._group_actions if a.dest == "verb").choices[verb]
    return {a.dest: a.default for a in sub._actions if a.dest != "help"}


@pytest.mark.parametrize("verb,sources", [
    ("train", [(TrainConfig, {})]),
    ("bench", [(BenchConfig, {}), (Thresholds, {})]),
    ("search", [(SearchConfig, {}),
                (TrainConfig, {k: v for k, v in vars(SearchConfig().trial).items() if k != "progress"})]),
    ("info", [(tier_utils.InfoConfig, {})]),
    ("smoke", [(tier_utils.SmokeConfig, {})]),
    ("analyze", [(tier_utils.AnalysisConfig, {})]),
    ("export", [(tier_utils.ExportConfig, {})]),
    ("fit", [(tier_utils.FitConfig, {})]),
    ("ranks", [(RanksConfig, {})]),
])
def test_cli_defaults_are_the_settings_defaults(verb, sources):
    """Each setting's default is declared once, in its dataclass (or, for search's trials, SearchConfig.trial):
    a verb's option that names a field has exactly that default."""
    cli, compared = _defaults(verb), 0
    for cls, own in sources:
        for f in dataclasses.fields(cls):
            # A field made by a factory (the memory settings) is no one option: its own fields are the options
            # (and bench's --memory is Thresholds').
            if f.name in cli and (f.default is not dataclasses.MISSING or f.name in own):
                expected = own.get(f.name, f.default)
                assert cli[f.name] == expected, f"{verb} --{f.name}: {cli[f.name]!r} != {cls.__name__} {expected!r}"
                compared += 1
    # Every field of a tier's own class is an option, but export's example (a tensor, for Python only).
    assert compared >= {"train": 25, "bench": 20, "search": 11, "info": 2, "smoke": 6, "analyze": 7, "export": 3,
                        "fit": 6, "ranks": 5}[verb]


def test_all_defaults_are_run_alls():
    """`all` has no settings class: its defaults are run_all's signature's."""
    params = inspect.signature(tier_utils.run_all).parameters
    cli = _defaults("all")
    shared = [n for n in params if n in cli and params[n].default is not inspect.Parameter.empty]
    assert len(shared) >= 3
    for name in shared:
        assert cli[name] == params[name].default, f"all --{name}: {cli[name]!r} != {params[name].default!r}"


def test_all_says_its_thread_count_and_why_when_it_starts(tmp_path, monkeypatch, capsys):
    from tier_utils import cli

    class Done:  # the job itself is tested in test_report; here only what `all` says before it
        model_status = "PASS"

        def summary_text(self):
            return "summary"

        def to_json(self):
            return {}

    import functools

    monkeypatch.setattr(cli, "run_all", functools.wraps(cli.run_all)(lambda *a, **k: Done()))  # its options
    assert main(["all", "--out", str(tmp_path)]) == 0
    first = capsys.readouterr().err.splitlines()[0]
    assert first.startswith("all: smoke, analysis, training, AMP benchmark · ") and " torch thread" in first


def _verb_parsers():
    import argparse

    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


# An identifier a user never types: a settings object, a module constant, a snake_case field name.
# Allowed: the package's own name, the Hugging Face methods that name a folder's format, and KEY=VALUE
# examples of a model's own arguments (d_model=256).
_INTERNAL = re.compile(r"settings\.|\bFAST\b|\bJOB\b|"
                       r"\b(?!(?:tier_utils|save_pretrained|save_to_disk)\b)[a-z0-9]+_[a-z0-9_]+\b(?!=)")
_METAVAR_STYLE = re.compile(r"[A-Z]+(,[A-Z]+|=[A-Z]+|/[A-Z]+)?")  # N, N,N, NAME,NAME, KEY=VALUE, USER/NAME


@pytest.mark.parametrize("verb", sorted(_verb_parsers()))
def test_every_verbs_help_says_each_default_once_in_the_users_words(verb):
    sub = _verb_parsers()[verb]
    text = sub.format_help()
    formatter = sub._get_formatter()
    for action in sub._actions:
        if not action.option_strings or action.help in (None, argparse.SUPPRESS):
            continue
        said = formatter._expand_help(action)
        assert said.count("(default:") <= 1 and "(default: none) (default:" not in said, (action.dest, said)
        assert not re.search(r"\(none: [^)]*\).*\(default: none\)", said), (action.dest, said)
        assert not _INTERNAL.search(said), (action.dest, said)
        assert not said.startswith("turn off:"), (action.dest, said)
        if action.metavar is not None:  # one style: what the value looks like, never the option's own name
            assert _METAVAR_STYLE.fullmatch(action.metavar) and action.metavar != action.dest.upper(), action.metavar
    assert "settings." not in text and "(default: none) (default:" not in text
    assert not re.search(r"\w-\n\s+\w", text), "a word wrapped at its hyphen"  # "hf-" / "dataset:NAME"
    if verb in ("info", "export", "colab", "compare"):  # they show no progress bar
        assert "--no-progress" not in text
    else:
        assert "--no-progress         turn off what is on by default: progress bars" in text


def test_a_switch_on_by_default_says_it_turns_that_off():
    """The issue's `fit --help` read "--no-checkpointing  turn off also plan each precision with ..."."""
    said = " ".join(_verb_parsers()["fit"].format_help().split())
    assert "--no-checkpointing turn off what is on by default: also plan each precision with activation " \
           "checkpointing" in said
    assert "turn off also" not in said


@pytest.mark.parametrize("args,verb,near", [
    (["train", "--max_steps", "3", "--out", "x"], "train", "; did you mean --max-steps?"),
    (["analyze", "--n_batches", "2"], "analyze", "; did you mean --n-batches?"),
    (["info", "--frobnicate"], "info", ""),
])
def test_a_wrong_option_points_to_the_verbs_own_help(args, verb, near, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: unrecognized arguments: {' '.join(a for a in args[1:] if a not in ('--out', 'x'))}")
    assert err.endswith(f"{near} (see python -m tier_utils {verb} --help)\n")


def test_a_verbs_table_fits_the_terminal_and_the_json_keeps_the_full_text(tmp_path, monkeypatch, capsys):
    from tiny import TINY_ARGS

    monkeypatch.setenv("COLUMNS", "100")  # the terminal's width, as shutil reads it
    out = tmp_path / "smoke.json"
    assert main(["smoke", *TINY_ARGS, "--no-progress", "--json", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[:-1]  # then the headline
    assert len(table) > 10 and max(len(line) for line in table) <= 100 and any("…" in line for line in table)
    longest = max((c["detail"] for c in json.loads(out.read_text())["checks"]), key=len)
    assert len(longest) > 100 and longest not in "\n".join(lines)  # cut on the terminal, whole in --json
