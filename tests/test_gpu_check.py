"""bench/gpu_check.sh, the prepared check for a GPU machine: on a machine without one it says so and exits 2,
and its steps' time caps keep the whole under 7 minutes (docs/testing.md)."""
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh"


def test_without_a_gpu_it_says_so_and_exits_2(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}  # no GPU, even on a GPU machine
    done = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "gpu_check: no GPU here (torch.cuda.is_available() is False): run it on a machine with a CUDA GPU"]
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_the_steps_caps_keep_it_under_seven_minutes_with_fit_alone_and_last():
    steps = re.findall(r"^step (\w+) (\d+) ", SCRIPT.read_text(), re.M)
    assert [name for name, _ in steps] == ["info", "suite", "notebooks", "all", "bench", "gpu_mfu", "fit"]
    kill_grace = int(re.search(r"timeout -s INT -k (\d+)", SCRIPT.read_text()).group(1))
    first_checks = 15  # torch imported twice (is there a GPU; which tools), before the first step
    assert sum(int(cap) + kill_grace for _, cap in steps) + first_checks <= 7 * 60
