"""The torch thread count of a run: chosen as the run starts from the CPU time other processes use now (not at
import, not from the load average), the caller's count back afterwards, the user's own choice (OMP_NUM_THREADS,
torch.set_num_threads) always kept, a resume on its checkpoint's count, and every result saying why."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny import TINY

from tier_utils import info
from tier_utils.core import threads
from tier_utils.core.measure import usable_cores
from tier_utils.core.results import run_metadata
from tier_utils.core.threads import Busy, choose_threads, others_busy, resume_threads, run_threads, threads_note

ROOT = Path(__file__).resolve().parents[2]
CORES = usable_cores()
# A CPU-bound process that ends itself, so it can't outlive the test.
SPIN = "import time\nend = time.monotonic() + 60\nwhile time.monotonic() < end:\n    pass\n"


def _never():
    raise AssertionError("sampled the CPU although the user chose the thread count")


@pytest.mark.parametrize("busy,chosen,said", [
    (Busy(0.3, 4), 4, "4 torch threads, one per core (other processes busy on 0.3 of 4 cores)"),
    (Busy(1.6, 4), 2, "2 torch threads, not 4: other processes leave 2 cores free (other processes busy on 1.6 of 4 "
                      "cores); OMP_NUM_THREADS=N overrides"),
    (Busy(9.0, 4), 1, "1 torch thread, not 4: other processes leave no core free"),
    (Busy(None, 4), 4, "4 torch threads, one per core (other processes' CPU use unknown on 4 cores)"),
])
def test_threads_follow_the_cores_other_processes_leave_free(busy, chosen, said):
    choice = choose_threads(4, {}, lambda: busy, default=4)
    assert choice.threads == chosen and choice.reason.startswith(said) and not choice.users


def test_the_users_own_thread_count_wins_without_a_sample():
    env = choose_threads(4, {"OMP_NUM_THREADS": "4"}, _never, default=4)
    assert (env.threads, env.reason, env.users) == (4, "4 torch threads: OMP_NUM_THREADS=4 is set", True)
    # torch's default is one thread per usable core: any other count was set by torch.set_num_threads
    before = choose_threads(3, {}, _never, default=4)
    assert before.threads == 3 and before.users and "set by torch.set_num_threads before the run, kept" in before.reason
    assert choose_threads(1, {}, lambda: Busy(9.0, 1), default=1).reason.startswith("1 torch thread, one per core")


def test_importing_the_package_leaves_the_thread_count_alone():
    """Even on a machine whose load average says every core is taken (the old rule's trigger)."""
    code = "import os\nos.getloadavg = lambda: (99.0, 99.0, 99.0)\n" \
           "import torch; n = torch.get_num_threads(); import tier_utils; assert torch.get_num_threads() == n, n"
    clean = {k: v for k, v in os.environ.items() if k not in threads.THREAD_ENV}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**clean, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.fixture
def torch_default(monkeypatch):
    """torch's own count (one thread per usable core) and no thread variable: the choice is tier_utils'."""
    for name in threads.THREAD_ENV:
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(CORES)
    yield
    torch.set_num_threads(before)


def test_a_run_chooses_as_it_starts_and_a_second_run_chooses_afresh(torch_default, monkeypatch):
    samples = [Busy(CORES, CORES), Busy(0.0, CORES)]  # a busy machine, then an idle one
    monkeypatch.setattr(threads, "others_busy", lambda: samples.pop(0))
    with run_threads() as first:
        assert first.threads == torch.get_num_threads() == 1 and not first.users
        with run_threads() as inner:  # a tier inside the main job keeps the job's count: no second sample
            assert inner is first
    assert torch.get_num_threads() == CORES  # the caller's count is back: tier_utils left nothing behind
    with run_threads() as second:  # not mistaken for a user's choice: the package's own count is gone
        assert second.threads == torch.get_num_threads() == CORES and second.reason.startswith(
            f"{CORES} torch thread{'s' if CORES != 1 else ''}, one per core")
    assert samples == []


def test_results_say_the_runs_count_and_why(torch_default, monkeypatch):
    monkeypatch.setattr(threads, "others_busy", lambda: Busy(float(CORES), CORES))
    environment = info("tiny-gpt", model_kwargs=TINY).to_json()["environment"]
    assert environment["threads"] == 1 and environment["threads_reason"].startswith("1 torch thread")
    assert f"busy on {CORES:.1f} of {CORES} core" in environment["threads_reason"]
    assert torch.get_num_threads() == CORES


def test_a_torch_set_num_threads_inside_a_run_is_what_results_report(torch_default, monkeypatch):
    monkeypatch.setattr(threads, "others_busy", lambda: Busy(0.0, CORES))
    with run_threads() as chosen:
        assert run_metadata("cpu")["threads_reason"] == threads_note() == chosen.reason
        torch.set_num_threads(chosen.threads + 1)
        assert threads_note() == f"{chosen.threads + 1} torch threads: set by torch.set_num_threads after " \
                                 f"tier_utils chose {chosen.threads}"
        assert run_metadata("cpu")["threads"] == chosen.threads + 1
    assert threads_note().endswith("(outside a tier_utils run)")


def test_a_resume_takes_its_checkpoints_count_unless_the_user_chose(torch_default, monkeypatch):
    monkeypatch.setattr(threads, "others_busy", lambda: Busy(float(CORES), CORES))
    with run_threads():
        resume_threads(CORES, 6)
        assert torch.get_num_threads() == CORES
        assert threads_note().startswith(f"{CORES} torch thread") and "as the checkpoint's run: resumed from step 6" \
            in threads_note()
    monkeypatch.setenv("OMP_NUM_THREADS", str(CORES))
    with run_threads():
        resume_threads(CORES + 1, 6)
        assert torch.get_num_threads() == CORES
        assert threads_note() == f"{CORES} torch thread{'s' if CORES != 1 else ''}: OMP_NUM_THREADS={CORES} is set; " \
                                 f"the checkpoint's run (step 6) used {CORES + 1}: the last bits may differ from an " \
                                 "uninterrupted run"


def test_the_sample_counts_other_processes_and_not_this_one(monkeypatch):
    clock = {"machine": 100.0, "own": 10.0}
    real_sleep = time.sleep

    class Me:
        def cpu_times(self):
            return (clock["own"], 0.0)

    def sleep(seconds):  # during the sample this process works 0.15 s and the machine 0.25 s in all
        clock["machine"] += 0.25
        clock["own"] += 0.15
        real_sleep(seconds)

    monkeypatch.setattr(threads, "work_seconds", lambda cpus: clock["machine"])
    monkeypatch.setattr(threads.psutil, "Process", Me)
    monkeypatch.setattr(threads.time, "sleep", sleep)
    busy = others_busy(0.2)
    assert busy.cores == CORES and 0.3 < busy.others < 0.55  # 0.1 s of others' work over ~0.2 s
    monkeypatch.undo()
    # and for real: a CPU-bound process beside this one keeps at least part of a core busy
    spin = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        time.sleep(0.5)
        assert others_busy().others >= 0.5
    finally:
        spin.kill()
        spin.wait()
