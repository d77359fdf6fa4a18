"""files.py: the run-folder lock and the temp files of atomic writes."""
import os
import subprocess
import sys

import pytest
from tiny import TINY_ARGS, tiny

from tier_utils import train
from tier_utils.cli import main
from tier_utils.core.errors import RunFolderBusy
from tier_utils.core.files import LOCK_NAME, atomic_write_bytes, run_lock
from tier_utils.models.checkpoint import save_checkpoint

RUN = dict(precision="fp32", max_steps=1, batch_size=4, seq_len=16, eval_every=0, eval_batches=1, progress=False,
           device="cpu")


def _dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_second_run_on_a_locked_folder_is_refused_naming_the_holder(tmp_path):
    with run_lock(tmp_path / "ckpt") as lock:
        assert lock.read_text().strip() == str(os.getpid())
        with pytest.raises(RunFolderBusy, match=rf"in use by another run \(pid {os.getpid()}, lock file"):
            train(tiny(), checkpoint_dir=tmp_path / "ckpt", **RUN)
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [LOCK_NAME]  # no checkpoint written
    assert not (tmp_path / "ckpt").exists()  # released, and the folder it made for a run that wrote nothing is gone
    result = train(tiny(), checkpoint_dir=tmp_path / "ckpt", **RUN)  # free again
    assert (tmp_path / "ckpt" / "last.pt").is_file() and not (tmp_path / "ckpt" / LOCK_NAME).exists()
    assert result.summary.checkpoint is not None


def test_cli_all_on_a_locked_folder_exits_2_in_one_line_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "report"
    with run_lock(out):
        code = main(["all", "--model", "tiny-gpt", *TINY_ARGS, "--fast", "--no-progress", "--out", str(out),
                     "--json", str(tmp_path / "all.json")])
        assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the banner naming the machine's load
    assert code == 2 and err.startswith("error: out_dir") and f"pid {os.getpid()}" in err
    assert "give another folder" in err
    assert not (tmp_path / "all.json").exists()


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    pid = _dead_pid()
    (folder / LOCK_NAME).write_text(f"{pid}\n")  # what a SIGKILLed run leaves
    with pytest.warns(UserWarning, match=f"took over .* from pid {pid}, which is no longer running"):
        train(tiny(), checkpoint_dir=folder, **RUN)
    assert (folder / "last.pt").is_file() and not (folder / LOCK_NAME).exists()


def test_a_killed_holder_releases_its_lock(tmp_path):
    """The OS drops a dead process's flock: a live holder refuses, the same holder killed does not."""
    code = (f"import sys, time; from tier_utils.core.files import run_lock\n"
            f"with run_lock({str(tmp_path)!r}): print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderBusy, match=f"pid {holder.pid}"), run_lock(tmp_path):
            pass
    finally:
        holder.kill()
        holder.wait()
    with pytest.warns(UserWarning, match=f"from pid {holder.pid}"), run_lock(tmp_path) as lock:
        assert lock.read_text().strip() == str(os.getpid())


def test_a_dead_writers_temp_files_are_removed_and_a_live_ones_kept(tmp_path):
    dead = _dead_pid()
    stale = [tmp_path / f".last.pt.{dead}.ab_c1234", tmp_path / f".last.pt.{dead}.zzzzzzzz"]
    # A live run's temp is in flight (the race two runs on one folder had): never removed.
    in_flight = tmp_path / f".last.pt.{os.getppid()}.abcd1234"
    keep = [in_flight, tmp_path / ".last.pt.not-ours-at-all", tmp_path / f".other.pt.{dead}.abcd1234",
            tmp_path / "notes.txt"]
    for p in stale + keep:
        p.write_bytes(b"x" * 100)
    save_checkpoint(tmp_path / "last.pt", {"step": 1})
    assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)
    atomic_write_bytes(tmp_path / "a.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".a.json")) == []
