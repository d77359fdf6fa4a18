"""CLI conventions shared by every verb: exit codes, one-line errors, --json only on success."""
import json
import subprocess
import sys

import pytest

from tier_utils.cli import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "tier_utils", *args], capture_output=True, text=True, timeout=120)


def test_info_prints_decision_and_writes_json(tmp_path):
    out = tmp_path / "info.json"
    assert main(["info", "--model", "tiny-encoder", "--model-arg", "num_classes=3", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data) == {"environment", "precision", "model"}
    assert data["model"]["task"] == "classification" and data["model"]["num_classes"] == 3
    assert data["precision"]["reason"] and data["environment"]["torch"]


@pytest.mark.parametrize("args,needle", [
    (["info", "--precision", "fp8"], "unknown precision 'fp8'"),
    (["info", "--model", "missing.py:Net"], "not found"),
    (["info", "--model-arg", "oops"], "expected KEY=VALUE"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, needle):
    out = tmp_path / "x.json"
    result = run_cli(*args, "--json", str(out)) if args[0] == "info" else run_cli(*args)
    assert result.returncode == 2
    lines = [l for l in result.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("error:")
    assert not out.exists()  # nothing half-written


def test_slow_precision_warning_is_one_line(capsys):
    from tier_utils import precision

    precision._slow_warned.clear()
    assert main(["info", "--precision", "fp16", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    from tier_utils.precision import native_support
    import torch
    if not native_support("fp16", torch.device("cpu"))[0]:
        assert err.startswith("warning: fp16 requested: runs, but") and err.count("\n") == 1
