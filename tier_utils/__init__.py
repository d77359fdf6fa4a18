"""tier_utils: smoke-test (tier 1), analyse (tier 2), train and benchmark mixed precision (tier 3)
for a PyTorch transformer, from notebooks, the CLI or Python."""
from .adapter.adapter import ModelAdapter, adapt
from .analysis import AnalysisConfig, AnalysisReport, analyze
from .benchmark.amp import BenchmarkResult, amp_benchmark
from .benchmark.config import BenchConfig, Thresholds
from .benchmark.strategies import StrategyBenchResult, strategy_benchmark
from .core.errors import (
    AdapterError,
    CheckpointError,
    DataError,
    ExportError,
    HostMemoryShort,
    LaunchError,
    LoggerError,
    MemorySettingError,
    ModelSpecError,
    TierError,
    TrainingDiverged,
    TrainingOutOfMemory,
    debug,
)
from .core.memory_settings import LoraSettings, MemorySettings
from .core.precision import (
    Precision,
    SlowPrecisionWarning,
    canonical_precision,
    resolve_device,
    resolve_precision,
    supported_precisions,
)
from .core.results import Check
from .data.datasets import DataSplits, corpus_split, corpus_topics, make_loader
from .data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
from .data.userdata import DataSource
from .exporting.exporter import ExportConfig, ExportResult, export
from .mainjob import AllResult, run_all
from .models.builtins import BUILTIN_MODELS, DEFAULT_MODEL, TinyEncoder, TinyGPT
from .models.checkpoint import load_checkpoint
from .models.loading import load_model, load_weights
from .planning.device_report import InfoConfig, InfoResult, info
from .planning.planner import FitConfig, FitResult, fit
from .planning.ranks import RanksConfig, RanksResult, plan_ranks
from .report import write_report
from .smoketest.suite import SmokeConfig, SmokeReport, smoke
from .tasks import Task, build_datasets, register_task
from .training.comparison import CompareResult, compare
from .training.config import TrainConfig
from .training.history import TrainResult
from .training.loop import train
from .tuning.study import SearchConfig, SearchResult, search

__version__ = "0.1.0"

# Importing changes no global state: each run chooses its torch thread count as it starts (core/threads.py).
__all__ = [
    # setup: models, data, precision
    "BUILTIN_MODELS", "DEFAULT_MODEL", "TinyEncoder", "TinyGPT", "load_model", "load_weights", "ModelAdapter", "adapt",
    "Tokenizer", "ByteTokenizer", "HFTokenizer", "load_tokenizer",
    "DataSplits", "DataSource", "build_datasets", "corpus_split", "corpus_topics", "make_loader", "Task",
    "register_task",
    "Precision", "SlowPrecisionWarning", "canonical_precision", "resolve_device", "resolve_precision",
    "supported_precisions", "InfoConfig", "InfoResult", "info",
    # tier 1, tier 2
    "Check", "SmokeConfig", "SmokeReport", "smoke", "AnalysisConfig", "AnalysisReport", "analyze",
    # tier 3
    "TrainConfig", "TrainResult", "TrainingDiverged", "train", "CheckpointError", "load_checkpoint",
    "TrainingOutOfMemory", "HostMemoryShort",
    "BenchConfig", "BenchmarkResult", "Thresholds", "amp_benchmark", "StrategyBenchResult", "strategy_benchmark",
    "SearchConfig", "SearchResult", "search", "CompareResult", "compare",
    "FitConfig", "FitResult", "fit", "LoraSettings", "MemorySettings", "MemorySettingError",
    "RanksConfig", "RanksResult", "plan_ranks", "LaunchError",
    # export, experiment loggers
    "ExportConfig", "ExportResult", "export", "ExportError", "LoggerError",
    # the main job
    "AllResult", "run_all", "write_report",
    # errors
    "TierError", "AdapterError", "DataError", "ModelSpecError", "debug",
]
