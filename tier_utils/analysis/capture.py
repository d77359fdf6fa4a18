"""Attention maps from any model, unmodified: capture them during the analysis forward only.

Ways in, all installed per instance or per `with` block and undone on exit; the model's outputs are
bitwise those of a plain forward (every captured call runs exactly as the model made it):
- `F.scaled_dot_product_attention` calls, seen through a TorchFunctionMode: the probabilities the call
  implies are recomputed from its q, k, attn_mask, is_causal, scale and enable_gqa (fewer key/value heads
  repeated as SDPA does);
- a hand-written softmax over a (B, H, T, T) or (B, T, T) score tensor whose last two sizes are the
  sequence: its output is the map, and the scores tell which keys the model's mask left visible;
- `nn.MultiheadAttention` (inside `nn.TransformerEncoder` too): per-instance hooks ask for per-head weights;
- Hugging Face models: `output_attentions=True` where the model runs eager attention (the weights come
  back in the output); under SDPA the SDPA capture above, without switching the implementation.
Each map is named by the module that made it (a module stack kept by forward pre-hooks), e.g.
`transformer.h.3.attn`; a call made outside any submodule is named by its order in the forward.
"""
from __future__ import annotations

import contextlib
import inspect
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
             "is_causal")
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SOFTMAX = frozenset({torch.softmax, torch.Tensor.softmax, F.softmax, torch.special.softmax})
# A key whose score sits this far below its row's best is one the model masked out (-inf, finfo.min, -1e9,
# -1e4 all do); no unmasked score gap comes near it, and exp(-1e3) is 0 in any float format anyway.
MASK_GAP = 1e3
# What scoring one map holds at once, in copies of its float32 weights (scores, distance profile, head pairs).
MAP_COPIES = 8
DEFAULT_MAP_BYTES = 256 << 20  # per map when no memory budget was read


@dataclass
class AttentionMap:
    name: str
    weights: torch.Tensor  # (B, heads, T_query, T_key) float32, detached
    allowed: torch.Tensor | None  # (B, T_query, T_key) bool: keys the call's own mask left visible; None unknown


class ModuleStack:
    """Which module is running now: pushed by forward pre-hooks, popped by forward hooks (on errors too)."""

    def __init__(self, model: nn.Module):
        self.names: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            self._handles.append(module.register_forward_pre_hook(partial(self._push, name)))
            self._handles.append(module.register_forward_hook(self._pop, always_call=True))

    def _push(self, name, module, args) -> None:
        self.names.append(name)

    def _pop(self, module, args, output) -> None:
        if self.names:
            self.names.pop()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def sdpa_probabilities(rows: int, query, key, value=None, attn_mask=None, dropout_p=0.0, is_causal=False,
                       scale=None, enable_gqa=False) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax an SDPA call computes, for its first `rows` sequences: ((rows, H, L, S) float32 weights,
    (rows, L, S) bool visible keys). Dropout is not applied: the analysis runs in eval mode."""
    with torch.no_grad(), torch.autocast(query.device.type, enabled=False):
        q, k = query[:rows].float(), key[:rows].float()
        if enable_gqa and q.dim() > 2 and k.size(-3) != q.size(-3):
            k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        scores = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(q.size(-1)) if scale is None else scale)
        L, S = scores.shape[-2:]
        if is_causal:  # top-left aligned, as SDPA's own causal mask
            causal = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril()
            scores = scores.masked_fill(~causal, -math.inf)
        if attn_mask is not None:
            mask = attn_mask[:rows] if attn_mask.dim() == scores.dim() and attn_mask.size(0) == query.size(0) \
                else attn_mask
            scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.float()
        return _with_heads(scores.softmax(-1), scores)


def _with_heads(weights: torch.Tensor, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, H, L, S) weights and (B, L, S) visible keys (visible to any head) from (B, [H,] L, S) tensors."""
    visible = ~(scores < scores.amax(-1, keepdim=True) - MASK_GAP)  # NaN rows stay visible: they are counted
    if weights.dim() == 3:
        return weights.unsqueeze(1), visible
    return weights, visible.expand(weights.shape).any(1)


def _kernel_name(func) -> str | None:
    """An attention kernel other than SDPA (a flash-attention package's op, an aten fused kernel), or None."""
    name = str(func) if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) \
        else f"{getattr(func, '__module__', '') or ''}.{getattr(func, '__qualname__', func)}"
    if func is F.multi_head_attention_forward:  # nn.MultiheadAttention's own path: its hooks read it
        return None
    return name.strip(".") if any(key in name.lower() for key in ("attn", "attention")) else None


class _CallCapture(TorchFunctionMode):
    """Sees every torch function call of the forward; keeps SDPA and score-softmax maps, notes other kernels."""

    def __init__(self, cap: AttentionCapture, stack: ModuleStack):
        super().__init__()
        self.cap, self.stack = cap, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # the model's own call, untouched; this mode is off while it runs
        if func is F.scaled_dot_product_attention:
            self._sdpa(args, kwargs)
        elif func in _SOFTMAX:
            self._softmax(out, args, kwargs)
        else:
            kernel = _kernel_name(func)
            if kernel is not None:
                self.cap.kernels.add(kernel)
        return out

    def _owner(self, kind: str) -> str | None:
        """The module path that made this call (None: inside a module whose maps come another way)."""
        if self.cap.owned.intersection(self.stack.names):
            return None
        path = self.stack.names[-1] if self.stack.names else ""
        if not path:  # not tied to any submodule: named by its order among this forward's captured calls
            return f"{kind} call {self.cap.calls}"
        return path

    def _sdpa(self, args, kwargs) -> None:
        bound = {**dict(zip(_SDPA_ARGS, args)), **kwargs}
        q, k = bound["query"], bound["key"]
        name = self._owner("sdpa")
        if name is None or q.dim() < 3:
            return
        heads = q.size(-3) if q.dim() > 3 else 1
        rows = self.cap.rows_for(q.size(0), heads * q.size(-2) * k.size(-2))
        if rows:
            self.cap.add("SDPA capture", name, *sdpa_probabilities(rows, **bound), q.size(0))

    def _softmax(self, out, args, kwargs) -> None:
        scores = args[0]
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        if not isinstance(scores, torch.Tensor) or scores.dim() not in (3, 4) or dim is None:
            return
        # Square scores over the analysed length, or any where it is None (an image's patches, counted by the model).
        square = scores.size(-1) == scores.size(-2) and self.cap.seq_len in (None, scores.size(-1))
        if dim % scores.dim() != scores.dim() - 1 or not square:
            return
        name = self._owner("softmax")
        rows = 0 if name is None else self.cap.rows_for(scores.size(0), scores[0].numel())
        if rows:
            with torch.no_grad(), torch.autocast(scores.device.type, enabled=False):
                weights, allowed = _with_heads(out[:rows].detach().float().clone(), scores[:rows].detach())
            self.cap.add("softmax capture", name, weights, allowed, scores.size(0))


class AttentionCapture:
    """Maps of one forward, in call order, handed to `on_map(AttentionMap)` as they come (or kept in `.maps`).

    seq_len: the analysed sequence length (a softmax over (T, T) scores is an attention map; None: over any square
    scores, for an input whose token count the model decides; 0: no softmax capture);
    max_map_bytes: what one map's scoring may hold; a map gets as many sequences of the batch as fit.
    """

    def __init__(self, seq_len: int | None = 0, max_map_bytes: int = DEFAULT_MAP_BYTES):
        self.maps: list[AttentionMap] = []
        self.on_map = None
        self.seq_len, self.max_map_bytes = seq_len, max_map_bytes
        self.kinds: set[str] = set()  # how the maps were found, e.g. "SDPA capture"
        self.needs_grad = False  # MHA: keep TransformerEncoderLayer off its fused path (it skips the hooks)
        self.owned: set[str] = set()  # module paths whose maps come from hooks, not from calls inside them
        self.kernels: set[str] = set()  # attention kernels outside SDPA that ran
        self.rows: dict[str, tuple[int, int]] = {}  # map name -> (sequences kept, of the batch)
        self.largest = 0  # bytes of the largest map kept
        self.calls = 0  # maps of this forward so far
        self._names: dict[str, int] = {}
        self._hf = False
        self.hf_paths: list[str] = []  # HF attention modules, in layer order

    def new_forward(self) -> None:
        self.maps.clear()
        self.calls, self._names = 0, {}

    def rows_for(self, batch: int, per_row: int) -> int:
        """Sequences of a map that fit max_map_bytes (0: not even one; that map is left out)."""
        return min(batch, self.max_map_bytes // max(1, per_row * 4 * MAP_COPIES))

    @property
    def source(self) -> str:
        return ", ".join(sorted(self.kinds))

    def add(self, kind: str, name: str, weights: torch.Tensor, allowed: torch.Tensor | None, batch: int) -> None:
        """Keep a map of a `batch`-sequence forward: as many of its sequences as fit max_map_bytes."""
        seen = self._names[name] = self._names.get(name, 0) + 1
        name = name if seen == 1 else f"{name}#{seen}"  # one module calling attention twice per forward
        self.calls += 1
        rows = min(weights.size(0), self.rows_for(batch, weights[0].numel()))
        if not rows:
            return
        weights = weights[:rows].detach()
        self.rows[name] = (rows, batch)
        self.kinds.add(kind)
        self.largest = max(self.largest, weights.numel() * 4)
        found = AttentionMap(name, weights, None if allowed is None else allowed[:rows])
        if self.on_map is None:
            self.maps.append(found)
        else:
            self.on_map(found)

    def collect(self, output) -> None:
        """An HF output's `attentions`, one per layer, named by the attention modules (`layer_idx`) that
        made them where the count matches, else `layer.N`."""
        if self._hf:
            attentions = getattr(output, "attentions", None) or ()
            paths = self.hf_paths if len(self.hf_paths) == len(attentions) else [f"layer.{i}" for i in
                                                                                  range(len(attentions))]
            for path, a in zip(paths, attentions):
                if a is not None:
                    self.add("HF output_attentions", path, a, None, a.size(0))


def _want_weights(module, args, kwargs):
    kwargs = {**kwargs, **dict(zip(_MHA_ARGS[3:], args[3:]))}
    kwargs.update(need_weights=True, average_attn_weights=False)
    return args[:3], kwargs


def _keep_mha(cap: AttentionCapture, name, module, args, output):
    if isinstance(output, tuple) and len(output) > 1 and output[1] is not None:
        cap.add("nn.MultiheadAttention hooks", name, output[1], None, output[1].size(0))


def _hf_output_attentions(model: nn.Module):
    """Ask an HF model running eager attention for its weights; return the undo.

    Asked for twice: through the config (what a wrapper around an HF model passes on) where the config
    accepts it, and as a forward keyword where the forward takes one.
    """
    config = model.config
    old_flag = config.output_attentions
    try:
        config.output_attentions = True
    except ValueError:  # refused by this family; the keyword below still asks
        pass
    params = inspect.signature(model.forward).parameters.values()
    hook = None
    if any(p.name == "output_attentions" or p.kind is p.VAR_KEYWORD for p in params):
        hook = model.register_forward_pre_hook(
            lambda module, args, kwargs: (args, {**kwargs, "output_attentions": True}), with_kwargs=True)

    def undo():
        if hook is not None:
            hook.remove()
        config.output_attentions = old_flag

    return undo


def hf_implementation(model: nn.Module) -> str | None:
    """The attention implementation an HF model (or a wrapper passing its config on) runs; None: not HF."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "output_attentions"):
        return None
    return getattr(config, "_attn_implementation", None) or "eager"


@contextlib.contextmanager
def capture_attention(model: nn.Module, seq_len: int | None = 0, max_map_bytes: int = DEFAULT_MAP_BYTES):
    """Capture attention maps from `model`'s forwards inside the block; yields an AttentionCapture.

    seq_len: the sequence length fed (softmax capture looks for (T, T) scores; None: any square scores; 0: no
    softmax capture)."""
    cap, undo = AttentionCapture(seq_len, max_map_bytes), []
    stack = ModuleStack(model)
    undo.append(stack.remove)
    try:
        for name, module in model.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                undo.append(module.register_forward_pre_hook(_want_weights, with_kwargs=True).remove)
                undo.append(module.register_forward_hook(partial(_keep_mha, cap, name)).remove)
                cap.owned.add(name)
                cap.needs_grad = True
        if hf_implementation(model) == "eager":  # the weights come back in the output; nothing else is needed
            undo.append(_hf_output_attentions(model))
            cap._hf = True
            cap.hf_paths = [name for name, m in model.named_modules()
                            if hasattr(m, "layer_idx") and "attention" in type(m).__name__.lower()]
        with contextlib.nullcontext() if cap._hf else _CallCapture(cap, stack):
            yield cap
    finally:
        for fn in reversed(undo):
            fn()
