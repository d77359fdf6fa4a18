"""Step time of `tier_utils.train()` on data of long-tailed lengths beside the HF Trainer and TRL's SFTTrainer (issue
57), side by side in one run on the same model, weights, rows and order:
- data made here (no hub), lengths drawn log-normal and cut at a longest, like real sentences: a classifier's CSV of
  sentences (median 17 tokens, longest 120), a T5's pairs JSONL (source median 15, longest 107; target median 8,
  longest 54) and chat data, a `messages` JSONL of one exchange each (the prompt, with the template's <s>, <|user|>
  and <|end|>, median 14 tokens, longest 60; the answer, with <|assistant|> and <|end|>, median 16, longest 64), each
  word one token of a word-level tokenizer (`tokenizers`) saved beside the model (for chat: with the chat demo's
  template, tier_utils/assets/chat_template.jinja, whose turns end with the end-of-turn token <|end|>);
- a BERT classifier (BertForSequenceClassification, 4 layers x 256), a T5 (3 + 3 layers x 256) and a Llama
  (LlamaForCausalLM, 4 layers x 256, tied embeddings), built from their configs, dropout off, saved with
  save_pretrained and loaded by every runner from that folder; train() scores a chat row's answer (its default), TRL
  its assistant turns (`assistant_only_loss=True` with bench/sft_peers.py's MARKED_TEMPLATE, the same tokens);
- the training rows in the order train()'s ShardedSampler gives for --seed (bench/peers.py's `train_order`), read by
  the peers in sequence; AdamW and the schedule from train()'s settings (peers.py's); bf16 autocast, batch 16.

Runners (RUNNERS): train() padding each batch to its longest row (a multiple of 8, the task's collator); train() on
rows padded to seq_len, as it was before issue 57; the HF Trainer with its default collator (DataCollatorWithPadding,
DataCollatorForSeq2Seq) and with train_sampling_strategy="group_by_length"; train() with group_by_length or packing
where TrainConfig has those settings (else skipped, the reason printed). On chat data the peer is TRL's SFTTrainer
(bench/sft_peers.py's, its `messages` format), not the HF Trainer: its default collator (each batch padded to its
longest, a multiple of 8) and `packing=True` (TRL 1.x's default strategy "bfd": best-fit decreasing into rows of
max_length = seq_len, padding-free: one flattened row per batch with position_ids, no mask).

Each call trains a fresh model for N2 steps (--steps N1 N2); step time = (t(N2) - t(N1)) / (N2 - N1), marked by
torch's global optimizer post-step hook (peers.py's `step_marks`). A forward pre-hook counts, for every training
forward, the positions computed (the batch's padded shapes: source, and target where there is one) and the real
tokens among them (the attention mask; a T5 target's decoder inputs that are not its pad, plus its start token), so
the time per 1,000 real tokens is that of steps N1+1..N2 over the real tokens they held (a padding-free batch has no
mask: its real tokens are those that are not the pad). An untimed warm-up round first; repeats interleaved, the
runners' order rotated each repeat. Verdicts per real token against each dataset's baseline (BASES: the HF Trainer's
default row; on chat data TRL's padded row) are the AMP benchmark's noise rule (`benchmark.verdicts.speedup`:
overlapping IQRs are "no measurable difference"). The loss check: one untimed first step of train() and of the
baseline on the same first batch, in fp32 and in the run's precision: their losses must agree (per-batch padding
masks what it adds). Counted: positions computed per real token of every runner (train() packed on chat data: the
issue's <= 1.1 target), and train()'s held-out loss with grouping or packing against per-batch padding's.

    python bench/padding.py --threads 1 --json padding.json     # 5 repeats, the three datasets, every runner
    python bench/padding.py --datasets chat --repeats 3 --steps 2 6 --threads 1
    python bench/padding.py --datasets classifier --repeats 3 --steps 2 6
    python bench/padding.py --tiny --repeats 1 --steps 1 2      # tiny sizes: does it run (tests/test_bench_padding.py)
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch.utils.data import Dataset, Subset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import quiet_peers, step_marks, train_order  # noqa: E402  the peers' shared timing, as peers.py does it
from sft_peers import VARIANTS, check_template, sft_trainer  # noqa: E402  TRL as sft_peers.py runs it

from tier_utils.adapter.adapter import resolve_model  # noqa: E402
from tier_utils.benchmark.verdicts import speedup  # noqa: E402
from tier_utils.core.device import device_name  # noqa: E402
from tier_utils.core.files import write_json  # noqa: E402
from tier_utils.core.measure import summarize  # noqa: E402
from tier_utils.core.precision import resolve_device, resolve_precision  # noqa: E402
from tier_utils.core.results import run_metadata  # noqa: E402
from tier_utils.core.threads import run_threads  # noqa: E402
from tier_utils.data.chat_demo import END_OF_TURN, SPECIAL, TEMPLATE  # noqa: E402
from tier_utils.data.collate import IGNORE  # noqa: E402
from tier_utils.engine.step import make_optimizer  # noqa: E402
from tier_utils.training.config import TrainConfig  # noqa: E402
from tier_utils.training.loop import train  # noqa: E402

RUNNERS = {
    "train()": "tier_utils.train, each batch padded to its longest (multiple of 8)",
    "train() seq_len": "tier_utils.train on rows padded to seq_len (as before issue 57)",
    "hf": "HF Trainer, default collator",
    "hf grouped": "HF Trainer, group_by_length",
    "train() grouped": "tier_utils.train, group_by_length",
    "train() packed": "tier_utils.train, packing",
    "trl": "TRL SFTTrainer, its collator (each batch padded to its longest, multiple of 8)",
    "trl packed": "TRL SFTTrainer, packing (bfd, padding-free)",
}
BASE = "hf"  # every ratio is against the HF Trainer with its default collator, except where BASES says otherwise
BASES = {"chat": "trl"}  # chat data's peer is TRL's SFTTrainer, padded per batch
GROUPED_TARGET = 0.77  # issue 57: with grouping or packing, time per real token <= 0.77x the baseline's
PACKED_TARGET = 1.1  # issue 57: packed chat data computes <= 1.1 positions per real token
MIN_REPEATS = 3  # below this an IQR says nothing, so no verdict is given
FP32_LOSS_TOLERANCE = 1e-4  # relative: the same batch in fp32, padding masked (summation order differs)
BF16_LOSS_TOLERANCE = 2e-2  # relative: bf16 autocast rounds each matmul's output to 8 bits of mantissa
# relative: grouping and packing put other examples side by side in a step, so the updates differ; after a few steps
# from the same start the held-out loss moves by less than this (it is no verdict on convergence)
HELD_OUT_TOLERANCE = 5e-2


@dataclass(frozen=True)
class Shape:
    """One dataset and its model: lengths (median, longest) of the source and of the target (None: no target)."""

    name: str
    source: tuple[int, int]
    target: tuple[int, int] | None
    seq_len: int
    target_len: int | None
    width: int
    layers: int
    rows: int


# chat: source = the prompt, target = the answer, each with its template tokens; one causal sequence (target_len None)
# of at most 124 tokens, so that neither train() (seq_len + 1 tokens) nor TRL (max_length = seq_len) cuts a row
SHAPES = {"classifier": Shape("classifier", (17, 120), None, 128, None, 256, 4, 2048),
          "pairs": Shape("pairs", (15, 107), (8, 54), 128, 64, 256, 3, 2048),
          "chat": Shape("chat", (14, 60), (16, 64), 128, None, 256, 4, 2048)}
TINY = {"classifier": Shape("classifier", (6, 30), None, 32, None, 32, 1, 160),
        "pairs": Shape("pairs", (6, 28), (4, 14), 32, 16, 32, 1, 160),
        "chat": Shape("chat", (6, 14), (6, 16), 32, None, 32, 1, 160)}
SPREAD = 0.63  # log-normal sigma: mean / median = exp(sigma^2 / 2) = 1.22, the 20.7 / 17
VOCAB_WORDS = 2000
SPECIALS = ["<pad>", "</s>", "<unk>", "[CLS]", "[SEP]"]  # pad id 0 (T5's pad and decoder start), eos 1
PAD_ID = 0  # every tokenizer here pads with id 0, which no text holds
PROMPT_MARKS, ANSWER_MARKS = 3, 2  # <s> <|user|> ... <|end|>; <|assistant|> ... <|end|> (the template's newlines are
# whitespace to the word-level tokenizer)


def lengths(n: int, median: int, longest: int, gen: torch.Generator) -> list[int]:
    """n token counts, log-normal around `median`, cut to [3, longest]; the longest appears at least once."""
    drawn = torch.exp(math.log(median) + SPREAD * torch.randn(n, generator=gen)).round().clamp(3, longest).long()
    drawn[int(torch.randint(n, (1,), generator=gen))] = longest
    return drawn.tolist()


def sentence(n: int, gen: torch.Generator) -> str:
    return " ".join(f"w{i}" for i in torch.randint(VOCAB_WORDS, (n,), generator=gen).tolist())


def write_data(shape: Shape, folder: Path, seed: int) -> Path:
    """The CSV (text, label), the pairs JSONL (source, target) or the chat JSONL (messages); each row's words + the
    specials = its length."""
    gen = torch.Generator().manual_seed(seed)
    if shape.name == "chat":
        path = folder / "chat.jsonl"
        prompts, answers = lengths(shape.rows, *shape.source, gen), lengths(shape.rows, *shape.target, gen)
        with path.open("w") as f:
            for p, a in zip(prompts, answers):
                f.write(json.dumps({"messages": [
                    {"role": "user", "content": sentence(max(1, p - PROMPT_MARKS), gen)},
                    {"role": "assistant", "content": sentence(max(1, a - ANSWER_MARKS), gen)}]}) + "\n")
        return path
    if shape.target is None:
        path = folder / "sentences.csv"
        with path.open("w", newline="") as f:
            out = csv.writer(f)
            out.writerow(["text", "label"])
            for n in lengths(shape.rows, *shape.source, gen):  # [CLS] and [SEP] are two of its tokens
                out.writerow([sentence(n - 2, gen), int(torch.randint(2, (1,), generator=gen))])
        return path
    path = folder / "pairs.jsonl"
    sources, targets = lengths(shape.rows, *shape.source, gen), lengths(shape.rows, *shape.target, gen)
    with path.open("w") as f:
        for s, t in zip(sources, targets):  # </s> is the last of each side's tokens
            f.write(json.dumps({"source": sentence(s - 1, gen), "target": sentence(t - 1, gen)}) + "\n")
    return path


def tokenizer(shape: Shape):
    """A word-level tokenizer over the words: [CLS] x [SEP] for the classifier, x </s> for T5 (pad 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chat = list(dict.fromkeys(SPECIAL)) if shape.name == "chat" else []
    vocab = {w: i for i, w in enumerate(dict.fromkeys([*SPECIALS, *chat, *(f"w{i}" for i in range(VOCAB_WORDS))]))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if chat:  # the chat demo's markers, split out before the words; its template; <|end|> ends a turn (the EOS)
        return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token=END_OF_TURN, pad_token="<pad>",
                                       unk_token="<unk>", additional_special_tokens=[t for t in chat if "|" in t
                                                                                     and t != END_OF_TURN],
                                       chat_template=TEMPLATE.read_text())
    if shape.target is None:
        tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]",
                                                           special_tokens=[("[CLS]", 3), ("[SEP]", 4)])
        return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", cls_token="[CLS]",
                                       sep_token="[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_folder(shape: Shape, folder: Path, seed: int) -> Path:
    """The model from its config, dropout off, and its tokenizer, saved as a user's folder (fp32)."""
    import transformers

    tok = tokenizer(shape)
    torch.manual_seed(seed)
    heads = max(1, shape.width // 64)
    if shape.name == "chat":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=len(tok), hidden_size=shape.width, intermediate_size=4 * shape.width,
            num_hidden_layers=shape.layers, num_attention_heads=heads, num_key_value_heads=heads,
            max_position_embeddings=shape.seq_len, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id, tie_word_embeddings=True))
    elif shape.target is None:
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=len(tok), hidden_size=shape.width, num_hidden_layers=shape.layers, num_attention_heads=heads,
            intermediate_size=4 * shape.width, max_position_embeddings=shape.seq_len, num_labels=2, pad_token_id=0,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0))
    else:
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=len(tok), d_model=shape.width, d_kv=64, d_ff=4 * shape.width, num_layers=shape.layers,
            num_decoder_layers=shape.layers, num_heads=heads, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
            decoder_start_token_id=0))
    out = folder / "model"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


class PaddedTo(Dataset):
    """Examples padded to seq_len (and target_len) when read, as tier_utils' readers built them before issue 57."""

    def __init__(self, rows: Dataset, seq_len: int, target_len: int | None):
        self.rows, self.seq_len, self.target_len = rows, seq_len, target_len

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        out = {k: _pad(v, self.seq_len, 0) for k, v in row.items() if k != "labels"}
        labels = row["labels"]
        out["labels"] = labels if labels.dim() == 0 else _pad(labels, self.target_len, IGNORE)
        return out


def _pad(v: torch.Tensor, n: int, fill: int) -> torch.Tensor:
    return torch.cat([v, v.new_full((n - len(v),), fill)])


@dataclass(frozen=True)
class Setup:
    """One dataset: its model folder, the splits train() reads, the rows in train()'s order, the settings."""

    shape: Shape
    folder: Path
    splits: object  # DataSplits, as train() builds them
    rows: Subset  # the training rows in train()'s order, enough for N2 steps
    cfg: TrainConfig
    device: torch.device
    # chat: the JSONL's rows behind `rows` (in train()'s order) and behind the whole training split, for TRL
    messages: tuple[list[dict], list[dict]] | None = None


def read_indices(data: Dataset) -> list[int]:
    """The positions, among the examples read from the file, of a split's examples (through its Subsets)."""
    if isinstance(data, Subset):
        inner = read_indices(data.dataset)
        return [inner[i] for i in data.indices]
    return list(range(len(data)))


def chat_messages(data: Path, splits, rows: Subset) -> tuple[list[dict], list[dict]]:
    """The chat rows TRL reads: those of `rows` in their order, and the whole training split's; every row was read
    (none is cut: the lengths fit seq_len), so the n-th example is the file's n-th row."""
    read = [json.loads(line) for line in data.read_text().splitlines()]
    train = read_indices(splits.train)
    if sum(len(x) for x in (splits.train, splits.val)) != len(read):
        raise RuntimeError(f"train() read {len(splits.train) + len(splits.val)} examples from {len(read)} chat rows: "
                           "some were left out, so TRL's rows would not be train()'s")
    return [read[train[i]] for i in rows.indices], [read[i] for i in train]


def setups(args, root: Path, device: torch.device) -> list[Setup]:
    import transformers

    found = []
    for name in args.datasets:
        shape = (TINY if args.tiny else SHAPES)[name]
        folder = root / name
        folder.mkdir()
        data, model = write_data(shape, folder, args.seed), build_folder(shape, folder, args.seed)
        adapter = resolve_model(str(model))
        splits = adapter.datasets(str(data), shape.seq_len, args.seed, target_len=shape.target_len)
        rows = Subset(splits.train, train_order(splits.train, args.batch_size, max(args.steps), args.seed))
        messages = None
        if shape.name == "chat":
            messages = chat_messages(data, splits, rows)
            # TRL's template (the demo's, marking the answers) renders each row as train()'s does
            check_template(transformers.AutoTokenizer.from_pretrained(model), messages[1])
        precision = resolve_precision(args.precision, device, warn=False)
        # eval_every=0: train() evaluates once, at the run's end (outside the timed steps)
        cfg = TrainConfig(precision=precision, batch_size=args.batch_size, seq_len=shape.seq_len,
                          target_len=shape.target_len, seed=args.seed, eval_every=0, eval_batches=args.eval_batches,
                          progress=False, device=device)
        found.append(Setup(shape, model, splits, rows, cfg, device, messages))
    return found


# -- the runners ----------------------------------------------------------------------------------------------------
def run_train(setup: Setup, steps: int, cfg: TrainConfig | None = None, padded: bool = False) -> float:
    """train() on the folder's model (loaded as a user loads it) with the splits it would build; `padded`: every
    example padded to seq_len first."""
    s = setup.splits
    data = (PaddedTo(s.train, setup.shape.seq_len, setup.shape.target_len), s.val) if padded else (s.train, s.val)
    adapter = resolve_model(str(setup.folder))
    result = counted(adapter.model, lambda: train(adapter, data, replace(cfg or setup.cfg, max_steps=steps)))
    HELD_OUT.append(result.summary.val_loss)
    return float(result.history.loc[result.history["kind"] == "step", "train_loss"].iloc[0])


def train_setting(name: str) -> str | None:
    """Why train() can't run with the batching setting `name` here (None: it can)."""
    if name not in {f.name for f in dataclasses.fields(TrainConfig)}:
        return (f"TrainConfig has no {name} setting on this branch (it comes with issue 57's batching work); "
                "merge it and rerun")
    return None


def run_train_with(setting: str):
    def run(setup: Setup, steps: int) -> float:
        return run_train(setup, steps, replace(setup.cfg, **{setting: True}))
    return run


def hf_rows(setup: Setup, rows) -> list[dict]:
    """The rows as a tokenized HF dataset holds them: plain lists of ids (a classifier's label an int)."""
    return [{k: v.tolist() for k, v in rows[i].items()} for i in range(len(rows))]


def run_hf(setup: Setup, steps: int, grouped: bool = False) -> float:
    """transformers' Trainer with its default collator for the task, over train()'s rows in sequence (or grouped
    by length, its own order), with train()'s optimizer and schedule; the model's own loss."""
    from transformers import (
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )
    from transformers.trainer_callback import PrinterCallback

    auto = AutoModelForSequenceClassification if setup.shape.target is None else AutoModelForSeq2SeqLM
    model = auto.from_pretrained(setup.folder, dtype=torch.float32).to(setup.device)
    tok = AutoTokenizer.from_pretrained(setup.folder)
    collator = DataCollatorWithPadding(tok) if setup.shape.target is None else DataCollatorForSeq2Seq(tok, model=model)
    cfg = setup.cfg
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, cfg.precision.adamw_eps)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=cfg.batch_size,
                                 max_grad_norm=cfg.grad_clip,
                                 train_sampling_strategy="group_by_length" if grouped else "sequential",
                                 use_cpu=setup.device.type == "cpu", bf16=cfg.precision.name == "bf16",
                                 report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, remove_unused_columns=False, seed=cfg.seed)
        # grouped: the whole training set, as a user's run groups it (the sampler sorts within megabatches of up to
        # 50 batches; over only the steps' rows it would sort within each batch)
        rows = hf_rows(setup, setup.splits.train if grouped else setup.rows)
        trainer = Trainer(model=model, args=args, train_dataset=rows, data_collator=collator,
                          optimizers=(optimizer, cfg.lr_schedule.scheduler(optimizer, steps)))
        trainer.remove_callback(PrinterCallback)
        counted(model, trainer.train)
    return FIRST_LOSS.pop() if FIRST_LOSS else math.nan


def run_trl(setup: Setup, steps: int, packed: bool = False) -> float:
    """TRL's SFTTrainer as bench/sft_peers.py runs it (its `messages` format: assistant_only_loss with the template
    marking the answers), here in the run's precision (bf16: autocast, as the HF Trainer), on the folder's model, over
    train()'s rows in sequence; `packed`: over the whole training split, packed (TRL's default strategy) into rows of
    seq_len. Returns the first step's loss (the model's own)."""
    import warnings

    from sft_peers import Setup as PeerSetup
    from transformers import AutoModelForCausalLM
    from transformers.trainer_callback import PrinterCallback

    cfg = setup.cfg
    ordered, whole = setup.messages
    model = AutoModelForCausalLM.from_pretrained(setup.folder, dtype=torch.float32)
    peer = PeerSetup("messages", VARIANTS["messages"], whole if packed else ordered, setup.folder, model.config, {},
                     cfg, cfg.precision)
    settings = dict(bf16=cfg.precision.name == "bf16", use_cpu=setup.device.type == "cpu",
                    max_length=setup.shape.seq_len, packing=packed, logging_strategy="no")
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        # TRL's SFTConfig sets the alias transformers 5 renamed (off here, as in sft_peers.py)
        warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)
        trainer = sft_trainer(model, peer, steps, out, **settings)
        trainer.remove_callback(PrinterCallback)
        counted(model, trainer.train)
    return FIRST_LOSS.pop() if FIRST_LOSS else math.nan


RUN = {"train()": run_train, "train() seq_len": lambda s, n: run_train(s, n, padded=True), "hf": run_hf,
       "hf grouped": lambda s, n: run_hf(s, n, grouped=True), "train() grouped": run_train_with("group_by_length"),
       "train() packed": run_train_with("packing"), "trl": run_trl, "trl packed": lambda s, n: run_trl(s, n, True)}


def baseline(shape: Shape) -> str:
    """The runner every ratio and verdict on `shape` is against."""
    return BASES.get(shape.name, BASE)


def skipped(runner: str, shape: Shape) -> str | None:
    """Why `runner` does not run on `shape` here (None: it runs)."""
    chat = shape.name == "chat"
    if runner in ("hf", "hf grouped") and chat:
        return "chat data's peer is TRL's SFTTrainer (its rows), which reads the messages and their template"
    if runner == "train() seq_len" and chat:
        return "rows padded to seq_len are measured on the classifier and pairs"
    if runner == "train() grouped":
        return train_setting("group_by_length")
    if runner == "train() packed":
        return train_setting("packing") if chat else "packing is for a causal LM's examples (chat data)"
    if runner.startswith("trl"):
        if importlib.util.find_spec("trl") is None:
            return "trl is not installed (pip install .[bench])"
        return None if chat else "TRL's SFTTrainer is measured on chat data"
    return None


# -- counting what each training forward computes -------------------------------------------------------------------
FORWARDS: list[tuple[int, int]] = []  # (positions computed, real tokens) of each training forward, in order
FIRST_LOSS: list[float] = []  # the HF Trainer's first step's loss (the model's own, from its output)
HELD_OUT: list[float] = []  # train()'s held-out loss at a call's end (its evaluation on --eval-batches batches)


def positions(kwargs: dict) -> tuple[int, int]:
    """(positions computed, real tokens) of one forward's inputs: the source's shape and its mask's ones (a packed
    batch has no mask: its ids that are not the pad); a T5 target's decoder inputs and those that are not its pad
    (id 0, which is also its start token: one per row)."""
    ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
    computed, real = ids.numel(), int(mask.sum()) if mask is not None else int(ids.ne(PAD_ID).sum())
    decoder = kwargs.get("decoder_input_ids")
    if decoder is not None:
        computed += decoder.numel()
        real += int(decoder.ne(0).sum()) + decoder.size(0)
    return computed, real


def counted(model: torch.nn.Module, run):
    """`run()` (a whole training call) with a forward pre-hook recording each training forward's positions (not a
    probe's or an evaluation's) and a hook keeping the first training forward's loss where the model computed one (a
    peer's); returns what `run` returns."""
    def before(module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            FORWARDS.append(positions({**dict(zip(("input_ids",), args)), **kwargs}))

    def after(module, args, kwargs, output):
        loss = getattr(output, "loss", None)
        if module.training and torch.is_grad_enabled() and loss is not None and len(FORWARDS) == 1:
            FIRST_LOSS.append(float(loss.detach()))

    handles = [model.register_forward_pre_hook(before, with_kwargs=True),
               model.register_forward_hook(after, with_kwargs=True)]
    try:
        return run()
    finally:
        for handle in handles:
            handle.remove()


# -- timing ---------------------------------------------------------------------------------------------------------
def call(runner: str, setup: Setup, steps: int, marks_at: tuple[int, int]) -> tuple[dict, list, float]:
    """One whole call: the times at the end of the marked steps, every training forward's positions, and the first
    step's loss."""
    FORWARDS.clear()
    FIRST_LOSS.clear()
    HELD_OUT.clear()
    with step_marks(marks_at, lambda: None) as marks:
        t0 = time.perf_counter()
        loss = RUN[runner](setup, steps)
    return {step: t - t0 for step, t in marks.items()}, list(FORWARDS), loss


def timed(runner: str, setup: Setup, args) -> dict:
    """ms per step, ms per 1,000 real tokens and positions per real token, of steps N1+1..N2 of one call."""
    n1, n2 = args.steps
    marks, forwards, _ = call(runner, setup, n2, args.steps)
    if set(marks) != {n1, n2} or len(forwards) < n2:
        raise RuntimeError(f"{RUNNERS[runner]}: marked steps {sorted(marks)}, {len(forwards)} training forwards; "
                           f"expected steps {n1} and {n2}, one forward each")
    ms = (marks[n2] - marks[n1]) * 1e3
    computed, real = (sum(f[i] for f in forwards[n1:n2]) for i in (0, 1))
    return {"step_ms": ms / (n2 - n1), "ms_per_1k_real": ms / real * 1e3, "positions_per_real": computed / real,
            "padding_share": 1 - real / computed, "held_out_loss": HELD_OUT[-1] if HELD_OUT else None}


def first_losses(setup: Setup, precision_name: str) -> dict:
    """The first step's loss of train() and of the baseline on the same first batch, in `precision_name`."""
    precision = resolve_precision(precision_name, setup.device, warn=False)
    s = replace(setup, cfg=replace(setup.cfg, precision=precision))
    losses = {}
    for runner in ("train()", baseline(setup.shape)):
        FORWARDS.clear()
        FIRST_LOSS.clear()
        losses[runner] = RUN[runner](s, 1)
    return losses


def measure(found: list[Setup], runners: dict, args) -> dict:
    samples = {(i, r): [] for i, s in enumerate(found) for r in runners[i]}
    for i, setup in enumerate(found):
        for runner in runners[i]:
            call(runner, setup, args.steps[0], args.steps)
    for rep in range(args.repeats):
        for i, setup in enumerate(found):
            order = runners[i]
            turn = rep % len(order)
            for runner in order[turn:] + order[:turn]:
                samples[(i, runner)].append(timed(runner, setup, args))
    return samples


def verdict(runner: str, base, stats, n: int, against: str = BASE) -> str:
    """Per real token, against the baseline's row (`against`), by the AMP benchmark's noise rule."""
    if runner == against:
        return "the baseline"
    if n < MIN_REPEATS:
        return f"no verdict from {n} repeat(s): at least {MIN_REPEATS} give a spread"
    sp = speedup(base, stats)
    said = ("no measurable difference" if sp.no_measurable_difference
            else "measurably faster" if sp.measurably_faster else "measurably slower")
    ratio = stats.median / base.median
    if runner in ("train() grouped", "train() packed", "hf grouped", "trl packed"):
        said += f"; {'within' if ratio <= GROUPED_TARGET else 'above'} the {GROUPED_TARGET}x target"
    return said


def table(found: list[Setup], runners: dict, samples: dict) -> list[dict]:
    rows = []
    for i, setup in enumerate(found):
        against = baseline(setup.shape)
        if against not in runners[i]:
            continue
        base = summarize([x["ms_per_1k_real"] for x in samples[(i, against)]])
        for runner in runners[i]:
            got = samples[(i, runner)]
            per_real = summarize([x["ms_per_1k_real"] for x in got])
            rows.append({"data": setup.shape.name, "runner": runner,
                         "step_ms": summarize([x["step_ms"] for x in got]).to_dict(),
                         "ms_per_1k_real": per_real.to_dict(), "baseline": against,
                         "vs_baseline": per_real.median / base.median,
                         "positions_per_real": summarize([x["positions_per_real"] for x in got]).median,
                         "padding_share": summarize([x["padding_share"] for x in got]).median,
                         "held_out_loss": got[-1]["held_out_loss"],
                         "verdict": verdict(runner, base, per_real, len(got), against)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| data | runner | ms per step, median [IQR q1–q3] (min–max) | ms per 1,000 real tokens, median [IQR "
             "q1–q3] (min–max) | vs the baseline per real token | positions per real token (padding) | verdict |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, per = r["step_ms"], r["ms_per_1k_real"]
        lines.append(f"| {r['data']} | {RUNNERS[r['runner']]} | {ms['median']:.1f} [{ms['q1']:.1f}–{ms['q3']:.1f}] "
                     f"({ms['min']:.1f}–{ms['max']:.1f}) | {per['median']:.2f} [{per['q1']:.2f}–{per['q3']:.2f}] "
                     f"({per['min']:.2f}–{per['max']:.2f}) | {r['vs_baseline']:.2f}× | "
                     f"{r['positions_per_real']:.2f} ({r['padding_share']:.0%}) | {r['verdict']} |")
    return "\n".join(lines)


def loss_lines(losses: dict) -> list[str]:
    lines = []
    for data, by_precision in losses.items():
        for name, got in by_precision.items():
            (_, ours), (against, peer) = got.items()
            rel = abs(ours - peer) / abs(peer)
            tol = FP32_LOSS_TOLERANCE if name == "fp32" else BF16_LOSS_TOLERANCE
            lines.append(f"first-step loss, {data}, {name}: train() {ours:.6f}, {RUNNERS[against]} {peer:.6f}, "
                         f"relative difference {rel:.1e}: {'equal' if rel <= tol else 'NOT equal'} within {tol:g}")
    return lines


def held_out_lines(rows: list[dict]) -> list[str]:
    """Grouping or packing against per-batch padding: train()'s held-out loss after N2 steps (the last repeat's)."""
    lines = []
    for r in rows:
        base = next((b for b in rows if b["data"] == r["data"] and b["runner"] == "train()"), None)
        if r["runner"] in ("train() grouped", "train() packed") and base and base["held_out_loss"] is not None:
            diff = abs(r["held_out_loss"] - base["held_out_loss"]) / base["held_out_loss"]
            lines.append(f"held-out loss after the run, {r['data']}: {RUNNERS[r['runner']]} {r['held_out_loss']:.4f}, "
                         f"per-batch padding {base['held_out_loss']:.4f}, relative difference {diff:.1e}: "
                         f"{'within' if diff <= HELD_OUT_TOLERANCE else 'OUTSIDE'} {HELD_OUT_TOLERANCE:g}")
    return lines


def positions_lines(rows: list[dict]) -> list[str]:
    """Positions computed per real token of each chat runner (medians over the repeats), and the issue's packing
    target on train()'s packed row."""
    chat = [r for r in rows if r["data"] == "chat"]
    lines = ["positions computed per real token, chat: " + "; ".join(
        f"{RUNNERS[r['runner']]} {r['positions_per_real']:.3f}" for r in chat)] if chat else []
    for r in chat:
        if r["runner"] == "train() packed":
            met = r["positions_per_real"] <= PACKED_TARGET
            lines.append(f"target, packed chat data computes <= {PACKED_TARGET} positions per real token: train() "
                         f"packed {r['positions_per_real']:.3f}: {'met' if met else 'NOT met'}")
    return lines


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS),
                    help=f"each dataset's baseline always runs (the HF Trainer's default row, {BASE}; on chat data "
                         "TRL's padded row, trl): every ratio is against it")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, nargs=2, default=[3, 11], metavar=("N1", "N2"),
                    help="steps per call; step time = (t(N2) - t(N1)) / (N2 - N1) within it")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-batches", type=int, default=4, help="held-out batches train() scores at a call's end")
    ap.add_argument("--threads", type=int, help="torch threads for every runner (default: train()'s choice)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda where there is one)")
    ap.add_argument("--tiny", action="store_true", help="tiny models and data: does it run")
    ap.add_argument("--no-loss-check", dest="loss_check", action="store_false")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not 1 <= args.steps[0] < args.steps[1] or args.repeats < 1:
        ap.error("--steps N1 N2 needs 1 <= N1 < N2, and --repeats at least 1")
    args.runners = list(dict.fromkeys(args.runners))
    return args


def chosen(found: list[Setup], args) -> dict:
    """{dataset index: its runners, baseline first}; a runner that can't run here is skipped, the reason printed (a
    dataset whose baseline can't run is skipped whole)."""
    runners = {}
    for i, setup in enumerate(found):
        runners[i] = []
        against = baseline(setup.shape)
        for runner in [against, *(r for r in args.runners if r != against)]:
            why = skipped(runner, setup.shape)
            if why:
                print(f"skipped {RUNNERS[runner]} on {setup.shape.name}: {why}")
            elif runner == against or runners[i]:
                runners[i].append(runner)
        if not runners[i]:
            print(f"skipped {setup.shape.name}: its baseline ({RUNNERS[against]}) can't run here")
    return runners


def main(argv=None) -> int:
    args = parse(argv)
    missing = [n for n in ("transformers", "accelerate", "tokenizers") if importlib.util.find_spec(n) is None]
    if missing:
        print(f"bench/padding.py: {', '.join(missing)} not installed here; pip install .[bench]", file=sys.stderr)
        return 2
    import transformers

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if importlib.util.find_spec("datasets") is not None:
        import datasets

        datasets.disable_progress_bars()  # TRL's dataset preparation, on every call
    transformers.utils.logging.disable_progress_bar()  # every runner's loading of the model folder
    with tempfile.TemporaryDirectory() as tmp, quiet_peers(["hf"]), run_threads() as threads:
        found = setups(args, Path(tmp), device)
        runners = chosen(found, args)
        losses = {s.shape.name: {p: first_losses(s, p) for p in dict.fromkeys(("fp32", args.precision))}
                  for i, s in enumerate(found) if runners[i]} if args.loss_check else {}
        samples = measure(found, runners, args)
    rows = table(found, runners, samples)
    n1, n2 = args.steps
    print(f"{device_name(device)} · torch {torch.__version__} · {threads.reason} · {args.repeats} interleaved repeats, "
          f"step = (t{n2} - t{n1}) / {n2 - n1} within each call · batch {args.batch_size} · {args.precision} · "
          + ", ".join(f"{s.shape.name}: seq_len {s.shape.seq_len}" + (f", target_len {s.shape.target_len}"
                                                                         if s.shape.target_len else "")
                      for s in found))
    print("baseline of each dataset (every ratio and verdict per real token is against it): " + "; ".join(
        f"{s.shape.name}: {RUNNERS[baseline(s.shape)]}" for s in found))
    print(markdown(rows))
    for line in loss_lines(losses) + held_out_lines(rows) + positions_lines(rows):
        print(line)
    if args.json:
        write_json(args.json, {"meta": run_metadata(device), "args": vars(args), "rows": rows, "first_losses": losses})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
