"""The notebooks in JupyterLab, driven by a real headless Chromium, as a user meets them: a transformers folder
and a text file typed into each notebook's panel reach every cell below (the summary names them), a path that
doesn't exist is one error line, and in tier3_training.ipynb the precision and batch-size widgets reach the run
through two Run Alls (the parameters cell's defaults don't replace them).

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
# Until JupyterLab has booted (seconds on a loaded machine) the app object is not there yet: nb is then undefined, and
# the kernel's status reads null, so _wait goes on waiting instead of the script raising.
_NOTEBOOK = "const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
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


def _box(driver, label: str):
    """The input of the panel's box labelled `label` (ipywidgets' inline box: a label, then the input)."""
    return driver.find_element(By.XPATH, f"//div[contains(@class, 'widget-inline-hbox')]"
                                         f"[./label[normalize-space()='{label}']]//input")


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
    batch_input = _box(browser, "batch size")
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
        assert _box(browser, "batch size").get_attribute("value") == str(NEW_BATCH_SIZE), run
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


_OUTPUTS = _NOTEBOOK + """
return nb.content.widgets.filter(c => c.model.type === 'code')
  .map(c => [c.model.sharedModel.getSource(), c.model.executionCount, c.model.outputs.toJSON()]);
"""
# The cell each notebook's first tier runs in: Run All Above it shows the panel without running a tier.
FIRST_RUN = {"tier1_smoke.ipynb": "tier_utils.smoke(", "tier2_analysis.ipynb": "tier_utils.analyze(",
             "tier3_training.ipynb": "tier_utils.train("}


def _type(driver, label: str, text: str) -> None:
    box = _box(driver, label)
    box.send_keys(Keys.CONTROL, "a")
    box.send_keys(text, Keys.ENTER)  # the box takes a path on Enter, not at each keystroke


def _run_all(driver, timeout: float) -> list:
    """Run All from cleared outputs; the code cells' (source, execution count, outputs) once it stopped: every
    cell ran, or one raised (Run All stops there)."""
    driver.execute_script(_NOTEBOOK + "window.jupyterapp.commands.execute('notebook:clear-all-cell-outputs');")
    driver.execute_script(_NOTEBOOK + "window.jupyterapp.commands.execute('notebook:run-all-cells');")

    def stopped():
        if driver.execute_script(_KERNEL_IDLE) != "idle":
            return None
        cells = driver.execute_script(_OUTPUTS)
        failed = any(o["output_type"] == "error" for _, _, outs in cells for o in outs)
        return cells if failed or cells[-1][1] is not None else None
    time.sleep(2)  # the kernel turns busy
    return _wait(driver, stopped, timeout, "Run All to finish")


def _streams(cells) -> str:
    return "".join(o.get("text", "") for _, _, outs in cells for o in outs if o["output_type"] == "stream")


@pytest.fixture(scope="module")
def user_files(tmp_path_factory, trained_hf_folder):
    """What a user brings: a trained GPT-2 folder with its own BPE tokenizer, and a text file."""
    root = tmp_path_factory.mktemp("user")
    model = shutil.copytree(trained_hf_folder, root / "my-gpt2")
    text = root / "notes.txt"
    text.write_text("The quick brown fox jumps over the lazy dog; the dog sleeps on in the sun. " * 400)
    return model, text


@pytest.mark.slow  # each notebook runs twice from a browser: minutes on 2 cores
@pytest.mark.parametrize("name", list(FIRST_RUN))
def test_a_users_folder_and_text_file_typed_into_the_panel_reach_every_cell(lab, browser, user_files, name):
    ARTIFACTS.mkdir(exist_ok=True)
    model, text = user_files
    url, token = lab
    browser.get(f"{url}/lab/tree/{name}?token={token}")
    _wait(browser, lambda: browser.execute_script(_KERNEL_IDLE) == "idle", 60, "the notebook's kernel")
    browser.execute_script(_RUN_CELL, FIRST_RUN[name], "notebook:run-all-above")
    _wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".widget-text input[list]"), 90,
          "the config panel")  # its model box: a combobox, a text input with a datalist
    labels = {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".widget-inline-hbox > label")}
    assert ("data" in labels) == (name != "tier1_smoke.ipynb")  # each panel shows only the boxes its tier reads

    # A path that doesn't exist: Run All stops at the first cell that builds the model, with one line.
    _type(browser, "model", "/no/such/model")
    cells = _run_all(browser, 300)
    errors = [o for _, _, outs in cells for o in outs if o["output_type"] == "error"]
    assert errors[0]["ename"] == "ModelSpecError" and len(errors[0]["traceback"]) == 1, errors
    assert "/no/such/model" in errors[0]["traceback"][0] and "Traceback" not in errors[0]["traceback"][0]
    # Run All stops there: ipykernel aborts the cells queued behind an error. On a busy machine a request may
    # reach the kernel after its abort window closed; that cell then runs and finds no result (NameError), or builds
    # the model again and stops with the same one line.
    assert all(e["ename"] == "NameError" or e["traceback"] == errors[0]["traceback"] for e in errors[1:]), errors
    cell = browser.execute_script(_CELL_NODE, FIRST_RUN[name])
    shown = cell.find_element(By.CSS_SELECTOR, "[data-mime-type='application/vnd.jupyter.stderr']")
    assert len([line for line in shown.text.splitlines() if line.strip()]) == 1, shown.text

    _type(browser, "model", str(model))
    if "data" in labels:
        _type(browser, "data", str(text))
    browser.save_screenshot(str(ARTIFACTS / f"{Path(name).stem}_panel.png"))
    cells = _run_all(browser, 900)
    browser.save_screenshot(str(ARTIFACTS / f"{Path(name).stem}_run_all.png"))
    assert [o for _, _, outs in cells for o in outs if o["output_type"] == "error"] == []
    assert all(count is not None for _, count, _ in cells)  # every cell ran
    for noise in ("attention_mask", "Loading weights", "Traceback"):  # nothing a user can't act on
        assert noise not in _streams(cells), noise
    source, _, outputs = cells[-1]
    assert source.startswith("summary(")
    summary = "".join(o.get("data", {}).get("text/plain", "") for o in outputs)
    assert f"model: {model}" in summary and f"tokenizer: {model}" in summary, summary
    assert "model checks: " in summary and " · benchmark verdicts: " in summary
    if "data" in labels:
        assert "data: text file notes.txt" in summary, summary
