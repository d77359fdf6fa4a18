"""The CPU load and the torch thread count chosen from it: fewer threads when other jobs hold the cores,
the user's own choice (OMP_NUM_THREADS, torch.set_num_threads) always kept, and every result saying why."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tier_utils.core.measure import Load, choose_threads, decide_threads, threads_note, usable_cores
from tier_utils.core.results import run_metadata

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("load,threads,said", [
    (Load(0.3, 4), 4, "4 torch threads, one per core (load 0.3 on 4 cores)"),
    (Load(1.6, 4), 2, "2 torch threads, not 4: other jobs leave 2 cores free (load 1.6 on 4 cores)"),
    (Load(9.0, 4), 1, "1 torch thread, not 4: other jobs leave no core free (load 9.0 on 4 cores)"),
    (Load(None, 4), 4, "4 torch threads, one per core (load unknown on 4 cores)"),
])
def test_threads_follow_the_cores_other_jobs_leave_free(load, threads, said):
    choice = choose_threads(4, load, {})
    assert choice.threads == threads and choice.reason.startswith(said)


def test_the_users_own_thread_count_wins():
    busy = Load(9.0, 4)
    env = choose_threads(4, busy, {"OMP_NUM_THREADS": "4"})
    assert env.threads == 4 and env.reason == "4 torch threads: OMP_NUM_THREADS=4 is set (load 9.0 on 4 cores)"
    # torch's default is one thread per usable core: any other count was set before tier_utils started
    preset = choose_threads(3, busy, {})
    assert preset.threads == 3 and "set before tier_utils started, kept" in preset.reason
    assert choose_threads(1, Load(9.0, 1), {}).reason.startswith("1 torch thread, one per core")


def test_a_later_torch_set_num_threads_is_what_results_report():
    chosen = decide_threads().threads
    meta = run_metadata("cpu")
    assert meta["threads"] == torch.get_num_threads() and meta["threads_reason"] == threads_note()
    try:
        torch.set_num_threads(chosen + 1)
        assert threads_note() == f"{chosen + 1} torch threads: set by torch.set_num_threads after tier_utils chose " \
                                 f"{chosen}"
        assert run_metadata("cpu")["threads"] == chosen + 1
    finally:
        torch.set_num_threads(chosen)


def _started(env: dict) -> tuple[str, str]:
    """A fresh process's torch thread count and reason, started on a machine whose load is 99 (other jobs
    hold every core), with no thread variable of this process's but those in `env`."""
    code = "import os\nos.getloadavg = lambda: (99.0, 99.0, 99.0)\nimport tier_utils, torch\n" \
           "from tier_utils.core.measure import threads_note\nprint(torch.get_num_threads(), threads_note(), sep='|')"
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**clean, "PYTHONPATH": str(ROOT), **env})
    assert run.returncode == 0, run.stderr
    return tuple(run.stdout.strip().split("|"))


def test_a_process_starting_on_a_busy_machine_takes_fewer_threads_unless_told():
    cores = usable_cores()
    load = f"load 99.0 on {cores} core{'s' if cores != 1 else ''}"
    threads, reason = _started({})
    assert threads == "1" and reason.startswith("1 torch thread") and load in reason
    assert (f"not {cores}: other jobs leave no core free" in reason) == (cores > 1)
    assert _started({"OMP_NUM_THREADS": "2"}) == ("2", f"2 torch threads: OMP_NUM_THREADS=2 is set ({load})")
