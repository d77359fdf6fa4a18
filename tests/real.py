"""Trained models as users bring them, made here (no hub): a save_pretrained folder with its own BPE tokenizer,
and a model in the convention of popular GPT training code (a config object, forward(idx, targets=None))."""
from pathlib import Path

import torch

from tier_utils import load_model, train
from tier_utils.data.datasets import corpus_split, corpus_topics

BPE_VOCAB = 1000
GPT2_SIZES = dict(n_embd=64, n_layer=2, n_head=4, n_positions=128)


def bpe_tokenizer():
    """A byte-level BPE tokenizer trained on the corpus' training topics, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    train_topics, _ = corpus_split()
    corpus = corpus_topics()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((corpus[t] for t in train_topics), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")


def trained_hf_folder(folder: Path, steps: int = 150) -> Path:
    torch.manual_seed(0)
    tokenizer = bpe_tokenizer()
    model = load_model("hf:GPT2LMHeadModel", vocab_size=len(tokenizer), **GPT2_SIZES,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    result = train(load_model(model, tokenizer=tokenizer), None, max_steps=steps, batch_size=8, seq_len=64, lr=5e-3,
                   warmup_steps=10, progress=False, device="cpu")
    result.model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "trained_val_loss.txt").write_text(f"{result.summary.val_loss}\n")
    return folder


NANO_MODEL = '''
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 256
    n_layer: int = 1
    n_head: int = 2
    n_embd: int = 32


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = nn.MultiheadAttention(config.n_embd, config.n_head, batch_first=True)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, x):
        T = x.size(1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:  # inference-time shortcut: only the last position
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss
'''

NANO_FACTORY = '''
from model import GPT, GPTConfig  # a file beside this one, as in a GPT training repository


def build(**kwargs):
    return GPT(GPTConfig(**kwargs))
'''


def nano_gpt_files(folder: Path) -> str:
    """model.py (the GPT code) and build.py (a factory importing it) in `folder`; returns the spec."""
    (folder / "model.py").write_text(NANO_MODEL)
    (folder / "build.py").write_text(NANO_FACTORY)
    return f"{folder / 'build.py'}:build"
