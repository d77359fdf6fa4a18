"""Progress output: a redrawn bar only where someone watches, plain short lines in a log."""
import io

from tqdm import tqdm

from tier_utils.core import progress
from tier_utils.core.progress import progress_bar


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_redirected_bar_writes_a_few_plain_lines(monkeypatch):
    monkeypatch.setattr(progress, "_in_notebook", lambda: False)
    log = io.StringIO()
    with progress_bar(total=1000, desc="train", unit="step", file=log) as bar:
        for _ in range(1000):
            bar.update()
    text = log.getvalue()
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    # first and last state; the 998 updates between fall inside the throttle interval
    assert len(lines) == 2 and lines[0].startswith("train: 0/1000 step") and lines[1].startswith("train: 1000/1000")


def test_a_terminal_gets_the_redrawn_bar_and_disabled_writes_nothing(monkeypatch):
    monkeypatch.setattr(progress, "_in_notebook", lambda: False)
    screen = Terminal()
    with progress_bar(range(3), desc="smoke", file=screen) as bar:
        assert type(bar) is tqdm
        list(bar)
    assert "\r" in screen.getvalue()
    quiet = io.StringIO()
    list(progress_bar(range(3), enabled=False, file=quiet))
    assert quiet.getvalue() == ""


def test_postfix_refreshes_do_not_bypass_the_throttle(monkeypatch):
    monkeypatch.setattr(progress, "_in_notebook", lambda: False)
    log = io.StringIO()
    with progress_bar(["shapes", "gradients", "memory"], desc="smoke", file=log) as bar:
        for name in bar:
            bar.set_postfix_str(name)  # refreshes the display at once on a terminal
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and lines[-1].startswith("smoke: 3/3")
