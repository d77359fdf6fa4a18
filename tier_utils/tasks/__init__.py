"""One class per task kind, in one registry (`register_task`); `build_datasets` reads data as a task's batches."""
from .base import Task, build_datasets, recognized_task, register_task, task_named, task_names, task_of_output
from .language import CAUSAL_LM, CLASSIFICATION, CausalLM, Classification
from .seq2seq import SEQ2SEQ, Seq2Seq, unsupported_encoder_decoder

__all__ = ["CAUSAL_LM", "CLASSIFICATION", "SEQ2SEQ", "CausalLM", "Classification", "Seq2Seq", "Task", "build_datasets",
           "recognized_task", "register_task", "task_named", "task_names", "task_of_output",
           "unsupported_encoder_decoder"]
