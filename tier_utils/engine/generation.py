"""What a sequence-to-sequence model writes: greedy generation on a few validation sources at each evaluation, scored
against their targets with chrF and BLEU (sacrebleu, an optional extra) and exact match, with the samples.

transformers' models generate through their own `generate()` and generation config (decoder start, end and padding
tokens, mBART's and Marian's forced first token); a hand-written encoder-decoder is decoded greedily here, one token
at a time, with the same start token its teacher-forced inputs begin with. Nothing is sampled: greedy decoding is
reproducible, so two evaluations differ only by what the model learnt.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch

MAX_SAMPLES = 16  # generation is slow next to a forward: a few sources tell what the model writes


@dataclass
class Generated:
    """One evaluation's generation: its scores (None where SKIPPED, with the reason) and its samples."""

    n: int
    chrf: float | None
    bleu: float | None
    exact_match: float
    seconds: float
    decoding: str
    skipped: str | None = None  # why chrF and BLEU were not scored
    # {"prompt", "reference", "generated"} (a pair's source and target); chat data: also the base's answer, "base"
    samples: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"n": self.n, "chrf": self.chrf, "bleu": self.bleu, "exact_match": self.exact_match,
                "seconds": self.seconds, "decoding": self.decoding, "skipped": self.skipped, "samples": self.samples}

    def describe(self) -> str:
        scores = (f"chrF {self.chrf:.1f} · BLEU {self.bleu:.1f}" if self.skipped is None
                  else f"chrF and BLEU SKIPPED ({self.skipped})")
        return (f"{scores} · exact match {self.exact_match:.0%} on {self.n} validation sources ({self.decoding}, "
                f"{self.seconds:.1f} s)")


def generate_and_score(adapter, splits, precision, n: int = MAX_SAMPLES, synced: bool = False) -> Generated:
    """Greedy generation on the first `n` validation pairs of `splits` (Pairs rows: input_ids, attention_mask,
    labels), batched by the task's collator; `synced`: every rank generates in step (see `_grad_mode`)."""
    rows = [splits.val[i] for i in range(min(n, len(splits.val)))]
    batch = splits.collate(rows)
    ids, mask, labels = (batch[k].to(adapter.device) for k in ("input_ids", "attention_mask", "labels"))
    longest = int(adapter.task.scored(labels).sum(1).max())  # a generation may run as long as the longest target
    model, start = adapter.model, time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        with _grad_mode(synced), precision.autocast():
            out = _generate(adapter, ids, mask, longest, synced)
    finally:
        model.train(was_training)
    seconds = time.perf_counter() - start
    tok = adapter.tokenizer
    decode = lambda row: _text(tok, row)  # noqa: E731 - one line, used three times
    sources = [decode(r["input_ids"][r["attention_mask"].bool()]) for r in rows]
    targets = [decode(r["labels"][adapter.task.scored(r["labels"])]) for r in rows]
    written = [decode(row) for row in out.cpu()]
    chrf, bleu, skipped = _sacrebleu(written, targets)
    exact = sum(w.strip() == t.strip() for w, t in zip(written, targets)) / len(rows)
    decoding = f"greedy, at most {longest} new tokens" + (", the model's generation config"
                                                         if callable(getattr(model, "generate", None)) else "")
    samples = [{"prompt": s, "reference": t, "generated": w} for s, t, w in zip(sources, targets, written)]
    return Generated(len(rows), chrf, bleu, exact, seconds, decoding, skipped, samples)


def sample_scores(pairs: list[tuple[str, str]]) -> dict[str, list[float]]:
    """Each (reference, written) pair's sacrebleu sentence chrF (absent without sacrebleu) and exact match (0 or 1):
    a generating task's per-example metrics, from what its samples hold."""
    exact = [float(w.strip() == r.strip()) for r, w in pairs]
    try:
        import sacrebleu
    except ImportError:
        return {"exact_match": exact}
    return {"chrf": [sacrebleu.sentence_chrf(w, [r]).score for r, w in pairs], "exact_match": exact}


def _grad_mode(synced: bool):
    """Generation's grad mode. A sharded model (FSDP) needs every rank in each forward, so the ranks generate in step
    (`synced`), under no_grad: FSDP2 makes its all-gather buffers in its first forward, and inference tensors made
    there would refuse training's in-place copies later."""
    return torch.no_grad() if synced else torch.inference_mode()


def _generate(adapter, ids: torch.Tensor, mask: torch.Tensor, longest: int, synced: bool = False) -> torch.Tensor:
    """The new tokens only, (B, <= longest); `synced`: every rank runs every step (transformers' synced_gpus; the
    loop below its whole length), since each forward needs them all."""
    generate = getattr(adapter.model, "generate", None)
    if callable(generate):
        return generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False, num_beams=1,
                        synced_gpus=synced)
    from ..tasks.seq2seq import decoder_inputs

    eos = adapter.tokenizer.eos_id
    # The start token the teacher-forced inputs begin with: the decoder inputs of a one-token target.
    out = decoder_inputs(adapter.model, torch.zeros(len(ids), 1, dtype=torch.long, device=ids.device))
    done = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    for _ in range(longest):
        logits = adapter.logits(ids, mask, labels=torch.cat([out[:, 1:], out[:, :1]], 1))
        nxt = logits[:, -1].argmax(-1)
        out = torch.cat([out, nxt[:, None]], 1)
        done |= nxt == eos if eos is not None else done
        if done.all() and not synced:
            break
    return out[:, 1:]


def _text(tokenizer, ids) -> str:
    """Ids as text, without the tokenizer's special tokens (padding, end of sequence)."""
    special = {t for t in (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id) if t is not None}
    return tokenizer.decode([int(t) for t in ids if int(t) not in special and int(t) >= 0])


def _sacrebleu(written: list[str], targets: list[str]) -> tuple[float | None, float | None, str | None]:
    try:
        import sacrebleu
    except ImportError:
        return None, None, "sacrebleu is not installed: pip install 'tier_utils[seq2seq]'"
    return (sacrebleu.corpus_chrf(written, [targets]).score, sacrebleu.corpus_bleu(written, [targets]).score, None)


ANSWER_MARGIN = 8  # new tokens past the longest reference answer: room to overshoot and still be seen to stop


def answer_prompts(adapter, splits, precision, n: int = MAX_SAMPLES, synced: bool = False) -> tuple[list[str], int]:
    """A decoder-only model's greedy answers to the first `n` held-out chat prompts (`splits.chat.prompts`, each
    with the template's generation prompt), batched with the prompts padded on the LEFT, at most the longest
    reference's length plus a margin, stopping at the end token (the model's generation config, which holds it);
    `generate()` returns prompt + answer, so the prompt is sliced off. Returns (answers, the new-token limit)."""
    prompts = splits.chat.prompts[:n]
    tok = adapter.tokenizer
    limit = max(len(tok.encode(ref)) for _, _, ref in prompts) + ANSWER_MARGIN
    left = replace(splits.collate, side="left")
    rows = [ids for ids, _, _ in prompts]
    ids = left.pad(rows, left.pad_id).to(adapter.device)
    mask = left.pad([torch.ones(len(r), dtype=torch.long) for r in rows], 0).to(adapter.device)
    model, was_training = adapter.model, adapter.model.training
    model.eval()
    try:
        with _grad_mode(synced), precision.autocast():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=limit, do_sample=False,
                                 num_beams=1, pad_token_id=left.pad_id, synced_gpus=synced)
    finally:
        model.train(was_training)
    ends = set(splits.chat.end_ids)
    answers = []
    for row in out[:, ids.shape[1]:].cpu().tolist():
        stop = next((i for i, t in enumerate(row) if t in ends), len(row))
        answers.append(_text(tok, row[:stop]))
    return answers, limit


def score_answers(adapter, splits, precision, base: list[str] | None, synced: bool = False) -> Generated:
    """The held-out chat prompts answered now, scored against their references like a seq2seq model's targets
    (exact match, chrF, BLEU), with the base model's answers (generated before the first step) beside them."""
    start = time.perf_counter()
    written, limit = answer_prompts(adapter, splits, precision, synced=synced)
    seconds = time.perf_counter() - start
    held = splits.chat.prompts[:len(written)]
    prompts, references = [question for _, question, _ in held], [ref for _, _, ref in held]
    chrf, bleu, skipped = _sacrebleu(written, references)
    exact = sum(w.strip() == r.strip() for w, r in zip(written, references)) / len(written)
    base = base or [None] * len(written)
    samples = [{"prompt": p, "reference": r, "base": b, "generated": w}
               for p, r, b, w in zip(prompts, references, base, written)]
    decoding = f"greedy, at most {limit} new tokens, stopping at the end of turn, prompts padded on the left"
    return Generated(len(written), chrf, bleu, exact, seconds, decoding, skipped, samples)
