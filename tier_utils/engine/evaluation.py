"""Validation metrics (`evaluate`), shared by training and the AMP benchmark."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..core.paired import ExampleScores
from ..data.datasets import to_device

TOP_K = 5  # a classifier of more classes is also scored on whether the label is among its 5 best guesses
# A classifier of at most this many classes gets a confusion matrix (a larger one is no table a person reads).
CONFUSION_CLASSES = 50


def perplexity(loss: float) -> float:
    return math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709


def evaluate(adapter, loader, precision, max_batches: int | None = None, reduce_sum=None,
             forwards: int | None = None, example_ids=None, gather=None, grad_mode=torch.inference_mode) -> dict:
    """Validation loss, perplexity (causal LM; NaN otherwise) and top-1 accuracy over every target
    (next tokens, or class labels) of a ModelAdapter in a Precision; top-5 accuracy where a task's classes are more
    than 5 (`top5_accuracy`, absent otherwise); for a one-label-per-row classifier of at most CONFUSION_CLASSES
    classes, `confusion`: counts by [true class][predicted class] (absent otherwise).

    Logits come from the precision's autocast and are scored in fp32, under inference_mode, on at
    most `max_batches` batches (None: all); the model is back in train mode afterwards.
    `reduce_sum` (e.g. DistEnv.all_sum) adds up the sums across ranks. `targets` is their count.
    `forwards`: under FSDP every rank must run as many forwards as the others (each one all-gathers weights
    with them), so a rank whose share ran out of batches runs uncounted forwards up to that number.
    `example_ids`: the loader's examples' indices in the validation split, in its order; given, `examples` holds each
    scored example's own scores (`example_scores`), gathered from every rank with `gather` (DistEnv.gather).
    `grad_mode`: inference_mode, or no_grad where a strategy's first forward must make no inference tensors.
    """
    model, device = adapter.model, adapter.device
    model.eval()
    sums = torch.zeros(4, device=device)  # loss x count, correct, count, correct in the top 5
    classes = adapter.num_classes if adapter.task.has_classes and not adapter.task.per_token else None
    confusion = torch.zeros(classes**2, device=device) if classes and classes <= CONFUSION_CLASSES else None
    done, examples = 0, [] if example_ids is not None else None
    try:
        with grad_mode():
            for i, batch in enumerate(loader):
                if max_batches is not None and i >= max_batches:
                    break
                batch = to_device(batch, device)
                with precision.autocast():
                    logits = adapter.batch_logits(batch)
                logits, labels = logits.float(), batch["labels"]
                scored = adapter.task.scored(labels)  # a seq2seq target's padding is not scored
                n = scored.sum()
                sums[0] += adapter.loss(logits, labels) * n
                sums[1] += ((logits.argmax(-1) == labels) & scored).sum()
                sums[2] += n
                if adapter.task.has_classes and logits.size(-1) > TOP_K:
                    sums[3] += ((logits.topk(TOP_K, -1).indices == labels.unsqueeze(-1)).any(-1) & scored).sum()
                if confusion is not None:
                    pairs = labels[scored] * classes + logits.argmax(-1)[scored]
                    confusion += torch.bincount(pairs, minlength=classes**2)[:classes**2]
                if examples is not None:
                    seen = sum(len(e.index) for e in examples)
                    examples.append(example_scores(adapter, batch, logits, example_ids[seen:seen + len(labels)]))
                done += 1
            for _ in range((forwards or 0) - done):
                adapter.batch_logits(adapter.example_batch(1, 1))  # its output is not scored
    finally:
        model.train()
    loss_sum, correct, count, top_k = (reduce_sum(sums) if reduce_sum else sums).tolist()
    ranked = adapter.task.has_classes and (adapter.num_classes or 0) > TOP_K
    val_loss = loss_sum / count
    counted = {} if confusion is None else {"confusion": (reduce_sum(confusion) if reduce_sum else confusion).view(
        classes, classes).long().tolist()}
    if examples is not None:
        mine = ExampleScores.merged(examples) if examples else ExampleScores([], {})
        counted["examples"] = ExampleScores.merged(gather(mine) if gather else [mine])
    return {"val_loss": val_loss, "perplexity": perplexity(val_loss) if adapter.task.has_perplexity else math.nan,
            "accuracy": correct / count, "targets": int(count), **({"top5_accuracy": top_k / count} if ranked else {}),
            **counted}


def example_scores(adapter, batch: dict, logits: torch.Tensor, ids) -> ExampleScores:
    """Each example's loss (the mean over its scored targets, by the labels' -100 mask: whatever the batch's
    padding) and accuracy (a per-position task's: its token accuracy), from fp32 logits."""
    rows = len(batch["labels"])
    labels = batch["labels"].reshape(rows, -1)  # one label per row: a row of one target
    logits = logits.reshape(rows, labels.size(1), -1)
    scored = adapter.task.scored(labels)
    per = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")  # 0 where -100
    right = (logits.argmax(-1) == labels) & scored
    n = scored.sum(1).clamp_min(1)
    name = "token_accuracy" if adapter.task.per_token else "accuracy"
    return ExampleScores([int(i) for i in ids], {"loss": (per.sum(1) / n).tolist(),
                                                 name: (right.sum(1) / n).tolist()})
