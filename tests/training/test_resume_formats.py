"""--resume where the checkpoint folder holds another format than this run writes (issue 42): one line naming how
to resume it, never a warning and a fresh start that leaves it behind."""
import re

import pytest
from tiny import TINY_ARGS

from tier_utils.cli import main
from tier_utils.core.errors import CheckpointError
from tier_utils.engine.strategies import other_format_checkpoint, strategy_class
from tier_utils.models.checkpoint import save_checkpoint


def test_a_single_process_resume_over_a_sharded_checkpoint_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints" / "last").mkdir(parents=True)
    (out / "checkpoints" / "last" / ".metadata").write_bytes(b"")  # DCP's index: what marks a sharded folder
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    code = main(["train", "--out", str(out), *TINY_ARGS, "--max-steps", "2", "--batch-size", "2", "--seq-len", "16",
                 "--device", "cpu", "--no-progress", "--resume"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("warning")]
    assert code == 2 and len(err) == 1, err
    assert "sharded (FSDP) checkpoint, last/" in err[0] and "--strategy fsdp" in err[0] and "--resume" in err[0]
    assert sorted(p.relative_to(out) for p in out.rglob("*") if p.name != ".lock") == before  # nothing written


@pytest.mark.parametrize("state,needle", [
    ({"strategy": "single", "world_size": 1}, "resume it without torchrun"),
    ({"strategy": "ddp", "world_size": 2}, "--strategy ddp (several machines"),
    ({"strategy": "fsdp", "world_size": 2, "consolidated": "final weights"}, "consolidated last.pt but not its"),
])
def test_a_sharded_resume_over_a_single_file_checkpoint_is_one_line(tmp_path, state, needle):
    save_checkpoint(tmp_path / "last.pt", state)
    with pytest.raises(CheckpointError, match=re.escape(needle)) as exc:
        other_format_checkpoint(strategy_class("fsdp")(), tmp_path / "last")
    assert "\n" not in str(exc.value)
    other_format_checkpoint(strategy_class("single")(), tmp_path / "last.pt")  # its own format: no line
