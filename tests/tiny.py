"""The tiny model most tests build (1 layer, 2 heads, 32 wide, 32 tokens: quick on 2 CPU cores), defined once.

A module, not only fixtures, because parametrize lists and CLI argument lists are built at import time."""
import json
import shutil

import torch
from torch.utils.data import Dataset

from tier_utils import load_model

TINY = dict(d_model=32, n_layer=1, n_head=2, max_len=32)
TINY_ARGS = [a for k, v in TINY.items() for a in ("--model-arg", f"{k}={v}")]  # the same, for the CLI


def tiny(spec="tiny-gpt", seed=None, **kwargs):
    """`spec` (a load_model spec, or a model class such as a TinyGPT subclass) at the tiny size, after
    torch.manual_seed(seed) when a seed is given; kwargs add to or override the sizes."""
    if seed is not None:
        torch.manual_seed(seed)
    kwargs = {**TINY, **kwargs}
    return load_model(spec, **kwargs) if isinstance(spec, str) else spec(**kwargs)


class LengthExamples(Dataset):
    """Classifier examples at their own lengths (token ids 1..n, label i % 2): batches padded per batch."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        n = self.lengths[i]
        return {"input_ids": torch.arange(1, n + 1), "attention_mask": torch.ones(n, dtype=torch.long),
                "labels": torch.tensor(i % 2)}


def without_template(model_folder, into):
    """A copy of a transformers model folder (the chat demo's) whose tokenizer has no chat template: a run on chat
    data then needs --chat-template."""
    shutil.copytree(model_folder, into)
    config = json.loads((into / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (into / "tokenizer_config.json").write_text(json.dumps(config))
    (into / "chat_template.jinja").unlink(missing_ok=True)
    return into
