"""How to call a model (the one place): calling conventions, where the logits are, task, vocab and max length,
and resolving a spec plus data into a model with its datasets. It imports core, data and models."""
