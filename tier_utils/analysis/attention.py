"""Attention patterns: capture per-head maps without patching any class, then score each head.

Three ways in, all undone on exit:
- modules that expose their weights (`keep_attention` flag + `.attention`, as the built-in TinyGPT):
  the flag is set on those instances only;
- `nn.MultiheadAttention` (inside `nn.TransformerEncoder` too): per-instance hooks ask for per-head
  weights (`need_weights=True, average_attn_weights=False`) and read them;
- Hugging Face models: eager attention where the family can switch, `output_attentions=True` passed to
  the forward, read from the output.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import math
from functools import partial
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.nn as nn

from ..core.errors import describe
from ..core.plotting import category_ticks
from ..core.results import Check
from .common import Context, Outcome

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure

ONE_HOT_MAX = 0.9  # mean top weight at or above this: the head looks at one token (near one-hot)
UNIFORM_ENTROPY = 0.97  # mean entropy / log(#keys) at or above this: the head averages (near uniform)
SAME_HEADS_TV = 0.05  # mean total-variation distance between a layer's heads below this: they all do the same
_MHA_ARGS = ("query", "key", "value", "key_padding_mask", "need_weights", "attn_mask", "average_attn_weights",
             "is_causal")


class AttentionCapture:
    """Collects (layer name, (B, heads, T_query, T_key) weights) for each forward, in call order."""

    def __init__(self):
        self.maps: list[tuple[str, torch.Tensor]] = []
        self.source: str | None = None
        self.needs_grad = False  # MHA: keep TransformerEncoderLayer off its fused path (it skips the hooks)
        self._hf = False

    def collect(self, output) -> None:
        if self._hf:
            attentions = getattr(output, "attentions", None) or ()
            self.maps += [(f"layer.{i}", a.detach()) for i, a in enumerate(attentions) if a is not None]


def _want_weights(module, args, kwargs):
    kwargs = {**kwargs, **dict(zip(_MHA_ARGS[3:], args[3:]))}
    kwargs.update(need_weights=True, average_attn_weights=False)
    return args[:3], kwargs


def _keep_mha(maps, name, module, args, output):
    if isinstance(output, tuple) and len(output) > 1 and output[1] is not None:
        maps.append((name, output[1].detach()))


def _keep_exposed(maps, name, module, args, output):
    if module.attention is not None:
        maps.append((name, module.attention.detach()))


def _restore_exposed(module, flag, attention) -> None:
    module.keep_attention, module.attention = flag, attention  # our maps are dropped: they can be large


def _hf_output_attentions(model: nn.Module):
    """Switch an HF model to eager attention and ask for the weights; return the undo.

    Asked for twice: through the config (what a wrapper around an HF model passes on) where the config
    accepts it, and as a forward keyword where the forward takes one (Falcon refuses the config flag under
    SDPA yet honours the keyword). A family that can't switch implementation at run time keeps its own
    and returns the weights, or none (then SKIP).
    """
    config = model.config
    old_impl, old_flag = getattr(config, "_attn_implementation", None), config.output_attentions
    setter = getattr(model, "set_attn_implementation", None)
    # Asked first, so families that can't switch don't log a warning on every analysis.
    switchable = getattr(model, "_can_set_attn_implementation", lambda: True)()

    def set_impl(name):
        if callable(setter):
            setter(name)
        else:  # older transformers read the config at call time
            config._attn_implementation = name

    switched = old_impl not in (None, "eager") and switchable
    if switched:
        set_impl("eager")  # SDPA/flash kernels never materialise the weights
    try:
        config.output_attentions = True
    except ValueError:  # refused under this implementation; the keyword below still asks
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
        if switched:
            set_impl(old_impl)

    return undo


def _has_attention(model: nn.Module) -> bool:
    """Whether any module is named like attention (by path or class): Mamba's mixers are not."""
    return any(key in f"{name} {type(m).__name__}".lower() for name, m in model.named_modules()
               for key in ("attn", "attention"))


@contextlib.contextmanager
def capture_attention(model: nn.Module):
    """Install per-instance capture on `model`; yields an AttentionCapture (`.source` None: nothing to capture)."""
    cap, undo, sources = AttentionCapture(), [], set()
    try:
        for name, module in model.named_modules():
            if isinstance(module, nn.MultiheadAttention):
                undo.append(module.register_forward_pre_hook(_want_weights, with_kwargs=True).remove)
                undo.append(module.register_forward_hook(partial(_keep_mha, cap.maps, name)).remove)
                sources.add("nn.MultiheadAttention hooks")
                cap.needs_grad = True
            elif isinstance(getattr(module, "keep_attention", None), bool) and hasattr(module, "attention"):
                undo.append(partial(_restore_exposed, module, module.keep_attention, module.attention))
                module.keep_attention = True
                undo.append(module.register_forward_hook(partial(_keep_exposed, cap.maps, name)).remove)
                sources.add("keep_attention modules")
        config = getattr(model, "config", None)
        if not sources and config is not None and hasattr(config, "output_attentions"):
            undo.append(_hf_output_attentions(model))
            cap._hf = True
            sources.add("HF output_attentions")
        cap.source = ", ".join(sorted(sources)) or None
        yield cap
    finally:
        for fn in reversed(undo):
            fn()


def _allowed(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, T, T) bool: which keys each query may see (padding masked, causal for a causal LM)."""
    allowed = mask[:, None, :] & mask[:, :, None]
    if causal:
        allowed = allowed & torch.ones(mask.size(1), mask.size(1), dtype=torch.bool, device=mask.device).tril()
    return allowed


class _HeadStats:
    """Sums over valid query rows per (layer, head): entropy/log(keys), top weight, distance, distance mass."""

    def __init__(self):
        self.sums: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, weights: torch.Tensor, allowed: torch.Tensor) -> None:
        w = weights.float().nan_to_num(0.0)  # (B, H, T, T); fully masked rows may be NaN
        T = w.size(-1)
        support = allowed.sum(-1)  # (B, T) keys per query
        rows = (support >= 2).unsqueeze(1).expand(-1, w.size(1), -1)  # (B, H, T) rows with a choice to make
        ent = -(w * w.clamp_min(1e-12).log()).sum(-1) / support.clamp_min(2).log().unsqueeze(1)
        pos = torch.arange(T, device=w.device)
        dist = (pos[:, None] - pos[None, :]).abs()  # (T, T)
        mean_dist = (w * dist).sum(-1)
        profile = torch.zeros_like(w).scatter_add_(-1, dist.expand_as(w), w)  # [..., d]: mass at distance d
        r = rows.float()
        s = self.sums.setdefault(name, {})
        for key, value in (("entropy", ent), ("max_weight", w.amax(-1)), ("mean_distance", mean_dist)):
            s[key] = s.get(key, 0) + (value * r).sum((0, 2)).cpu()
        s["profile"] = s.get("profile", 0) + (profile * r.unsqueeze(-1)).sum((0, 2)).cpu()
        s["rows"] = s.get("rows", 0) + r.sum((0, 2)).cpu()
        # nan_to_num above is for fully masked rows; NaN/inf in a row with a choice is the model's doing.
        s["nonfinite"] = s.get("nonfinite", 0) + int(((~torch.isfinite(weights)).any(-1) & rows).sum())
        # How alike the heads are: mean total-variation distance between every pair, over valid rows.
        pairs = list(itertools.combinations(range(w.size(1)), 2))
        if pairs:
            tv = torch.stack([0.5 * (w[:, i] - w[:, j]).abs().sum(-1) for i, j in pairs])  # (P, B, T)
            s["tv"] = s.get("tv", 0) + (tv * r[:, 0]).sum().cpu() / len(pairs)
            s["tv_rows"] = s.get("tv_rows", 0) + r[:, 0].sum().cpu()


def _classify(entropy: float, max_weight: float) -> str:
    if max_weight >= ONE_HOT_MAX:
        return "one-hot"
    if entropy >= UNIFORM_ENTROPY:
        return "uniform"
    return "ok"


def run(ctx: Context) -> Outcome:
    model, causal = ctx.adapter.model, ctx.adapter.task == "causal-lm"
    stats, example = _HeadStats(), {}
    with capture_attention(model) as cap:
        if cap.source is None:
            return Outcome([Check("attention maps", "SKIP", None, None,
                                  f"{ctx.adapter.name} exposes no attention weights: no nn.MultiheadAttention, no "
                                  "module with keep_attention/.attention, no HF output_attentions")])
        for i, batch in enumerate(ctx.batches):
            cap.maps.clear()
            grad = torch.enable_grad() if cap.needs_grad else torch.no_grad()
            try:
                with grad, ctx.precision.autocast():
                    out = ctx.adapter.forward(batch["input_ids"], batch.get("attention_mask"))
            except Exception as exc:
                if not cap._hf:
                    raise
                # The tool's request, not the model, failed: say so rather than FAIL a healthy model.
                return Outcome([Check("attention maps", "SKIP", None, None,
                                      f"{ctx.adapter.name} refused output_attentions=True "
                                      f"({describe(exc, limit=200)}); build it with attn_implementation='eager'")])
            cap.collect(out)
            del out
            if not cap.maps:
                why = ("a fused kernel bypassed them, or a wrapper dropped them" if _has_attention(model)
                       else f"{ctx.adapter.name} has no attention layers (e.g. a state-space model)")
                return Outcome([Check("attention maps", "SKIP", None, None,
                                      f"{cap.source} installed but the forward produced no attention weights: {why}")])
            mask = ctx.mask(batch)
            allowed = _allowed(mask, causal)
            for name, weights in cap.maps:
                if weights.dim() != 4 or weights.shape[-2:] != allowed.shape[-2:]:
                    continue  # cross-attention or an unexpected layout: not a self-attention map
                stats.add(name, weights, allowed)
                if i == 0 and name not in example:
                    n = int(mask[0].sum())
                    example[name] = weights[0, :, :n, :n].float().cpu()
    if not stats.sums:
        return Outcome([Check("attention maps", "SKIP", None, None,
                              f"{cap.source}: no (B, heads, T, T) self-attention maps were captured")])
    return _outcome(stats, example, cap.source, len(ctx.batches))


def _outcome(stats: _HeadStats, example: dict, source: str, n_batches: int) -> Outcome:
    heads, layers, profile_rows = [], [], []
    for li, (name, s) in enumerate(stats.sums.items()):
        n = s["rows"].clamp_min(1)
        kinds = []
        for h in range(len(n)):
            ent, top = float(s["entropy"][h] / n[h]), float(s["max_weight"][h] / n[h])
            kinds.append(_classify(ent, top))
            heads.append({"layer": name, "layer_index": li, "head": h, "entropy": ent, "max_weight": top,
                          "mean_distance": float(s["mean_distance"][h] / n[h]), "pattern": kinds[-1],
                          "rows": int(s["rows"][h])})
            prof = s["profile"][h] / n[h]
            profile_rows += [{"layer": name, "head": h, "distance": d, "weight": float(v)} for d, v in enumerate(prof)]
        tv = float(s["tv"] / s["tv_rows"].clamp_min(1)) if "tv" in s else math.nan
        collapsed = sum(k != "ok" for k in kinds)
        layers.append({"layer": name, "heads": len(kinds), "collapsed_heads": collapsed, "head_similarity_tv": tv,
                       "collapsed": collapsed == len(kinds) or (len(kinds) > 1 and tv < SAME_HEADS_TV)})
    heads_df, layers_df = pd.DataFrame(heads), pd.DataFrame(layers)
    bad = heads_df[heads_df.pattern != "ok"]
    n_heads = len(heads_df)
    named = ", ".join(f"{r.layer} h{r.head} ({r.pattern})" for r in bad.head(6).itertuples())
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    if len(bad) and (bad.pattern == "uniform").all():
        more += "; near-uniform heads everywhere is what an untrained model shows"
    checks = [Check("collapsed heads", "WARN" if len(bad) else "PASS", f"{len(bad)}/{n_heads}",
                    f"max_weight >= {ONE_HOT_MAX} or entropy >= {UNIFORM_ENTROPY}",
                    (f"{named}{more}" if len(bad) else "every head attends selectively")
                    + f" (captured via {source}, {n_batches} batches)")]
    bad_layers = layers_df[layers_df.collapsed]
    all_uniform = heads_df.groupby("layer").pattern.agg(lambda p: bool((p == "uniform").all()))
    untrained = bool(all_uniform[bad_layers.layer].all())  # every collapsed layer is uniform in every head
    checks.append(Check("collapsed layers", "WARN" if len(bad_layers) else "PASS",
                        f"{len(bad_layers)}/{len(layers_df)}",
                        f"all heads collapsed or head TV distance < {SAME_HEADS_TV}",
                        ", ".join(bad_layers.layer) + ("; all heads uniform, which is what an untrained model shows"
                                                       if untrained else "")
                        if len(bad_layers) else "heads differ within every layer"))
    broken = {name: s["nonfinite"] for name, s in stats.sums.items() if s["nonfinite"]}
    for check in checks if broken else ():  # the statistics above read NaN rows as zeros: none may PASS
        check.status = "FAIL"
        check.detail = (f"{sum(broken.values())} attention rows hold NaN/inf weights in {', '.join(broken)}; "
                        + check.detail)
    frames = {"attention": heads_df, "attention_layers": layers_df, "attention_distance": pd.DataFrame(profile_rows)}
    return Outcome(checks, frames, {"maps": example})


def _pick(names: list[str], layers) -> list[str]:
    if layers is None:
        return list(dict.fromkeys([names[0], names[-1]]))
    picked = []
    for item in layers if isinstance(layers, (list, tuple)) else [layers]:
        if isinstance(item, int):
            picked.append(names[item])
        elif item in names:
            picked.append(item)
        else:
            raise ValueError(f"unknown attention layer {item!r}; use an index or one of: {', '.join(names)}")
    return picked


def plot(outcome: Outcome, layers=None, heads=None) -> Figure:
    """Heatmaps (query rows, key columns) of example 0 for the chosen layers (default first and last)
    and heads (default up to 4), plus each head's distance profile."""
    maps = outcome.artifacts["maps"]
    chosen = _pick(list(maps), layers)
    n_heads = maps[chosen[0]].size(0)
    head_ids = list(range(min(4, n_heads))) if heads is None else list(heads)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2.6 * (len(head_ids) + 1), 2.6 * len(chosen)), layout="constrained")
    axes = fig.subplots(len(chosen), len(head_ids) + 1, squeeze=False)
    prof = outcome.frames["attention_distance"]
    for row, name in zip(axes, chosen):
        for ax, h in zip(row, head_ids):
            image = ax.imshow(maps[name][h].numpy(), cmap="viridis", vmin=0, aspect="auto")
            ax.set_title(f"{name} h{h}", fontsize=8)
            ax.set_xlabel("key", fontsize=7)
            ax.set_ylabel("query", fontsize=7)
        fig.colorbar(image, ax=row[len(head_ids) - 1], shrink=0.8, label="attention weight")
        for h, grp in prof[prof.layer == name].groupby("head"):
            row[-1].plot(grp.distance, grp.weight, label=f"h{h}")
        row[-1].set_title(f"{name}: mass by distance", fontsize=8)
        row[-1].set_xlabel("|query - key| (tokens)", fontsize=7)
        row[-1].set_ylabel("mean attention weight", fontsize=7)
        row[-1].legend(fontsize=7)
    fig.suptitle("Attention (example 0, mean over valid query rows for the profile)")
    return fig


def panel(ax, outcome: Outcome) -> None:
    """Overview: normalised entropy per (layer, head)."""
    df = outcome.frames["attention"]
    grid = df.pivot(index="layer_index", columns="head", values="entropy")
    image = ax.imshow(grid.to_numpy(), cmap="magma", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(grid.shape[1]), grid.columns)
    category_ticks(ax, list(df.drop_duplicates("layer_index").layer), axis="y")
    ax.set(xlabel="head", ylabel="layer", title="attention entropy / log(keys) (1 = uniform)")
    ax.figure.colorbar(image, ax=ax, shrink=0.8, label="normalised entropy")
    if grid.to_numpy().min() >= UNIFORM_ENTROPY:  # one flat block reads as a broken plot without this
        ax.text(0.5, 0.5, "near 1 everywhere: uniform attention,\nexpected before training", ha="center",
                va="center", fontsize=8, transform=ax.transAxes, bbox={"facecolor": "white", "alpha": 0.8})
