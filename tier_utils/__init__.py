"""tier_utils: smoke-test (tier 1), analyse (tier 2), train and benchmark mixed precision (tier 3)
for a PyTorch transformer, from notebooks, the CLI or Python."""
from .adapter import ModelAdapter, adapt
from .data import DataSplits, build_datasets, corpus_split, corpus_topics, make_loader
from .errors import AdapterError, DataError, ModelSpecError, TierError
from .info import InfoResult, info
from .models import BUILTIN_MODELS, DEFAULT_MODEL, TinyEncoder, TinyGPT, load_model
from .precision import Precision, canonical_precision, resolve_device, resolve_precision, supported_precisions
from .results import Check
from .train import TrainingDiverged

__version__ = "0.1.0"

__all__ = [
    "AdapterError", "BUILTIN_MODELS", "Check", "DEFAULT_MODEL", "DataError", "DataSplits", "InfoResult",
    "ModelAdapter", "ModelSpecError", "Precision", "TierError", "TinyEncoder", "TinyGPT", "TrainingDiverged",
    "adapt", "build_datasets", "canonical_precision", "corpus_split", "corpus_topics", "info", "load_model",
    "make_loader", "resolve_device", "resolve_precision", "supported_precisions",
]
