"""A training run as one tracker run (tier_utils/training/tracking.py)."""
from tier_utils import TrainConfig
from tier_utils.training.tracking import open_train_run


def test_only_rank_0_logs(tmp_path):
    cfg = TrainConfig(loggers=("tensorboard",), log_dir=str(tmp_path))
    info = {"model": "M", "precision": "fp32"}
    assert not open_train_run(cfg, is_main=False, resumed=False, info=info).backends
    run = open_train_run(cfg, is_main=True, resumed=False, info=info)
    assert list(run.backends) == ["tensorboard"] and run.run_name.startswith("M-fp32-")
    run.close()
