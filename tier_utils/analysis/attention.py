"""Attention patterns: per-head maps captured from the unmodified model (analysis/capture.py), then
each head scored: entropy, top weight, distance profile, and how alike a layer's heads are."""
from __future__ import annotations

import itertools
import math
from functools import partial
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.nn as nn

from ..adapter.adapter import extract_logits
from ..core.errors import describe
from ..core.plotting import category_ticks
from ..core.results import Check
from .capture import DEFAULT_MAP_BYTES, AttentionCapture, AttentionMap, capture_attention, hf_implementation
from .common import Context, Outcome, head
from .pixels import SHOWN, TOP_SHARE, draw, grid_figure, overlay, patch_grid, pixel_gradients, rollout, top_share

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure

ONE_HOT_MAX = 0.9  # mean top weight at or above this: the head looks at one token (near one-hot)
UNIFORM_ENTROPY = 0.97  # mean entropy / log(#keys) at or above this: the head averages (near uniform)
SAME_HEADS_TV = 0.05  # mean total-variation distance between a layer's heads below this: they all do the same
TICKS_SHOWN = 16  # a map's axis labels at most this many of its tokens: more overlap at a panel's size


def _has_attention(model: nn.Module) -> bool:
    """Whether any module is named like attention (by path or class): Mamba's mixers are not."""
    return any(key in f"{name} {type(m).__name__}".lower() for name, m in model.named_modules()
               for key in ("attn", "attention"))


def _fallback(model: nn.Module) -> str:
    """How to run the model's attention through SDPA or eager code instead of its fused kernel, if it says."""
    impl = hf_implementation(model)
    if impl is not None:
        return "; build it with attn_implementation='sdpa' (or 'eager') to see them"
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if "flash" in attr.lower() and value is True:
                return f"; its fallback: set {name or 'model'}.{attr} = False for the analysis"
    return "; the model has no switch to SDPA or eager attention that tier 2 could find"


def _no_maps(ctx: Context, cap: AttentionCapture) -> Check:
    """The SKIP row for a forward that produced no attention weights, with the reason."""
    model, name = ctx.adapter.model, ctx.adapter.name
    impl = hf_implementation(model)
    if cap.kernels:
        why = (f"its attention runs in {', '.join(sorted(cap.kernels))}, a kernel outside SDPA that never forms the "
               f"weights{_fallback(model)}")
    elif impl not in (None, "eager", "sdpa"):
        why = f"it runs attn_implementation={impl!r}, a kernel outside SDPA{_fallback(model)}"
    elif _has_attention(model):
        why = "a fused kernel bypassed them, or a wrapper dropped them"
    else:
        why = "it has no attention layers (a state-space model, a CNN)"
    return Check("attention maps", "SKIP", None, None,
                 f"{name} exposes no attention weights (no SDPA call, no softmax over (T, T) scores, no "
                 f"nn.MultiheadAttention, no HF output_attentions): {why}")


def _allowed(queries: torch.Tensor, keys: torch.Tensor, causal: bool) -> torch.Tensor:
    """(B, Tq, Tk) bool: which keys each query may see (padding masked on both sides, causal where the layer is)."""
    allowed = queries[:, :, None] & keys[:, None, :]
    if causal:
        allowed = allowed & torch.ones(allowed.shape[-2:], dtype=torch.bool, device=allowed.device).tril()
    return allowed


class _HeadStats:
    """Sums over valid query rows per (layer, head): entropy/log(keys), top weight, distance, distance mass."""

    def __init__(self):
        self.sums: dict[str, dict[str, torch.Tensor]] = {}

    def add(self, name: str, weights: torch.Tensor, allowed: torch.Tensor) -> None:
        w = weights.float().nan_to_num(0.0)  # (B, H, Tq, Tk); fully masked rows may be NaN
        Tq, Tk = w.shape[-2:]  # a cross-attention map is rectangular: target queries, source keys
        support = allowed.sum(-1)  # (B, Tq) keys per query
        rows = (support >= 2).unsqueeze(1).expand(-1, w.size(1), -1)  # (B, H, Tq) rows with a choice to make
        ent = -(w * w.clamp_min(1e-12).log()).sum(-1) / support.clamp_min(2).log().unsqueeze(1)
        dist = (torch.arange(Tq, device=w.device)[:, None] - torch.arange(Tk, device=w.device)[None, :]).abs()
        mean_dist = (w * dist).sum(-1)
        # [..., d]: mass at distance d, over every distance a query and a key can be apart
        profile = w.new_zeros(*w.shape[:-1], max(Tq, Tk)).scatter_add_(-1, dist.expand_as(w), w)
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


def _real(mask: torch.Tensor | None, weights: torch.Tensor, axis: int) -> torch.Tensor:
    """A (B, T) mask of real positions; every position where the input has none (an image's patches)."""
    if mask is not None:
        return mask
    return torch.ones(weights.size(0), weights.size(axis), dtype=torch.bool, device=weights.device)


def _score(stats: _HeadStats, example: dict | None, means: dict | None, masks: dict, task,
           found: AttentionMap) -> None:
    """Add one captured map to the statistics (and to the example maps on the first batch, and to `means`, the
    first images' head-averaged maps that rollout multiplies). The task says what the layer's queries and keys are
    (an encoder-decoder's: source or target) and whether it is causal."""
    weights = found.weights
    queries, keys, causal = task.attention_role(found.name)
    q_mask, k_mask = _real(masks[queries], weights, -2), _real(masks[keys], weights, -1)
    if weights.dim() != 4 or weights.shape[-2:] != (q_mask.size(1), k_mask.size(1)):
        return  # an unexpected layout: not a map over this batch's tokens
    q_mask, k_mask = q_mask[:weights.size(0)], k_mask[:weights.size(0)]
    padding = _allowed(q_mask, k_mask, causal=False)
    allowed = _allowed(q_mask, k_mask, causal) if found.allowed is None else found.allowed & padding
    stats.add(found.name, weights, allowed)
    if example is not None and found.name not in example:
        example[found.name] = weights[0, :, :int(q_mask[0].sum()), :int(k_mask[0].sum())].float().cpu()
    if means is not None and found.name not in means:
        means[found.name] = weights[:SHOWN].float().mean(1).cpu()


def run(ctx: Context) -> Outcome:
    model, task = ctx.adapter.model, ctx.adapter.task
    stats, example = _HeadStats(), {}
    means = {} if task.reads_pixels else None  # the first images' maps, for rollout over them
    first = ctx.mask(ctx.batches[0])
    seq_len = None if first is None else int(first.size(1))  # an image's tokens are its patches: any square map
    limit = ctx.budget.probe_limit if ctx.budget else DEFAULT_MAP_BYTES
    with capture_attention(model, seq_len, limit) as cap:
        for i, batch in enumerate(ctx.batches):
            cap.new_forward()
            masks = {"source": ctx.mask(batch), "target": task.target_mask(batch)}
            cap.on_map = partial(_score, stats, *((example, means) if i == 0 else (None, None)), masks, task)
            grad = torch.enable_grad() if cap.needs_grad else torch.no_grad()
            try:
                with grad, ctx.precision.autocast():
                    out = ctx.adapter.batch_forward(batch)
            except Exception as exc:
                if not cap._hf:
                    raise
                # The tool's request, not the model, failed: say so rather than FAIL a healthy model.
                return Outcome([Check("attention maps", "SKIP", None, None,
                                      f"{ctx.adapter.name} refused output_attentions=True "
                                      f"({describe(exc, limit=200)}); build it with attn_implementation='sdpa'")])
            cap.collect(out)
            if i == 0:
                predicted = extract_logits(out, ctx.adapter.name).detach().argmax(-1)
            del out
            if not cap.calls:
                return _saliency(ctx, _no_maps(ctx, cap)) if task.reads_pixels else Outcome([_no_maps(ctx, cap)])
    if not stats.sums:
        return Outcome([Check("attention maps", "SKIP", None, None,
                              f"{cap.source}: no (B, heads, queries, keys) attention maps over the batch's tokens "
                              "were captured")])
    outcome = _outcome(stats, example, f"{cap.source}, {len(ctx.batches)} batches; {_size(cap, limit, task)}",
                       task)
    if means is not None:
        _add_rollout(ctx, outcome, list(means.values()), predicted)
    outcome.artifacts["tokens"] = _map_tokens(ctx, example)
    return outcome


def _add_rollout(ctx: Context, outcome: Outcome, layers: list[torch.Tensor], predicted: torch.Tensor) -> None:
    """The first images' attention rollout drawn over them: a row and an overlay added to `outcome`, or a SKIP row
    where the layers' maps can't be multiplied through (shapes that differ: a Swin's windows and stages) or the
    tokens are no grid of patches."""
    shapes = {tuple(a.shape) for a in layers}
    grid = patch_grid(rollout(layers)) if len(shapes) == 1 else None
    if grid is None:
        why = (f"the layers' maps differ in shape ({', '.join(map(str, sorted(shapes)))})" if len(shapes) > 1 else
               f"its {layers[0].size(-1)} tokens are no square grid of patches behind a CLS token")
        outcome.checks.append(Check("attention rollout", "SKIP", None, None, f"{why}: no rollout to draw"))
        return
    shown = overlay(ctx, f"attention rollout to the patches through {len(layers)} layers", ctx.batches[0], predicted,
                    grid)
    outcome.checks.append(_heat_check("attention rollout", shown, "patches", f"rollout (Abnar & Zuidema) of the "
                                      f"head-averaged maps of {len(layers)} layers, read from the first token"))
    outcome.frames["attention_rollout"] = shown.frame()
    outcome.artifacts["overlay"] = shown


def _saliency(ctx: Context, skipped: Check) -> Outcome:
    """An image model without attention maps: its gradient saliency map instead (|d logit / d pixels| of the
    predicted class, the largest over the channels), drawn over the first images."""
    batch = head(ctx.batches[0], SHOWN)
    grad, _, predicted = pixel_gradients(ctx, batch["pixel_values"])
    shown = overlay(ctx, "gradient saliency |d logit / d pixels|", batch, predicted, grad.abs().amax(1))
    check = _heat_check("gradient saliency", shown, "pixels", "|d logit / d pixels| of the predicted class, the "
                        "largest over the channels, instead of attention")
    return Outcome([skipped, check], {"saliency": shown.frame()}, {"overlay": shown})


def _heat_check(name: str, shown, cells: str, what: str) -> Check:
    """The row a heat map over the images gets: how concentrated it is (FAIL where it holds NaN/inf)."""
    threshold = f"share on the top {TOP_SHARE:.0%} of {cells} ({TOP_SHARE:.0%}: flat)"
    if not torch.isfinite(shown.heats).all():
        return Check(name, "FAIL", None, threshold, f"{what}: NaN/inf in the map")
    share = float(top_share(shown.heats).mean())
    right = sum(a == b for a, b in zip(shown.labels, shown.predictions))
    return Check(name, "PASS", round(share, 4), threshold, f"{what}: the top {TOP_SHARE:.0%} of {cells} hold "
                 f"{share:.0%} of it (mean over {len(shown.labels)} images, {right} predicted right)")


def _map_tokens(ctx: Context, example: dict) -> dict:
    """Each example map's rows and columns as (side, tokens): the side the task says its queries and keys are
    (an encoder-decoder's source or target) and example 0's tokens there, as far as the map reaches (nothing for a
    task whose inputs are not tokens)."""
    task, batch = ctx.adapter.task, ctx.batches[0]
    if not task.reads_tokens:
        return {}
    label = ctx.adapter.tokenizer.label
    target = task.target_tokens(ctx.adapter, batch)
    sides = {"source": batch["input_ids"][0], **({} if target is None else {"target": target[0]})}
    named = {}
    for name, weights in example.items():
        queries, keys, _ = task.attention_role(name)
        named[name] = tuple((side, [label(int(t)) for t in sides[side][:n]])
                            for side, n in ((queries, weights.size(-2)), (keys, weights.size(-1))))
    return named


def _size(cap: AttentionCapture, limit: int, task) -> str:
    """What the captured maps held: rows kept per batch (sequences, images) and the largest map, against the
    budget."""
    kept = min(rows for rows, _ in cap.rows.values())
    batch = max(total for _, total in cap.rows.values())
    return (f"maps of {kept} of {task.rows(batch)} per batch, largest {cap.largest / 2**20:.2f} MiB, "
            f"sized to {limit / 2**20:.3g} MiB per map")


def _outcome(stats: _HeadStats, example: dict, captured: str, task) -> Outcome:
    """The checks and frames of the captured maps, each layer named with its role (the task's attention_kind:
    self, encoder self, decoder self, cross)."""
    heads, layers, profile_rows = [], [], []
    for li, (name, s) in enumerate(stats.sums.items()):
        n, role = s["rows"].clamp_min(1), task.attention_kind(name)
        kinds = []
        for h in range(len(n)):
            ent, top = float(s["entropy"][h] / n[h]), float(s["max_weight"][h] / n[h])
            kinds.append(_classify(ent, top))
            heads.append({"layer": name, "role": role, "layer_index": li, "head": h, "entropy": ent, "max_weight": top,
                          "mean_distance": float(s["mean_distance"][h] / n[h]), "pattern": kinds[-1],
                          "rows": int(s["rows"][h])})
            prof = s["profile"][h] / n[h]
            profile_rows += [{"layer": name, "head": h, "distance": d, "weight": float(v)} for d, v in enumerate(prof)]
        tv = float(s["tv"] / s["tv_rows"].clamp_min(1)) if "tv" in s else math.nan
        collapsed = sum(k != "ok" for k in kinds)
        layers.append({"layer": name, "role": role, "heads": len(kinds), "collapsed_heads": collapsed,
                       "head_similarity_tv": tv,
                       "collapsed": collapsed == len(kinds) or (len(kinds) > 1 and tv < SAME_HEADS_TV)})
    heads_df, layers_df = pd.DataFrame(heads), pd.DataFrame(layers)
    bad = heads_df[heads_df.pattern != "ok"]
    n_heads = len(heads_df)
    named = ", ".join(f"{r.layer} ({r.role}) h{r.head} ({r.pattern})" for r in bad.head(6).itertuples())
    more = f" and {len(bad) - 6} more" if len(bad) > 6 else ""
    if len(bad) and (bad.pattern == "uniform").all():
        more += "; near-uniform heads everywhere is what an untrained model shows"
    checks = [Check("collapsed heads", "WARN" if len(bad) else "PASS", f"{len(bad)}/{n_heads}",
                    f"max_weight >= {ONE_HOT_MAX} or entropy >= {UNIFORM_ENTROPY}",
                    (f"{named}{more}" if len(bad) else "every head attends selectively")
                    + f" (captured via {captured})")]
    bad_layers = layers_df[layers_df.collapsed]
    all_uniform = heads_df.groupby("layer").pattern.agg(lambda p: bool((p == "uniform").all()))
    untrained = bool(all_uniform[bad_layers.layer].all())  # every collapsed layer is uniform in every head
    checks.append(Check("collapsed layers", "WARN" if len(bad_layers) else "PASS",
                        f"{len(bad_layers)}/{len(layers_df)}",
                        f"all heads collapsed or head TV distance < {SAME_HEADS_TV}",
                        ", ".join(f"{r.layer} ({r.role})" for r in bad_layers.itertuples())
                        + ("; all heads uniform, which is what an untrained model shows"
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


def _token_axes(ax, tokens) -> None:
    """A map's axes named by their side and labelled with its tokens (every n-th past TICKS_SHOWN of them)."""
    (rows, row_tokens), (columns, column_tokens) = tokens

    def shown(names):
        every = max(1, -(-len(names) // TICKS_SHOWN))
        return range(0, len(names), every), names[::every]

    ax.set_yticks(*shown(row_tokens), fontsize=7)  # the plots' smallest readable size (tests/test_plots.py)
    ax.set_xticks(*shown(column_tokens), fontsize=7, rotation=90)
    ax.set_ylabel(f"query ({rows} token)", fontsize=7)
    ax.set_xlabel(f"key ({columns} token)", fontsize=7)


def plot(outcome: Outcome, layers=None, heads=None) -> Figure:
    """Heatmaps (query rows, key columns, labelled with example 0's tokens: an encoder-decoder's cross-attention
    rows are target tokens, its columns source tokens) of example 0 for the chosen layers (default first and last)
    and heads (default up to 4), plus each head's distance profile; an image model's first images lie above them
    under their attention rollout. An image model without attention: its gradient saliency map over the images."""
    shown = outcome.artifacts.get("overlay")
    if "maps" not in outcome.artifacts:
        return grid_figure(shown)
    maps = outcome.artifacts["maps"]
    chosen = _pick(list(maps), layers)
    n_heads = maps[chosen[0]].size(0)
    head_ids = list(range(min(4, n_heads))) if heads is None else list(heads)
    from matplotlib.figure import Figure

    size = (2.6 * (len(head_ids) + 1), 2.6 * len(chosen))
    if shown is None:
        fig = Figure(figsize=size, layout="constrained")
        _draw_maps(fig, outcome, chosen, head_ids)
        return fig
    above = 2.5 * math.ceil(len(shown.labels) / 4) + 0.4  # grid_figure's rows of four
    fig = Figure(figsize=(max(size[0], 9.2), size[1] + above), layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[above, size[1]])
    grid_figure(shown, top)
    _draw_maps(bottom, outcome, chosen, head_ids)
    return fig


def _draw_maps(fig, outcome: Outcome, chosen: list[str], head_ids: list[int]) -> None:
    """The chosen layers' maps, one row each, into `fig` (a Figure or SubFigure)."""
    maps, tokens = outcome.artifacts["maps"], outcome.artifacts.get("tokens", {})
    axes = fig.subplots(len(chosen), len(head_ids) + 1, squeeze=False)
    prof = outcome.frames["attention_distance"]
    roles = dict(zip(outcome.frames["attention_layers"].layer, outcome.frames["attention_layers"].role))
    for row, name in zip(axes, chosen):
        for ax, h in zip(row, head_ids):
            image = ax.imshow(maps[name][h].numpy(), cmap="viridis", vmin=0, aspect="auto")
            ax.set_title(f"{name} ({roles[name]}) h{h}", fontsize=8)
            if name in tokens:
                _token_axes(ax, tokens[name])
            else:
                ax.set_xlabel("key", fontsize=7)
                ax.set_ylabel("query", fontsize=7)
        fig.colorbar(image, ax=row[len(head_ids) - 1], shrink=0.8, label="attention weight")
        for h, grp in prof[prof.layer == name].groupby("head"):
            row[-1].plot(grp.distance, grp.weight, label=f"h{h}")
        row[-1].set_title(f"{name} ({roles[name]}): mass by distance", fontsize=8)
        row[-1].set_xlabel("|query - key| (tokens)", fontsize=7)
        row[-1].set_ylabel("mean attention weight", fontsize=7)
        row[-1].legend(fontsize=7)
    fig.suptitle("Attention (example 0, mean over valid query rows for the profile)")


def panel(ax, outcome: Outcome) -> None:
    """Overview: normalised entropy per (layer, head); an image model without attention: its first image under its
    gradient saliency map."""
    if "attention" not in outcome.frames:
        shown = outcome.artifacts["overlay"]
        draw(ax, shown, 0)
        ax.set_title(f"no attention: gradient saliency\n(true {shown.labels[0]}, predicted {shown.predictions[0]})",
                     fontsize=9)
        return
    df = outcome.frames["attention"]
    grid = df.pivot(index="layer_index", columns="head", values="entropy")
    image = ax.imshow(grid.to_numpy(), cmap="magma", vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(grid.shape[1]), grid.columns)
    layers = df.drop_duplicates("layer_index")
    category_ticks(ax, [f"{n} ({r})" for n, r in zip(layers.layer, layers.role)], axis="y")
    ax.set(xlabel="head", ylabel="module path", title="attention entropy / log(keys) (1 = uniform)")
    ax.figure.colorbar(image, ax=ax, shrink=0.8, label="normalised entropy")
    if grid.to_numpy().min() >= UNIFORM_ENTROPY:  # one flat block reads as a broken plot without this
        ax.text(0.5, 0.5, "near 1 everywhere: uniform attention,\nexpected before training", ha="center",
                va="center", fontsize=8, transform=ax.transAxes, bbox={"facecolor": "white", "alpha": 0.8})
