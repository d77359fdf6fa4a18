"""Experiment loggers: TensorBoard, W&B and MLflow, fed from history rows and results.

They read what train(), amp_benchmark() and search() already produce (history rows, summaries,
tables), never the loop's tensors, so logging adds no host sync: rows exist only at log points.
Every backend is imported lazily; `logger_names` checks the packages are installed before anything runs.

A run's logged identity (run name and each backend's run id) and the last step logged per row kind
are kept in `log_dir/tier_utils_run.json`. A resumed train() reads it, continues the same runs and
leaves out rows at steps already logged (the killed attempt logged them), so no step appears twice.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path

from .errors import LoggerError
from .files import atomic_write_bytes, jsonable
from .inputs import select_names

LOGGER_NAMES = ("tensorboard", "wandb", "mlflow")  # each the name of the package it needs
STATE_FILE = "tier_utils_run.json"


def logger_names(value) -> tuple[str, ...]:
    """Canonical logger names from a tuple/list or "a,b" (empty: none); unknown or missing packages raise."""
    if not value:
        return ()
    try:
        names = select_names(value, LOGGER_NAMES, "logger")
    except ValueError as exc:
        raise LoggerError(str(exc)) from None
    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        raise LoggerError(f"logger {', '.join(missing)} needs its package: pip install \"tier_utils[loggers]\"")
    return tuple(names)


def default_log_dir(log_dir, checkpoint_dir=None) -> Path:
    """`log_dir`, else `logs` beside the checkpoint folder, else runs/logs."""
    if log_dir is not None:
        return Path(log_dir)
    return Path(checkpoint_dir).parent / "logs" if checkpoint_dir is not None else Path("runs") / "logs"


def _numbers(d: dict, prefix: str = "") -> dict:
    """Finite numbers of a (nested) dict, flattened to slash-separated keys."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_numbers(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[f"{prefix}{k}"] = float(v)
    return out


def row_metrics(row: dict) -> dict:
    """A history row as metrics named kind/column (step/train_loss, eval/val_loss, ...); NaNs left out."""
    return _numbers({k: v for k, v in row.items() if k not in ("kind", "step")}, f"{row['kind']}/")


def _text(d: dict) -> str:
    return "\n".join(f"- **{k}**: {v}" for k, v in jsonable(d).items())


class _TensorBoard:
    def __init__(self, log_dir: Path, run_name: str, run_id, project: str, mlflow_uri):
        from torch.utils.tensorboard import SummaryWriter

        self.id = run_id or _unused(log_dir / "tensorboard", run_name)
        self.writer = SummaryWriter(str(log_dir / "tensorboard" / self.id))  # a resumed run adds an event file

    def params(self, config: dict, info: dict) -> None:
        self.writer.add_text("config", _text(config))
        self.writer.add_text("run", _text(info))

    def metrics(self, step: int, values: dict) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def table(self, name: str, df) -> None:
        self.writer.add_text(name, df.to_csv(index=False).replace("\n", "  \n"))

    def summary(self, summary: dict, step: int) -> None:
        self.writer.add_text("summary", _text(summary), step)
        self.metrics(step, _numbers(summary, "final/"))

    def close(self, status: str) -> None:
        self.writer.close()


def _unused(folder: Path, name: str) -> str:
    """`name`, or name-2, name-3, ... if a run folder of that name exists (two runs in the same second)."""
    n, candidate = 1, name
    while (folder / candidate).exists():
        n += 1
        candidate = f"{name}-{n}"
    return candidate


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

        return read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")) is not None
    except Exception:  # an internal helper: if it moves, stay offline rather than fail
        return False


class _WandB:
    def __init__(self, log_dir: Path, run_name: str, run_id, project: str, mlflow_uri):
        import wandb

        self.wandb = wandb
        # WANDB_MODE, when set, decides; otherwise online only for a logged-in user (never a login prompt).
        mode = None if os.environ.get("WANDB_MODE") else ("online" if _wandb_logged_in() else "offline")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=run_name, id=run_id, resume="allow" if run_id else None,
                              dir=str(log_dir), mode=mode, reinit="finish_previous",
                              settings=wandb.Settings(silent=True, console="off", x_disable_stats=True))
        self.id = self.run.id

    def params(self, config: dict, info: dict) -> None:
        self.run.config.update(jsonable({**config, **info}), allow_val_change=True)

    def metrics(self, step: int, values: dict) -> None:
        self.run.log(values, step=step)

    def table(self, name: str, df) -> None:
        rows = [[v if isinstance(v, (int, float, bool)) or v is None else str(v) for v in r.values()]
                for r in jsonable(df)]
        self.run.log({name: self.wandb.Table(columns=[str(c) for c in df.columns], data=rows)})

    def summary(self, summary: dict, step: int) -> None:
        self.run.summary.update(jsonable(summary))

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)


class _MLflow:
    def __init__(self, log_dir: Path, run_name: str, run_id, project: str, mlflow_uri):
        from mlflow import MlflowClient

        uri, artifacts = str(mlflow_uri or log_dir / "mlflow"), None
        if "://" not in uri:  # a folder: a SQLite store in it (MLflow refuses its old file store)
            folder = Path(uri).resolve()
            folder.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{folder / 'mlflow.db'}"
        if uri.startswith("sqlite:///"):  # artifacts beside the database, not in ./mlruns wherever we run
            db_folder = Path(uri[len("sqlite:///"):]).resolve().parent
            db_folder.mkdir(parents=True, exist_ok=True)
            artifacts = (db_folder / "artifacts").as_uri()
        self.client = MlflowClient(uri)
        if run_id is None:
            exp = self.client.get_experiment_by_name(project)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(project, artifact_location=artifacts)
            run_id = self.client.create_run(exp_id, run_name=run_name).info.run_id
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.id = run_id

    def params(self, config: dict, info: dict) -> None:
        from mlflow.entities import Param, RunTag

        self.client.log_batch(self.id, params=[Param(k, json.dumps(v)[:6000]) for k, v in jsonable(config).items()],
                              tags=[RunTag(k, str(v)[:5000]) for k, v in jsonable(info).items()])

    def metrics(self, step: int, values: dict) -> None:
        from mlflow.entities import Metric

        now = int(datetime.now(timezone.utc).timestamp() * 1000)
        self.client.log_batch(self.id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def table(self, name: str, df) -> None:
        self.client.log_table(self.id, df.astype(str), f"{name}.json")

    def summary(self, summary: dict, step: int) -> None:
        self.client.log_dict(self.id, jsonable(summary), "summary.json")
        self.metrics(step, _numbers(summary, "final/"))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.id, status)


_BACKENDS = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}


class RunLogger:
    """One run in every named logger. With no names (or on a rank other than 0) every call does nothing.

    resume=True continues the runs recorded in log_dir's state file (a new run when there is none)
    and skips rows at steps already logged there.
    """

    def __init__(self, names=(), log_dir="runs/logs", run_name: str | None = None, project: str = "tier_utils",
                 mlflow_uri: str | None = None, resume: bool = False):
        self.dir, self.backends, self._seen = Path(log_dir), {}, 0
        names = logger_names(names)
        state = self._read_state() if names and resume else None
        self.resumed = state is not None
        self.last = dict(state["last"]) if state else {}
        if not names:
            return
        self.run_name = state["run_name"] if state else run_name or "run"
        ids = state["ids"] if state else {}
        try:
            for n in names:
                self.backends[n] = _BACKENDS[n](self.dir, self.run_name, ids.get(n), project, mlflow_uri)
        except BaseException:
            self.close("FAILED")
            raise
        self._write_state()

    def _read_state(self) -> dict | None:
        path = self.dir / STATE_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def _write_state(self) -> None:
        ids = {n: b.id for n, b in self.backends.items()}
        atomic_write_bytes(self.dir / STATE_FILE, json.dumps({"run_name": self.run_name, "ids": ids,
                                                              "last": self.last}).encode())

    def _each(self, method: str, *args) -> None:
        for backend in self.backends.values():
            getattr(backend, method)(*args)

    def params(self, config: dict, info: dict) -> None:
        """The settings and the run's facts (precision decision and reason, device, versions); once per run."""
        if self.backends and not self.resumed:  # MLflow params are write-once; a resumed run has them
            self._each("params", config, info)

    def rows(self, rows: list[dict]) -> None:
        """Log the rows appended since the last call (cheap when there are none: call it every step)."""
        if not self.backends or len(rows) == self._seen:
            return
        new, self._seen = rows[self._seen:], len(rows)
        logged = False
        for row in new:
            if row["step"] <= self.last.get(row["kind"], -1):
                continue  # logged before a crash, or restored from the checkpoint
            self._each("metrics", int(row["step"]), row_metrics(row))
            self.last[row["kind"]] = int(row["step"])
            logged = True
        if logged:
            self._write_state()

    def table(self, name: str, df) -> None:
        self._each("table", name, df)

    def finish(self, summary: dict, step: int, status: str = "FINISHED") -> None:
        """The final summary, then close."""
        if self.backends:
            self._each("summary", summary, step)
        self.close(status)

    def close(self, status: str = "FINISHED") -> None:
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.close(status)


def run_stamp() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")


def log_result_tables(names, log_dir, run_name: str, tables: dict, info: dict, project: str = "tier_utils") -> None:
    """One run holding a result's tables (e.g. amp_benchmark's per-precision table and verdicts);
    log_dir None: runs/logs."""
    run = RunLogger(names, default_log_dir(log_dir), run_name, project)
    try:
        run.params({}, info)
        for name, df in tables.items():
            run.table(name, df)
    finally:
        run.close()
