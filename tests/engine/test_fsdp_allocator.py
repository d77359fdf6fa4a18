"""Under FSDP on CPU ranks train() fixes glibc's mmap threshold before the model is built and says so in the
summary's sharding line; on a GPU it leaves the host allocator alone. A one-rank FSDP run in this process;
mallopt itself is replaced, so the test process keeps its own allocator."""
import types

import pytest
import torch
import torch.distributed as dist

from tier_utils.core import allocator
from tier_utils.engine import sharding
from tier_utils.training.loop import train


@pytest.fixture
def mallopt(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "glibc_mallopt", lambda: lambda param, value: calls.append((param, value)) or 1)
    monkeypatch.delenv(allocator.ENV_VAR, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    return calls


def test_only_cpu_ranks_touch_the_host_allocator(mallopt):
    assert sharding.host_allocator(types.SimpleNamespace(device=torch.device("cuda", 0))) is None
    assert mallopt == []
    assert "fixed at 64 KiB" in sharding.host_allocator(types.SimpleNamespace(device=torch.device("cpu")))
    assert mallopt == [(allocator.M_MMAP_THRESHOLD, allocator.MMAP_THRESHOLD)]


@pytest.fixture
def one_rank(tmp_path):
    """A gloo group of one in this process (through a file store), which train() joins as it is."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _run():
    return train("tiny-gpt", None, model_kwargs=dict(d_model=16, n_layer=2, n_head=2, max_len=16), strategy="fsdp",
                 precision="fp32", device="cpu", batch_size=2, seq_len=8, max_steps=1, eval_every=0,
                 eval_batches=1, progress=False).summary


@pytest.mark.slow
def test_a_cpu_fsdp_run_fixes_the_threshold_unless_the_user_did_and_says_which(mallopt, one_rank, monkeypatch):
    summary = _run()
    assert mallopt == [(-3, 65536)]
    assert "glibc mmap threshold fixed at 64 KiB for this process" in summary.sharding
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "262144")
    summary = _run()
    assert mallopt == [(-3, 65536)]  # not called again
    assert "the user's (MALLOC_MMAP_THRESHOLD_=262144) kept" in summary.sharding
