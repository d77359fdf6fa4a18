"""The user's model and data, below every tier: loading a spec, the tokenizer, the adapter (how to call the
model), datasets and loaders, checkpoints, the training step (AdamW, the LR schedule, autocast and the
GradScaler), torch.compile, evaluation, and the shipped demo model. It imports only core."""
