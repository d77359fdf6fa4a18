"""Tokenizers behind one small interface: byte-level (the built-ins' own) or a model's own through
transformers' `AutoTokenizer` (a `save_pretrained` folder or a hub id).

Every tier that turns text into ids goes through a `Tokenizer`: the ids a model is fed are the ids it
was trained on, and results name the tokenizer they used.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np  # always installed: pandas needs it
import torch

from ..core.errors import ModelSpecError, one_line
from ..core.hub import HUB_PREFIX, from_hub

BYTE_VOCAB = 256
BYTES = "bytes"


class Tokenizer:
    """Text <-> ids. `name` says which (results print it); `vocab_size` is the number of ids it can emit."""

    name: str
    vocab_size: int
    pad_id: int | None = None
    bos_id: int | None = None
    eos_id: int | None = None

    def encode(self, text: str) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_example(self, text: str, target: bool = False) -> torch.Tensor:
        """One example as the model's tokenizer encodes it on its own, its special tokens included (a pair's
        source, or with `target` its target); running text cut into windows uses `encode`."""
        return self.encode(text)

    def label(self, token: int) -> str:
        """A short printable label for one token (plots, attribution tables)."""
        text = self.decode([token])
        return text.replace("\n", "⏎").replace(" ", "␣") if text.strip() or text else f"<{token}>"

    def save(self, folder) -> None:
        """Write it beside a saved model, so the folder loads with its tokenizer."""
        raise ModelSpecError(f"the {self.name} tokenizer has no save_pretrained form; nothing to save")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab {self.vocab_size})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255: needs no download and no vocabulary file."""

    name, vocab_size = BYTES, BYTE_VOCAB

    def encode(self, text: str) -> torch.Tensor:
        return torch.from_numpy(np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64))

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids if 0 <= int(t) < BYTE_VOCAB).decode("utf-8", errors="replace")

    def label(self, token: int) -> str:
        if token == 10:
            return "⏎"
        if 32 <= token < 127:
            return chr(token)
        return f"<{token}>" if token >= BYTE_VOCAB else "·"


class HFTokenizer(Tokenizer):
    """A transformers tokenizer (fast or slow). Its special ids come from it; no special tokens are added
    when encoding running text, so windows cut from a corpus are what the model saw in pretraining."""

    def __init__(self, hf, name: str | None = None):
        self.hf = hf
        self.name = name or getattr(hf, "name_or_path", "") or type(hf).__name__
        self.vocab_size = len(hf)  # the base vocabulary plus added tokens: the largest id it can emit + 1
        self.pad_id = hf.pad_token_id if hf.pad_token_id is not None else hf.eos_token_id
        self.bos_id, self.eos_id = hf.bos_token_id, hf.eos_token_id

    def encode(self, text: str) -> torch.Tensor:
        # verbose=False: a corpus is longer than the model's window by design, it is cut into windows later.
        ids = self.hf(text, add_special_tokens=False, verbose=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids) -> str:
        return self.hf.decode([int(t) for t in ids])

    def encode_example(self, text: str, target: bool = False) -> torch.Tensor:
        encoded = self.hf(text_target=text) if target else self.hf(text)  # with T5's / BART's special tokens
        return torch.tensor(encoded["input_ids"], dtype=torch.long)

    def save(self, folder) -> None:
        self.hf.save_pretrained(folder)


def is_tokenizer_folder(path: Path) -> bool:
    # spiece.model: T5's SentencePiece; source.spm: Marian's.
    return path.is_dir() and any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json",
                                                                 "tokenizer.model", "spiece.model", "source.spm"))


def load_tokenizer(spec) -> Tokenizer:
    """A Tokenizer from: a Tokenizer (as is), a transformers tokenizer, "bytes", a folder holding tokenizer
    files, or a hub id (`hf:ORG/NAME` or `ORG/NAME`; needs network)."""
    if isinstance(spec, Tokenizer):
        return spec
    if spec is None or spec == BYTES:
        return ByteTokenizer()
    if hasattr(spec, "convert_ids_to_tokens"):  # a transformers tokenizer object
        return HFTokenizer(spec)
    if not isinstance(spec, (str, Path)) or not str(spec).strip():
        raise ModelSpecError(f"tokenizer must be 'bytes', a folder or a hub id, got {type(spec).__name__}")
    text = str(spec).strip()
    path = Path(text).expanduser()
    if path.exists():
        if not is_tokenizer_folder(path):
            raise ModelSpecError(f"{text} holds no tokenizer files (tokenizer.json, tokenizer_config.json, "
                                 "vocab.json); give the folder save_pretrained wrote, a hub id or 'bytes'")
        return _auto_tokenizer(str(path.resolve()))
    return _auto_tokenizer(text.removeprefix(HUB_PREFIX), hub=True)


def _auto_tokenizer(where: str, hub: bool = False) -> HFTokenizer:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise ModelSpecError("a model's own tokenizer needs the transformers package; pip install transformers, "
                             "or pass --tokenizer bytes") from exc
    if hub:
        return HFTokenizer(from_hub(AutoTokenizer.from_pretrained, where, "tokenizer"), HUB_PREFIX + where)
    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(where), where)
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"cannot load the tokenizer in {where} ({one_line(exc)[:160]}); check the folder, "
                             "or pass --tokenizer bytes") from exc
