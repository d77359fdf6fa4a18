"""glibc's mmap threshold for a sharded CPU run: fixed at 64 KiB through mallopt unless the user set one, left
alone on another C library, and said in words either way. mallopt itself is replaced: the test process keeps
its own allocator."""
import pytest

from tier_utils.core import allocator


@pytest.fixture
def mallopt(monkeypatch):
    calls = []

    def fake(param, value):
        calls.append((param, value))
        return 1

    monkeypatch.setattr(allocator, "glibc_mallopt", lambda: fake)
    return calls


def test_the_threshold_is_fixed_when_the_user_set_none(mallopt):
    said = allocator.return_freed_memory({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert mallopt == [(-3, 64 << 10)]  # M_MMAP_THRESHOLD in <malloc.h>
    assert "fixed at 64 KiB" in said and "MALLOC_MMAP_THRESHOLD_" in said


@pytest.mark.parametrize("env, named", [
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_=131072"),
    ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=4096"},
     "glibc.malloc.mmap_threshold=4096"),
])
def test_the_users_own_threshold_is_kept(mallopt, env, named):
    said = allocator.return_freed_memory(env)
    assert mallopt == [] and named in said and "kept" in said


def test_another_c_library_or_a_refusal_is_left_alone_and_said(monkeypatch):
    monkeypatch.setattr(allocator, "glibc_mallopt", lambda: None)
    assert allocator.return_freed_memory({}) == "allocator: not glibc, left as it is"
    monkeypatch.setattr(allocator, "glibc_mallopt", lambda: lambda param, value: 0)
    assert "refused" in allocator.return_freed_memory({})


def test_glibc_is_recognised_from_its_version_string(monkeypatch):
    monkeypatch.setattr(allocator.os, "confstr", lambda name: "musl 1.2", raising=False)
    assert allocator.glibc_mallopt() is None
    monkeypatch.setattr(allocator.os, "confstr", lambda name: None, raising=False)
    assert allocator.glibc_mallopt() is None
