"""Attribution: gradient x input saliency per token, or integrated gradients per pixel, with torch.autograd only.

The token-embedding output is swapped (by a forward hook) for a leaf tensor, the log-probability
of the model's own prediction is differentiated with respect to it, and each token's saliency is
sum_d(grad * embedding). Target: the next token after the last real position for a causal LM,
the predicted class for a classifier. Positive saliency supports the prediction, negative opposes it.
A per-position batch whose labels score only some real positions (a chat answer, a completion) attributes its
answer instead: the sum of the scored positions' target log-probabilities, teacher-forced, over the input tokens,
each named a prompt or an answer token; the finding is the share that falls on the prompt.
An image model's first images get integrated gradients of their predicted class's logit over their pixels
(analysis/pixels.py), drawn as a heat map over each; the share of the logit's change they miss says how far
to trust them.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.nn.functional as F

from ..core.budget import affordable_repeats, gib
from ..core.measure import SavedTensorMeter
from ..core.precision import dtype_name
from ..core.results import Check
from .common import Context, Outcome, head
from .pixels import SHOWN, draw, grid_figure, integrated_gradients, overlay, top_share

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure

RECENT = 8  # a causal LM's finding quotes the saliency share of its last RECENT tokens
TOP_SHARE = 0.1  # a classifier's finding quotes the share held by its top 10% tokens
COLUMNS = ["position", "token", "text", "saliency", "share"]
_CHARS_PER_ROW = 32
BUDGET_S = 10.0  # seconds of forward + backward: a big model attributes fewer sequences (the row says how many)
# Points on integrated gradients' path per image, each a forward and backward: the first try, and the most.
IG_STEPS, IG_MAX_STEPS = 16, 256
# Integrated gradients missing more than this share of the logit's change: the path's steps are too coarse for
# the model, and the map is rough.
IG_GAP = 0.1


@contextlib.contextmanager
def _leaf_embeddings(embedding):
    """Replace the embedding output with a leaf that requires grad; yields a list that receives it."""
    leaves = []

    def hook(module, args, out):
        leaf = out.detach().requires_grad_()
        leaves.append(leaf)
        return leaf

    handle = embedding.register_forward_hook(hook)
    try:
        yield leaves
    finally:
        handle.remove()


def scored_answers(task, batch: dict, mask: torch.Tensor) -> torch.Tensor | None:
    """(B, T) bool: the real positions whose next token the labels score, for a batch of a task that predicts its
    input's positions whose labels leave some real positions unscored (-100: a chat answer's prompt, a completion's
    prompt); None where every real position is scored (plain text) or the labels are not per input position."""
    labels = batch.get("labels")
    if not task.per_token or task.own_target_length or labels is None or labels.shape != mask.shape:
        return None
    scored = (labels != -100) & mask
    return scored if scored.any() and (mask & ~scored).any() else None


def saliency(ctx: Context, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """((B, T) gradient x input per token, zero on padding; (B,) target token/class ids; (B, T) the scored
    positions where the answer is attributed (`scored_answers`), else None)."""
    adapter = ctx.adapter
    ids, mask = batch["input_ids"], ctx.mask(batch)
    task = adapter.task
    with _leaf_embeddings(task.source_embedding(adapter)) as leaves, torch.enable_grad(), ctx.precision.autocast():
        logits = adapter.batch_logits(batch).float()
    if not leaves:
        raise RuntimeError(f"{adapter.name}'s forward never called its token embedding")
    answer = None if mask is None else scored_answers(task, batch, mask)
    if answer is not None:  # the answer's own tokens, teacher-forced: the sum of their log-probs
        target = batch["labels"].clamp_min(0)
        objective = (F.log_softmax(logits, dim=-1).gather(2, target[..., None]).squeeze(-1) * answer).sum()
    else:
        if task.per_token:  # each row's last prediction
            logits = logits[torch.arange(len(ids), device=ids.device), task.last_prediction(batch, mask)]
        logp = F.log_softmax(logits, dim=-1)
        target = logp.argmax(-1)
        objective = logp.gather(1, target[:, None]).sum()
    # Each row's target depends only on its own row, so one backward gives every row's gradient.
    source = leaves[task.source_call]
    (grad,) = torch.autograd.grad(objective, source)
    sal = (grad.float() * source.detach().float()).sum(-1)
    return sal * mask, target, answer


def run(ctx: Context) -> Outcome:
    return _over_pixels(ctx) if ctx.adapter.task.reads_pixels else _over_tokens(ctx)


def _over_tokens(ctx: Context) -> Outcome:
    """Gradient x input per token: one sequence first, timed and its saved activations counted, then as many of the
    first batch's sequences as fit both the time budget and the memory budget."""
    adapter = ctx.adapter
    if adapter.task.source_embedding(adapter) is None:
        return Outcome([Check("saliency", "SKIP", None, None,
                              f"{adapter.name} exposes no nn.Embedding to attribute to")])
    rows, start = len(ctx.batches[0]["input_ids"]), time.perf_counter()
    batch = head(ctx.batches[0], 1)
    with SavedTensorMeter(adapter.model) as meter:
        sal, target, answer = saliency(ctx, batch)
    n = affordable_repeats(time.perf_counter() - start, BUDGET_S, rows)
    by_memory = rows if ctx.budget is None else max(1, int(ctx.budget.limit // max(1, meter.bytes)))
    scope = ""
    if min(n, by_memory) < rows:
        scope = (f"; {min(n, by_memory)} of {rows} sequences, as many as fit the {BUDGET_S:g} s budget"
                 if n <= by_memory else f"; {by_memory} of {rows} sequences: one holds {gib(meter.bytes)} for "
                 f"backward, {gib(ctx.budget.limit)} may be held here")
    n = min(n, by_memory)
    if n > 1:
        batch = head(ctx.batches[0], n)
        sal, target, answer = saliency(ctx, batch)
    mask = ctx.mask(batch)
    if not torch.isfinite(sal).all():
        return Outcome([Check("saliency", "FAIL", None, None, "gradient x input is NaN/inf: the backward pass "
                              "through the embeddings overflows")])
    mag = sal.abs()
    total = mag.sum(1)
    if not (total > 0).any():
        return Outcome([Check("saliency", "WARN", 0.0, None, "gradient x input is zero everywhere: no gradient "
                              "reaches the token embeddings (detached or frozen path)")])
    if answer is not None:
        return _over_prompt(ctx, batch, sal, answer, scope)
    lengths = mask.sum(1)
    if adapter.task.per_token:
        pos = torch.arange(sal.size(1), device=sal.device)
        recent = (pos[None, :] >= (lengths[:, None] - RECENT)) & mask
        share = (mag * recent).sum(1) / total.clamp_min(1e-30)
        what = (f"{share.mean():.0%} of |grad x input| for the next-token prediction falls on the last "
                f"{RECENT} tokens (mean over {len(sal)} sequences)")
        threshold = f"share on last {RECENT} tokens"
    else:
        top_k = (lengths.float() * TOP_SHARE).ceil().long().clamp_min(1)
        ranked = mag.sort(1, descending=True).values
        share = torch.stack([ranked[i, : top_k[i]].sum() for i in range(len(sal))]) / total.clamp_min(1e-30)
        what = (f"the top {TOP_SHARE:.0%} of tokens hold {share.mean():.0%} of |grad x input| for the predicted "
                f"class (mean over {len(sal)} sequences)")
        threshold = f"share on top {TOP_SHARE:.0%} tokens"
    table, label = _example_table(ctx, batch, sal), adapter.tokenizer.label
    top = table.nlargest(3, "share")
    target0 = int(target[0])
    goal = adapter.task.name_target(target0, label)
    detail = f"{what}{scope}; example 0 ({goal}) leans most on " + ", ".join(
        f"{r.text!r}@{r.position}" for r in top.itertuples())
    return Outcome([Check("saliency", "PASS", round(float(share.mean()), 4), threshold, detail)],
                   {"attribution": table}, {"target": goal})


def _example_table(ctx: Context, batch: dict, sal: torch.Tensor) -> pd.DataFrame:
    """Example 0's real tokens with their saliency and share of |saliency|."""
    n = int(ctx.mask(batch)[0].sum())
    tokens = batch["input_ids"][0, :n].tolist()
    s0 = sal[0, :n].cpu()
    label = ctx.adapter.tokenizer.label  # decoded tokens of the model's own vocabulary
    return pd.DataFrame({"position": range(n), "token": tokens, "text": [label(t) for t in tokens],
                         "saliency": s0.tolist(), "share": (s0.abs() / s0.abs().sum().clamp_min(1e-30)).tolist()},
                        columns=COLUMNS)


def _over_prompt(ctx: Context, batch: dict, sal: torch.Tensor, answer: torch.Tensor, scope: str) -> Outcome:
    """The answer's attribution: each input token is an answer token where the position before it is scored (the
    answer fed back, teacher-forced), else a prompt token (the template's markers included); the finding is the
    share of |grad x input| on the prompt's tokens."""
    mask = ctx.mask(batch)
    fed_back = torch.zeros_like(answer)
    fed_back[:, 1:] = answer[:, :-1]
    prompt = mask & ~fed_back
    mag = sal.abs()
    share = (mag * prompt).sum(1) / mag.sum(1).clamp_min(1e-30)
    table, label = _example_table(ctx, batch, sal), ctx.adapter.tokenizer.label
    table["part"] = ["answer" if a else "prompt" for a in fed_back[0, : len(table)].tolist()]
    targets = batch["labels"][0][answer[0]].tolist()
    goal = f"the answer {''.join(label(t) for t in targets)!r}"
    top = table[table.part == "prompt"].nlargest(3, "share")
    detail = (f"{share.mean():.0%} of |grad x input| for the answer (the sum of its scored tokens' log-probs, "
              f"teacher-forced) falls on the prompt's tokens (mean over {len(sal)} sequences){scope}; example 0 "
              f"({goal}: {len(targets)} scored tokens over {int(prompt[0].sum())} prompt tokens) leans most on "
              + ", ".join(f"{r.text!r}@{r.position}" for r in top.itertuples()))
    return Outcome([Check("saliency", "PASS", round(float(share.mean()), 4), "share on the prompt's tokens", detail)],
                   {"attribution": table}, {"target": goal})


def _over_pixels(ctx: Context) -> Outcome:
    """Integrated gradients over the first batch's first images (at most SHOWN, the first always, the rest while the
    time budget lasts); each image's heat is its |attribution| summed over the channels."""
    batch = ctx.batches[0]
    images = batch["pixel_values"][:SHOWN]
    deadline = time.perf_counter() + BUDGET_S
    found = []
    for image in images:
        if found and time.perf_counter() > deadline:
            break
        found.append(_integrate(ctx, image, len(images), deadline))
    attributions, gaps, targets, steps = zip(*found)
    n, heats = len(found), torch.stack(attributions).abs().sum(1)
    shown = overlay(ctx, "integrated gradients of the predicted class", head(batch, n), torch.tensor(targets), heats)
    frame = shown.frame().assign(steps=list(steps), completeness_gap=list(gaps))
    threshold = f"share on the top 10% of pixels; completeness gap <= {IG_GAP}"
    scope = f"; {n} of {len(images)} images, as many as fit the {BUDGET_S:g} s budget" if n < len(images) else ""
    if not torch.isfinite(heats).all():
        return Outcome([Check("pixel attribution", "FAIL", None, threshold, "integrated gradients are NaN/inf: the "
                              "backward pass through the pixels overflows")])
    if not (heats > 0).any():
        return Outcome([Check("pixel attribution", "WARN", 0.0, threshold, "integrated gradients are zero "
                              "everywhere: no gradient reaches the pixels (a detached path)")])
    share = float(top_share(heats).mean())
    words, rough = _completeness(gaps, max(steps), dtype_name(ctx.precision.compute_dtype))
    check = Check("pixel attribution", "WARN" if rough else "PASS", round(share, 4), threshold,
                  f"integrated gradients over {n} images{scope}: the top 10% of pixels hold {share:.0%} of "
                  f"|attribution|; {words}")
    return Outcome([check], {"attribution": frame}, {"overlay": shown})


def _completeness(gaps: tuple[float, ...], steps: int, dtype: str) -> tuple[str, bool]:
    """How closely the attributions sum to each logit's change, in words, and whether one misses past IG_GAP; an
    image whose logit moves too little for its dtype's rounding (NaN gap) is left out."""
    measured = [g for g in gaps if not math.isnan(g)]
    if not measured:
        return (f"every image's logit moves too little from a mean-colour image for {dtype} logits to measure "
                "completeness"), False
    worst = max(measured)
    words = f"they sum to the logit's change from a mean-colour image within {worst:.1%}"
    if worst > IG_GAP:
        words += f", past {IG_GAP:.0%} at {steps} steps: the model bends sharply along the path, read the maps as rough"
    if len(measured) < len(gaps):
        words += (f" ({len(gaps) - len(measured)} of {len(gaps)} images left out: their logit moves too little for "
                  f"{dtype} logits to measure it)")
    return words, worst > IG_GAP


def _integrate(ctx: Context, image: torch.Tensor, chunk: int, deadline: float) -> tuple:
    """One image's integrated gradients on IG_STEPS steps, four times as many while they miss more than IG_GAP of
    the logit's change and the budget lasts (up to IG_MAX_STEPS): (attribution, gap, class, steps)."""
    steps = IG_STEPS
    while True:
        attribution, gap, target = integrated_gradients(ctx, image, steps, chunk)
        if not gap > IG_GAP or steps >= IG_MAX_STEPS or time.perf_counter() > deadline:  # NaN: more won't help
            return attribution, gap, target, steps
        steps *= 4


def plot(outcome: Outcome) -> Figure:
    """Example 0's tokens, each on a background coloured by its signed gradient x input; an image model's images,
    each under its attribution's heat map."""
    if "overlay" in outcome.artifacts:
        return grid_figure(outcome.artifacts["overlay"])
    table = outcome.frames["attribution"]
    rows = max(1, -(-len(table) // _CHARS_PER_ROW))
    import matplotlib as mpl
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 0.45 * rows + 1.2), layout="constrained")
    ax = fig.add_subplot()
    limit = float(table.saliency.abs().max()) or 1.0
    norm, cmap = mpl.colors.Normalize(-limit, limit), mpl.colormaps["coolwarm"]
    for r in table.itertuples():
        x, y = r.position % _CHARS_PER_ROW, -(r.position // _CHARS_PER_ROW)
        ax.text(x, y, r.text if r.text != " " else "␣", family="monospace", ha="center", va="center", fontsize=10,
                bbox={"facecolor": cmap(norm(r.saliency)), "edgecolor": "none", "pad": 2})
    ax.set(xlim=(-1, _CHARS_PER_ROW), ylim=(-rows, 1))
    ax.axis("off")
    fig.colorbar(mpl.cm.ScalarMappable(norm, cmap), ax=ax, orientation="horizontal", shrink=0.5,
                 label="gradient x input (red supports the prediction)")
    ax.set_title(f"Saliency for {outcome.artifacts['target']}")
    return fig


def panel(ax, outcome: Outcome) -> None:
    if "overlay" in outcome.artifacts:
        shown = outcome.artifacts["overlay"]
        draw(ax, shown, 0)
        ax.set_title(f"integrated gradients\n(true {shown.labels[0]}, predicted {shown.predictions[0]})", fontsize=9)
        return
    table = outcome.frames["attribution"]
    from matplotlib.patches import Patch

    ax.bar(table.position, table.share, color=["C3" if s > 0 else "C0" for s in table.saliency])
    ax.set(xlabel="token position (example 0)", ylabel="share of |gradient x input|")
    ax.legend(handles=[Patch(color="C3", label="supports the prediction"), Patch(color="C0", label="opposes it")],
              fontsize=7)
    ax.set_title(f"saliency share for {outcome.artifacts['target']}")
