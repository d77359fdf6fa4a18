"""What training runs on, whichever tier calls it: the training step (AdamW, the LR schedule, autocast and the
GradScaler), torch.compile and evaluation."""
