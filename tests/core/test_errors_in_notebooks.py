"""A TierError in a notebook reads as the CLI's one line; tier_utils.debug() or TIER_UTILS_DEBUG=1 bring the
traceback back."""
import pytest
from IPython.core.interactiveshell import InteractiveShell

import tier_utils
from tier_utils.core.errors import ModelSpecError


@pytest.fixture
def shell(monkeypatch, capsys):
    monkeypatch.delenv("TIER_UTILS_DEBUG", raising=False)
    yield InteractiveShell.instance()
    tier_utils.debug(None)
    InteractiveShell.clear_instance()


def _shown(shell, capsys, code: str) -> list[str]:
    shell.run_cell(code)
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]


def test_a_tier_error_is_one_line_and_debug_shows_the_traceback(shell, capsys, monkeypatch):
    code = "import tier_utils; tier_utils.load_model('/no/such/folder')"
    lines = _shown(shell, capsys, code)
    assert len(lines) == 1 and "error: " in lines[0] and "/no/such/folder" in lines[0], lines
    assert "Traceback" not in lines[0]
    tier_utils.debug(True)
    assert len(_shown(shell, capsys, code)) > 5  # the whole traceback, frames included
    tier_utils.debug(None)  # back to the environment variable
    monkeypatch.setenv("TIER_UTILS_DEBUG", "1")
    assert len(_shown(shell, capsys, code)) > 5
    monkeypatch.setenv("TIER_UTILS_DEBUG", "0")
    assert len(_shown(shell, capsys, code)) == 1
    monkeypatch.setenv("TIER_UTILS_DEBUG", "1")
    tier_utils.debug(False)  # said in the notebook: it wins over the environment
    assert len(_shown(shell, capsys, code)) == 1


def test_the_line_names_the_fix():
    error = ModelSpecError("model.pt does not exist; check the path")
    (line,) = error._render_traceback_()
    assert "check the path" in line and "ModelSpecError" in line
