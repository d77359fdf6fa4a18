"""The folder report and the `all` main job (API and CLI), end to end with tiny sizes."""
import json
import re
from dataclasses import replace

import pandas as pd
import pytest
from matplotlib.figure import Figure
from tiny import TINY, TINY_ARGS

from tier_utils import BenchConfig, TrainConfig, report
from tier_utils.cli import main
from tier_utils.core.errors import TrainingDiverged
from tier_utils.core.results import Result
from tier_utils.presets import Preset
from tier_utils.report import run_all, write_report

TINY_SIZES = Preset(batch_size=4, seq_len=16, analysis_batches=1,
                    train=TrainConfig(max_steps=4, eval_every=2, eval_batches=1),
                    bench=BenchConfig(untimed_steps=1, timed_steps=2, repeats=2, accuracy_steps=2, eval_batches=1))


class Fake(Result):
    def __init__(self, statuses, with_plot=True):
        self.statuses, self.with_plot = statuses, with_plot

    @property
    def table(self):
        return pd.DataFrame({"check": [f"c{i}" for i in range(len(self.statuses))], "status": self.statuses,
                             "value": [0.123456] * len(self.statuses), "detail": ["<b>x</b>"] * len(self.statuses)})

    def plot(self):
        if not self.with_plot:
            return None
        fig = Figure()
        fig.subplots().plot([1, 2, 3])
        return fig

    def to_json(self):
        return {"rows": self.table}


@pytest.fixture
def tiny_sizes(monkeypatch):
    monkeypatch.setattr(report, "FAST", TINY_SIZES)


def test_write_report_puts_tables_plots_and_an_index_together(tmp_path):
    index = write_report({"smoke": Fake(["PASS", "FAIL"]), "extra": Fake(["PASS"], with_plot=False)},
                         tmp_path / "out", metadata={"device_name": "cpu-x", "torch": "9.9"})
    out = tmp_path / "out"
    assert index == out / "index.html"
    assert pd.read_csv(out / "smoke.csv")["status"].tolist() == ["PASS", "FAIL"]
    assert (out / "smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "extra.png").exists()
    assert json.loads((out / "smoke.json").read_text())["rows"][1]["status"] == "FAIL"
    page = index.read_text()
    assert "src='smoke.png'" in page and "extra.png" not in page and str(tmp_path) not in page  # relative links
    assert "<h2>smoke <span class='FAIL'>FAIL</span></h2>" in page and "<td class='FAIL'>FAIL</td>" in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page  # table text is escaped
    assert "device_name: cpu-x" in page
    nav = "<a href='#smoke'>smoke</a> <span class='FAIL'>FAIL</span> · <a href='#extra'>extra</a> <span class='PASS'>"
    assert nav in page


@pytest.mark.parametrize("name", ["../evil", "a b", ""])
def test_write_report_refuses_names_that_are_not_file_names(tmp_path, name):
    with pytest.raises(ValueError, match="plain file name"):
        write_report({name: Fake(["PASS"])}, tmp_path)


def test_all_cli_runs_every_tier_and_writes_the_report(tmp_path, tiny_sizes, capsys, monkeypatch):
    monkeypatch.setattr(report, "load_average", lambda: 99.0)  # other jobs on the machine
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
    assert set(verdicts["precision"]) == {"fp32", "bf16", "fp16"}
    assert data["tiers"][5]["status"] in verdicts["status"].tolist()
    train = json.loads((out / "train.json").read_text())
    assert train["summary"]["steps"] == TINY_SIZES.train.max_steps and train["summary"]["global_batch"] == 4
    # the job decided `auto` once; training runs that decision, so its reason still says auto (not "bf16 requested")
    assert train["summary"]["precision_reason"].startswith("auto: ")
    printed = capsys.readouterr().out
    for head in ("smoke: ", "analysis: ", "train: 4 steps, global batch 4", "fit: largest training batch at T=16 here",
                 "ranks: smallest N that trains at T=16",
                 "amp_benchmark: ", "model checks: ", "  at batch 4 x 16 tokens"):
        assert head in printed
    assert f"machine busy: load 99.0 on {data['run_metadata']['cpu_count']} cores" in printed.splitlines()[0]
    assert data["run_metadata"]["load_average_1m"] == 99.0 and data["bench_size"] is None  # grown on a GPU only
    assert len(printed.splitlines()) < 60  # one screen


def test_all_refuses_a_file_as_out_dir_before_running(tmp_path, capsys):
    target = tmp_path / "taken"
    target.write_text("")
    assert main(["all", "--out", str(target), "--fast"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_diverged_training_is_a_fail_with_its_partial_history(tmp_path, tiny_sizes, monkeypatch):
    real_train = report.train

    def diverging(model, data, config):
        partial = real_train(model, data, config, max_steps=1)
        partial.summary.diverged_at_step = 2
        raise TrainingDiverged(2, "fp16", float("nan"), result=partial)

    monkeypatch.setattr(report, "train", diverging)
    for tier in ("smoke", "analyze", "amp_benchmark"):  # only training matters here
        monkeypatch.setattr(report, tier, lambda *a, **k: Fake(["PASS"]))
    result = run_all("tiny-gpt", tmp_path, fast=True, progress=False, model_kwargs=TINY)
    assert result.statuses["train"] == "FAIL" and result.status == "FAIL" and result.model_status == "FAIL"
    assert result.results["train"].summary.steps == 1 and (tmp_path / "train.csv").exists()


def test_benchmark_verdict_fail_is_reported_but_not_a_model_failure(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "smoke", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(report, "analyze", lambda *a, **k: Fake(["WARN"]))
    monkeypatch.setattr(report, "_train", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(report, "amp_benchmark", lambda *a, **k: Fake(["FAIL"]))
    result = run_all("tiny-gpt", tmp_path, fast=True, progress=False, model_kwargs=TINY)
    assert (result.status, result.model_status) == ("FAIL", "WARN")


def test_ctrl_c_in_training_stops_the_job_with_130(tmp_path, tiny_sizes, monkeypatch, capsys):
    real_train = report.train
    ran = []

    def interrupted(model, data, config):
        def ctrl_c(step, metrics):
            raise KeyboardInterrupt

        return real_train(model, data, config, on_eval=ctrl_c)  # train() returns a partial result

    monkeypatch.setattr(report, "train", interrupted)
    for tier in ("smoke", "analyze", "amp_benchmark"):
        monkeypatch.setattr(report, tier, lambda *a, tier=tier, **k: ran.append(tier) or Fake(["PASS"]))
    out = tmp_path / "report"
    assert main(["all", *TINY_ARGS, "--out", str(out), "--fast", "--no-progress"]) == 130
    assert ran == ["smoke", "analyze"] and not (out / "index.html").exists()  # no benchmark, no report


def test_all_result_is_a_result_and_the_cli_passes_seed(tmp_path, monkeypatch):
    seeds = []
    monkeypatch.setattr(report, "smoke", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(report, "analyze", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(report, "_train", lambda model, data, config: seeds.append(config.seed) or Fake(["PASS"]))
    monkeypatch.setattr(report, "amp_benchmark", lambda *a, **k: Fake(["PASS"]))
    monkeypatch.setattr(report.AllResult, "summary_text", lambda self: "")  # it reads real tier tables
    assert main(["all", *TINY_ARGS, "--out", str(tmp_path / "r"), "--fast", "--seed", "7", "--no-progress"]) == 0
    assert seeds == [7]
    result = run_all("tiny-gpt", tmp_path / "api", fast=True, progress=False, model_kwargs=TINY)
    assert isinstance(result, Result)
    saved = json.loads(result.save_json(tmp_path / "all.json").read_text())
    assert saved["status"] == "PASS" and [t["tier"] for t in saved["tiers"]][2] == "train"


def test_the_page_shows_verdict_columns_with_the_tables_own_statuses(tmp_path):
    class Measured(Fake):
        @property
        def table(self):
            return pd.DataFrame({"group": ["latency", "shapes"], "check": ["latency B=1", "shapes"],
                                 "status": ["PASS", "PASS"], "value": [1.5, 7.334e-08], "threshold": [None, "== 3"],
                                 "unused": [None, None], "raw_ms": [1.51, None],
                                 "detail": ["aten._scaled_dot_product_flash_attention_for_cpu float32", "ok"]})

    page = write_report({"smoke": Measured(["PASS"])}, tmp_path).read_text()
    # A row without a threshold (a measurement) reads PASS as in .table and the CLI, not a page-only word.
    assert page.count("<td class='PASS'>PASS</td>") == 2 and "measured" not in page
    head = page[page.index("<thead>"):page.index("</thead>")]
    assert [h for h in ("group", "check", "status", "value", "threshold", "detail") if f"<th>{h}</th>" in head] == \
        ["group", "check", "status", "value", "threshold", "detail"]
    assert "raw_ms" not in head and "unused" not in head and "None" not in page
    assert "leaves out 2 columns; the CSV has all" in page and "<a href='smoke.csv'>smoke.csv</a>" in page
    assert list(pd.read_csv(tmp_path / "smoke.csv").columns)[-2:] == ["raw_ms", "detail"]  # the CSV keeps all
    # A long token may wrap after its separators; an ordinary word (float32) never breaks.
    assert "aten.<wbr>_<wbr>scaled_<wbr>dot_<wbr>product_<wbr>flash_<wbr>attention_<wbr>for_<wbr>cpu float32" in page
    assert "<td><span class='w'>7.334e-08</span></td>" in page  # a browser would wrap it after the hyphen
    assert "word-break" not in page and "anywhere" not in page


def test_a_benchmark_shows_its_verdicts_and_links_its_measurements(tmp_path):
    class Bench(Fake):
        @property
        def table(self):
            return pd.DataFrame({f"measure_{i}": [i] for i in range(34)})

        @property
        def verdicts(self):
            return pd.DataFrame({"precision": ["bf16"], "mode": ["eager"], "check": ["speedup vs fp32"],
                                 "status": ["WARN"], "value": [0.75], "threshold": [1.5], "detail": ["inconclusive"]})

    page = write_report({"amp_benchmark": Bench(["WARN"])}, tmp_path).read_text()
    assert "measure_0" not in page and "<td class='WARN'>WARN</td>" in page and "<td>bf16</td>" in page
    assert "<a href='amp_benchmark.csv'>amp_benchmark.csv</a>" in page
    assert len(pd.read_csv(tmp_path / "amp_benchmark.csv").columns) == 34
    assert pd.read_csv(tmp_path / "amp_benchmark_verdicts.csv")["status"].tolist() == ["WARN"]


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


def test_the_report_says_when_training_and_the_benchmark_timed_the_same_step_far_apart(tmp_path):
    from tier_utils.benchmark.amp import amp_benchmark
    from tier_utils.models.loading import load_model
    from tier_utils.training.loop import train

    model = load_model("tiny-gpt", **TINY)
    trained = train(model, max_steps=3, batch_size=4, seq_len=16, eval_every=0, eval_batches=1, precision="fp32",
                    progress=False, device="cpu")
    bench = amp_benchmark(model, precisions=("fp32",), batch_size=4, seq_len=16, untimed_steps=0, timed_steps=1,
                          repeats=2, accuracy_steps=0, progress=False, device="cpu")
    step, fp32 = trained.summary.step_time_ms, bench.records[0]

    def timed(median, q1, q3):
        fp32.speed = replace(fp32.speed, step_ms=replace(fp32.speed.step_ms, median=median, q1=q1, q3=q3))

    timed(step.median / 20, step.q1 / 25, step.q1 / 21)  # a load came and went
    page = write_report({"train": trained, "amp_benchmark": bench}, tmp_path,
                        metadata={"load_average_1m": 3.1, "cpu_count": 2}).read_text()
    text = re.sub("<[^>]+>", "", page)  # the words, as a reader sees them
    assert "<section id='consistency'>" in page and "step time: train vs amp_benchmark" in text
    assert "20.0x apart" in text and "load 3.1 on 2 cores" in text
    assert pd.read_csv(tmp_path / "consistency.csv")["status"].tolist() == ["WARN"]
    timed(step.median, step.q1, step.q3)  # the same step timed alike: nothing to say
    assert "consistency" not in write_report({"train": trained, "amp_benchmark": bench}, tmp_path / "b").read_text()
