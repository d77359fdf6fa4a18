"""Every result's notebook display is a table a person reads: at most 12 columns, statuses coloured as on
the report page, figures rounded, empty cells blank; the full frame stays in `.table`."""
import re

import pandas as pd
import pytest
from tiny import TINY

import tier_utils
from tier_utils.core.display import MAX_COLUMNS, STATUS_STYLE, html_table, round_to_spread
from tier_utils.core.results import STATUSES, TierFailure

SMALL = dict(batch_size=2, seq_len=16, progress=False, device="cpu")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One of each result type, at tiny sizes (seconds)."""
    model = tier_utils.load_model("tiny-gpt", **TINY)
    out = tmp_path_factory.mktemp("display")
    train = tier_utils.train(model, None, max_steps=2, eval_every=None, eval_batches=1, **SMALL)
    return {
        "smoke": tier_utils.smoke(model, batch_sizes=(1, 2), seq_lens=(16,), progress=False, device="cpu"),
        "analysis": tier_utils.analyze(model, None, n_batches=1, **SMALL),
        "train": train,
        "fit": tier_utils.fit(model, seq_len=16, validate=False, progress=False, device="cpu"),
        "bench": tier_utils.amp_benchmark(model, None, untimed_steps=1, timed_steps=1, repeats=1, accuracy_steps=2,
                                          eval_batches=1, **SMALL),
        "export": tier_utils.export(model, out / "m.pt2", format="pt2", repeats=2),
        "search": tier_utils.search(model, None, tier_utils.SearchConfig(
            n_trials=2, trial=tier_utils.TrainConfig(max_steps=2, eval_every=1, eval_batches=1, **SMALL)),
            space={"lr": ("log", 1e-4, 1e-2)}),
        "failure": TierFailure("smoke", "RuntimeError: boom"),
    }


def _header(page: str) -> list[str]:
    return re.findall(r"<th>(.*?)</th>", re.search(r"<thead>(.*?)</thead>", page).group(1))


@pytest.mark.parametrize("name", ["smoke", "analysis", "train", "fit", "bench", "export", "search", "failure"])
def test_the_notebook_display_is_a_readable_verdict_table(results, name):
    result = results[name]
    page = result._repr_html_()
    assert 1 <= len(_header(page)) <= MAX_COLUMNS, _header(page)
    assert ">None<" not in page and ">nan<" not in page.lower()  # empty cells are blank
    assert not re.search(r"\d\.0*[1-9]\d{4,}", page)  # no 0.1050470123: figures rounded
    for status in set(result.table["status"]) if "status" in result.table.columns else ():
        assert f"<td style='{STATUS_STYLE[status]}'>{status}</td>" in page  # coloured as on the report page
    assert len(result.table.columns) >= len(_header(page)) - 2  # the full frame stays one attribute away


@pytest.mark.parametrize("name", ["smoke", "analysis", "train", "fit", "bench", "export", "search", "failure"])
def test_every_result_says_its_own_summary_line_and_verdict(results, name):
    """Issue 43: the main job, the report and the notebooks' summary ask each result; none looks inside."""
    result = results[name]
    line = result.summary_line()
    assert line and "\n" not in line and result.verdict in (*STATUSES, None)
    assert result.verdict == result.status and result.judges == ("device" if name == "bench" else "model")
    assert result.problems().empty or set(result.problems()["status"]) <= {"WARN", "FAIL", "SKIP"}


def test_the_benchmark_shows_its_verdicts_and_keeps_its_measurements(results):
    bench = results["bench"]
    assert len(bench.table.columns) > MAX_COLUMNS  # the 30-odd measurement columns: in .table and the CSV
    assert _header(bench._repr_html_())[:3] == ["precision", "mode", "check"]


def test_latency_and_fit_tables_are_indexed_by_their_meaning(results):
    assert results["export"].latency_table.index.names == ["shape", "runner"]
    assert results["smoke"].latency_table.index.names == ["batch_size", "seq_len"]
    assert results["fit"].overview().index.names == ["mode"]  # e.g. "bf16 + checkpointing", "LoRA r=8 · fp32"
    assert _header(results["fit"]._repr_html_())[:2] == ["mode", "status"]


def test_best_config_shows_what_the_search_changed(results):
    best = results["search"].best_config
    page = best._repr_html_()
    assert _header(page) == ["setting", "best trial"] and page.count("<tr>") == 2  # the header and lr
    assert "<td>lr</td>" in page
    assert isinstance(best, tier_utils.TrainConfig) and best.lr != results["search"].base_config.lr


def test_a_median_is_rounded_to_its_spread():
    frame = pd.DataFrame({"median_ms": [0.105047, 12.3456], "iqr_ms": [0.004277, None]})
    rounded = round_to_spread(frame)
    assert rounded["median_ms"].tolist() == [0.105, 12.3456] and rounded["iqr_ms"][0] == 0.0043


def test_a_wide_table_is_cut_to_twelve_columns_and_says_so():
    page = html_table(pd.DataFrame([range(20)], columns=[f"c{i}" for i in range(20)]))
    assert len(_header(page)) == MAX_COLUMNS and "8 more columns" in page


def test_a_named_index_counts_among_the_twelve_columns():
    frame = pd.DataFrame([range(20)], columns=[f"c{i}" for i in range(20)])
    page = html_table(frame.set_index(["c0", "c1"]))  # two index columns shown, then ten
    assert len(_header(page)) == MAX_COLUMNS and "8 more columns" in page
