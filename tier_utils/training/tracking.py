"""A training run as one experiment-tracker run: the core loggers (TensorBoard, W&B, MLflow), named and
configured from the run's TrainConfig."""
from __future__ import annotations

from ..core.loggers import RunLogger, default_log_dir, run_stamp
from .config import TrainConfig


def open_train_run(cfg: TrainConfig, is_main: bool, resumed: bool, info: dict) -> RunLogger:
    """train()'s RunLogger, its config and `info` (model, precision and reason, device, versions) logged;
    settings resolved from its TrainConfig; nothing on ranks other than 0."""
    if not (cfg.loggers and is_main):
        return RunLogger()
    run = RunLogger(cfg.loggers, default_log_dir(cfg.log_dir, cfg.checkpoint_dir),
                    cfg.log_run_name or f"{info['model']}-{info['precision']}-{run_stamp()}", cfg.log_project,
                    cfg.mlflow_uri, resume=resumed)
    run.params(cfg.to_dict(), info)
    return run
