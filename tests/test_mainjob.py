"""The `all` main job (API and CLI), end to end with tiny sizes."""
import json
import warnings
from dataclasses import replace

import pandas as pd
import pytest
import torch
from test_report import Fake, FakeBench
from tiny import TINY, TINY_ARGS, tiny, without_template

from tier_utils import BenchConfig, TrainConfig, mainjob
from tier_utils.cli import main
from tier_utils.core.errors import TrainingDiverged
from tier_utils.core.precision import SlowPrecisionWarning
from tier_utils.core.results import Result
from tier_utils.data.chat_demo import chat_demo
from tier_utils.mainjob import run_all
from tier_utils.models.loading import load_model
from tier_utils.presets import Preset

TINY_SIZES = Preset(batch_size=4, seq_len=16, analysis_batches=1,
                    train=TrainConfig(max_steps=4, eval_every=2, eval_batches=1),
                    bench=BenchConfig(untimed_steps=1, timed_steps=2, repeats=2, accuracy_steps=2, eval_batches=1))



@pytest.fixture
def tiny_sizes(monkeypatch):
    monkeypatch.setattr(mainjob, "FAST", TINY_SIZES)


def test_all_cli_runs_every_tier_and_writes_the_report(tmp_path, tiny_sizes, capsys, monkeypatch):
    monkeypatch.setattr(mainjob, "load_average", lambda: 99.0)  # other jobs on the machine
    out, summary = tmp_path / "report", tmp_path / "all.json"
    code = main(["all", *TINY_ARGS, "--out", str(out), "--fast", "--no-progress", "--json", str(summary)])
    data = json.loads(summary.read_text())
    assert [t["tier"] for t in data["tiers"]] == ["smoke", "analysis", "train", "fit", "ranks", "amp_benchmark"]
    # Exit 1 only when the model's own checks FAIL; the benchmark's verdicts judge the device's precisions.
    assert code == (1 if data["model_status"] == "FAIL" else 0)
    for tier in ("smoke", "analysis", "train", "fit", "ranks", "amp_benchmark"):
        assert (out / f"{tier}.csv").stat().st_size > 0 and (out / f"{tier}.png").exists()
        assert f"src='{tier}.png'" in (out / "index.html").read_text()
    assert "amp_benchmark_verdicts.csv" in (out / "index.html").read_text()
    verdicts = pd.read_csv(out / "amp_benchmark_verdicts.csv")
    assert set(verdicts["precision"]) == set(BenchConfig().precisions)  # every mode the benchmark compares, by default
    assert data["tiers"][5]["status"] in verdicts["status"].tolist()
    train = json.loads((out / "train.json").read_text())
    assert train["summary"]["steps"] == TINY_SIZES.train.max_steps and train["summary"]["global_batch"] == 4
    # the job decided `auto` once; training runs that decision, so its reason still says auto (not "bf16 requested")
    assert train["summary"]["precision_reason"].startswith("auto: ")
    printed = capsys.readouterr().out
    for head in ("smoke TinyGPT: ", "analysis TinyGPT: ", "train: 4 steps, global batch 4",
                 "fit at B=4, T=16: cheapest mode that fits here", "ranks: smallest N that trains at T=16",
                 "benchmark TinyGPT: ", "model checks: ", " at batch 4 x 16 tokens"):
        assert head in printed
    # fit's fastest here is what the benchmark measured in the same run; the last line leads with the answer. (On a
    # CPU without native bf16/fp16 no other mode runs: "no mode was measurably faster here (no other mode ran".)
    assert ("fastest here " in printed or "no mode was measurably faster here (" in printed) and \
        "measured by this run's benchmark at batch 4 x 16" in printed
    last = printed.splitlines()[-1]
    assert data["summary"] == last
    assert last.split(" here: ")[0] in BenchConfig().precisions and last.index(" here: ") < last.index("model checks")
    # The fine-tune against its base: in the last line (4 validation examples: the interval only), the report's plot.
    assert " · fine-tune vs base: val loss " in last and "fewer than 30 pairs, interval only (n=4" in last
    assert "src='train_versus_base.png'" in (out / "index.html").read_text()
    assert f"machine busy: load 99.0 on {data['run_metadata']['cpu_count']} cores" in printed.splitlines()[0]
    assert data["run_metadata"]["load_average_1m"] == 99.0 and data["bench_size"] is None  # grown on a GPU only
    assert data["plan"]["train_steps"] == TINY_SIZES.train.max_steps and data["plan"]["growth"] is None
    assert len(printed.splitlines()) < 60  # one screen


def test_all_refuses_a_file_as_out_dir_before_running(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("")
    assert main(["all", "--out", str(target), "--fast"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_diverged_training_is_a_fail_with_its_partial_history(tmp_path, tiny_sizes, monkeypatch):
    real_train = mainjob.train

    def diverging(model, data, config):
        partial = real_train(model, data, config, max_steps=1)
        partial.summary.diverged_at_step, partial.summary.diverged = 2, "loss became nan at step 2 in fp16"
        raise TrainingDiverged(2, "fp16", float("nan"), result=partial)

    monkeypatch.setattr(mainjob, "train", diverging)
    for tier in ("smoke", "analyze", "amp_benchmark"):  # only training matters here
        monkeypatch.setattr(mainjob, tier, lambda *a, **k: Fake(["PASS"]))
    result = run_all("tiny-gpt", tmp_path, fast=True, progress=False, model_kwargs=TINY)
    assert result.statuses["train"] == "FAIL" and result.status == "FAIL" and result.model_status == "FAIL"
    assert result.results["train"].summary.steps == 1 and (tmp_path / "train.csv").exists()


LOUD = """
from tier_utils import TinyGPT


class Loud(TinyGPT):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 7e4
"""


@pytest.mark.parametrize("case,line", [
    ("every step skipped", "fp16 and the run ended with train_loss nan; likeliest cause: fp16's GradScaler skipped "
                           "every step (4 of 4)"),
    ("a weight past fp16", "fp16 would overflow: head.weight holds values beyond fp16's ±65504"),
])
def test_a_non_finite_training_fails_all_with_its_line(case, line, tmp_path, tiny_sizes, monkeypatch):
    # Before (issue 50, item 6): NaN train and val loss, exit 0.
    (tmp_path / "loud.py").write_text(LOUD)
    model = load_model(f"{tmp_path / 'loud.py'}:Loud", **TINY) if case == "every step skipped" else tiny(seed=0)
    if case == "a weight past fp16":
        with torch.no_grad():
            model.head.weight[0, 0] = 1e6
    for tier in ("smoke", "analyze", "amp_benchmark"):  # only training matters here
        monkeypatch.setattr(mainjob, tier, lambda *a, **k: Fake(["PASS"]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPrecisionWarning)  # fp16 on a CPU
        result = run_all(model, tmp_path / "report", fast=True, precision="fp16", device="cpu", progress=False)
    assert result.statuses["train"] == "FAIL" and result.model_status == "FAIL"  # the CLI's exit 1
    assert line in result.summary_text()


def test_benchmark_verdict_fail_is_reported_but_not_a_model_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(mainjob, "smoke", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(mainjob, "analyze", lambda *a, **k: Fake(["WARN"]))
    monkeypatch.setattr(mainjob, "_train", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(mainjob, "amp_benchmark", lambda *a, **k: FakeBench(["FAIL"]))
    result = run_all("tiny-gpt", tmp_path, fast=True, progress=False, model_kwargs=TINY)
    assert (result.status, result.model_status) == ("FAIL", "WARN")
    # The last line: the answer first, then the modes whose verdicts failed, then the verdicts.
    last = result.summary_text().splitlines()[-1]
    assert last.startswith("bf16 here: 1.45× fp32 · failed: bf16 (c0) · model checks: WARN · benchmark verdicts: "
                           "FAIL · report: ")


TIER_NAMES = {"smoke", "analysis", "train", "fit", "ranks", "amp_benchmark", "analyze", "bench", "benchmark"}


def test_the_main_job_has_no_branch_on_a_tier_name():
    """Issue 43: mainjob.py asks each result (summary_line, verdict, problems, answer); a table naming the tiers
    it runs is fine, a comparison with a tier's name is not."""
    import ast
    from pathlib import Path

    tree = ast.parse(Path(mainjob.__file__).read_text())
    compared = [(node.lineno, c.value) for node in ast.walk(tree) if isinstance(node, ast.Compare)
                for c in (node.left, *node.comparators)
                if isinstance(c, ast.Constant) and isinstance(c.value, str) and c.value in TIER_NAMES]
    matched = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.MatchValue)]
    assert not compared and not matched, compared or matched
    # Issue 51: nor a test of a result's type; what it needs of one (the benchmark's measured speedups) it asks.
    typed = [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call)
             and getattr(node.func, "id", None) == "isinstance" and "Result" in ast.unparse(node.args[1])]
    assert not typed, typed


def test_ctrl_c_in_training_stops_the_job_with_130(tmp_path, tiny_sizes, monkeypatch, capsys):
    real_train = mainjob.train
    ran = []

    def interrupted(model, data, config):
        def ctrl_c(step, metrics):
            raise KeyboardInterrupt

        return real_train(model, data, config, on_eval=ctrl_c)  # train() returns a partial result

    monkeypatch.setattr(mainjob, "train", interrupted)
    for tier in ("smoke", "analyze", "amp_benchmark"):
        monkeypatch.setattr(mainjob, tier, lambda *a, tier=tier, **k: ran.append(tier) or Fake(["PASS"]))
    out = tmp_path / "report"
    assert main(["all", *TINY_ARGS, "--out", str(out), "--fast", "--no-progress"]) == 130
    # The benchmark runs before training (the trained copy is not held beside it); Ctrl-C: no report.
    assert ran == ["smoke", "analyze", "amp_benchmark"] and not (out / "index.html").exists()


def test_all_result_is_a_result_and_the_cli_passes_seed(tmp_path, monkeypatch):
    seeds = []
    monkeypatch.setattr(mainjob, "smoke", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(mainjob, "analyze", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(mainjob, "_train", lambda model, data, config: seeds.append(config.seed) or Fake(["PASS"]))
    monkeypatch.setattr(mainjob, "amp_benchmark", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(mainjob.AllResult, "summary_text", lambda self: "")  # it reads real tier tables
    assert main(["all", *TINY_ARGS, "--out", str(tmp_path / "r"), "--fast", "--seed", "7", "--no-progress"]) == 0
    assert seeds == [7]
    result = run_all("tiny-gpt", tmp_path / "api", fast=True, progress=False, model_kwargs=TINY)
    assert isinstance(result, Result)
    saved = json.loads(result.save_json(tmp_path / "all.json").read_text())
    assert saved["status"] == "PASS" and [t["tier"] for t in saved["tiers"]][2] == "train"


@pytest.mark.slow  # the real CLI in a subprocess, --fast: ~20 s on 2 cores
def test_main_job_logged_to_a_file_has_short_plain_lines(tmp_path):
    """Progress bars redrawn with carriage returns become one endless line in a log: not any more."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    log = tmp_path / "log"
    with open(log, "w") as fh:  # stdout and stderr both to the file, as `... > log 2>&1`; progress left on
        code = subprocess.call([sys.executable, "-m", "tier_utils", "all", *TINY_ARGS, "--fast", "--out",
                                str(tmp_path / "report")], stdout=fh, stderr=subprocess.STDOUT, cwd=tmp_path,
                               env={**os.environ, "PYTHONPATH": str(root)})
    text = log.read_text()
    assert code in (0, 1), text[-2000:]
    assert "\r" not in text
    assert max(len(line) for line in text.splitlines()) <= 500
    assert "train: " in text and "amp benchmark: " in text  # plain progress lines, not silence




def test_the_main_job_builds_the_adapter_once_and_hands_it_to_every_tier(tmp_path, monkeypatch):
    """Issue 51: run_all adapts the model once; every tier gets that adapter (training a copy of it, the loader's
    record kept), none resolves the module again."""
    from tier_utils.adapter.adapter import ModelAdapter
    from tier_utils.models.loading import source_of

    got, adapted = {}, []
    real_adapt = mainjob.adapt
    monkeypatch.setattr(mainjob, "adapt", lambda model: adapted.append(model) or real_adapt(model))
    for name in ("smoke", "analyze", "amp_benchmark", "fit", "plan_ranks"):
        monkeypatch.setattr(mainjob, name, lambda model, *a, name=name, **k: got.setdefault(name, model) and
                            Fake(["PASS"]))
    monkeypatch.setattr(mainjob, "_train", lambda model, data, config: got.setdefault("train", model) and
                        Fake(["PASS"]))
    run_all("tiny-gpt", tmp_path, fast=True, progress=False, model_kwargs=TINY)
    assert len(adapted) == 1 and set(got) == {"smoke", "analyze", "amp_benchmark", "fit", "plan_ranks", "train"}
    adapter = got["smoke"]
    assert isinstance(adapter, ModelAdapter) and adapter.model is adapted[0]
    assert all(got[name] is adapter for name in ("analyze", "amp_benchmark", "fit", "plan_ranks"))
    trained = got["train"]
    assert trained.model is not adapter.model and source_of(trained.model) is adapter.source is not None


@pytest.fixture(scope="module")
def bare_chat(tmp_path_factory):
    """The chat demo with its model copied into a folder whose tokenizer has no chat template of its own."""
    demo = chat_demo(tmp_path_factory.mktemp("chat"), n=40)
    return demo, without_template(demo.model, demo.model.parent / "bare")


@pytest.mark.slow  # a Llama through every tier: ~30-60 s on 2 busy cores
def test_all_reads_chat_data_with_the_given_template_and_loss_in_every_tier(bare_chat, tmp_path, monkeypatch,
                                                                              capsys):
    demo, bare = bare_chat
    monkeypatch.setattr(mainjob, "FAST", replace(TINY_SIZES, seq_len=48))  # the demo's conversations fit in 48
    out, summary = tmp_path / "report", tmp_path / "all.json"
    code = main(["all", "--model", str(bare), "--data", str(demo.data), "--chat-template", str(demo.template),
                 "--loss-on", "all", "--out", str(out), "--fast", "--no-progress", "--json", str(summary)])
    data = json.loads(summary.read_text())
    assert code == (1 if data["model_status"] == "FAIL" else 0)
    chat = json.loads((out / "train.json").read_text())["summary"]["chat"]
    assert chat["format"] == "messages" and chat["scored_share"] == 1.0 and chat["template"] == str(demo.template)
    # The analysis and the benchmark read the data the same way (the bare tokenizer would refuse them otherwise).
    read = "messages format, every token scored (100% of the tokens), chat template "
    for tier in ("analysis", "amp_benchmark"):
        assert read in (out / f"{tier}.json").read_text()
    assert read in data["run_metadata"]["data"] and read in capsys.readouterr().out


@pytest.mark.parametrize("given,line", [
    ((), "has no chat template; give one with --chat-template FILE"),
    (("--loss-on", "most"), "argument --loss-on: invalid choice: 'most'"),
    (("--data-format", "chatml"), "argument --data-format: invalid choice: 'chatml'"),
    (("--chat-template", "{here}/chat.jsonl"), "holds no Jinja"),
])
def test_all_refuses_bad_chat_settings_in_one_line_writing_nothing(bare_chat, tmp_path, capsys, given, line):
    demo, bare = bare_chat
    out = tmp_path / "report"
    given = [g.format(here=demo.data.parent) for g in given]
    try:  # argparse's refusals exit; the others return the code
        code = main(["all", "--model", str(bare), "--data", str(demo.data), *given, "--out", str(out), "--fast",
                     "--no-progress"])
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and line in err and not out.exists()


def test_all_plans_fit_at_the_longest_batch_its_chat_data_makes(bare_chat, tmp_path, monkeypatch):
    demo, bare = bare_chat
    for name in ("smoke", "analyze", "amp_benchmark", "plan_ranks", "_train"):  # fit alone runs
        monkeypatch.setattr(mainjob, name, lambda *a, **k: Fake(["PASS"], with_plot=False))
    monkeypatch.setattr(mainjob, "FAST", replace(TINY_SIZES, seq_len=128))  # longer than any demo conversation
    real_fit = mainjob.fit  # as the job calls it, on its fp32 row alone (no LoRA, no 4-bit base to import)
    monkeypatch.setattr(mainjob, "fit", lambda model, config, **k: real_fit(
        model, replace(config, precisions=("fp32",), checkpointing=False, lora=None, optimizers=("adamw",)), **k))
    result = run_all(str(bare), tmp_path / "report", data=str(demo.data), fast=True, progress=False, device="cpu",
                     chat_template=str(demo.template))  # the bare tokenizer: fit reads the rows with it, or refuses
    planned = result.results["fit"]
    assert planned.from_data is not None and planned.seq_len == planned.from_data.length < 128
    said = f"planned at T={planned.seq_len}, the longest batch the data makes"
    assert said in planned.summary_line() and said in (tmp_path / "report" / "index.html").read_text()


def test_a_job_says_each_warning_once_though_its_tiers_reset_pythons_registry():
    def reading(text):  # a tier: its own catch_warnings resets Python's once-per-place registry, then it reads
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
        warnings.warn(text, stacklevel=1)

    cut = "chat.jsonl: 4 conversations lost turns from the front to fit"
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("default")
        with mainjob.each_warning_once():
            for text in (cut, cut, "another line", cut):
                reading(text)
        reading(cut)  # the next job says it again
    assert [str(w.message) for w in got] == [cut, "another line", cut]
