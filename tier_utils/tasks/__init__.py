"""One class per task kind, in one registry (`register_task`); `build_datasets` reads data as a task's batches."""
from .base import (
    Task,
    build_datasets,
    marked_task,
    recognized_task,
    register_task,
    task_named,
    task_names,
    task_of_output,
)
from .language import CAUSAL_LM, CLASSIFICATION, CausalLM, Classification
from .seq2seq import SEQ2SEQ, Seq2Seq, unsupported_encoder_decoder
from .vision import IMAGE_CLASSIFICATION, ImageClassification

__all__ = ["CAUSAL_LM", "CLASSIFICATION", "IMAGE_CLASSIFICATION", "SEQ2SEQ", "CausalLM", "Classification",
           "ImageClassification", "Seq2Seq", "Task", "build_datasets", "marked_task",
           "recognized_task", "register_task", "task_named", "task_names", "task_of_output",
           "unsupported_encoder_decoder"]
