"""The notebooks' shape: what nbval and Colab rely on, checked without running a kernel
(nbval runs them: pytest --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/sanitize.cfg notebooks/)."""
import re
from pathlib import Path

import nbformat
import pytest
from nbval.plugin import get_sanitize_patterns

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ["tier1_smoke.ipynb", "tier2_analysis.ipynb", "tier3_training.ipynb"]
REPO_URL = re.search(r'REPO_URL="\$\{TIER_UTILS_REPO_URL:-https://github\.com/([^}]+)\}"',
                     (ROOT / "colab_setup.sh").read_text()).group(1)


def load(name):
    return nbformat.read(ROOT / "notebooks" / name, as_version=4)


def code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_with_outputs_from_one_top_to_bottom_run(name):
    cells = code_cells(load(name))
    assert [c.execution_count for c in cells] == list(range(1, len(cells) + 1))
    assert all(o.output_type != "error" for c in cells for o in c.outputs)
    checked = [c for c in cells if c.source.startswith("# NBVAL_CHECK_OUTPUT")]
    assert checked and all(c.outputs for c in checked)  # nbval has a reference for every checked cell


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_cell_order_setup_parameters_widgets_then_short_run_cells(name):
    nb = load(name)
    cells = code_cells(nb)
    assert "colab_setup.sh" in cells[0].source and "google.colab" in cells[0].source
    assert cells[1].metadata.get("tags") == ["parameters"]
    assert "config_panel(cfg, tier=" in cells[2].source
    for cell in cells:
        assert "clear_output" not in cell.source
        assert len(cell.source.splitlines()) <= 15, cell.source  # logic belongs in the package
    # Run cells read the config only: the panel's values, not the parameters, reach the run.
    for cell in cells[3:]:
        assert not re.search(r"\b(PRECISION|BATCH_SIZE|MODEL)\b", cell.source), cell.source


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_colab_badge_and_setup_use_the_one_repository(name):
    nb = load(name)
    badge = f"https://colab.research.google.com/github/{REPO_URL}/blob/main/notebooks/{name}"
    assert badge in nb.cells[0].source
    found = set(re.findall(r"github(?:usercontent)?\.com/(?:github/)?([\w.-]+/[\w.-]+)/",
                           "\n".join(c.source for c in nb.cells)))
    assert found == {REPO_URL}


def test_sanitizer_masks_timings_rates_addresses_and_dates():
    patterns = get_sanitize_patterns((ROOT / "notebooks" / "sanitize.cfg").read_text())  # nbval's own parser
    assert len(patterns) == 5
    text = ("12.5 ms, 3 s, 1,234 tokens/s, 7.2it/s at 0x7f3a9c at 2026-01-02T03:04:05+00:00; "
            "50%|###  | 10/20 [00:01<00:01]")
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    assert text == "TIME, TIME, RATE, RATE at ADDRESS at DATE; PROGRESS"


# Words that name a machine or what it runs natively. A checked cell's saved output is compared on every
# machine CI may get (any CPU, a GPU), so none of these may appear in one.
MACHINE_WORDS = re.compile(r"avx\d*|amx_|EPYC|Xeon|Intel|AMD|NVIDIA|Tesla|H100|A100|\bT4\b|compute capability|"
                           r"this CPU|\bcuda\b|native", re.I)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_checked_outputs_name_no_machine(name):
    for cell in code_cells(load(name)):
        if not cell.source.startswith("# NBVAL_CHECK_OUTPUT"):
            continue
        text = "".join(o.get("text", "") + o.get("data", {}).get("text/plain", "") for o in cell.outputs)
        assert not MACHINE_WORDS.search(text), (cell.source, text)
        assert "resolve_precision(\"auto\"" not in cell.source  # auto's choice is a device fact


# An absolute path of the machine that ran the notebook (a checkout, a temporary folder, a home, Colab's /content,
# a Windows drive); a notebook's own relative paths (runs/tier3/...) are fine.
MACHINE_PATH = re.compile(r"(?<![\w.~-])(?:/(?:home|work|tmp|root|Users|usr|opt|content|var|mnt|private|srv|data)/"
                          r"[^\s'\"<>]+|[A-Za-z]:\\[^\s'\"<>]+)")


def _output_text(output) -> str:
    data = output.get("data", {})
    return output.get("text", "") + "".join(
        v if isinstance(v, str) else "".join(v) for k, v in data.items() if k.startswith("text/"))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_no_saved_output_shows_a_machine_path(name):
    """A saved warning once showed the checkout that ran the notebook (/work/wt/vision-analysis/tier_utils/...)."""
    found = [(i, m.group(0)) for i, cell in enumerate(code_cells(load(name))) for o in cell.outputs
             for m in MACHINE_PATH.finditer(_output_text(o))]
    assert not found, found


def test_the_machine_path_check_sees_paths():
    warning = {"output_type": "stream", "name": "stderr",
               "text": "/work/wt/x/tier_utils/tasks/seq2seq.py:82: UserWarning: cut\n"}
    page = {"output_type": "display_data", "data": {"text/html": "<a href='C:\\Users\\me\\run'>run</a>"}}
    assert [MACHINE_PATH.search(_output_text(o)) is not None for o in (warning, page)] == [True, True]
    assert MACHINE_PATH.search("runs/tier3/model.pt2 and </td></tr>") is None


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_run_cells_pass_the_panels_configs_and_copy_no_setting_by_hand(name):
    """A tier call takes its settings from the panel's config (cfg.smoke_config(), cfg.train_config(), ...):
    none of the config's fields is copied into a tier keyword, where it would be declared a second time."""
    import ast

    calls = [node for cell in code_cells(load(name)) if "tier_utils." in cell.source
             for node in ast.walk(ast.parse("\n".join(line for line in cell.source.splitlines()
                                                       if not line.lstrip().startswith(("!", "%")))))
             if isinstance(node, ast.Call) and ast.unparse(node.func).startswith("tier_utils.")]
    tiers = [c for c in calls if ast.unparse(c.func).split(".")[1] in
             {"smoke", "analyze", "train", "fit", "amp_benchmark", "search"}]
    assert tiers
    for call in tiers:
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            text = ast.unparse(arg)
            assert not text.startswith("cfg.") or text in ("cfg.data", "cfg.build_model()") \
                or re.fullmatch(r"cfg\.\w+_config\(.*\)", text), (name, ast.unparse(call))


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_first_cell_says_run_all_and_the_last_sums_up(name):
    """A freshly opened notebook shows no panel (its state isn't saved where JupyterLab draws it): the first cell
    says what to do. The last cell shows what ran, the verdict line and the files written."""
    nb = load(name)
    assert "Run All" in nb.cells[0].source and "panel appears" in nb.cells[0].source
    last = code_cells(nb)[-1]
    assert last.source.startswith("summary(cfg, {") and "runs/tier" in last.source
    shown = "".join(o.get("data", {}).get("text/plain", "") for o in last.outputs)
    assert "model checks: " in shown and " · benchmark verdicts: " in shown and "index.html" in shown


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_no_markdown_states_the_default_runs_facts(name):
    """Facts about the model or data are printed from the run (tier_utils.notebook.about), not written for the
    default model: a user's GPT-2 folder does not start at ln(256) or train on CPython's docs."""
    text = "\n".join(c.source for c in load(name).cells if c.cell_type == "markdown")
    for stale in ("ln(256)", "5.5", "CPython's docs", "validation split of the bundled corpus"):
        assert stale not in text, stale
    assert any("print(about(cfg," in c.source for c in code_cells(load(name)))
