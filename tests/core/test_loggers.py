"""Experiment loggers, run for real and read back: TensorBoard event files through tensorboard's reader,
W&B offline run files, MLflow through its client; a resumed run continues the same logged runs."""
import json
from pathlib import Path

import pytest
import torch
from tiny import TINY_ARGS, tiny

from tier_utils import TrainConfig, train
from tier_utils.cli import main
from tier_utils.core import loggers as lg

RUN = dict(precision="fp32", batch_size=4, seq_len=16, max_steps=6, log_every=1, eval_every=3, eval_batches=1,
           checkpoint_every=2, progress=False, device="cpu")


def tokens():
    return torch.randint(0, 256, (60, 17), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")  # never the network
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")


def tensorboard_steps(folder: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [e.step for e in acc.Scalars(tag)]


def wandb_history(run_dirs) -> dict[str, list[int]]:
    """key -> steps, from W&B's offline .wandb files (a LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2

    out = {}
    for path in sorted(p for d in run_dirs for p in d.glob("run-*.wandb")):
        data, pos, block, buf = path.read_bytes(), 7, 32768, b""  # 7: W&B's own file header
        while pos + 7 <= len(data):
            left = block - pos % block
            length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
            if left < 7 or (length == 0 and kind == 0):
                pos += left  # block trailer / padding
                continue
            buf += data[pos + 7:pos + 7 + length]
            pos += 7 + length
            if kind in (1, 4):  # FULL or LAST chunk: one record
                rec = wandb_internal_pb2.Record()
                rec.ParseFromString(buf)
                buf = b""
                if rec.WhichOneof("record_type") == "history":
                    for item in rec.history.item:
                        key = item.key or "/".join(item.nested_key)
                        out.setdefault(key, []).append(rec.history.step.num)
    return out


@pytest.mark.slow  # three trackers start up (W&B spawns its service): ~20 s
def test_every_logger_records_rows_and_a_resumed_run_continues_without_duplicates(tmp_path, offline_wandb):
    ckpt, logs = tmp_path / "run" / "checkpoints", tmp_path / "run" / "logs"
    settings = dict(RUN, checkpoint_dir=str(ckpt), loggers="tensorboard,wandb,mlflow", resume=True,
                    deterministic=True)

    def stop(step, metrics):
        raise KeyboardInterrupt  # at step 3, after its rows are logged; the checkpoint is from step 2

    torch.manual_seed(0)  # dropout: the RNG states the checkpoint restores matter
    first = train(tiny(dropout=0.1), tokens(), on_eval=stop, **settings)
    assert first.interrupted and first.summary.steps == 3
    state = json.loads((logs / lg.STATE_FILE).read_text())  # log_dir defaulted to "logs" beside the checkpoints
    torch.manual_seed(0)
    done = train(tiny(dropout=0.1), tokens(), **settings)
    assert done.summary.resumed_from_step == 2 and done.summary.steps == 6
    torch.manual_seed(0)  # opening the trackers drew nothing from the restored RNGs: resume is still exact
    whole = train(tiny(dropout=0.1), tokens(),
                  **dict(RUN, checkpoint_dir=str(tmp_path / "whole"), deterministic=True))
    for name, tensor in whole.model.state_dict().items():
        assert torch.equal(done.model.state_dict()[name], tensor), name
    again = json.loads((logs / lg.STATE_FILE).read_text())
    assert again["ids"] == state["ids"]  # the same runs, continued
    steps = list(range(1, 7))

    tb = logs / "tensorboard" / state["ids"]["tensorboard"]
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2
    assert tensorboard_steps(tb, "step/train_loss") == steps  # each step once, though step 3 ran twice
    assert tensorboard_steps(tb, "eval/val_loss") == [3]
    assert tensorboard_steps(tb, "epoch/val_loss") == [6]
    assert tensorboard_steps(tb, "final/val_loss") == [3, 6]  # the interrupted attempt's summary, then the end

    history = wandb_history((logs / "wandb").glob(f"offline-run-*-{state['ids']['wandb']}"))
    assert len(list((logs / "wandb").glob(f"offline-run-*-{state['ids']['wandb']}"))) == 2
    assert sorted(history["step/train_loss"]) == steps
    assert history["eval/val_loss"] == [3] and history["epoch/val_loss"] == [6]
    assert sorted(history["step/lr"]) == steps

    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{(logs / 'mlflow' / 'mlflow.db').resolve()}")
    run_id = state["ids"]["mlflow"]
    loss = client.get_metric_history(run_id, "step/train_loss")
    assert sorted(m.step for m in loss) == steps
    logged = {m.step: m.value for m in loss}
    assert logged[6] == pytest.approx(done.history.query("kind == 'step' and step == 6")["train_loss"].item())
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert json.loads(run.data.params["lr"]) == 3e-4
    assert run.data.tags["precision"] == "fp32" and run.data.tags["precision_reason"]
    assert run.data.tags["torch"] == torch.__version__
    assert run.data.metrics["final/val_loss"] == pytest.approx(done.summary.val_loss)


def test_unknown_or_missing_logger_is_one_line_naming_the_fix(monkeypatch):
    with pytest.raises(lg.LoggerError, match="unknown logger 'neptune'; choose from: tensorboard, wandb, mlflow"):
        TrainConfig(loggers=("neptune",))
    real = lg.importlib.util.find_spec
    monkeypatch.setattr(lg.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    with pytest.raises(lg.LoggerError) as info:
        TrainConfig(loggers="tensorboard,wandb")
    assert str(info.value) == 'logger wandb needs its package: pip install "tier_utils[loggers]"'
    assert TrainConfig(loggers="tensorboard").loggers == ("tensorboard",)


def test_cli_train_log_bad_name_exits_2_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["train", "--out", str(out), "--log", "nope", "--max-steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown logger 'nope'" in err
    assert not out.exists()


def test_cli_train_log_writes_tensorboard_under_out(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["train", "--model", "tiny-gpt", *TINY_ARGS, "--data", "synthetic", "--seq-len", "16",
                 "--batch-size", "4", "--max-steps", "2", "--log-every", "1", "--eval-batches", "1", "--out", str(out),
                 "--log", "tensorboard", "--no-progress"])
    assert code == 0
    (run_dir,) = (out / "logs" / "tensorboard").iterdir()
    assert tensorboard_steps(run_dir, "step/train_loss") == [1, 2]


def tensorboard_text(folder: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    (event,) = acc.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def test_search_logs_one_run_per_trial(tmp_path):
    from tier_utils import search

    torch.manual_seed(0)
    result = search(tiny(), tokens(), n_trials=2, max_steps=2, eval_every=1, eval_batches=1,
                    seq_len=16, batch_size=4, log_every=1, space={"lr": ("log", 1e-4, 1e-3)},
                    loggers=("tensorboard",), log_dir=str(tmp_path))
    runs = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    assert runs == ["tier_utils-trial-0", "tier_utils-trial-1"]
    for trial, name in zip(result.study.trials, runs):
        assert tensorboard_steps(tmp_path / "tensorboard" / name, "step/train_loss") == [1, 2]
        assert f"**lr**: {trial.params['lr']}" in tensorboard_text(tmp_path / "tensorboard" / name, "config")


def test_amp_benchmark_logs_its_tables(tmp_path):
    from tier_utils import amp_benchmark

    torch.manual_seed(0)
    result = amp_benchmark(tiny(), precisions=("fp32",), batch_size=4, seq_len=16,
                           untimed_steps=0, timed_steps=1, repeats=1, accuracy_steps=0, progress=False, device="cpu",
                           loggers="tensorboard", log_dir=str(tmp_path))
    (run,) = (tmp_path / "tensorboard").iterdir()
    assert run.name.startswith("amp_benchmark-TinyGPT-")
    table = tensorboard_text(run, "amp_benchmark")
    assert table.splitlines()[0].startswith(",".join(map(str, result.table.columns[:3])))
    assert "speed" in tensorboard_text(run, "verdicts")
