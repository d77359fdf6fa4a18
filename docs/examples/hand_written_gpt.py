"""A GPT written the way current GPT code is: attention through F.scaled_dot_product_attention (grouped-query,
is_causal), zero-initialised residual output projections, RMS norm, and an assertion on its own limits.

Tier 2 reads its attention maps without any change to it (`file.py:Name` spec):

    python -m tier_utils analyze --model docs/examples/hand_written_gpt.py:HandWrittenGPT --analyses attention
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, n_head: int, n_kv_head: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, width // n_head
        self.c_q = nn.Linear(width, width, bias=False)
        self.c_kv = nn.Linear(width, 2 * n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(width, width, bias=False)
        nn.init.zeros_(self.c_proj.weight)  # each block starts as the identity

    def forward(self, x):
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k, v = self.c_kv(x).view(B, T, 2, self.n_kv_head, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, width: int, n_head: int, n_kv_head: int):
        super().__init__()
        self.attn = CausalSelfAttention(width, n_head, n_kv_head)
        self.c_fc, self.c_proj = nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False)
        nn.init.zeros_(self.c_proj.weight)

    def forward(self, x):
        x = x + self.attn(F.rms_norm(x, (x.size(-1),)))
        return x + self.c_proj(F.relu(self.c_fc(F.rms_norm(x, (x.size(-1),)))).square())


class HandWrittenGPT(nn.Module):
    task = "causal-lm"

    def __init__(self, vocab_size: int = 256, max_len: int = 128, width: int = 64, n_layer: int = 2,
                 n_head: int = 4, n_kv_head: int = 2):
        super().__init__()
        self.max_len = max_len
        self.wte, self.wpe = nn.Embedding(vocab_size, width), nn.Embedding(max_len, width)
        self.h = nn.ModuleList(Block(width, n_head, n_kv_head) for _ in range(n_layer))
        self.lm_head = nn.Linear(width, vocab_size, bias=False)

    def forward(self, input_ids):
        T = input_ids.size(1)
        assert T <= self.max_len, f"sequence length {T} is over max_len={self.max_len}"
        x = self.wte(input_ids) + self.wpe(torch.arange(T, device=input_ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(F.rms_norm(x, (x.size(-1),)))
