"""The fine-tune against its base, in a training run with a held-out split: both scored per example on the same
validation examples (the ones evaluation reads), the paired verdict per metric (core/paired.py).

The base is the model as the run started it: a full fine-tune's initial weights, scored before the first step (no
second copy is held; the scores go into every checkpoint, so a resume keeps them); LoRA's and QLoRA's model with its
adapters off (peft's `disable_adapter()`), scored at the end. The fine-tune is the weights the run returns (the best
ones under restore_best), scored before a merge: the run's last evaluation scored them already, unless restore_best
put back others. A run that writes checkpoints also writes their `scores.json`:
the per-example scores and the validation split's identity, which `compare` pairs with another run's.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.utils.data import Subset

from ..core.files import write_json
from ..core.paired import ExampleScores, Pairing
from ..engine.evaluation import evaluate
from ..engine.generation import Generated, _text, sample_scores

SCORES_FILE = "scores.json"  # beside the checkpoints: what `compare` reads
SCORES_FORMAT = 1
TEXT_CHARS = 200  # of an example's text, kept with its scores


@dataclass
class VersusBase:
    """What the comparison needs of the run, given whole; `seconds` is what it has cost so far."""

    run: object  # the training run (loop._Run): its adapter, data, precision, strategy, config and progress
    lora: str | None  # LoRA or QLoRA: the base is the model with its adapters off (None: the initial weights)
    new_head: str | None  # a head the loader started new: the base scored it untrained
    skipped: str | None  # why the run compares nothing (None: it compares)
    seconds: float = 0.0
    last: tuple[int, ExampleScores] | None = field(default=None, repr=False)  # the last evaluation's step, scores
    tuned: ExampleScores | None = field(default=None, repr=False)  # the fine-tune's scores, at the run's end
    pairing: Pairing | None = field(default=None, repr=False)

    @classmethod
    def decide(cls, run, new_head: str | None) -> VersusBase:
        cfg, memory = run.cfg, run.built.memory
        lora = None if memory.lora is None else "QLoRA's 4-bit" if memory.quantized else "LoRA's"
        skipped = None
        if not cfg.evaluates:
            skipped = "not run: no held-out split (eval_every=never or val_fraction=0)"
        elif not cfg.compare_base:
            skipped = "off (compare_base=False: --no-compare-base, or a search trial)"
        return cls(run, lora, new_head, skipped)

    @property
    def base(self) -> str:
        """Which model the base is, in words."""
        what = (f"{self.lora} base: the model with its adapters off (peft's disable_adapter)" if self.lora
                else "the initial weights, scored before the first step")
        return what + (f"; its head was untrained ({self.new_head})" if self.new_head else "")

    @property
    def example_ids(self) -> list[int] | None:
        """This rank's validation examples' indices in its loader's order (eval_shard's share, in the order its sampler
        reads it: grouping by length reorders the scored rows); None: nothing compared."""
        if self.skipped:
            return None
        env, n = self.run.env, len(self.run.data.splits.val)
        share = list(range(env.rank, n, env.world_size) if env.active else range(n))
        return [share[i] for i in self.run.data.val_loader.sampler]

    def evaluated(self, step: int, metrics: dict, generated) -> None:
        """An evaluation's per-example scores, kept: the last one's are the fine-tune's."""
        if "examples" in metrics:
            self.last = step, _with_generation(metrics["examples"], generated)

    def scores(self, grad_mode=torch.inference_mode) -> ExampleScores:
        """The model as it is now, scored per example (every rank runs it: evaluation's collectives)."""
        run = self.run
        metrics = evaluate(run.adapter, run.data.val_loader, run.precision, run.cfg.eval_batches, run.env.all_sum,
                           run.data.eval_forwards, self.example_ids, run.env.gather, grad_mode)
        return _with_generation(metrics["examples"], run.generation() if run.generates else None)

    def _named(self, scores: ExampleScores) -> ExampleScores:
        """The scores with each example's text: its input decoded with the model's tokenizer (none for an image)."""
        adapter, val = self.run.adapter, self.run.data.splits.val
        if not adapter.task.reads_tokens or adapter.tokenizer is None:
            return replace(scores, text=[_source(val, i) for i in scores.index])
        texts = []
        for i in scores.index:
            row = val[i]
            ids, mask = row[adapter.task.input_key], row.get("attention_mask")
            texts.append(_text(adapter.tokenizer, ids[mask.bool()] if mask is not None else ids)[:TEXT_CHARS])
        return replace(scores, text=texts)

    def at_start(self) -> None:
        """A full fine-tune's base: scored before the first step (a resume has it from its checkpoint)."""
        p = self.run.progress
        if self.skipped or self.lora or p.step or p.base_scores is not None:
            return
        start = time.perf_counter()
        p.base_scores = self.scores(self.run.strategy.first_eval_mode)  # the first forward of the run
        self.seconds += time.perf_counter() - start

    def at_end(self, weights_step: int) -> None:
        """The fine-tune's scores (the last evaluation's, where it scored the weights of `weights_step`), the
        base's where it is the adapters turned off, and their pairing."""
        if self.skipped:
            return
        start, p, model = time.perf_counter(), self.run.progress, self.run.adapter.model
        if self.lora:
            with model.disable_adapter():  # peft: the frozen base alone (a head trained in full back at its start)
                p.base_scores = self.scores()
        fresh = self.last is not None and self.last[0] == weights_step
        self.tuned = self._named(self.last[1] if fresh else self.scores())
        if p.base_scores is not None:
            self.pairing = Pairing.of(self._named(p.base_scores), self.tuned, self.run.cfg.seed)
        self.seconds += time.perf_counter() - start

    def summary(self) -> dict:
        """The summary's record: the pairing (None where none ran, with why), which base, what it cost."""
        why = self.skipped
        if why is None and self.tuned is None:
            why = "not run: the run did not reach its end (interrupted or diverged)"
        elif why is None and self.pairing is None:
            why = "not run: resumed from a checkpoint written before base scores were kept"
        return {"skipped": why, "base": self.base, "seconds": round(self.seconds, 3),
                "pairing": self.pairing and self.pairing.to_dict()}

    def settings(self) -> dict:
        """What `compare` names where two runs differ."""
        run = self.run
        cfg = run.cfg
        return {"precision": run.precision.name, "memory": run.built.memory.describe(), "lr": cfg.lr,
                "steps": run.progress.step, "global_batch": run.data.global_batch, "seed": cfg.seed,
                "order": "shuffled each epoch" if cfg.shuffle else "the data's own order", "schedule": cfg.schedule,
                "eval_batches": cfg.eval_batches}

    def save(self, folder, fingerprint: dict | None) -> Path | None:
        """scores.json in the checkpoint folder (rank 0): the fine-tune's (and base's) per-example scores, the
        validation split's identity and the settings `compare` names where two runs differ."""
        tuned = self.tuned
        if folder is None or tuned is None or not self.run.env.is_main:
            return None
        run = self.run
        record = {"format": SCORES_FORMAT, "model": run.built.name, "task": run.adapter.task.name,
                  "tokenizer": run.data.description.tokenizer,
                  "validation": {"sha1": (fingerprint or {}).get("val_sha1"), "examples": len(run.data.splits.val),
                                 "how": run.data.description.validation},
                  "settings": self.settings(), "tuned": tuned.to_dict(),
                  "base": run.progress.base_scores and run.progress.base_scores.to_dict(), "base_is": self.base}
        return write_json(Path(folder) / SCORES_FILE, record)


def _source(dataset, i: int) -> str | None:
    """Where a validation example was read from, where its Dataset says (an image's file), through Subsets."""
    while isinstance(dataset, Subset):
        dataset, i = dataset.dataset, dataset.indices[i]
    where = getattr(dataset, "example_source", None)
    return where(i) if callable(where) else None


def _with_generation(scores: ExampleScores, generated) -> ExampleScores:
    """`scores` with a generating task's per-example chrF and exact match on the sources it wrote for (the first
    few of the split), from the (reference, written) pairs its samples hold; as they are where none ran."""
    if not isinstance(generated, Generated):
        return scores
    pairs = [(s["reference"], s["generated"]) for s in generated.samples]
    return scores.with_metrics(list(range(len(pairs))), sample_scores(pairs))


def pairing(record: dict | None) -> Pairing | None:
    """The summary record's pairing (None: no comparison ran)."""
    return Pairing.from_dict(record["pairing"]) if record and record.get("pairing") else None


def describe(record: dict | None, cost: bool = True) -> str | None:
    """The summary's line: "val loss −0.42 [−0.47, −0.38], improved (n=320, ...)", or why there is none; `cost`:
    with the seconds it took."""
    if not record:
        return None
    paired = pairing(record)
    if paired is None:
        return record["skipped"]
    line = f"val {paired.headline.describe()}"
    return line + f" · {record['seconds']:.1f} s (--no-compare-base turns it off)" * cost
