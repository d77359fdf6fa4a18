"""colab_setup.sh, run for real with `pip` replaced by a stub that only records what it was asked."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "colab_setup.sh"

FAKE_PIP = """#!/bin/sh
echo "pip $*" >> "$PIP_LOG"
prev=""
for arg in "$@"; do
    if [ "$prev" = "-c" ]; then sed 's/^/constraint /' "$arg" >> "$PIP_LOG"; fi
    prev="$arg"
done
"""


@pytest.fixture
def env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text(FAKE_PIP)
    (bin_dir / "pip").chmod(0o755)
    log = tmp_path / "pip.log"
    log.touch()
    path = os.pathsep.join([str(bin_dir), str(Path(sys.executable).parent), os.environ["PATH"]])
    # The stub pip installs nothing, so the fixture puts what a real install would: tier_utils's metadata
    # (nothing missing; a test may put other metadata first) and the package, from this checkout. Both
    # absolute, so they hold from any working directory, whether or not tier_utils is pip-installed here.
    installed = tmp_path / "installed"
    (installed / "tier_utils-0.1.0.dist-info").mkdir(parents=True)
    (installed / "tier_utils-0.1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tier_utils\nVersion: 0.1.0\n")
    # The environment's own PYTHONPATH stays after them (the dependencies may live there), made absolute.
    inherited = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    pythonpath = os.pathsep.join([str(installed), str(ROOT), *inherited])
    return {**os.environ, "PATH": path, "PIP_LOG": str(log), "PYTHON": sys.executable,
            "PYTHONPATH": pythonpath}, log


def run_setup(script, cwd, env):
    proc = subprocess.run(["bash", str(script)], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def pip_installs(log: Path) -> list[str]:
    return [line for line in log.read_text().splitlines() if line.startswith("pip install")]


def test_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_outside_a_checkout_it_clones_once_then_updates(tmp_path, env):
    env, log = env
    upstream = tmp_path / "upstream"
    (upstream / "tier_utils").mkdir(parents=True)
    (upstream / "pyproject.toml").write_text("[project]\nname = 'tier_utils'\n")
    (upstream / "tier_utils" / "__init__.py").write_text("")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(upstream)]
    subprocess.run(["git", "init", "-q", str(upstream)], check=True)
    subprocess.run(git + ["add", "."], check=True)
    subprocess.run(git + ["commit", "-qm", "init"], check=True)
    work = tmp_path / "content"
    work.mkdir()
    shutil.copy(SCRIPT, work)  # a lone script, as after downloading it into a Colab runtime
    env["TIER_UTILS_REPO_URL"] = str(upstream)

    first = run_setup(work / "colab_setup.sh", work, env)
    clone = work / "tier_utils"
    assert f"cloning {upstream}" in first and (clone / ".git").is_dir()
    (clone / "kept.txt").write_text("a re-clone would delete me")
    second = run_setup(work / "colab_setup.sh", work, env)
    assert "updating" in second and "cloning" not in second
    assert (clone / "kept.txt").exists()
    assert pip_installs(log) == [f"pip install -q --no-deps {clone}"] * 2
    # The last step is `python -m tier_utils info`: the device and the auto precision with its reason.
    assert "reason" in second and "auto:" in second


def test_installs_only_missing_dependencies_never_torch_or_numpy(tmp_path, env):
    env, log = env
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    shutil.copy(SCRIPT, checkout)
    shutil.copy(ROOT / "pyproject.toml", checkout)
    (checkout / "tier_utils").mkdir()
    # Installed metadata asking for too-new torch/numpy/pandas, a missing package and a test extra.
    dist = tmp_path / "site" / "tier_utils-0.1.0.dist-info"
    dist.mkdir(parents=True)
    requires = ["torch>=999", "numpy>=999", "pandas>=999", "tqdm>=4", "no-such-dist-xyz>=1.0",
                'pytest>=999; extra == "test"']
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tier_utils\nVersion: 0.1.0\n"
                                   + "".join(f"Requires-Dist: {r}\n" for r in requires))
    env["PYTHONPATH"] = os.pathsep.join([str(dist.parent), env["PYTHONPATH"]])

    out = run_setup(checkout / "colab_setup.sh", tmp_path, env)
    assert "cloning" not in out and "updating" not in out  # inside a checkout: installs that checkout
    installs = pip_installs(log)
    assert installs[0] == f"pip install -q --no-deps {checkout}"
    assert installs[1].startswith("pip install -q -c ")
    assert installs[1].split()[5:] == ["pandas>=999", "no-such-dist-xyz>=1.0"]
    assert len(installs) == 2
    constraints = [line.split()[1] for line in log.read_text().splitlines() if line.startswith("constraint")]
    assert sorted(c.split("==")[0] for c in constraints) == ["numpy", "torch"]
    asked = " ".join(installs)
    assert "torch" not in asked and "numpy" not in asked and " -e " not in asked


def test_colab_verb_points_badges_and_setup_at_a_fork(tmp_path, capsys):
    from tier_utils.cli import main

    for name in ("colab_setup.sh", "README.md", "notebooks"):
        (shutil.copytree if (ROOT / name).is_dir() else shutil.copy2)(ROOT / name, tmp_path / name)
    old = re.search(r"github\.com/([\w.-]+/[\w.-]+)\}", (tmp_path / "colab_setup.sh").read_text()).group(1)
    assert main(["colab", "--repo", "alice/tu-fork", "--root", str(tmp_path)]) == 0
    assert "point at alice/tu-fork" in capsys.readouterr().out
    setup = (tmp_path / "colab_setup.sh").read_text()
    assert "https://github.com/alice/tu-fork}" in setup and os.access(tmp_path / "colab_setup.sh", os.X_OK)
    for nb in (tmp_path / "notebooks").glob("*.ipynb"):
        text = nb.read_text()
        assert f"colab.research.google.com/github/alice/tu-fork/blob/main/notebooks/{nb.name}" in text
        assert "raw.githubusercontent.com/alice/tu-fork/main/colab_setup.sh" in text and old not in text
        json.loads(text)  # still a notebook
    assert "colab.research.google.com/github/alice/tu-fork/" in (tmp_path / "README.md").read_text()
    assert main(["colab", "--repo", "not a repo", "--root", str(tmp_path)]) == 2
    assert "USER/NAME" in capsys.readouterr().err
