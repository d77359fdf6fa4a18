"""tier3_training.ipynb in JupyterLab, driven by a real headless Chromium: change the precision and
batch-size widgets, Run All twice, and read the rendered results table: the panel's values reach the
run both times (the parameters cell's defaults don't replace them).

Needs Debian's `chromium` and `chromium-driver` (skipped only when /usr/bin/chromium is missing).
Screenshots: test-artifacts/tier3_training_widgets.png (the panel after the change) and
test-artifacts/tier3_training_browser.png (the results table).
"""
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("selenium", reason="selenium is a test extra (pip install '.[test]')")
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import Select

from tier_utils.core.precision import resolve_precision

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
NEW_BATCH_SIZE = 3

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} not installed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """JupyterLab on 127.0.0.1 serving a copy of the notebooks, with its own config and workspace dirs."""
    root = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "config"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
           "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"),
           "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
           "--LabApp.expose_app_in_browser=True", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"]
    if os.geteuid() == 0:  # CI containers run as root
        cmd.append("--allow-root")
    log = open(tmp_path / "lab.log", "w")
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as resp:
                    json.load(resp)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-2000:])
                time.sleep(0.5)
        yield url, token
    finally:
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()


@pytest.fixture
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)  # no driver download
    try:
        yield driver
    finally:
        driver.quit()


# JupyterLab's own commands, through the app object it exposes (expose_app_in_browser).
_NOTEBOOK = "const nb = window.jupyterapp.shell.currentWidget;"
_FIND_CELL = _NOTEBOOK + """
const i = nb.content.widgets.findIndex(c => c.model.sharedModel.getSource().includes(arguments[0]));
"""
_RUN_CELL = _FIND_CELL + """
nb.content.activeCellIndex = i;
window.jupyterapp.commands.execute(arguments[1]);
return i;
"""
_KERNEL_IDLE = _NOTEBOOK + """
const k = nb && nb.sessionContext && nb.sessionContext.session && nb.sessionContext.session.kernel;
return k ? k.status : null;
"""
_CELL_NODE = _FIND_CELL + "return nb.content.widgets[i].node;"


def _wait(driver, condition, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.25)
    driver.save_screenshot(str(ARTIFACTS / "tier3_training_browser_timeout.png"))
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _results_table(cell) -> dict:
    """The rendered DataFrame of a cell's output as {metric: value}."""
    rows = {}
    for tr in cell.find_elements(By.CSS_SELECTOR, ".jp-OutputArea-output table tbody tr"):
        tds = [td.text for td in tr.find_elements(By.TAG_NAME, "td")]
        if len(tds) == 2:
            rows[tds[0]] = tds[1]
    return rows


def test_widgets_set_in_the_browser_reach_the_training_run(lab, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    url, token = lab
    browser.get(f"{url}/lab/tree/tier3_training.ipynb?token={token}")
    _wait(browser, lambda: browser.execute_script(_KERNEL_IDLE) == "idle", 60, "the notebook's kernel")

    # Run everything above the training cell: setup, parameters, the panel and the precision line.
    browser.execute_script(_RUN_CELL, "tier_utils.train(", "notebook:run-all-above")
    panel = _wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".widget-dropdown select"), 60,
                  "the config panel")
    precision_select = Select(panel[0])  # the model and data boxes are comboboxes (text inputs)
    batch_input = browser.find_element(By.CSS_SELECTOR, ".widget-inline-hbox input[type='number']")
    assert precision_select.first_selected_option.text == "auto" and batch_input.get_attribute("value") == "4"

    # An explicit precision other than what auto picks here, so the run must say "<name> requested".
    auto = resolve_precision("auto").name  # this process sees the same device as the kernel
    choices = [o.text for o in precision_select.options if o.text != "auto"]
    choice = next((c for c in choices if c != auto), choices[0])
    precision_select.select_by_visible_text(choice)
    batch_input.send_keys(Keys.CONTROL, "a")
    batch_input.send_keys(str(NEW_BATCH_SIZE), Keys.ENTER)
    decision = browser.find_element(By.CSS_SELECTOR, ".widget-html small")
    _wait(browser, lambda: decision.text.startswith(f"{choice} requested"), 10, "the panel to show the new choice")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", decision)
    browser.save_screenshot(str(ARTIFACTS / "tier3_training_widgets.png"))

    # Run All: the parameters cell rebuilds cfg at its defaults, and the panel keeps the user's choice.
    for run in (1, 2):
        browser.execute_script(_NOTEBOOK + "window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs');")
        browser.execute_script(_NOTEBOOK + "window.jupyterapp.commands.execute('notebook:run-all-cells');")
        cell = browser.execute_script(_CELL_NODE, "tier_utils.train(")
        table = _wait(browser, lambda cell=cell: (lambda t: t if "global_batch" in t else None)(_results_table(cell)),
                      120, f"the training results table after Run All #{run}")
        assert table["precision"] == choice and table["global_batch"] == str(NEW_BATCH_SIZE), (run, table)
        assert table["precision_reason"].startswith(f"{choice} requested"), (run, table)
        _wait(browser, lambda: browser.execute_script(_KERNEL_IDLE) == "idle"
              and browser.find_elements(By.CSS_SELECTOR, ".widget-dropdown select"), 300, "Run All to finish")
        precision_select = Select(browser.find_element(By.CSS_SELECTOR, ".widget-dropdown select"))
        assert precision_select.first_selected_option.text == choice, run
        assert browser.find_element(By.CSS_SELECTOR, ".widget-inline-hbox input[type='number']"
                                    ).get_attribute("value") == str(NEW_BATCH_SIZE), run
    shown = cell.find_element(By.XPATH, ".//tr[td[text()='precision']]")
    browser.execute_script("arguments[0].scrollIntoView()", shown)  # precision ... global_batch in view
    browser.save_screenshot(str(ARTIFACTS / "tier3_training_browser.png"))


@pytest.fixture(scope="module")
def main_job_report(tmp_path_factory):
    """The main job's index.html at tiny sizes: real tables from every tier, run once for this file."""
    from tiny import TINY

    from tier_utils import BenchConfig, TrainConfig, mainjob
    from tier_utils.presets import Preset

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mainjob, "FAST", Preset(batch_size=4, seq_len=16, analysis_batches=1,
                                          train=TrainConfig(max_steps=4, eval_every=2, eval_batches=1),
                                          bench=BenchConfig(untimed_steps=1, timed_steps=1, repeats=1,
                                                            accuracy_steps=2, eval_batches=1)))
        result = mainjob.run_all("tiny-gpt", tmp_path_factory.mktemp("report"), fast=True, progress=False,
                                device="cpu", model_kwargs=TINY)
    return result.index.resolve().as_uri()


def _open(browser, url, width):
    browser.set_window_size(width, 900)
    browser.get(url)
    _wait(browser, lambda: browser.execute_script("return document.readyState") == "complete", 10, "the page")


@pytest.mark.slow  # runs the main job (tiny sizes) before the browser loads its page
def test_report_page_never_scrolls_sideways(browser, main_job_report):
    """The main job's index.html, real tables included, in Chromium at a laptop's width: wide tables
    scroll inside their own box, the page itself has no horizontal overflow."""
    ARTIFACTS.mkdir(exist_ok=True)
    for width in (1280, 800):
        _open(browser, main_job_report, width)
        scroll, view = browser.execute_script(
            "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        browser.save_screenshot(str(ARTIFACTS / f"report_page_{width}.png"))
        assert scroll <= view, f"the page is {scroll} px wide in a {view} px window"
        boxes = browser.find_elements(By.CSS_SELECTOR, "section .scroll")
        assert boxes and all(b.size["width"] <= view for b in boxes)


# Each word of each table cell, as the browser laid it out: a word whose characters sit on more than one
# line was broken inside. A long token's <wbr> parts are text nodes of their own, so they may wrap.
_BROKEN_WORDS = """
const broken = [];
for (const cell of document.querySelectorAll('td, th')) {
  const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const m of node.textContent.matchAll(/\\S+/g)) {
      const range = document.createRange();
      range.setStart(node, m.index);
      range.setEnd(node, m.index + m[0].length);
      const lines = new Set(Array.from(range.getClientRects(), r => Math.round(r.top)));
      if (lines.size > 1) broken.push(m[0]);
    }
  }
}
return broken;
"""
_TABLE_WIDTHS = """
return Array.from(document.querySelectorAll('section'), s => [s.id, Array.from(s.querySelectorAll('table'),
  t => [Math.ceil(t.getBoundingClientRect().width), t.parentElement.clientWidth])]);
"""


@pytest.mark.slow  # runs the main job (tiny sizes) before the browser loads its page
def test_report_tables_at_1280px_break_no_word_and_the_benchmark_fits(browser, main_job_report):
    """At 1280 px: no table cell has a word broken across lines ("float3 2", "robustnes s"), and no
    benchmark table is wider than the window (it shows its verdict columns; the measurements are a CSV)."""
    _open(browser, main_job_report, 1280)
    view = browser.execute_script("return document.documentElement.clientWidth")
    cells = browser.execute_script("return document.querySelectorAll('td').length")
    assert cells > 50  # every tier's table is there
    assert browser.execute_script(_BROKEN_WORDS) == []
    widths = dict(browser.execute_script(_TABLE_WIDTHS))
    assert widths["amp_benchmark"], "the benchmark section shows a table"
    for table, box in widths["amp_benchmark"]:
        assert table <= box <= view, f"a benchmark table is {table} px wide in a {box} px box, {view} px window"
