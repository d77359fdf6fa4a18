"""Small GPTs written the ways people write them today, for tier 2's attention capture and tier 1's recipe checks.

Each attention module can also return its probabilities itself (`forward(ids, return_maps=True)` gives
(logits, {module path: (B, H, T, T)})): a copy of the model called that way is the reference the captured
maps are compared with. The capture itself never uses that path.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, WIDTH, HEADS, LAYERS, MAX_LEN = 256, 32, 4, 2, 32


class SdpaCausal(nn.Module):
    """SDPA with is_causal=True, the standard fast path."""

    def __init__(self, n_kv_head: int = HEADS):
        super().__init__()
        self.n_kv_head, self.head_dim = n_kv_head, WIDTH // HEADS
        self.c_q = nn.Linear(WIDTH, WIDTH)
        self.c_kv = nn.Linear(WIDTH, 2 * n_kv_head * self.head_dim)
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def heads(self, x):
        B, T, _ = x.shape
        q = self.c_q(x).view(B, T, HEADS, self.head_dim).transpose(1, 2)
        k, v = self.c_kv(x).view(B, T, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)
        return q, k, v

    def forward(self, x, maps=None, path=""):
        q, k, v = self.heads(x)
        if maps is not None:  # the reference: the probabilities written out
            maps[path] = _softmax(q, k, torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device).tril())
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).flatten(2))


class SdpaWindowGqa(SdpaCausal):
    """SDPA with an explicit sliding-window mask and grouped-query attention (2 key/value heads for 4)."""

    window = 5

    def __init__(self):
        super().__init__(n_kv_head=2)

    def mask(self, T, device):
        i = torch.arange(T, device=device)
        return (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < self.window)

    def forward(self, x, maps=None, path=""):
        q, k, v = self.heads(x)
        mask = self.mask(x.size(1), x.device)
        if maps is not None:
            maps[path] = _softmax(q, k.repeat_interleave(HEADS // self.n_kv_head, dim=1), mask)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.c_proj(y.transpose(1, 2).flatten(2))


class HandSoftmax(SdpaCausal):
    """softmax(q kᵀ / √d) with masked_fill, written out."""

    def forward(self, x, maps=None, path=""):
        q, k, v = self.heads(x)
        T = x.size(1)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).tril() == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        if maps is not None:
            maps[path] = att
        return self.c_proj((att @ v).transpose(1, 2).flatten(2))


def _softmax(q, k, allowed):
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1)


class Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(WIDTH), attention(), nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x, maps=None, path=""):
        x = x + self.attn(self.ln_1(x), maps, f"{path}.attn")
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """transformer.h.{i}.attn, as GPT code names it; the attention style is a class argument."""

    task, max_len = "causal-lm", MAX_LEN

    def __init__(self, attention=SdpaCausal):
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(VOCAB, WIDTH), "wpe": nn.Embedding(MAX_LEN, WIDTH),
                                          "h": nn.ModuleList(Block(attention) for _ in range(LAYERS))})
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids, return_maps=False):
        maps = {} if return_maps else None
        positions = torch.arange(input_ids.size(1), device=input_ids.device)
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, maps, f"transformer.h.{i}")
        logits = self.lm_head(x)
        return (logits, maps) if return_maps else logits


class Unnamed(nn.Module):
    """SDPA called from the model's own forward, in a loop over weights: no submodule to tie the calls to."""

    task, max_len = "causal-lm", MAX_LEN

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.qkv = nn.ParameterList(nn.Parameter(torch.randn(WIDTH, 3 * WIDTH) * 0.2) for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids):
        x = self.emb(input_ids)
        B, T, _ = x.shape
        for w in self.qkv:
            q, k, v = (x @ w).view(B, T, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        return self.head(x)


@torch.library.custom_op("tier_utils_tests::fused_attention", mutates_args=())
def fused_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Stands in for a flash-attention package's kernel: the weights never exist outside it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@fused_attention.register_fake
def _(q, k, v):
    return torch.empty_like(q)


class FusedKernel(SdpaCausal):
    def __init__(self):
        super().__init__()
        self.use_flash = True  # the model's own switch; its fallback is the SDPA path

    def forward(self, x, maps=None, path=""):
        q, k, v = self.heads(x)
        y = fused_attention(q, k, v) if self.use_flash else F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).flatten(2))


class ZeroInitGPT(nn.Module):
    """The current recipe: zero-initialised residual output projections, learned scalar gates, RMS norm
    without weights, and a forward that refuses a single token."""

    task, max_len = "causal-lm", MAX_LEN

    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(ZeroInitBlock() for _ in range(LAYERS))
        self.backout_lambda = nn.Parameter(torch.tensor(0.5))
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids):
        B, T = input_ids.shape
        assert T > 1, "Training forward pass should have T > 1"
        x = x0 = F.rms_norm(self.wte(input_ids), (WIDTH,))
        for block in self.blocks:
            x = block(x)
        # A tiny pull back toward the embeddings: its gradient is tiny, which is no vanishing layer.
        x = x - self.backout_lambda * 1e-6 * x0
        return self.lm_head(F.rms_norm(x, (WIDTH,)))


class ZeroInitBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn, self.mlp = ZeroInitAttention(), ZeroInitMLP()
        self.lambdas = nn.Parameter(torch.ones(2))  # per-branch gates

    def forward(self, x):
        x = x + self.lambdas[0] * self.attn(F.rms_norm(x, (WIDTH,)))
        return x + self.lambdas[1] * self.mlp(F.rms_norm(x, (WIDTH,)))


class ZeroInitAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_q, self.c_k, self.c_v = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))
        self.c_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        nn.init.zeros_(self.c_proj.weight)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, HEADS, -1).transpose(1, 2) for f in (self.c_q, self.c_k, self.c_v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).flatten(2))


class ZeroInitMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(WIDTH, 4 * WIDTH, bias=False), nn.Linear(4 * WIDTH, WIDTH, bias=False)
        nn.init.zeros_(self.c_proj.weight)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())
