"""Bad inputs, as a new user or an attacker would give them, through the CLI and the Python API.

Every case asserts: the exit code (2 bad input, 1 a model that fails), one line on stderr that names
the fix, no traceback, and nothing written. Each fails before any training step, so the table is fast.
"""
import json
import os
import stat
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn as nn
from tiny import TINY_ARGS, tiny

import tier_utils
from tier_utils.adapter.adapter import adapt
from tier_utils.cli import main
from tier_utils.core.errors import ModelForwardError, TierError
from tier_utils.core.files import atomic_write_bytes
from tier_utils.models.checkpoint import load_checkpoint, save_checkpoint

MODELS = textwrap.dedent('''
    import torch
    import torch.nn as nn

    class Broken(nn.Module):
        """A plain module (no task, vocab_size or max_len attributes) whose forward raises."""

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 8)
            self.pos_emb = nn.Embedding(16, 8)

        def forward(self, input_ids):
            raise RuntimeError("planted: shapes do not line up in block 3")

    class Frozen(nn.Module):
        task = "causal-lm"
        max_len = 16

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 256)
            self.requires_grad_(False)

        def forward(self, input_ids, attention_mask=None):
            return self.emb(input_ids)

    class NoMaxLen(nn.Module):
        """No position table and no declared limit, but a hidden one: 16 tokens."""

        task = "causal-lm"

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(256, 256)

        def forward(self, input_ids, attention_mask=None):
            if input_ids.size(1) > 16:
                raise ValueError("at most 16 tokens")
            return self.emb(input_ids)

    NOT_A_MODEL = 42
''')

class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    (d / "models.py").write_text(MODELS)
    (d / "syntax.py").write_text("class Net(:\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "text.txt").write_text("plain text, no labels. " * 400)
    (d / "a_file").write_text("not a folder")
    (d / "a_dir").mkdir()
    torch.save({"format": 1, "payload": Evil()}, d / "evil.pt")
    (d / "zero.pt").write_bytes(b"")
    (d / "random.pt").write_bytes(bytes(range(256)) * 4)
    (d / "text.pt").write_text("hello\n" * 50)
    torch.save({"weights": torch.zeros(2)}, d / "foreign.pt")
    return d


def _fmt(args, files):
    return [a.format(d=files) for a in args]


def run_main(args, capsys):
    """main() in-process: (exit code, stderr lines). An exception escaping main fails the test (a traceback)."""
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip() and not line.startswith("warning:")]


# (args, needle in the one error line). All exit 2; {d} is the folder holding the fixture files.
CLI_BAD = [
    (["info", "--precision", "fp8"], "unknown precision"),
    (["info", "--device", "tpu"], "use cpu, cuda or cuda:N"),
    (["info", "--model-arg", "oops"], "expected KEY=VALUE"),
    (["info", "--model-arg", "d_model=abc"], "check its arguments"),
    (["frobnicate"], "invalid choice"),
    (["smoke", "--model", "missing.py:Net"], "not found"),
    (["smoke", "--model", "nosuch"], "unknown model 'nosuch'"),
    (["smoke", "--model", "hf:NoSuchModelClass"], "e.g. hf:GPT2LMHeadModel"),
    (["smoke", "--model", "{d}/models.py:Missing"], "has no attribute 'Missing'"),
    (["smoke", "--model", "{d}/models.py:NOT_A_MODEL"], "not a model class or factory"),
    (["smoke", "--model", "{d}/syntax.py:Net"], "fix the file"),
    (["smoke", "--model", "no_such_pkg_xyz.mod:Net"], "check it is installed"),
    (["smoke", "--model", "{d}/models.py:NoMaxLen"], "pass max_len=N"),
    (["smoke", "--model-arg", "d_model=30", "--model-arg", "n_head=4"], "pick sizes that divide"),
    (["smoke", "--checks", "shapes,speed"], "unknown check group 'speed'"),
    (["smoke", "--batch-sizes", "0"], "batch_sizes must be a whole number >= 1"),
    (["smoke", "--batch-sizes", "a,b"], "expected comma-separated whole numbers"),
    (["smoke", "--seq-lens", "-1"], "seq_lens must be a whole number >= 1"),
    (["smoke", "--json", "{d}/a_dir"], "is a folder"),
    (["smoke", "--json", "{d}/no_such_dir/x.json"], "does not exist"),
    (["smoke", "--json", "{d}/a_file/x.json"], "does not exist"),
    (["smoke", "--json", "/proc/x.json"], "not writable"),
    (["analyze", "--analyses", "attention,vibes"], "unknown analysis 'vibes'"),
    (["analyze", "--n-batches", "0"], "whole number >= 1"),
    (["analyze", "--data", "{d}/missing.txt"], "not found"),
    (["analyze", "--data", "{d}/empty.txt"], "is empty"),
    (["analyze", "--json", "{d}/a_dir"], "is a folder"),
    (["train", "--out", "{d}/a_file"], "is a file"),
    (["train", "--out", "/proc/forbidden"], "not writable"),
    (["train", "--out", "{d}/a_file/sub"], "is a file, not a folder"),
    (["train", "--out", "{d}/run", "--json", "{d}/a_dir"], "is a folder"),
    (["train", "--out", "{d}/run", "--json", "/nonexistent_dir_xyz/x.json"], "does not exist"),
    (["train", "--out", "{d}/run", "--data", "{d}/missing.txt"], "not found"),
    (["train", "--out", "{d}/run", "--data", "{d}/empty.txt"], "is empty"),
    (["train", "--out", "{d}/run", "--precision", "fp8"], "unknown precision"),
    (["train", "--out", "{d}/run", "--max-steps", "0"], "max_steps must be a whole number >= 1"),
    (["train", "--out", "{d}/run", "--epochs", "0"], "epochs must be a whole number >= 1"),
    (["train", "--out", "{d}/run", "--lr", "0"], "lr must be a number > 0"),
    (["train", "--out", "{d}/run", "--lr", "nan"], "lr must be a number > 0"),
    (["train", "--out", "{d}/run", "--weight-decay", "-1"], "weight_decay must be a number >= 0"),
    (["train", "--out", "{d}/run", "--grad-clip", "-1"], "grad_clip must be a number >= 0"),
    (["train", "--out", "{d}/run", "--seq-len", "0"], "seq_len must be a whole number >= 1"),
    (["train", "--out", "{d}/run", "--grad-accum", "0"], "grad_accum_steps must be a whole number >= 1"),
    (["train", "--out", "{d}/run", "--batch-size", "0"], "whole number >= 1"),
    (["train", "--out", "{d}/run", "--num-workers", "-1"], "num_workers must be a whole number >= 0"),
    (["train", "--out", "{d}/run", "--eval-batches", "0"], "eval_batches must be a whole number >= 1"),
    (["train", "--out", "{d}/run", "--log-every", "0"], "log_every must be a whole number >= 1"),
    (["train", "--out", "{d}/run", "--checkpoint-every", "0"], "checkpoint_every must be a whole number >= 1"),
    (["train", "--out", "{d}/run", "--max-steps", "1", "--epochs", "2"], "not allowed with argument"),
    (["train", "--out", "{d}/run", "--model-arg", "seed=3"], "unexpected keyword argument 'seed'; check its arguments"),
    (["train", "--out", "{d}/run", "--model", "tiny-encoder", "--data", "{d}/text.txt"], "has no labels"),
    (["train", "--out", "{d}/run", "--model-arg", "vocab_size=100"], "vocab_size>=256"),
    (["train", "--out", "{d}/run", "--batch-size", "100000", "--max-steps", "1", *TINY_ARGS], "lower batch_size"),
    (["train", "--out", "{d}/run", "--model", "{d}/models.py:Frozen"], "no trainable parameters"),
    (["bench", "--precisions", "fp8"], "unknown precision"),
    (["bench", "--precisions", "auto"], "auto"),
    (["bench", "--timed-steps", "0"], "whole number >= 1"),
    (["bench", "--repeats", "0"], "whole number >= 1"),
    (["bench", "--memory", "bogus"], "invalid choice"),
    (["bench", "--model", "{d}/models.py:Frozen"], "no trainable parameters"),
    (["bench", "--data", "{d}/empty.txt", *TINY_ARGS], "is empty"),
    (["search", "--trials", "0"], "whole number >= 1"),
    (["search", "--max-steps", "0"], "whole number >= 1"),
    (["search", "--model", "{d}/models.py:Frozen"], "no trainable parameters"),
    (["search", "--storage", "bogus://nowhere", *TINY_ARGS], "cannot open study storage"),
    (["all", "--out", "{d}/a_file"], "is a file"),
    (["all", "--out", "/proc/forbidden"], "not writable"),
    (["all", "--batch-size", "0"], "whole number >= 1"),
]


@pytest.mark.parametrize("args,needle", CLI_BAD, ids=[" ".join(a)[:60] for a, _ in CLI_BAD])
def test_cli_bad_input(files, tmp_path, capsys, args, needle):
    args = _fmt(args, files)
    before = sorted(p.name for p in files.iterdir())
    out = tmp_path / "out.json"
    if args[0] != "frobnicate" and "--json" not in args:
        args += ["--json", str(out)]
    code, lines = run_main(args + ["--no-progress"] if args[0] != "frobnicate" else args, capsys)
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not out.exists()
    assert sorted(p.name for p in files.iterdir()) == before  # no --out folder, no json, no temp file
    assert not os.path.exists("/nonexistent_dir_xyz")


@pytest.mark.parametrize("name", ["evil", "zero", "random", "text", "foreign"])
def test_cli_resume_from_bad_checkpoint(files, tmp_path, capsys, name):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "last.pt").write_bytes((files / f"{name}.pt").read_bytes())
    code, lines = run_main(["train", "--out", str(out), "--resume", "--max-steps", "2", *TINY_ARGS, "--no-progress",
                            "--device", "cpu", "--json", str(tmp_path / "x.json")], capsys)
    assert code == 2
    assert len(lines) == 1 and ("delete it to start over" in lines[0] or "only resume from" in lines[0]
                                or "point checkpoint_dir at a tier_utils run" in lines[0]), lines
    assert "weights_only=False" not in lines[0] and "likely succeed" not in lines[0]
    if name == "evil":
        assert "posix.system" in lines[0] or "os.system" in lines[0]
    assert sorted(p.name for p in out.rglob("*")) == ["checkpoints", "last.pt"]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("verb", ["smoke", "analyze"])
def test_cli_broken_forward_is_fail_rows_exit_1_with_json(files, tmp_path, capsys, verb):
    out = tmp_path / "out.json"
    code = main([verb, "--model", f"{files}/models.py:Broken", "--device", "cpu", "--no-progress", "--json", str(out)])
    assert code == 1
    data = json.loads(out.read_text())
    rows = data["checks"] if verb == "smoke" else data["findings"]
    assert rows and all(r["status"] == "FAIL" and "planted: shapes do not line up" in r["detail"] for r in rows)
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("verb", ["train", "bench", "search"])
def test_cli_broken_forward_in_train_bench_search_is_one_line_exit_1(files, tmp_path, capsys, verb):
    args = [verb, "--model", f"{files}/models.py:Broken", "--device", "cpu", "--no-progress",
            "--json", str(tmp_path / "x.json")]
    if verb == "train":
        args += ["--out", str(tmp_path / "run")]
    code, lines = run_main(args, capsys)
    assert code == 1
    assert len(lines) == 1 and "planted: shapes do not line up" in lines[0] and "fix its forward" in lines[0]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow  # two CLI processes
def test_cli_subprocess_no_traceback(files, tmp_path):
    """The real entry point: bad outputs and a broken model, one line each, no traceback."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for args, code in [(["train", "--out", "/proc/forbidden"], 2),
                       (["smoke", "--model", f"{files}/models.py:Broken", "--json", str(tmp_path / "s.json")], 1)]:
        r = subprocess.run([sys.executable, "-m", "tier_utils", *args, "--no-progress", "--device", "cpu"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == code, r.stderr
        assert "Traceback" not in r.stderr
        if code == 2:
            assert len(r.stderr.strip().splitlines()) == 1
    assert json.loads((tmp_path / "s.json").read_text())["status"] == "FAIL"


# -- the Python API -------------------------------------------------------------------------------------------

def _enc():
    return tiny("tiny-encoder", num_classes=4)


def _models(files):
    return {name: tier_utils.load_model(f"{files}/models.py:{name}") for name in ("Broken", "Frozen", "NoMaxLen")}


def _train(model, data=None, **kw):
    return lambda d, ck: tier_utils.train(model if isinstance(model, nn.Module) else model(), data, max_steps=1,
                                          progress=False, device="cpu", checkpoint_dir=str(ck), **kw)


def _ids(*shape, high=256):
    return torch.randint(0, high, shape)


# (call(files_dir, checkpoint_dir) -> anything, needle). Each must raise a TierError/ValueError with one line.
API_BAD = [
    (lambda d, ck: tier_utils.smoke(42), "must be a string or an nn.Module"),
    (lambda d, ck: tier_utils.smoke(tiny(), batch_sizes=[]), "is empty"),
    (lambda d, ck: tier_utils.smoke(tiny(), batch_sizes=[0]), "whole number >= 1"),
    (lambda d, ck: tier_utils.smoke(tiny(), batch_sizes=[True]), "whole number >= 1"),
    (lambda d, ck: tier_utils.smoke(_models(d)["NoMaxLen"]), "adapt(model, max_len=N)"),
    (lambda d, ck: tier_utils.smoke(_models(d)["NoMaxLen"], model_kwargs={"d_model": 3}),
     "only task, vocab_size, max_len"),
    (lambda d, ck: tier_utils.smoke(adapt(tiny()), model_kwargs={"max_len": 8}), "pass them to adapt(model, ...)"),
    (lambda d, ck: tier_utils.smoke(tiny(), model_kwargs={"task": "regression"}), "unknown task"),
    (lambda d, ck: tier_utils.smoke(tiny(), precision="fp8"), "unknown precision"),
    # A tier's keywords are its settings only: a typo or a model argument is refused, not passed to the model.
    (lambda d, ck: tier_utils.smoke(tiny(), batch_size=2), "unknown smoke setting(s) batch_size; valid: batch_sizes"),
    (lambda d, ck: tier_utils.smoke(tiny(), config=5), "config must be a SmokeConfig or a dict"),
    (lambda d, ck: tier_utils.analyze("tiny-gpt", d_model=32), "unknown analysis setting(s) d_model; valid: analyses"),
    (lambda d, ck: tier_utils.export(tiny(), d / "m.pt2", repeat=2), "unknown export setting(s) repeat; valid: format"),
    (lambda d, ck: tier_utils.export(tiny(), d / "m.x", format="tflite"), "unknown export format 'tflite'"),
    (lambda d, ck: tier_utils.fit(tiny(), batch_sizes=2), "unknown fit setting(s) batch_sizes; valid: batch_size"),
    (lambda d, ck: tier_utils.fit(tiny(), seq_len=0), "seq_len must be a whole number >= 1"),
    (lambda d, ck: tier_utils.info(tiny(), {"precison": "fp32"}), "unknown info setting(s) precison; valid: precision"),
    (lambda d, ck: tier_utils.analyze(tiny(), analyses=[]), "no analysis given"),
    (lambda d, ck: tier_utils.analyze(tiny(), batch_size=0), "batch_size must be"),
    (lambda d, ck: tier_utils.analyze(tiny(), data=torch.rand(40, 33)), "integer ids"),
    (lambda d, ck: tier_utils.load_model(tiny(), d_model=8), "adapt(model, max_len=N)"),
    (lambda d, ck: tier_utils.load_model(""), "must be a string or an nn.Module"),
    (lambda d, ck: adapt("tiny-gpt"), "load it with load_model first"),
    (lambda d, ck: adapt(nn.ReLU()), "has no parameters"),
    (_train(tiny, unknown_setting=1), "unknown training setting"),
    (lambda d, ck: tier_utils.train(tiny(), config=5), "must be a TrainConfig or a dict"),
    (lambda d, ck: tier_utils.train(tiny(), resume=True), "needs checkpoint_dir"),
    (lambda d, ck: tier_utils.train(tiny(), checkpoint_every=5), "needs checkpoint_dir"),
    (lambda d, ck: tier_utils.train(tiny(), checkpoint_dir=str(d / "a_file")), "is a file"),
    (lambda d, ck: tier_utils.train(tiny(), checkpoint_dir="/proc/forbidden/ck"), "not writable"),
    (_train(tiny, batch_size=True), "batch_size must be a whole number"),
    (_train(tiny, precision="fp8"), "unknown precision"),
    (_train(tiny, torch.rand(200, 33)), "integer ids, got a float32 tensor"),
    (_train(tiny, torch.rand(200, 33).double()), "integer ids, got a float64 tensor"),
    (_train(tiny, torch.ones(200, 33, dtype=torch.bool)), "integer ids, got a bool tensor"),
    (_train(tiny, _ids(200, 33, high=300)), "outside [0, 256)"),
    (_train(tiny, -_ids(200, 33) - 1), "outside [0, 256)"),
    (_train(tiny, _ids(200, 40)), "past the model's max_len=32"),
    (_train(tiny, _ids(200)), "must be one (N, seq_len + 1)"),
    (_train(tiny, _ids(0, 33)), "is empty"),
    (_train(tiny, (_ids(200, 33), _ids(200))), "must be one (N, seq_len + 1)"),
    (_train(_enc, (_ids(200, 16), _ids(200, high=9))), "outside [0, 4)"),
    (_train(_enc, (_ids(200, 16), -_ids(200, high=4) - 1)), "outside [0, 4)"),
    (_train(_enc, (_ids(200, 16), torch.rand(200))), "labels must be integer ids"),
    (_train(_enc, (torch.rand(200, 16), _ids(200, high=4))), "input_ids must be integer ids"),
    (_train(_enc, (_ids(200, 16), _ids(150, high=4))), "one label per row"),
    (_train(_enc, (_ids(200, 40), _ids(200, high=4))), "past the model's max_len=32"),
    (_train(_enc, (_ids(200, 16, 2), _ids(200, high=4))), "must be an (input_ids (N, T), labels (N,)) pair"),
    (_train(tiny, []), "empty list of strings"),
    (_train(tiny, ["", ""]), "empty list of strings"),
    (_train(tiny, 123), "unsupported data int"),
    (lambda d, ck: _train(tiny, str(d / "empty.txt"))(d, ck), "is empty"),
    (lambda d, ck: _train(tiny, str(d / "missing.txt"))(d, ck), "not found"),
    (lambda d, ck: _train(tiny, ["short"])(d, ck), "too short"),
    (lambda d, ck: _train(_models(d)["Frozen"])(d, ck), "no trainable parameters"),
    (lambda d, ck: _train(_models(d)["Broken"])(d, ck), "fix its forward"),
    (lambda d, ck: tier_utils.amp_benchmark(_models(d)["Broken"], device="cpu"), "fix its forward"),
    (lambda d, ck: tier_utils.amp_benchmark(_models(d)["Frozen"], device="cpu"), "no trainable parameters"),
    (lambda d, ck: tier_utils.amp_benchmark(tiny(), batch_size=0), "batch_size must be"),
    (lambda d, ck: tier_utils.amp_benchmark(tiny(), precisions=[]), "no precision"),
    (lambda d, ck: tier_utils.amp_benchmark(tiny(), precisions=["fp8"]), "unknown precision"),
    (lambda d, ck: tier_utils.amp_benchmark(tiny(), data=torch.rand(200, 33), device="cpu"), "integer ids"),
    (lambda d, ck: tier_utils.search(tiny(), space={"lr": ("log", 0, 1e-3)}), "log range must start above 0"),
    (lambda d, ck: tier_utils.search(tiny(), space={"lr": ("log", 1e-3, 1e-5)}), "lo <= hi"),
    (lambda d, ck: tier_utils.search(tiny(), space={"lr": ("uniform", 0, 1)}), "must be a tuple starting with"),
    (lambda d, ck: tier_utils.search(tiny(), space={"nope": ("int", 0, 1)}), "not a TrainConfig field"),
    (lambda d, ck: tier_utils.search(tiny(), space={"batch_size": ("choice", [])}), "non-empty list"),
    (lambda d, ck: tier_utils.search(tiny(), space={"precision": ("choice", ["fp8"])}), "unknown precision"),
    (lambda d, ck: tier_utils.search(tiny(), space={"warmup_steps": ("int", 0.5, 3)}), "needs whole numbers"),
    (lambda d, ck: tier_utils.search(tiny(), space={"lr": ("float", "a", 1)}), "needs two numbers"),
    (lambda d, ck: tier_utils.search(tiny(), n_trials=0), "n_trials must be a whole number >= 1"),
    (lambda d, ck: tier_utils.search(_models(d)["Frozen"]), "no trainable parameters"),
    (lambda d, ck: tier_utils.run_all(tiny(), str(d / "a_file")), "is a file"),
    (lambda d, ck: tier_utils.run_all(tiny(), "/proc/forbidden"), "not writable"),
    (lambda d, ck: load_checkpoint(d / "evil.pt"), "posix.system"),
    (lambda d, ck: load_checkpoint(d / "zero.pt"), "is empty; delete it to start over"),
    (lambda d, ck: load_checkpoint(d / "random.pt"), "delete it to start over"),
    (lambda d, ck: load_checkpoint(d / "text.pt"), "delete it to start over"),
    (lambda d, ck: load_checkpoint(d / "foreign.pt"), "not a tier_utils training checkpoint"),
    (lambda d, ck: load_checkpoint(d / "missing.pt"), "not found"),
]


@pytest.mark.parametrize("call,needle", API_BAD, ids=[f"{i:02d}-{n[:40]}" for i, (_, n) in enumerate(API_BAD)])
def test_api_bad_input(files, tmp_path, call, needle):
    before = sorted(p.name for p in files.iterdir())
    ck = tmp_path / "ck"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # bf16/fp16 slow-precision warnings are not the point here
        with pytest.raises((TierError, ValueError)) as info:
            call(files, ck)
    message = str(info.value)
    assert "\n" not in message and needle in message, message
    assert "weights_only=False" not in message
    assert not ck.exists()
    assert sorted(p.name for p in files.iterdir()) == before
    assert not os.path.exists("/proc/forbidden")


# -- broken models become findings, quiet things speak --------------------------------------------------------

def test_smoke_and_analyze_turn_a_raising_forward_into_fail_rows(files):
    broken = _models(files)["Broken"]
    report = tier_utils.smoke(broken, device="cpu", progress=False)
    assert not report.passed and len(report.checks) == 7
    assert all(c.status == "FAIL" and "planted: shapes do not line up" in c.detail for c in report.checks)
    findings = tier_utils.analyze(broken, device="cpu", progress=False).table
    assert set(findings.status) == {"FAIL"} and findings.detail.str.contains("planted").all()
    with pytest.raises(ModelForwardError, match="planted"):
        tier_utils.train(broken, max_steps=1, progress=False)


def test_main_job_on_a_raising_forward_writes_a_fail_report(files, tmp_path, capsys):
    code = main(["all", "--model", f"{files}/models.py:Broken", "--out", str(tmp_path / "r"), "--fast", "--device",
                 "cpu", "--no-progress"])
    assert code == 1
    assert (tmp_path / "r" / "index.html").is_file() and not (tmp_path / "r" / "train.csv").exists()
    assert "planted: shapes do not line up" in (tmp_path / "r" / "smoke.csv").read_text()


def test_instance_accepts_adapter_keywords(files):
    report = tier_utils.smoke(_models(files)["NoMaxLen"], model_kwargs={"max_len": 16}, checks="shapes", device="cpu",
                              progress=False)
    assert report.model["max_len"] == 16 and report.passed


def test_seq_len_past_max_len_is_capped_with_a_warning_and_recorded_everywhere():
    with pytest.warns(UserWarning, match="seq_len=64 exceeds TinyGPT's max_len=32; using 32"):
        result = tier_utils.train(tiny(), "synthetic", seq_len=64, max_steps=1, batch_size=4, progress=False,
                                  device="cpu", eval_batches=1)
    assert result.config.seq_len == 32
    with pytest.warns(UserWarning, match="seq_len=64 exceeds"):
        bench = tier_utils.amp_benchmark(tiny(), "synthetic", precisions=["fp32"], batch_size=2, seq_len=64,
                                         untimed_steps=0, timed_steps=1, repeats=1, accuracy_steps=0, device="cpu",
                                         progress=False)
    assert bench.config.settings.seq_len == 32 and bench.to_json()["config"]["seq_len"] == 32
    with pytest.warns(UserWarning, match="seq_lens entry=64 exceeds"):
        report = tier_utils.smoke(tiny(), seq_lens=(64,), checks="latency", device="cpu", progress=False)
    assert report.seq_lens == [32]


def test_resume_with_nothing_to_resume_says_so(tmp_path):
    with pytest.warns(UserWarning, match="does not exist; starting from step 0"):
        result = tier_utils.train(tiny(), "synthetic", max_steps=1, batch_size=4, seq_len=16, progress=False,
                                  device="cpu", eval_batches=1, checkpoint_dir=str(tmp_path / "ck"), resume=True)
    assert result.summary.resumed_from_step is None and result.summary.steps == 1


def test_binary_data_file_warns(tmp_path):
    data = tmp_path / "blob.bin"
    data.write_bytes(bytes(range(256)) * 64)
    with pytest.warns(UserWarning, match="is not UTF-8 text"):
        tier_utils.train(tiny(), str(data), max_steps=1, batch_size=4, seq_len=16, progress=False, device="cpu",
                         eval_batches=1)


# -- files: the user's umask, no stale temp files ------------------------------------------------------------

def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = atomic_write_bytes(tmp_path / "a.json", b"{}")
        assert stat.S_IMODE(path.stat().st_mode) == 0o644
        os.umask(0o077)
        save_checkpoint(tmp_path / "last.pt", {"x": torch.zeros(1)})
        assert stat.S_IMODE((tmp_path / "last.pt").stat().st_mode) == 0o600
    finally:
        os.umask(old)


def test_stale_temp_files_are_removed_on_the_next_write(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a writer that has ended: its temps are stale (tests/test_files.py: a live one's are kept)
    stale = [tmp_path / f".last.pt.{child.pid}.ab_c1234", tmp_path / f".last.pt.{child.pid}.zzzzzzzz"]
    for p in stale:
        p.write_bytes(b"x" * 100)  # what a SIGKILL mid-write leaves
    keep = [tmp_path / ".last.pt.not-ours-at-all", tmp_path / ".other.pt.abcd1234", tmp_path / "notes.txt"]
    for p in keep:
        p.write_text("keep")
    save_checkpoint(tmp_path / "last.pt", {"x": torch.zeros(1)})
    assert not any(p.exists() for p in stale) and all(p.exists() for p in keep)
    assert load_checkpoint(tmp_path / "last.pt")["x"].shape == (1,)


def test_every_error_class_lives_in_errors_py_with_its_exit_code():
    """One place says what each error means to the CLI: 2 for the user's input, 1 for a finding about the
    model or the run (a broken forward, a diverged run), as a FAIL row is."""
    import importlib
    import inspect
    import pkgutil

    from tier_utils.core import errors

    package = importlib.import_module("tier_utils")
    classes = set()
    for info in pkgutil.walk_packages(package.__path__, "tier_utils."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        classes |= {c for _, c in inspect.getmembers(module, inspect.isclass) if issubclass(c, Exception)
                    and not issubclass(c, Warning) and c.__module__.startswith("tier_utils")}
    assert {c.__module__ for c in classes} == {"tier_utils.core.errors"}, sorted(c.__qualname__ for c in classes)
    assert all(issubclass(c, errors.TierError) for c in classes)
    ones = {c.__name__ for c in classes if c.exit_code == 1}
    assert ones == {"ModelForwardError", "TrainingDiverged"} and {c.exit_code for c in classes} == {1, 2}


def test_all_refuses_a_folder_holding_a_training_run(tmp_path, capsys):
    """Its report (train.csv, plots, index.html) would sit beside the run's metrics, checkpoints and training.png."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.csv").write_text("step,train_loss\n1,5.5\n")
    before = sorted(p.name for p in run.rglob("*"))
    code, lines = run_main(["all", "--fast", "--out", str(run), "--no-progress", *TINY_ARGS], capsys)
    errors = [line for line in lines if line.startswith("error: ")]  # after all's line naming its tiers and threads
    assert code == 2 and len(errors) == 1 and errors[0] == lines[-1], lines
    assert f"{run} holds a training run (checkpoints, metrics.csv)" in errors[0] and f"--out {run}/report" in errors[0]
    assert sorted(p.name for p in run.rglob("*")) == before


def test_a_second_ctrl_c_still_leaves_training_png_and_says_what_was_saved(tmp_path, capsys, monkeypatch):
    """Two SIGINTs: the first stops the loop, the second comes while the partial result is written (here: as the
    plot starts). It left no training.png, and the CLI said only "interrupted"."""
    import signal

    from tier_utils.engine.step import TrainStep
    from tier_utils.training.history import TrainResult

    step, plot = TrainStep.__call__, TrainResult.save_plot
    calls = []

    def interrupted_step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # Python's handler raises KeyboardInterrupt here
        return step(self, *args, **kwargs)

    def interrupted_plot(self, path):
        os.kill(os.getpid(), signal.SIGINT)  # the second Ctrl-C
        return plot(self, path)

    monkeypatch.setattr(TrainStep, "__call__", interrupted_step)
    monkeypatch.setattr(TrainResult, "save_plot", interrupted_plot)
    out = tmp_path / "run"
    code = main(["train", "--out", str(out), "--max-steps", "8", "--log-every", "1", "--eval-every", "0",
                 "--eval-batches", "1", "--batch-size", "2", "--seq-len", "16", "--no-progress", *TINY_ARGS])
    err = capsys.readouterr().err
    assert code == 130 and (out / "training.png").is_file() and (out / "metrics.csv").is_file(), err
    assert "interrupted after step 2: wrote metrics.csv, training.png; no checkpoint was saved yet" in err, err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the user's handler back
