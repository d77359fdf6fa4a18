"""Point a checkout's Colab badges and `colab_setup.sh` at a fork, in one step:
`python -m tier_utils colab --repo USER/NAME`, then commit and push the changed files."""
from __future__ import annotations

import re
from pathlib import Path

from .core.files import atomic_write_bytes

SETUP = "colab_setup.sh"
# The one place the repository is declared; the badges and the notebooks' curl line follow it.
_DECLARED = re.compile(r'(REPO_URL="\$\{TIER_UTILS_REPO_URL:-https://github\.com/)([\w.-]+/[\w.-]+)(\}")')
_REPO = re.compile(r"[\w.-]+/[\w.-]+")


def point_at(repo: str, root=".") -> list[Path]:
    """Replace the repository in colab_setup.sh, README.md's badge and every notebook's badge and setup
    line under `root` with `repo` ("USER/NAME" on GitHub). Returns the files it changed."""
    if not _REPO.fullmatch(repo):
        raise ValueError(f"--repo must be USER/NAME as on GitHub (e.g. alice/tier_utils), got {repo!r}")
    root = Path(root)
    setup = root / SETUP
    if not setup.is_file():
        raise ValueError(f"no {SETUP} in {root.resolve()}; run this in the root of your checkout (or pass --root)")
    declared = _DECLARED.search(setup.read_text())
    if declared is None:
        raise ValueError(f"{SETUP} has no REPO_URL=\"${{TIER_UTILS_REPO_URL:-https://github.com/USER/NAME}}\" line; "
                         "restore it from the upstream repository")
    old = declared.group(2)
    # Colab badge (colab.research.google.com/github/OLD/) and raw script (raw.githubusercontent.com/OLD/).
    link = re.compile(r"((?:colab\.research\.google\.com/github|github(?:usercontent)?\.com)/)" + re.escape(old) + "/")
    changed = []
    for path in [setup, root / "README.md", *sorted((root / "notebooks").glob("*.ipynb"))]:
        if not path.is_file():
            continue
        text = path.read_text()
        new = link.sub(lambda m: m.group(1) + repo + "/", text)
        if path == setup:
            new = _DECLARED.sub(lambda m: m.group(1) + repo + m.group(3), new)
        if new != text:
            mode = path.stat().st_mode
            atomic_write_bytes(path, new.encode())
            path.chmod(mode)  # colab_setup.sh stays executable
            changed.append(path)
    return changed
