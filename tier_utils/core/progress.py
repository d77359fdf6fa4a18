"""Progress bars only where someone watches them: a redrawn bar in a terminal or a notebook widget;
plain, throttled lines when the output is a file or a pipe (a redrawn bar there is one endless line)."""
from __future__ import annotations

import sys
import time

from tqdm import tqdm as _std_tqdm

# A log gets at most one line per this many seconds per bar, plus its first and last state.
LOG_INTERVAL_S = 15.0
_LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} {unit} [{elapsed}<{remaining}{postfix}]"


def _in_notebook() -> bool:
    """True in a Jupyter kernel with ipywidgets, where tqdm.auto picks its widget bar (tqdm.auto, not
    tqdm.autonotebook, which warns on import in a notebook)."""
    from tqdm.auto import tqdm as chosen

    return any(c.__module__ == "tqdm.notebook" for c in chosen.__mro__)


class _LogLines(_std_tqdm):
    """A tqdm whose display is one newline-terminated line, never a carriage-return redraw, at most one
    per LOG_INTERVAL_S: the throttle sits here because postfix updates and tqdm's monitor thread
    refresh the bar outside its own `mininterval`."""

    _shown_at, _shown_n = None, None

    def display(self, msg=None, pos=None, force=False):
        if msg == "":  # tqdm clearing the bar: there is nothing on screen to clear
            return False
        now = time.monotonic()
        if not force and self._shown_at is not None and now - self._shown_at < LOG_INTERVAL_S:
            return True
        self._shown_at, self._shown_n = now, self.n
        self.fp.write((msg if msg is not None else str(self)).strip() + "\n")
        self.fp.flush()
        return True

    def close(self):
        if not self.disable and self._shown_n != self.n:
            self.display(force=True)  # the final state, even inside the throttle interval
        super().close()


def progress_bar(iterable=None, *, enabled: bool = True, **kwargs):
    """A tqdm for `iterable` (or `total=`): the notebook widget in Jupyter, the usual bar on a terminal,
    `_LogLines` when the stream is redirected, nothing when `enabled` is False."""
    if not enabled:
        return _std_tqdm(iterable, disable=True, **kwargs)
    if _in_notebook():
        from tqdm.auto import tqdm as notebook_tqdm

        return notebook_tqdm(iterable, **kwargs)
    stream = kwargs.get("file") or sys.stderr
    if getattr(stream, "isatty", lambda: False)():
        return _std_tqdm(iterable, **kwargs)
    kwargs.setdefault("unit", "it")
    return _LogLines(iterable, mininterval=LOG_INTERVAL_S, bar_format=_LOG_FORMAT, leave=False, **kwargs)


def interactive() -> bool:
    """Whether a redrawn bar has somewhere to draw (for libraries with their own bar, e.g. Optuna)."""
    return _in_notebook() or sys.stderr.isatty()
