"""tier_utils: smoke-test (tier 1), analyse (tier 2), train and benchmark mixed precision (tier 3)
for a PyTorch transformer, from notebooks, the CLI or Python."""
from .adapter import ModelAdapter, adapt
from .analysis import AnalysisReport, analyze
from .bench import BenchmarkResult, amp_benchmark
from .data import DataSplits, build_datasets, corpus_split, corpus_topics, make_loader
from .errors import AdapterError, DataError, ModelSpecError, TierError
from .info import InfoResult, info
from .models import BUILTIN_MODELS, DEFAULT_MODEL, TinyEncoder, TinyGPT, load_model
from .precision import Precision, canonical_precision, resolve_device, resolve_precision, supported_precisions
from .report import AllResult, run_all, write_report
from .results import Check
from .search import SearchResult, search
from .smoke import SmokeReport, smoke
from .checkpoint import CheckpointError, load_checkpoint
from .history import TrainResult
from .train import TrainConfig, TrainingDiverged, train
from .verdicts import Thresholds

__version__ = "0.1.0"

__all__ = [
    "AdapterError", "AnalysisReport", "BUILTIN_MODELS", "Check", "DEFAULT_MODEL", "DataError", "DataSplits", "InfoResult",
    "ModelAdapter", "ModelSpecError", "Precision", "TierError", "TinyEncoder", "TinyGPT", "TrainingDiverged",
    "adapt", "analyze", "build_datasets", "canonical_precision", "corpus_split", "corpus_topics", "info", "load_model",
    "make_loader", "resolve_device", "resolve_precision", "supported_precisions",
    "SearchResult", "search", "SmokeReport", "smoke",
    "CheckpointError", "TrainConfig", "TrainResult", "load_checkpoint", "train",
    "BenchmarkResult", "Thresholds", "amp_benchmark",
    "AllResult", "run_all", "write_report",
]
