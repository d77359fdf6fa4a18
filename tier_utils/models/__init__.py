"""Spec forms → nn.Module: the built-in networks, `from_pretrained` folders and hub ids, own checkpoints,
`--weights`, and the shipped demo model. It imports core and data (a model's tokenizer)."""
