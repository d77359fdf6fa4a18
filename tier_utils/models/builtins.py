"""The built-in networks (tiny-gpt, tiny-encoder, tiny-seq2seq, tiny-vit) and the names of the built-in specs."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.errors import ModelSpecError


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through SDPA (tier 2 reads its maps from the SDPA call); `causal=False`: every
    position sees every other (a ViT's patches)."""

    def __init__(self, d_model: int, n_head: int, dropout: float, causal: bool = True):
        super().__init__()
        self.causal = causal
        if d_model % n_head:
            raise ModelSpecError(f"d_model={d_model} is not divisible by n_head={n_head}; pick sizes that divide")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, n_head: int, dropout: float, causal: bool = True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, causal)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model), nn.Dropout(dropout)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _TokenModel(nn.Module):
    """What both built-ins share: token + learned position embeddings, and HF-style accessors."""

    def __init__(self, vocab_size: int, max_len: int, d_model: int):
        super().__init__()
        self.vocab_size, self.max_len = vocab_size, max_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.tok_emb

    def embed(self, input_ids=None, inputs_embeds=None) -> torch.Tensor:
        """Token (or given) embeddings plus positions; inputs_embeds lets tier 2 perturb embeddings."""
        x = self.tok_emb(input_ids) if inputs_embeds is None else inputs_embeds
        T = x.size(1)
        if T > self.max_len:
            raise ValueError(f"sequence length {T} exceeds max_len={self.max_len}; build the model with a larger "
                             "max_len")
        return x + self.pos_emb(torch.arange(T, device=x.device))


class TinyGPT(_TokenModel):
    """Decoder-only language model: token + learned position embeddings, causal blocks, LM head.

    Defaults are byte-level (vocab 256) to match the bundled corpus.
    """

    task = "causal-lm"
    # It ignores attention_mask (its windows carry no padding), so only right padding, which causal
    # attention never looks at, leaves its outputs exact; the adapter's padding check reads this.
    padding_side = "right"

    def __init__(self, vocab_size: int = 256, max_len: int = 128, d_model: int = 128,
                 n_layer: int = 2, n_head: int = 4, dropout: float = 0.0):
        super().__init__(vocab_size, max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None) -> torch.Tensor:
        # attention_mask is accepted for a uniform call signature; causal LM windows carry no padding.
        x = self.drop(self.embed(input_ids, inputs_embeds))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TinyEncoder(_TokenModel):
    """Encoder classifier built on nn.TransformerEncoder: embeddings, encoder, masked mean pool, head."""

    task = "classification"

    def __init__(self, vocab_size: int = 256, max_len: int = 128, d_model: int = 128, n_layer: int = 2,
                 n_head: int = 4, num_classes: int = 4, dropout: float = 0.0):
        super().__init__(vocab_size, max_len, d_model)
        self.num_classes = num_classes
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        # enable_nested_tensor=False keeps padded batches on one code path (and quiets a warning).
        self.encoder = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)
        self.apply(_init_weights)

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None) -> torch.Tensor:
        x = self.embed(input_ids, inputs_embeds)
        pad = None if attention_mask is None else attention_mask == 0
        x = self.ln_f(self.encoder(x, src_key_padding_mask=pad))
        # In the activations' dtype: an fp32 mask would promote a bf16 model's pooled vector past its head.
        keep = (torch.ones(x.shape[:2], device=x.device, dtype=x.dtype) if attention_mask is None
                else attention_mask.to(x.dtype))
        pooled = (x * keep.unsqueeze(-1)).sum(1) / keep.sum(1, keepdim=True).clamp(min=1)
        return self.head(pooled)


class TinySeq2Seq(_TokenModel):
    """Encoder-decoder built on nn.Transformer: one token and position table for both sides, an encoder over the
    source, a causal decoder reading it through cross-attention, an LM head over the target positions."""

    task = "seq2seq"

    def __init__(self, vocab_size: int = 256, max_len: int = 128, d_model: int = 128,
                 n_layer: int = 2, n_head: int = 4, dropout: float = 0.0):
        super().__init__(vocab_size, max_len, d_model)
        if d_model % n_head:
            raise ModelSpecError(f"d_model={d_model} is not divisible by n_head={n_head}; pick sizes that divide")
        layer = nn.TransformerEncoderLayer(d_model, n_head, 4 * d_model, dropout, batch_first=True, norm_first=True)
        # Its own encoder: nn.Transformer's asks for nested tensors, which pre-norm layers can't use (a warning each
        # time the model is built).
        encoder = nn.TransformerEncoder(layer, n_layer, nn.LayerNorm(d_model), enable_nested_tensor=False)
        self.transformer = nn.Transformer(d_model, n_head, n_layer, n_layer, 4 * d_model, dropout,
                                          custom_encoder=encoder, batch_first=True, norm_first=True)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(_init_weights)

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, inputs_embeds=None):
        src, tgt = self.embed(input_ids, inputs_embeds), self.embed(decoder_input_ids)
        pad = None if attention_mask is None else attention_mask == 0
        T = tgt.size(1)
        future = torch.ones(T, T, dtype=torch.bool, device=tgt.device).triu(1)  # a target sees only its past
        out = self.transformer(src, tgt, tgt_mask=future, src_key_padding_mask=pad, memory_key_padding_mask=pad,
                               tgt_is_causal=True)
        return self.head(out)


class TinyViT(nn.Module):
    """Vision transformer classifier: a patch embedding (a strided convolution), a CLS token and learned positions,
    bidirectional blocks, the head on the CLS token. Its size, mean and std are declared: it has no processor."""

    task = "image-classification"
    mean = std = (0.5, 0.5, 0.5)

    def __init__(self, image_size: int = 32, patch_size: int = 8, num_channels: int = 3, d_model: int = 64,
                 n_layer: int = 2, n_head: int = 4, num_classes: int = 4, dropout: float = 0.0):
        super().__init__()
        if image_size % patch_size:
            raise ModelSpecError(f"image_size={image_size} is not divisible by patch_size={patch_size}; pick sizes "
                                 "that divide")
        self.image_size, self.num_channels, self.num_classes = image_size, num_channels, num_classes
        self.patch_embed = nn.Conv2d(num_channels, d_model, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image_size // patch_size) ** 2 + 1, d_model))
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout, causal=False) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes)
        self.apply(_init_weights)
        for table in (self.cls_token, self.pos_embed):  # ViT's: small random, so each position starts distinct
            nn.init.trunc_normal_(table, std=0.02)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        # In the weights' dtype, as transformers' ViT does: bf16 weights run without autocast in the benchmark.
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        if x.size(1) != self.pos_embed.size(1):
            raise ValueError(f"images of {tuple(pixel_values.shape[-2:])} give {x.size(1) - 1} patches but the "
                             f"model was built for {self.image_size} x {self.image_size}; resize the images")
        x = self.drop(x + self.pos_embed)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x[:, 0]))


def _init_weights(module: nn.Module) -> None:
    # GPT-2's init: N(0, 0.02) for linear and embedding weights, zero biases.
    if isinstance(module, (nn.Linear, nn.Embedding, nn.Conv2d)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


BUILTIN_MODELS = {"tiny-gpt": TinyGPT, "tiny-encoder": TinyEncoder, "tiny-seq2seq": TinySeq2Seq, "tiny-vit": TinyViT}
DEFAULT_MODEL = "tiny-gpt"
# A tiny-gpt trained on the bundled corpus, shipped in the package (tier_utils/models/demo_model.py); fixed sizes, no
# kwargs. Tier 2 analyses it where the user left DEFAULT_MODEL, so its first picture is of a trained model.
DEMO_MODEL = "tiny-gpt-trained"
