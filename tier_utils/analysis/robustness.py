"""Robustness: perturb real inputs at several levels and compare predictions with the clean ones.

Perturbations of tokens (level = a fraction of the real tokens, or a noise scale):
- substitution: that share of tokens replaced by a different random token;
- deletion: that share of tokens removed (the rest shift left, padding fills the end);
- embedding_noise: Gaussian noise of std level x RMS(embedding output), added by a forward hook
  on the token embedding.
An image's pixels get noise, blur and brightness instead (analysis/pixels.py says each level's size).
Per level: agreement (the perturbed argmax equals the clean argmax), KL(clean || perturbed), logit
drift (the relative L2 change of the logits, centred, as softmax reads them) and flip rate (the
share of clean-correct predictions the perturbation makes wrong). A causal LM is
compared position by position (after a deletion, by the token each prediction follows); a
classifier per sequence. Level 0 runs the clean input a second time: agreement below 1 there
means the model is not deterministic in eval mode, which FAILs.
"""
from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.nn.functional as F

from ..core.budget import affordable_repeats
from ..core.results import Check
from . import pixels
from .common import Context, Outcome, head_rows

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure

LEVELS = (0.0, 0.05, 0.1, 0.2)
PERTURBATIONS = ("substitution", "deletion", "embedding_noise")
REFERENCE_LEVEL = 0.1  # the level a finding quotes
FRAGILE_AGREEMENT = 0.5  # below this at the reference level: WARN
COLUMNS = ["perturbation", "level", "n", "agreement", "kl", "logit_drift", "n_correct", "flip_rate"]
_UNITS = {"substitution": "of tokens (substitution)", "deletion": "of tokens (deletion)",
          "embedding_noise": "x embedding RMS noise", **pixels.UNITS}
# Seconds the perturbed passes may take: a big model compares fewer sequences (the rows say how many).
BUDGET_S = 10.0


def _substitute(ids, mask, level, vocab, g):
    hit = (torch.rand(ids.shape, generator=g) < level).to(ids.device) & mask
    shift = torch.randint(1, vocab, ids.shape, generator=g).to(ids.device)  # never the same token again
    new = torch.where(hit, (ids + shift) % vocab, ids)
    return new, mask, torch.arange(ids.size(1), device=ids.device).expand_as(ids)


def _delete(ids, mask, level, vocab, g):
    """Drop round(level * n_real) real tokens per row; `origin[b, j]` = original position now at j, or -1."""
    new, new_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    origin = torch.full_like(ids, -1)
    for b in range(ids.size(0)):
        real = mask[b].nonzero().squeeze(1)
        n_drop = int(round(level * len(real)))
        drop = real[torch.randperm(len(real), generator=g)[:n_drop].to(ids.device)]
        keep = torch.ones(ids.size(1), dtype=torch.bool, device=ids.device)
        keep[drop] = False
        keep &= mask[b]
        kept = keep.nonzero().squeeze(1)
        new[b, : len(kept)], new_mask[b, : len(kept)], origin[b, : len(kept)] = ids[b, kept], True, kept
    return new, new_mask, origin


@contextlib.contextmanager
def _embedding_noise(embedding, level, g):
    def hook(module, args, out):
        scale = out.detach().float().pow(2).mean().sqrt() * level
        return out + (torch.randn(out.shape, generator=g) * scale.cpu()).to(out.device, out.dtype)

    handle = embedding.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _log_probs(ctx: Context, ids, mask, labels) -> torch.Tensor:
    """Log-probabilities for (perturbed) input ids, or pixels; a task that feeds its targets gets the clean ones (a
    seq2seq decoder reads the same targets whatever noise the source carries)."""
    with torch.no_grad(), ctx.precision.autocast():
        logits = ctx.adapter.logits(ids, None if mask is None else mask.long(),
                                    labels=labels if ctx.adapter.task.feeds_targets else None)
    return F.log_softmax(logits.float(), dim=-1)


def _compare(ctx, clean, pert, labels, mask, new_mask, origin):
    """(agree, kl, drift, correct_before, flipped) as flat tensors over the compared predictions."""
    task = ctx.adapter.task
    if task.per_token and not task.predicts_input_positions:  # target positions: the source's noise moves none
        valid = task.scored(labels)
        clean, pert, labels = clean[valid], pert[valid], labels[valid]
    elif task.per_token:  # per input position: compare the predictions of the tokens that survived
        valid = new_mask & (origin >= 0)
        b, j = valid.nonzero(as_tuple=True)
        k = origin[b, j]
        valid_clean = mask[b, k]
        b, j, k = b[valid_clean], j[valid_clean], k[valid_clean]
        clean, pert, labels = clean[b, k], pert[b, j], labels[b, k]
    top_clean, top_pert = clean.argmax(-1), pert.argmax(-1)
    kl = (clean.exp() * (clean - pert)).sum(-1)
    # Log-probabilities less their mean are the logits less theirs: the logits as far as softmax can tell them.
    centred_clean, centred_pert = (p - p.mean(-1, keepdim=True) for p in (clean, pert))
    drift = (centred_pert - centred_clean).norm(dim=-1) / centred_clean.norm(dim=-1).clamp_min(1e-12)
    correct = top_clean == labels
    return top_clean == top_pert, kl, drift, correct, correct & (top_pert != labels)


def run(ctx: Context) -> Outcome:
    adapter = ctx.adapter
    kinds, levels = (pixels.PERTURBATIONS, pixels.LEVELS) if adapter.task.reads_pixels else (PERTURBATIONS, LEVELS)
    key = adapter.task.input_key
    start = time.perf_counter()
    clean = [_log_probs(ctx, b[key], ctx.mask(b), b["labels"]) for b in ctx.batches]
    # Every further pass costs about what the clean one did: as many sequences as fit the time budget.
    passes = (0 in levels) + len(kinds) * sum(level != 0 for level in levels)
    total = sum(len(b["labels"]) for b in ctx.batches)
    per_sequence = (time.perf_counter() - start) / total
    rows_kept = affordable_repeats(per_sequence * passes, BUDGET_S, total)
    batches = head_rows(ctx.batches, rows_kept)
    clean = [c[: len(b["labels"])] for c, b in zip(clean, batches)]
    # Level 0 compares a second clean run with the first: the eval-mode determinism check.
    again = [_log_probs(ctx, b[key], ctx.mask(b), b["labels"]) for b in batches] if 0 in levels else clean
    rows, notes = [], []
    scope = (f"; {rows_kept} of {adapter.task.rows(total)}, as many as fit the {BUDGET_S:g} s budget at "
             f"{per_sequence * passes:.2g} s each for {passes} passes" if rows_kept < total else "")
    for pi, kind in enumerate(kinds):
        if kind == "embedding_noise" and adapter.task.source_embedding(adapter) is None:
            notes.append(f"embedding_noise skipped: {adapter.name} exposes no nn.Embedding")
            continue
        for li, level in enumerate(levels):
            g = torch.Generator().manual_seed(1000 * pi + li)
            parts = [_compare(ctx, ref, *_perturbed(ctx, kind, level, batch, rerun, g))
                     for batch, ref, rerun in zip(batches, clean, again)]
            agree, kl, drift, correct, flipped = (torch.cat(t) for t in zip(*parts))
            n_correct = int(correct.sum())
            rows.append({"perturbation": kind, "level": level, "n": len(agree),
                         "agreement": float(agree.float().mean()), "kl": float(kl.mean()),
                         "logit_drift": float(drift.mean()), "n_correct": n_correct,
                         "flip_rate": float(flipped.sum()) / n_correct if n_correct else float("nan")})
    df = pd.DataFrame(rows, columns=COLUMNS)
    nonfinite = sum(int((~torch.isfinite(c).all(-1)).sum()) for c in clean)
    reference = pixels.REFERENCE_LEVEL if adapter.task.reads_pixels else REFERENCE_LEVEL
    return Outcome(_checks(df, notes, nonfinite, scope, reference), {"robustness": df})


def _perturbed(ctx: Context, kind: str, level: float, batch: dict, rerun: torch.Tensor, g: torch.Generator):
    """(perturbed log-probs, labels, clean mask, perturbed mask, origin: the clean position now at each one) for
    one batch at one level; level 0 is the clean input's second run."""
    adapter, labels, mask = ctx.adapter, batch["labels"], ctx.mask(batch)
    x = batch[adapter.task.input_key]
    origin = None if mask is None else torch.arange(x.size(1), device=x.device).expand_as(x)
    if level == 0:
        return rerun, labels, mask, mask, origin
    if adapter.task.reads_pixels:
        return _log_probs(ctx, pixels.perturb(kind, x, level, g), None, labels), labels, None, None, None
    if kind == "embedding_noise":
        with _embedding_noise(adapter.task.source_embedding(adapter), level, g):
            return _log_probs(ctx, x, mask, labels), labels, mask, mask, origin
    perturb = _substitute if kind == "substitution" else _delete
    new_ids, new_mask, origin = perturb(x, mask, level, adapter.vocab_size, g)
    return _log_probs(ctx, new_ids, new_mask, labels), labels, mask, new_mask, origin


def _checks(df: pd.DataFrame, notes: list[str], nonfinite: int = 0, scope: str = "",
            reference: float = REFERENCE_LEVEL) -> list[Check]:
    """`nonfinite`: clean predictions with a NaN/inf log-probability; any of them and nothing can PASS.
    `scope`: appended to each detail when the time budget left sequences out. `reference`: the level quoted."""
    checks = []
    for kind, grp in df.groupby("perturbation", sort=False):
        zero = grp[grp.level == 0]
        nonzero = grp[grp.level > 0]
        ref = nonzero.iloc[(nonzero.level - reference).abs().argsort().iloc[0]] if len(nonzero) else grp.iloc[-1]
        flips = (f"flip rate {ref.flip_rate:.2f} of {ref.n_correct} correct" if ref.n_correct
                 else "no correct predictions to flip")
        detail = (f"at {ref.level:g} {_UNITS[kind]}: agreement {ref.agreement:.2f}, KL {ref.kl:.3g}, logit drift "
                  f"{ref.logit_drift:.3g}, {flips}, over {ref.n} predictions{scope}")
        if nonfinite or not math.isfinite(ref.kl):
            status, detail = "FAIL", (f"{nonfinite} clean predictions have NaN/inf log-probabilities: agreement "
                                      "between NaN outputs means nothing; " + detail)
        elif len(zero) and zero.agreement.iloc[0] != 1.0:
            status, detail = "FAIL", (f"agreement {zero.agreement.iloc[0]:.4f} on unperturbed input: the model is "
                                      "not deterministic in eval mode; " + detail)
        else:
            status = "WARN" if ref.agreement < FRAGILE_AGREEMENT else "PASS"
        checks.append(Check(kind, status, round(float(ref.agreement), 4), f">= {FRAGILE_AGREEMENT} agreement", detail))
    checks += [Check("embedding_noise", "SKIP", None, None, note) for note in notes]
    return checks


_Y_LABELS = {"agreement": "share of predictions unchanged", "kl": "KL(clean || perturbed) (nats)",
             "logit_drift": "relative change of the logits", "flip_rate": "share of correct ones flipped"}


def plot(outcome: Outcome) -> Figure:
    """Agreement, KL, logit drift and flip rate against perturbation level, one line per perturbation."""
    df = outcome.frames["robustness"]
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 3.4), layout="constrained")
    for ax, metric in zip(fig.subplots(1, 4), ("agreement", "kl", "logit_drift", "flip_rate")):
        for kind, grp in df.groupby("perturbation", sort=False):
            ax.plot(grp.level, grp[metric], marker="o", label=kind)
        ax.set(xlabel="perturbation level", ylabel=_Y_LABELS[metric], title=metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Robustness (up to {int(df.n.max())} predictions per point; flip rate over the correct ones)")
    return fig


def panel(ax, outcome: Outcome) -> None:
    df = outcome.frames["robustness"]
    for kind, grp in df.groupby("perturbation", sort=False):
        ax.plot(grp.level, grp.agreement, marker="o", label=kind)
    ax.set(ylim=(0, 1.05), xlabel="perturbation level", ylabel=_Y_LABELS["agreement"], title="prediction agreement")
    ax.legend(fontsize=7)
