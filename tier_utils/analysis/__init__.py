"""Tier 2: explain a model. `analyze(model)` -> AnalysisReport (attention, robustness, attribution,
precision headroom, per-op dtypes); each analysis lives in its own module here."""
from .capture import capture_attention
from .dtypes import OpDtypeRecorder
from .suite import ANALYSES, TABLE_COLUMNS, AnalysisConfig, AnalysisReport, analyze

__all__ = ["ANALYSES", "TABLE_COLUMNS", "AnalysisConfig", "AnalysisReport", "OpDtypeRecorder", "analyze",
           "capture_attention"]
