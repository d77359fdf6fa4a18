"""One class per task kind, in one registry (`register_task`); `build_datasets` reads data as a task's batches."""
from .base import Task, build_datasets, register_task, task_named, task_names, task_of_architecture, task_of_output
from .language import CAUSAL_LM, CLASSIFICATION, CausalLM, Classification

__all__ = ["CAUSAL_LM", "CLASSIFICATION", "CausalLM", "Classification", "Task", "build_datasets", "register_task",
           "task_named", "task_names", "task_of_architecture", "task_of_output"]
