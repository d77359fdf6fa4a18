"""Fixtures shared by the test files; the sizes behind them live in tiny.py."""
import gc
import os

import pytest
import torch
from filelock import FileLock
from tiny import TINY, tiny

_share = torch.get_num_threads()  # this process's torch threads while it runs tests (pytest_configure sets it)


def pytest_configure(config):
    """One torch thread count for the whole suite (torch's own, unless the caller fixed one): runs compared across
    processes share it, and the suite's hundreds of runs don't each sample the machine for 0.2 s to choose.
    tests/core/test_threads.py and the resume test in tests/training/test_repeatability.py clear it to test the choice.
    Under pytest-xdist (`-n N`) the workers share the cores: a worker's share each, or two threads per worker
    spin-wait on each other (bench/threads.py measured 2 threads beside 2 busy processes 28x slower than 1). Not in
    xdist's controller, which runs no test: the workers start from its environment, and an OMP_NUM_THREADS it set for
    itself (the whole machine's) would be theirs."""
    global _share
    if getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, torch.get_num_threads() // workers)))
    _share = int(os.environ["OMP_NUM_THREADS"])
    torch.set_num_threads(_share)


@pytest.fixture(autouse=True)
def _thread_share_kept():
    """A test that changes torch's thread count (to test the choice, or to time one thread) must not hand it to the
    next: a worker on two threads beside a busy one spin-waits, ten times slower (bench/threads.py)."""
    yield
    if torch.get_num_threads() != _share:
        torch.set_num_threads(_share)


@pytest.fixture(scope="module", autouse=True)
def _heap_frozen_per_module():
    """What is alive as a module starts (torch, transformers, pandas, every collected test) lives to the end of
    the run: frozen, the package's own gc.collect() calls (a benchmark run's fresh start, PeakRSS, after an
    out-of-memory error) skip it and walk only what the module made since. Unfrozen, each call walked half a
    million objects here, 0.3 CPU-s, hundreds of times per run."""
    gc.collect()
    gc.freeze()


def built_once(tmp_path_factory, name: str, build):
    """`build(folder)`'s folder, made once per test run: under pytest-xdist the workers share it (the first
    builds it under a lock, the others wait and reuse it); alone, in this session's temporary folder."""
    base = tmp_path_factory.getbasetemp()
    # A worker's base is popen-gwN inside the run's own folder; a run without workers must not share its parent
    # (every pytest run of this user keeps its folders there).
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, done = root / name, root / f"{name}.done"
    with FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            folder.mkdir(exist_ok=True)
            build(folder)
            done.touch()
    return folder


@pytest.fixture
def tiny_kwargs() -> dict:
    return dict(TINY)  # a copy: a test may add to it


@pytest.fixture
def tiny_model():
    """The builder: tiny_model(), tiny_model("tiny-encoder", num_classes=3), tiny_model(MyGPT, seed=0)."""
    return tiny


@pytest.fixture(scope="session")
def trained_hf_folder(tmp_path_factory):
    """A trained model as users bring one: a BPE tokenizer (vocab 1000) trained with `tokenizers` on the
    bundled corpus, a small GPT-2 trained on its ids for 150 steps, both written with save_pretrained.
    Nothing is downloaded; a few seconds, once per run (shared by pytest-xdist's workers)."""
    from real import trained_hf_folder as build

    return built_once(tmp_path_factory, "trained-hf", build)
