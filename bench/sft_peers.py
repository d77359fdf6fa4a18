"""Chat fine-tuning beside TRL's SFTTrainer (issue 58 item 7): the same rows through `trl.SFTTrainer` and through
`tier_utils.train()`, and whether they score the same tokens, start from the same loss, and how long a step takes.

Both read the bundled chat demo's rows (tier_utils/data/chat_demo.py) with its tokenizer and chat template, in the
formats made from the same conversations (--formats), each with the TRL setting that scores the answer:
- `prompt-completion`: the last exchange as strings, not templated (prompt + completion + EOS); TRL's completion-only
  loss, its default for prompt-completion;
- `conversational-prompt-completion`: the prompt turns and the last answer as message lists, through the template;
  TRL's completion-only loss and `assistant_only_loss=True`: the answer up to its end-of-turn token;
- `conversational-prompt-completion-trl-default`: the same rows with TRL's completion-only loss alone, which also
  scores what the template writes after the answer's `<|end|>` (its newline), where tier_utils stops at the end token
  (issue 58 item 4): that difference, and only it, is expected;
- `messages`: whole conversations; TRL with `assistant_only_loss=True` (its default scores every token).
`assistant_only_loss` needs a template that marks the assistant's turns: MARKED_TEMPLATE below, the demo's template
with `{% generation %}` around each answer and its `<|end|>` (not the newline after it), checked to render every row
exactly as the demo's own template does; train() reads the rows with the demo's own template.
On the CPU (TRL's use_cpu, train()'s device="cpu"), one initial state_dict is loaded into a fresh model for every
call (a Llama from the demo's config; --width/--layers make it bigger), fp32 on both sides, the rows in their own
order (TRL's sequential sampler; train()'s shuffle off), AdamW from `make_optimizer`, TrainConfig's schedule over the
call's steps and clipping at 1.0 (bench/peers.py's `optimization`, handed to TRL), gradient checkpointing off, each
batch padded on the right to a multiple of 8 with an attention mask on both sides. TRL's sequences are one token
longer than train()'s (it shifts inside the model's forward; tier_utils' examples come shifted), so the padded widths
may differ; the scored positions cannot.

Checked and printed, per format:
- the scored tokens, example by example: TRL's collated `labels` (its completion_mask / assistant_masks folded in
  when it prepares the dataset), shifted as its loss shifts them, against train()'s collated labels on the same rows,
  position by position; where they differ, which tokens, after what;
- the first-step loss each trainer reports (TRL's log at logging_steps=1, train()'s history at log_every=1) in a
  one-step call, on the same first batch with the same weights, to 1e-5; the timed calls' losses at their last step
  are printed beside it.
The script exits 1 when a check fails.
Timed (--time; by default prompt-completion and messages): whole training calls of S and L steps (--steps S L) from
a fresh model to the trained one (set-up included: TRL's dataset preparation, train()'s reading of the rows),
step = (t_L - t_S) / (L - S), fixed cost = t_S - S x step; beside it the step within the L-step call, between the
ends of steps S and L (bench/peers.py's optimizer-step marks), which the fixed cost's jitter does not reach;
interleaved repeats (the one-step checks warm both runners up first), the runners' order rotated each repeat; both
log every step; the verdicts are the AMP benchmark's noise rule as bench/peers.py gives it. One torch thread by
default (--threads).

    python bench/sft_peers.py                                      # the demo's model, 5 repeats, steps 2 and 12
    python bench/sft_peers.py --width 256 --layers 4 --json sft_peers.json
    python bench/sft_peers.py --repeats 1 --steps 1 2 --rows 16     # tiny (tests/test_bench_sft_peers.py)

Needs TRL: `pip install .[bench]`.
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/peers.py, whose helpers time the peers alike
from peers import MIN_REPEATS, optimization, quiet_peers, step_marks, verdict  # noqa: E402

from tier_utils.adapter.adapter import adapt  # noqa: E402
from tier_utils.core.files import write_json  # noqa: E402
from tier_utils.core.measure import summarize  # noqa: E402
from tier_utils.core.precision import Precision, resolve_precision  # noqa: E402
from tier_utils.core.results import run_metadata  # noqa: E402
from tier_utils.core.threads import run_threads  # noqa: E402
from tier_utils.data.chat_demo import chat_demo, demo_rows  # noqa: E402
from tier_utils.data.datasets import make_loader  # noqa: E402
from tier_utils.training.config import TrainConfig  # noqa: E402
from tier_utils.training.loop import train  # noqa: E402

RUNNERS = {"trl": "TRL SFTTrainer", "tier_utils": "tier_utils.train"}
LOSS_TOLERANCE = 1e-5  # the first-step loss, fp32, same batch and weights
IGNORE = -100
SHOWN_TARGETS = 8  # of an example's differing targets, in its line
# The demo's template (tier_utils/assets/chat_template.jinja) with each assistant turn's answer and end-of-turn token
# inside {% generation %}, which TRL's assistant_only_loss reads through transformers' return_assistant_tokens_mask.
# The newline the template writes after <|end|> stays outside, as tier_utils leaves it unscored. Whitespace is written
# as strings: transformers renders templates with trim_blocks, which would eat a newline after a block tag.
MARKED_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")


def prompt_completion(row: dict) -> dict:
    """The conversation's last exchange as untemplated strings (the completion starts with a space, so its first word
    is one token, as in most instruction data)."""
    *_, user, answer = row["messages"]
    return {"prompt": f"{user['content']}\nanswer:", "completion": f" {answer['content']}"}


def conversational_prompt_completion(row: dict) -> dict:
    return {"prompt": row["messages"][:-1], "completion": row["messages"][-1:]}


@dataclass(frozen=True)
class Variant:
    """A format's rows made from the demo's conversations, and the SFTConfig flags TRL reads them with."""

    rows: Callable[[dict], dict]
    trl_flags: dict
    # TRL's default completion mask also scores what the template writes after the answer's end-of-turn token (the
    # newline), which tier_utils leaves out (issue 58 item 4): the one difference this variant may show
    after_end: bool = False


VARIANTS = {
    "prompt-completion": Variant(prompt_completion, {}),
    # assistant_only_loss on top of TRL's completion mask: the answer up to its <|end|>, as tier_utils scores it
    "conversational-prompt-completion": Variant(conversational_prompt_completion, {"assistant_only_loss": True}),
    "conversational-prompt-completion-trl-default": Variant(conversational_prompt_completion, {}, after_end=True),
    "messages": Variant(lambda row: row, {"assistant_only_loss": True}),
}
TIMED = ("prompt-completion", "messages")  # --time's default (every variant in --formats is checked)


@dataclass(frozen=True)
class Setup:
    """Everything both runners are handed for one format (`cfg` and `precision`: what peers.optimization reads)."""

    name: str
    variant: Variant
    rows: list[dict]
    folder: Path  # the demo's model folder: its tokenizer and chat template
    config: object  # the Llama config every call builds its fresh model from
    initial: dict  # the state_dict every call starts from
    cfg: TrainConfig
    precision: Precision


def fresh_model(setup: Setup):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(setup.config)
    model.load_state_dict(setup.initial)
    return model


def trl_tokenizer(setup: Setup):
    """The demo's tokenizer as TRL gets it: with the marked template where its assistant-only loss needs one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(setup.folder)
    if setup.variant.trl_flags.get("assistant_only_loss"):
        tokenizer.chat_template = MARKED_TEMPLATE
    return tokenizer


def sft_trainer(model, setup: Setup, steps: int, out: str, **settings):
    """TRL's SFTTrainer over the rows in order, with the shared optimizer, schedule and clipping, fp32 on the CPU;
    `settings`: SFTConfig settings that replace these (bench/padding.py's bf16, max_length, packing)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cfg = setup.cfg
    args = SFTConfig(**{**dict(output_dir=out, max_steps=steps, per_device_train_batch_size=cfg.batch_size,
                               max_grad_norm=cfg.grad_clip, learning_rate=cfg.lr, seed=cfg.seed, bf16=False,
                               fp16=False, gradient_checkpointing=False, use_cpu=True,
                               train_sampling_strategy="sequential", dataloader_drop_last=True, max_length=None,
                               pad_to_multiple_of=8, logging_steps=1, report_to="none", save_strategy="no",
                               eval_strategy="no", disable_tqdm=True),
                        **setup.variant.trl_flags, **settings})
    return SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(setup.rows),
                      processing_class=trl_tokenizer(setup), optimizers=optimization(model, setup, steps))


def run_trl(model, setup: Setup, steps: int) -> list[float]:
    """A whole SFTTrainer call; the loss it logged at each step."""
    from transformers.trainer_callback import PrinterCallback

    with tempfile.TemporaryDirectory() as out:
        trainer = sft_trainer(model, setup, steps, out)
        trainer.remove_callback(PrinterCallback)  # its line per logged step
        trainer.train()
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def run_train(model, setup: Setup, steps: int) -> list[float]:
    """A whole train() call on the rows, the model's tokenizer given with it; the loss of each step."""
    result = train(model, setup.rows, replace(setup.cfg, max_steps=steps), model_kwargs={"tokenizer": setup.folder})
    history = result.history
    return history.loc[history["kind"] == "step", "train_loss"].tolist()


RUN = {"trl": run_trl, "tier_utils": run_train}


def timed_call(runner: str, setup: Setup, steps: int, marked: tuple = ()) -> tuple[float, list[float], dict]:
    """Seconds of one whole call from a fresh model with the initial weights to the trained one; its step losses;
    {step: seconds into the call} at the end of the optimizer steps `marked` (bench/peers.py's step_marks: torch's
    global optimizer post-step hook, which both runners' AdamW calls)."""
    model = fresh_model(setup)
    with step_marks(marked, lambda: None) as marks:
        t0 = time.perf_counter()
        losses = RUN[runner](model, setup, steps)
        seconds = time.perf_counter() - t0
    return seconds, losses, {step: t - t0 for step, t in marks.items()}


def trl_scored(setup: Setup) -> list[tuple[list[int], list[int]]]:
    """(inputs, targets) of every example in TRL's collated batches, cut to its attention mask: the positions that
    predict (all but the last) and their labels shifted by one, as its loss shifts them (-100: not scored). A padding
    position it scored is an error."""
    examples = []
    with tempfile.TemporaryDirectory() as out:
        trainer = sft_trainer(fresh_model(setup), setup, 1, out)
        for batch in trainer.get_train_dataloader():
            for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
                n = int(mask.sum())
                if (labels[n:] != IGNORE).any():
                    raise AssertionError(f"{setup.name}: TRL scores a padding position")
                examples.append((ids[:n - 1].tolist(), labels[1:n].tolist()))
    return examples


def train_scored(setup: Setup) -> list[tuple[list[int], list[int]]]:
    """(inputs, targets) of every example in train()'s collated batches, cut to its attention mask: the rows read by
    the model's task as train() reads them (its adapter's datasets, the task's collator), in their order, full batches
    only (train() drops the last part batch, as TRL is told to here)."""
    cfg = setup.cfg
    splits = adapt(fresh_model(setup), tokenizer=setup.folder).datasets(setup.rows, cfg.seq_len, cfg.seed, cfg.held_out)
    examples = []
    for batch in make_loader(splits.train, cfg.batch_size, collate=splits.collate, shuffle=False,
                             drop_last=True):
        for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
            n = int(mask.sum())
            if (labels[n:] != IGNORE).any():
                raise AssertionError(f"{setup.name}: train() scores a padding position")
            examples.append((ids[:n].tolist(), labels[:n].tolist()))
    return examples


@dataclass
class Agreement:
    """How TRL's scored tokens and train()'s compare on one format, example by example."""

    name: str
    examples: tuple[int, int]  # (TRL's, train()'s)
    same_inputs: int = 0
    same_scored: int = 0
    scored: int = 0  # targets train() scores
    targets: int = 0  # targets in all
    only: dict = field(default_factory=lambda: {"TRL": Counter(), "train()": Counter()})  # "'token' after 'token'"
    first: list = field(default_factory=list)  # the first examples that differ, in words
    after_end: bool = False  # the variant's one allowed difference (Variant.after_end)

    @property
    def agrees(self) -> bool:
        n = min(self.examples)
        return self.examples[0] == self.examples[1] and self.same_inputs == n and self.same_scored == n

    @property
    def as_declared(self) -> bool:
        """Agrees, or differs only as its variant says it may: TRL alone scores targets right after <|end|>."""
        if self.agrees or not self.after_end:
            return self.agrees
        n = min(self.examples)
        return (self.examples[0] == self.examples[1] and self.same_inputs == n and not self.only["train()"]
                and all(key.endswith("after '<|end|>'") for key in self.only["TRL"]))

    def line(self) -> str:
        n = min(self.examples)
        status = ("agree" if self.agrees else "DIFFER" if not self.as_declared else "differ as expected (TRL's default "
                  "completion mask also scores what the template writes after <|end|>; tier_utils does not)")
        said = (f"{self.name}: {status}: {self.examples[0]} examples from TRL, {self.examples[1]} from train(); same "
                f"input ids in {self.same_inputs}, same scored targets in {self.same_scored} of {n}; train() scores "
                f"{self.scored} of {self.targets} targets ({self.scored / max(self.targets, 1):.1%})")
        for side, kinds in self.only.items():
            if kinds:
                said += f"\n  scored by {side} alone: " + ", ".join(f"{c} x {k}" for k, c in kinds.most_common(6))
        return "\n".join([said, *(f"  {d}" for d in self.first)])


def compare(setup: Setup, tokenizer, shown: int = 3) -> Agreement:
    """TRL's scored targets against train()'s, position by position, on every example of the rows."""
    theirs, ours = trl_scored(setup), train_scored(setup)
    name = lambda i: repr(tokenizer.convert_ids_to_tokens(i)).replace("Ġ", " ").replace("Ċ", "\\n")  # noqa: E731
    found = Agreement(setup.name, (len(theirs), len(ours)), after_end=setup.variant.after_end)
    for number, ((ids, trl_labels), (our_ids, labels)) in enumerate(zip(theirs, ours)):
        found.targets += len(labels)
        found.scored += sum(t != IGNORE for t in labels)
        if ids != our_ids:
            found.first += [f"example {number}: the input ids differ"][:shown - len(found.first)]
            continue
        found.same_inputs += 1
        diff = [(p, a, b) for p, (a, b) in enumerate(zip(trl_labels, labels)) if a != b]
        found.same_scored += not diff
        for p, a, b in diff:
            side, token = ("TRL", a) if b == IGNORE else ("train()", b) if a == IGNORE else ("both", a)
            found.only.setdefault(side, Counter())[f"{name(token)} after {name(ids[p])}"] += 1
        if diff and len(found.first) < shown:
            cut = "" if len(diff) <= SHOWN_TARGETS else f", the first {SHOWN_TARGETS} of {len(diff)}"
            diff = diff[:SHOWN_TARGETS]
            found.first.append(f"example {number}: targets {[p for p, _, _ in diff]} of {len(labels)} differ{cut} "
                               f"(TRL {[a for _, a, _ in diff]}, train() {[b for _, _, b in diff]})")
    return found


def measure(setups: list[Setup], args) -> dict:
    """{(format, runner): {"step_ms", "in_call_ms", "fixed_s", "first_loss", "last_loss"}}: per repeat, each
    runner's whole calls of S and then L steps, the runners' order rotated each repeat (the first-step checks before
    it warm both up); in_call_ms: the L-step call's own steps S+1..L, from the marks at the ends of steps S and L."""
    short, long = args.steps
    samples = {(s.name, r): {"step_ms": [], "in_call_ms": [], "fixed_s": [], "first_loss": [], "last_loss": []}
               for s in setups for r in RUNNERS}
    runners = list(RUNNERS)
    for rep in range(args.repeats):
        order = runners[rep % 2:] + runners[:rep % 2]
        for setup in setups:
            calls = {(r, n): timed_call(r, setup, n, (short, long)) for n in (short, long) for r in order}
            for runner in order:
                (t_short, first, _), (t_long, last, marks) = calls[(runner, short)], calls[(runner, long)]
                if set(marks) != {short, long}:
                    raise RuntimeError(f"{RUNNERS[runner]} did not reach optimizer steps {short} and {long} "
                                       f"(marked: {sorted(marks)})")
                step = (t_long - t_short) / (long - short)
                tally = samples[(setup.name, runner)]
                tally["step_ms"].append(step * 1e3)
                tally["in_call_ms"].append((marks[long] - marks[short]) / (long - short) * 1e3)
                tally["fixed_s"].append(t_short - short * step)
                tally["first_loss"].append(first[0])
                tally["last_loss"].append(last[-1])
    return samples


def apart(tallies: dict, key: str) -> float:
    """The largest difference between the runners' `key` in the same repeat."""
    return max(abs(a - b) for a, b in zip(*(t[key] for t in tallies.values())))


def table(setups: list[Setup], samples: dict) -> list[dict]:
    rows = []
    for setup in setups:
        tallies = {r: samples[(setup.name, r)] for r in RUNNERS}
        base = {key: summarize(tallies["trl"][key]) for key in ("step_ms", "in_call_ms")}
        for runner, tally in tallies.items():
            row = {"format": setup.name, "runner": runner, "fixed_s": summarize(tally["fixed_s"]).to_dict(),
                   "first_step_loss": tally["first_loss"][-1], "last_step_loss": tally["last_loss"][-1],
                   "first_loss_difference": apart(tallies, "first_loss"),
                   "last_loss_difference": apart(tallies, "last_loss")}
            for key in ("step_ms", "in_call_ms"):
                stats = summarize(tally[key])
                # peers.verdict: the AMP benchmark's noise rule, worded as bench/peers.py words it
                row[key] = {**stats.to_dict(), "vs_trl": stats.median / base[key].median,
                            "verdict": "the baseline" if runner == "trl" else verdict(runner, base[key], stats)}
            rows.append(row)
    return rows


def markdown(rows: list[dict], steps) -> str:
    short, long = steps
    lines = [f"| format | runner | ms per step, whole calls: (t{long} − t{short}) / {long - short}, median (min–max) | "
             f"vs TRL | ms per step within the {long}-step call, median (min–max) | vs TRL | fixed cost, s | "
             f"first-step loss | loss at step {long} |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f}) | {s['vs_trl']:.2f}× ({s['verdict']})"
                 for s in (r["step_ms"], r["in_call_ms"])]
        lines.append(f"| {r['format']} | {RUNNERS[r['runner']]} | {' | '.join(cells)} | {r['fixed_s']['median']:.2f} | "
                     f"{r['first_step_loss']:.6f} | {r['last_step_loss']:.6f} |")
    return "\n".join(lines)


def first_step_losses(setup: Setup) -> dict:
    """The loss each runner reports for its first step (one-step calls), and their difference."""
    losses = {runner: timed_call(runner, setup, 1)[1][0] for runner in RUNNERS}
    return {**losses, "difference": abs(losses["trl"] - losses["tier_utils"])}


def check_template(tokenizer, rows: list[dict]) -> None:
    """MARKED_TEMPLATE renders every conversation (and its prompt) as the demo's own template does."""
    for row in rows:
        for prompt in (False, True):
            own = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=prompt)
            marked = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=prompt,
                                                   chat_template=MARKED_TEMPLATE)
            if own != marked:
                raise AssertionError(f"MARKED_TEMPLATE renders {marked!r} where the demo's template renders {own!r}")


def setups(args, folder: Path) -> tuple[list[Setup], object]:
    """The demo written into `folder` (its model config, tokenizer and template), its rows in each chosen format, and
    the initial weights drawn once from --seed (the demo's own model unless --width/--layers make it bigger)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    demo = chat_demo(folder, n=args.rows, seed=args.seed)
    tokenizer = AutoTokenizer.from_pretrained(demo.model)
    conversations = demo_rows(args.rows, args.seed)
    check_template(tokenizer, conversations)
    config = LlamaConfig.from_pretrained(demo.model)
    if args.width:
        config.hidden_size, config.intermediate_size = args.width, 2 * args.width
    if args.layers:
        config.num_hidden_layers = args.layers
    torch.manual_seed(args.seed)
    initial = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    precision = resolve_precision("fp32", torch.device("cpu"), warn=False)
    cfg = TrainConfig(precision=precision, batch_size=args.batch_size, seq_len=config.max_position_embeddings,
                      seed=args.seed, shuffle=False, eval_every="never", log_every=1, progress=False, device="cpu")
    found = [Setup(name, VARIANTS[name], [VARIANTS[name].rows(r) for r in conversations], demo.model, config,
                   initial, cfg, precision) for name in args.formats]
    return found, tokenizer


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                    help="the formats checked (scored tokens, first-step loss)")
    ap.add_argument("--time", nargs="*", default=list(TIMED), choices=list(VARIANTS),
                    help="the checked formats also timed (none: no timing)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, nargs=2, default=[2, 12], metavar=("S", "L"),
                    help="steps of the two whole calls; step time = (t_L - t_S) / (L - S)")
    ap.add_argument("--rows", type=int, default=240, help="the demo's conversations (at least one batch)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--width", type=int, help="the Llama's hidden size (MLP: twice it; default: the demo's)")
    ap.add_argument("--layers", type=int, help="the Llama's layers (default: the demo's)")
    ap.add_argument("--seed", type=int, default=0, help="the demo's rows and the initial weights")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both runners")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not 1 <= args.steps[0] < args.steps[1] or args.repeats < 0 or args.rows < args.batch_size:
        ap.error("--steps S L needs 1 <= S < L, --repeats at least 0 and --rows at least --batch-size")
    if args.steps[1] * args.batch_size > args.rows:
        ap.error("--steps L x --batch-size is more than --rows: both would start a second epoch (TRL's sampler and "
                 "train()'s order agree only within one)")
    args.time = [f for f in args.formats if f in args.time]
    return args


def versions() -> str:
    import transformers
    import trl

    return f"torch {torch.__version__} · transformers {transformers.__version__} · trl {trl.__version__}"


def report(found: list[Setup], agreements: list[Agreement], losses: dict, rows: list[dict], args, threads) -> bool:
    """Print the checks and the table; whether every check held (scored tokens as declared, first-step losses within
    LOSS_TOLERANCE where the tokens agree)."""
    config = found[0].config
    params = sum(v.numel() for k, v in found[0].initial.items() if "lm_head" not in k)  # tied to the embedding
    print(f"cpu · {versions()} · {threads.reason} · Llama {config.num_hidden_layers} x {config.hidden_size} "
          f"({params / 1e6:.3g}M parameters, vocabulary {config.vocab_size}) · batch {args.batch_size} · fp32")
    print("scored tokens, TRL's collated labels against train()'s:")
    for a in agreements:
        print(a.line())
    ok = all(a.as_declared for a in agreements)
    print(f"first-step loss (one-step calls, same batch and weights; agree within {LOSS_TOLERANCE:g}):")
    for a in agreements:
        loss = losses[a.name]
        held = loss["difference"] <= LOSS_TOLERANCE
        ok &= held or not a.agrees
        print(f"{a.name}: TRL {loss['trl']:.7f} · train() {loss['tier_utils']:.7f} · difference "
              f"{loss['difference']:.2g} ({'agree' if held else 'DIFFERENT' if a.agrees else 'other tokens scored'})")
    if rows:
        short, long = args.steps
        print(f"step time: {args.repeats} interleaved repeats of whole calls of {short} and {long} steps; per step "
              f"from the two calls, and within the {long}-step call between the ends of steps {short} and {long}; "
              f"fixed cost = t{short} less {short} steps (verdicts need {MIN_REPEATS} repeats)")
        print(markdown(rows, args.steps))
        print(f"the two runners' losses, largest difference over the repeats, at step 1 / at step {long}: " + "; ".join(
            f"{r['format']} {r['first_loss_difference']:.2g} / {r['last_loss_difference']:.2g}" for r in rows[::2]))
    return ok


def main(argv=None) -> int:
    args = parse(argv)
    missing = [name for name in ("trl", "datasets", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"bench/sft_peers.py: {', '.join(missing)} not installed here; pip install .[bench]", file=sys.stderr)
        return 2
    import datasets

    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()  # TRL's dataset preparation, on every call
    with quiet_peers(["hf"]), run_threads() as threads, tempfile.TemporaryDirectory() as folder, \
            warnings.catch_warnings():
        # TRL's SFTConfig sets the alias transformers 5 renamed (its default is on; it is off here)
        warnings.filterwarnings("ignore", message="`gradient_checkpointing` is deprecated", category=FutureWarning)
        found, tokenizer = setups(args, Path(folder))
        agreements = [compare(s, tokenizer) for s in found]
        losses = {s.name: first_step_losses(s) for s in found}
        timed = [s for s in found if s.name in args.time and args.repeats]
        rows = table(timed, measure(timed, args)) if timed else []
        meta = run_metadata(torch.device("cpu"))  # inside the run: its thread count and why
    ok = report(found, agreements, losses, rows, args, threads)
    if args.json:
        write_json(args.json, {"meta": meta, "versions": versions(), "args": vars(args),
                               "scored_tokens": [{**vars(a), "only": {k: dict(v) for k, v in a.only.items()},
                                                  "agrees": a.agrees} for a in agreements],
                               "first_step_loss": losses, "rows": rows})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
