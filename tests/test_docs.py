"""Every `python` and `bash` block in README.md and docs/*.md runs, on CPU and offline, so a doc example that
breaks fails CI. A block whose first line is `# docs-test: skip (reason)` (a GPU, the network, a server) is
skipped with that reason.

The blocks of one page run in order in one temporary folder, the python blocks in one namespace (a later block
may use what an earlier one made). A bash block runs line by line with this venv's python first on PATH and the
checkout importable; a `python -m tier_utils VERB ...` line calls the CLI's `main` in this process (the same
parsing, checks and exit codes, without a second torch import per line) and may exit 0 or 1 (1: a check
FAILed, which is the verb's finding, not a broken example); any other line must exit 0.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from tier_utils.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^( *)```(\w*)\s*$")
_SKIP = re.compile(r"^#\s*docs-test:\s*skip\s*\((.+)\)\s*$")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str

    @property
    def skip(self) -> str | None:
        first = self.code.lstrip().splitlines()[0] if self.code.strip() else ""
        found = _SKIP.match(first.strip())
        return found.group(1) if found else None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page.name}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The python and bash blocks of a markdown page, dedented (a block may sit in a list item)."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        if opening.group(2) in ("python", "bash"):
            found.append(Block(page, i + 1, opening.group(2), textwrap.dedent("\n".join(lines[i + 1:end]))))
        i = end + 1
    return found


@dataclass
class PageRun:
    """One page's blocks run in order, in one folder and one namespace."""

    folder: Path
    namespace: dict = field(default_factory=lambda: {"__name__": "__docs__"})
    done: int = 0

    def run(self, block: Block) -> None:
        here = Path.cwd()
        os.chdir(self.folder)
        try:
            if block.lang == "python":
                exec(compile(block.code, block.where, "exec"), self.namespace)  # noqa: S102 the docs' own code
            else:
                for line in _commands(block.code):
                    _run_line(line, self.folder, block.where)
        finally:
            os.chdir(here)
            plt.close("all")


def _commands(code: str) -> list[str]:
    """The bash block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = code.replace("\\\n", " ")
    return [line for line in joined.splitlines() if shlex.split(line, comments=True)]


def _run_line(line: str, folder: Path, where: str) -> None:
    words = shlex.split(line, comments=True)
    env = {}
    while words and _ASSIGNMENT.match(words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[:3] == ["python", "-m", "tier_utils"] and not set("|&;<>") & set(line.split("#")[0]):
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            code = main(words[3:])
        except SystemExit as exc:  # argparse: a bad option
            code = exc.code
        finally:
            for k, v in before.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        assert code in (0, 1), f"{where}: `{line.strip()}` exited {code}"
        return
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    run = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", line], cwd=folder, capture_output=True, text=True,
                         env={**os.environ, "PATH": path, "PYTHONPATH": str(ROOT), **env}, timeout=300)
    assert run.returncode == 0, f"{where}: `{line.strip()}` exited {run.returncode}: {run.stderr[-2000:]}"


_RUNS: dict[Path, PageRun] = {}


def _page_run(page: Path, tmp_path_factory) -> PageRun:
    if page not in _RUNS:
        _RUNS[page] = PageRun(tmp_path_factory.mktemp(page.stem))
    return _RUNS[page]


ALL = [b for page in PAGES for b in blocks(page)]


@pytest.mark.parametrize("block", ALL, ids=lambda b: b.where)
def test_the_docs_code_runs(block, tmp_path_factory):
    if block.skip:
        pytest.skip(block.skip)
    run = _page_run(block.page, tmp_path_factory)
    earlier = [b for b in blocks(block.page) if b.line < block.line and not b.skip]
    for b in earlier[run.done:]:  # a block selected alone (-k) gets the blocks before it first
        run.run(b)
    run.run(block)
    run.done = len(earlier) + 1


def test_the_readme_is_a_front_page_whose_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#]+?\.md)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).is_file(), f"{page.name} links to {target}, which is not there"
    assert {p.name for p in PAGES[1:]} <= set(re.findall(r"docs/([\w-]+\.md)", readme))


BROKEN = """# A broken page

```python
x = 1
```

```python
# docs-test: skip (needs a GPU)
raise RuntimeError("never runs")
```

```python
assert x == 2, "x is 1"
```

```bash
python -m tier_utils smoke --no-such-option
```

```bash
false
```
"""


def test_a_broken_copy_fails_and_says_where(tmp_path, capsys):
    page = tmp_path / "broken.md"
    page.write_text(BROKEN)
    found = blocks(page)
    assert [(b.line, b.lang, b.skip) for b in found] == [(3, "python", None), (7, "python", "needs a GPU"),
                                                         (12, "python", None), (16, "bash", None),
                                                         (20, "bash", None)]
    run = PageRun(tmp_path)
    run.run(found[0])
    with pytest.raises(AssertionError, match="x is 1"):
        run.run(found[2])
    with pytest.raises(AssertionError, match=r"broken.md:16: `python -m tier_utils smoke --no-such-option` exited 2"):
        run.run(found[3])
    with pytest.raises(AssertionError, match=r"broken.md:20: `false` exited 1"):
        run.run(found[4])
    # and the real pages' blocks are what the test above runs
    assert {b.page for b in ALL} >= {ROOT / "README.md", ROOT / "docs" / "tier1-smoke.md"}
