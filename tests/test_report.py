"""The folder report: tables, plots and an index.html, from any results."""
import json
import re
from dataclasses import replace

import pandas as pd
import pytest
from matplotlib.figure import Figure
from tiny import TINY

from tier_utils.core.results import Result
from tier_utils.report import write_report


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

        def verdict_table(self):
            return pd.DataFrame({"precision": ["bf16"], "mode": ["eager"], "check": ["speedup vs fp32"],
                                 "status": ["WARN"], "value": [0.75], "threshold": [1.5], "detail": ["inconclusive"]})

        def tables(self):
            return {"": self.table, "_verdicts": self.verdict_table()}

    page = write_report({"amp_benchmark": Bench(["WARN"])}, tmp_path).read_text()
    assert "measure_0" not in page and "<td class='WARN'>WARN</td>" in page and "<td>bf16</td>" in page
    assert "<a href='amp_benchmark.csv'>amp_benchmark.csv</a>" in page
    assert len(pd.read_csv(tmp_path / "amp_benchmark.csv").columns) == 34
    assert pd.read_csv(tmp_path / "amp_benchmark_verdicts.csv")["status"].tolist() == ["WARN"]


def test_the_report_shows_the_consistency_rows_the_main_job_hands_it_first(tmp_path):
    """The main job's check that training and the benchmark timed the same step alike reaches the page as a table
    handed in (`leading`): the report knows no tier."""
    from tier_utils.benchmark.amp import amp_benchmark
    from tier_utils.benchmark.mainjob.consistency import consistency, recorded_load
    from tier_utils.core.results import checks_table
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
    results, meta = {"train": trained, "amp_benchmark": bench}, {"load_average_1m": 3.1, "cpu_count": 2}

    def rows():
        return {"consistency": checks_table(consistency(results, recorded_load(meta)))}

    page = write_report(results, tmp_path, metadata=meta, leading=rows()).read_text()
    text = re.sub("<[^>]+>", "", page)  # the words, as a reader sees them
    assert "<section id='consistency'>" in page and "step time: train vs amp_benchmark" in text
    assert page.index("<section id='consistency'>") < page.index("<section id='train'>")
    assert "20.0x apart" in text and "load 3.1 on 2 cores" in text
    assert pd.read_csv(tmp_path / "consistency.csv")["status"].tolist() == ["WARN"]
    timed(step.median, step.q1, step.q3)  # the same step timed alike: nothing to say
    assert "consistency" not in write_report(results, tmp_path / "b", metadata=meta, leading=rows()).read_text()


class FakeBench(Fake):
    """A benchmark's stand-in: its verdicts judge the device, and it answers the question."""

    judges = "device"

    def answer(self):
        return "bf16 here: 1.45× fp32 · failed: bf16 (c0)"


def test_the_page_opens_with_the_answer_and_the_verdict_line(tmp_path):
    """The main job's last line at the top: the answer first, then "model checks: … · benchmark verdicts: …" (a
    FAILing benchmark on a CPU does not read as a broken model); each section says its result's own line."""
    page = write_report({"smoke": Fake(["PASS"]), "train": Fake(["PASS", "WARN"]), "bench": FakeBench(["FAIL"])},
                        tmp_path).read_text()
    first = re.search(r"<h1>.*?</h1>\s*<p class='verdict'>(.*?)</p>", page, re.S)
    assert first and first.group(1) == ("bf16 here: 1.45× fp32 · failed: bf16 (c0) · model checks: WARN · "
                                        "benchmark verdicts: FAIL")
    assert page.index("class='verdict'") < page.index("<section")
    assert "<p class='summary'>FakeBench: FAIL (1 FAIL)</p>" in page
    only = write_report({"smoke": Fake(["PASS"])}, tmp_path / "b").read_text()
    assert "model checks: PASS · benchmark verdicts: not run" in only


class Wide(Fake):
    """A measurement table 17 columns wide, as the report page once showed whole."""

    @property
    def table(self):
        return pd.DataFrame({f"column_{i}": [float(i), i + 0.5] for i in range(17)})


def test_every_table_on_the_page_is_at_most_twelve_columns_and_the_csv_has_all(tmp_path):
    page = write_report({"wide": Wide([]), "smoke": Fake(["PASS"])}, tmp_path).read_text()
    for table in re.findall(r"<table.*?</table>", page, re.S):
        head = re.search(r"<tr.*?</tr>", table, re.S).group(0)
        assert 0 < head.count("<th") <= 12, head
    assert "leaves out 5 columns; the CSV has all" in page
    assert len(pd.read_csv(tmp_path / "wide.csv").columns) == 17


def test_printing_a_result_shows_at_most_twelve_columns_and_says_where_the_rest_are():
    text = repr(Wide([]))
    assert "column_11" in text and "column_12" not in text
    assert text.endswith("(5 more columns in .table)")
