"""Step time of `tier_utils.train()` beside its peers (a bare PyTorch loop, the Hugging Face Trainer, the Lightning
Trainer), side by side in one run on the same model, weights, rows, order, optimizer, schedule and clipping:
- a GPT-2 (GPT2LMHeadModel) and a Llama shape (LlamaForCausalLM, tied embeddings, an MLP of the same size), dropout
  off (each runner would draw its own masks); one initial state_dict loaded into each call's fresh copy;
- the bundled corpus's windows in the order train()'s ShardedSampler gives for --seed, read by the peers in sequence;
- AdamW from `make_optimizer` (foreach on a CPU, fused on CUDA; decay on matrices only; the precision's eps),
  the TrainConfig's `lr_schedule` over the call's steps, clipping at TrainConfig's 1.0;
- the window's mean next-token cross-entropy (no padding) in fp32 (autocast's rule; accelerate hands the Trainer
  fp32 logits), under fp32 or bf16 autocast over fp32 weights (HF bf16=True, Lightning "bf16-mixed").
So all end at the same held-out loss: in fp32 bit for bit; in bf16 Lightning's last bits differ (it sums the
clipping norm over its optimizer's groups, matrices first; the others over model.parameters()).

Per repeat each runner trains a fresh copy for N2 steps (--steps N1 N2); torch's global optimizer post-step hook marks
the ends of steps N1 and N2 in every runner alike. Step time free of set-up: (t(N2) - t(N1)) / (N2 - N1); fixed cost:
the whole call (fresh model on the host to the trained one) less N2 such steps (set-up, compilation, the first
steps' warm-up, the run's end). An untimed warm-up round goes first (imports, allocator growth, the compile cache
later runs reuse; the HF Trainer in bf16 recompiles every run: accelerate's autocast wrapper is new each time).
Repeats are interleaved, the runners' order rotated each time, so a drift in the machine's load hits them all. Each
trained model is scored on the same --eval-rows held-out rows in fp32 by one function. The verdict against the bare
loop is the AMP benchmark's rule (`benchmark.verdicts.speedup`): overlapping IQRs are "no measurable difference".
The torch thread count is decided once for every runner (train()'s rule, `run_threads`; --threads fixes it).

Needs the peers: `pip install .[bench]`. The table for bench/RESULTS.md; on CUDA, also with every runner compiled:

    python bench/peers.py --threads 1 --json peers.json     # 7 repeats, GPT-2 and Llama, fp32 and bf16, 8 x 128
    python bench/peers.py --compile
    python bench/peers.py --repeats 1 --steps 1 3 --layers 1 --width 32 --heads 2 --vocab 256 --batch-size 2 \\
        --seq-len 16                                         # tiny: does it run (tests/test_bench_peers.py)
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import Subset

from tier_utils.benchmark.verdicts import speedup
from tier_utils.core.device import device_name
from tier_utils.core.files import write_json
from tier_utils.core.measure import summarize
from tier_utils.core.precision import Precision, resolve_device, resolve_precision
from tier_utils.core.results import run_metadata
from tier_utils.core.threads import run_threads
from tier_utils.data.datasets import make_loader, to_device
from tier_utils.engine.distributed import ShardedSampler
from tier_utils.engine.step import make_optimizer
from tier_utils.tasks import build_datasets
from tier_utils.training.config import TrainConfig
from tier_utils.training.loop import train

RUNNERS = {"bare": "a bare PyTorch loop", "train()": "tier_utils.train", "hf": "HF Trainer",
           "lightning": "Lightning Trainer"}
# What a precision is called by each peer (only the modes all four run without a loss scaler).
PEER_FLAGS = {"fp32": {"hf": {}, "lightning": "32-true"}, "bf16": {"hf": {"bf16": True}, "lightning": "bf16-mixed"}}
TRAIN_TARGET = 1.02  # issue 52: train() at the bare loop's speed, within 2 %
MIN_REPEATS = 3  # below this an IQR says nothing, so no verdict is given


@dataclass(frozen=True)
class Setup:
    """One comparison: a model shape in one precision, and everything every runner is handed."""

    shape: str
    precision: Precision
    cfg: TrainConfig  # train()'s settings; the peers read their lr, decay, warm-up, clipping and batch from it
    initial: dict  # the state_dict every call starts from
    rows: Subset  # the training rows in train()'s order, enough for N2 steps
    data: tuple  # (train, val) as train() gets them
    held_out: list[dict]  # the batches every trained model is scored on
    device: torch.device


def build_model(shape: str, args) -> torch.nn.Module:
    """The shape from its transformers config, dropout off; its weights are replaced by the initial state_dict."""
    import transformers

    common = dict(vocab_size=args.vocab)
    if shape == "gpt2":
        config = transformers.GPT2Config(n_positions=args.seq_len, n_embd=args.width, n_layer=args.layers,
                                         n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         **common)
        return transformers.GPT2LMHeadModel(config)
    # SwiGLU's three matrices of width x I hold what GPT-2's two of width x 4 width do at I = 8/3 width
    config = transformers.LlamaConfig(hidden_size=args.width, intermediate_size=8 * (args.width // 3),
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
                                      tie_word_embeddings=True, **common)
    return transformers.LlamaForCausalLM(config)


def train_order(dataset, batch_size: int, steps: int, seed: int) -> list[int]:
    """The rows train() reads in `steps` steps: its sampler's permutation for (seed, epoch), full batches only."""
    sampler, order, epoch = ShardedSampler(dataset, seed=seed), [], 0
    per_epoch = len(sampler) // batch_size * batch_size
    while len(order) < steps * batch_size:
        sampler.set_epoch(epoch)
        order += list(sampler)[:per_epoch]
        epoch += 1
    return order[:steps * batch_size]


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, as train()'s causal-LM task computes it."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def loss_of(model, batch: dict) -> torch.Tensor:
    return token_loss(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                      batch["labels"])


def optimization(model, setup: Setup, steps: int):
    """AdamW and the schedule train() builds for a run of `steps` steps."""
    optimizer = make_optimizer(model, setup.cfg.lr, setup.cfg.weight_decay, setup.precision.adamw_eps)
    return optimizer, setup.cfg.lr_schedule.scheduler(optimizer, steps)


def run_bare(model, setup: Setup, steps: int) -> None:
    """The loop a careful user writes: autocast forward and loss, backward, clip, step, schedule."""
    model.to(setup.device).train()
    stepped = torch.compile(model) if setup.cfg.compile else model
    optimizer, scheduler = optimization(model, setup, steps)
    rows = Subset(setup.rows, range(steps * setup.cfg.batch_size))
    autocast = dict(device_type=setup.device.type, dtype=setup.precision.compute_dtype,
                    enabled=setup.precision.autocasts)
    for batch in make_loader(rows, setup.cfg.batch_size, shuffle=False, device=setup.device):
        batch = to_device(batch, setup.device)
        with torch.autocast(**autocast):
            loss = loss_of(stepped, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), setup.cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def run_train(model, setup: Setup, steps: int) -> None:
    train(model, setup.data, replace(setup.cfg, max_steps=steps))


def run_hf(model, setup: Setup, steps: int) -> None:
    """transformers' Trainer over the rows in sequence, with the shared optimizer, schedule and loss."""
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

    model.to(setup.device)  # before the optimizer, as the Trainer would: make_optimizer picks fused on CUDA
    cfg = setup.cfg
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=cfg.batch_size,
                                 max_grad_norm=cfg.grad_clip, train_sampling_strategy="sequential",
                                 use_cpu=setup.device.type == "cpu", torch_compile=setup.cfg.compile,
                                 report_to="none", save_strategy="no", eval_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, remove_unused_columns=False, seed=cfg.seed,
                                 **PEER_FLAGS[setup.precision.name]["hf"])
        # compute_loss_func: the rows come shifted already (labels = next tokens), so the model's own loss, which
        # shifts again, would score one position fewer
        trainer = Trainer(model=model, args=args, train_dataset=setup.rows,
                          optimizers=optimization(model, setup, steps),
                          compute_loss_func=lambda out, labels, num_items_in_batch=None: token_loss(out.logits, labels))
        trainer.remove_callback(PrinterCallback)  # its end-of-training metrics line
        trainer.train()
    # accelerate leaves its autocast wrapper on the model's forward after training: a bf16 run's model would go on
    # computing in bf16 wherever it is used next (the held-out loss differed by 3e-5 with it on)
    trainer.accelerator.unwrap_model(model, keep_fp32_wrapper=False)


def run_lightning(model, setup: Setup, steps: int) -> None:
    """Lightning's Trainer over the rows in sequence, with the shared optimizer, schedule and loss."""
    import pytorch_lightning as pl

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = torch.compile(model) if setup.cfg.compile else model

        def training_step(self, batch, _):
            return loss_of(self.model, batch)

        def configure_optimizers(self):
            optimizer, scheduler = optimization(model, setup, steps)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    trainer = pl.Trainer(accelerator="gpu" if setup.device.type == "cuda" else "cpu", devices=1, max_steps=steps,
                         precision=PEER_FLAGS[setup.precision.name]["lightning"], gradient_clip_val=setup.cfg.grad_clip,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Module(), make_loader(setup.rows, setup.cfg.batch_size, shuffle=False, device=setup.device))


RUN = {"bare": run_bare, "train()": run_train, "hf": run_hf, "lightning": run_lightning}


def missing_peers(runners) -> list[str]:
    """The packages the chosen runners need and this environment lacks (every runner trains a transformers model)."""
    needs = ["transformers", *["accelerate"] * ("hf" in runners), *["pytorch_lightning"] * ("lightning" in runners)]
    return [name.replace("_", "-") for name in needs if importlib.util.find_spec(name) is None]


@contextlib.contextmanager
def step_marks(at: tuple[int, int], sync):
    """{step: seconds} at the end of the optimizer steps `at`, whichever loop calls optimizer.step(): torch's global
    post-step hook, which every runner has, so none needs a callback of its own (synced there, and only there)."""
    marks, count = {}, [0]

    def mark(optimizer, args, kwargs):
        count[0] += 1
        if count[0] in at:
            sync()
            marks[count[0]] = time.perf_counter()

    handle = register_optimizer_step_post_hook(mark)
    try:
        yield marks
    finally:
        handle.remove()


def call(runner: str, setup: Setup, steps: int, args) -> tuple[float, dict, torch.nn.Module]:
    """One whole call's seconds, from a fresh model with the initial weights on the host to the trained model; the
    times at the end of steps N1 and N2 within it; the trained model."""
    model = build_model(setup.shape, args)
    model.load_state_dict(setup.initial)
    sync = torch.cuda.synchronize if setup.device.type == "cuda" else (lambda: None)
    with step_marks(args.steps, sync) as marks:
        sync()
        t0 = time.perf_counter()
        RUN[runner](model, setup, steps)
        sync()
        seconds = time.perf_counter() - t0
    return seconds, {step: t - t0 for step, t in marks.items()}, model


def timed(runner: str, setup: Setup, args) -> tuple[float, float, float]:
    """(ms per step, fixed seconds, held-out loss) of one call of N2 steps: the step time from the steps after the
    first N1, so compilation and the first steps' warm-up stay out of it; the rest of the call is the fixed cost."""
    n1, n2 = args.steps
    seconds, marks, model = call(runner, setup, n2, args)
    if set(marks) != {n1, n2}:
        raise RuntimeError(f"{RUNNERS[runner]} did not reach optimizer steps {n1} and {n2} (marked: {sorted(marks)})")
    step = (marks[n2] - marks[n1]) / (n2 - n1)
    return step * 1e3, seconds - n2 * step, held_out_loss(model, setup)


@torch.no_grad()
def held_out_loss(model, setup: Setup) -> float:
    """The trained model's mean loss over the held-out batches, in fp32 without autocast: one scorer for all."""
    model.eval()
    losses = [loss_of(model, to_device(b, setup.device)).item() for b in setup.held_out]
    return sum(losses) / len(losses)


def setups(args, device: torch.device) -> list[Setup]:
    """Every (shape, precision) comparison: its precision decided once for the device, its initial weights drawn
    once from --seed, the rows and held-out batches the same for all."""
    splits = build_datasets(None, "causal-lm", args.seq_len)
    rows = Subset(splits.train, train_order(splits.train, args.batch_size, max(args.steps), args.seed))
    scored = Subset(splits.val, range(min(args.eval_rows, len(splits.val))))
    held_out = list(make_loader(scored, args.batch_size, shuffle=False))
    found = []
    for shape in args.shapes:
        torch.manual_seed(args.seed)
        initial = {k: v.clone() for k, v in build_model(shape, args).state_dict().items()}
        for name in args.precisions:
            precision = resolve_precision(name, device, warn=False)
            # eval_batches=1: train() always evaluates at a run's end (it has no "never"); one batch keeps it small
            cfg = TrainConfig(precision=precision, batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                              eval_every=0, eval_batches=1, progress=False, compile=args.compile, device=device)
            found.append(Setup(shape, precision, cfg, initial, rows, (splits.train, splits.val), held_out, device))
    return found


def measure(found: list[Setup], args) -> dict:
    """{(setup index, runner): {"step_ms", "fixed_s", "loss"}}, one sample of each per repeat, after a warm-up
    round; each repeat's runners in an order rotated by one."""
    samples = {(i, r): {"step_ms": [], "fixed_s": [], "loss": []} for i in range(len(found)) for r in args.runners}
    for setup in found:
        for runner in args.runners:
            call(runner, setup, args.steps[0], args)
    for rep in range(args.repeats):
        turn = rep % len(args.runners)
        for i, setup in enumerate(found):
            for runner in args.runners[turn:] + args.runners[:turn]:
                for key, value in zip(("step_ms", "fixed_s", "loss"), timed(runner, setup, args)):
                    samples[(i, runner)][key].append(value)
    return samples


def verdict(runner: str, base, stats) -> str:
    """The runner's step time against the bare loop's, by the AMP benchmark's noise rule."""
    if runner == "bare":
        return "the baseline"
    if stats.n < MIN_REPEATS:
        return f"no verdict from {stats.n} repeat(s): at least {MIN_REPEATS} give a spread"
    sp = speedup(base, stats)
    said = ("no measurable difference" if sp.no_measurable_difference
            else "measurably faster" if sp.measurably_faster else "measurably slower")
    if runner == "train()":
        said += f"; {'within' if stats.median <= TRAIN_TARGET * base.median else 'above'} the {TRAIN_TARGET}x target"
    return said


def table(found: list[Setup], runners, samples: dict) -> list[dict]:
    rows = []
    for i, setup in enumerate(found):
        base = summarize(samples[(i, "bare")]["step_ms"])
        losses = [samples[(i, r)]["loss"][-1] for r in runners]
        for runner in runners:
            stats, tally = summarize(samples[(i, runner)]["step_ms"]), samples[(i, runner)]
            rows.append({"shape": setup.shape, "precision": setup.precision.name,
                         "dtype": str(setup.precision.compute_dtype).replace("torch.", ""), "runner": runner,
                         "step_ms": stats.to_dict(), "vs_bare": stats.median / base.median,
                         "fixed_s": summarize(tally["fixed_s"]).to_dict(), "held_out_loss": tally["loss"][-1],
                         "loss_across_repeats": max(tally["loss"]) - min(tally["loss"]),
                         "loss_spread_across_runners": max(losses) - min(losses),
                         "verdict": verdict(runner, base, stats)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| shape | precision | runner | ms per step, median (min–max) | vs bare loop | fixed cost, s | "
             "held-out loss | verdict |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ms, fixed = r["step_ms"], r["fixed_s"]
        lines.append(f"| {r['shape']} | {r['precision']} | {RUNNERS[r['runner']]} | {ms['median']:.1f} "
                     f"({ms['min']:.1f}–{ms['max']:.1f}) | {r['vs_bare']:.2f}× | {fixed['median']:.2f} | "
                     f"{r['held_out_loss']:.4f} | {r['verdict']} |")
    spreads = {(r["shape"], r["precision"]): r["loss_spread_across_runners"] for r in rows}
    lines.append("held-out loss, largest difference between runners: "
                 + "; ".join(f"{s} {p} {d:.2g}" for (s, p), d in spreads.items()))
    return "\n".join(lines)


@contextlib.contextmanager
def quiet_peers(runners):
    """The peers' chatter off for the run: Lightning's lines on every fit, its deprecation warnings and its
    few-workers hint (every runner loads in the main process alike), the Trainer's notes; back as it was after."""
    import transformers

    if "lightning" in runners:
        import pytorch_lightning  # noqa: F401  its import sets its loggers to INFO: first, so the levels set here hold
    loggers = {lg: lg.level for lg in map(logging.getLogger, ("pytorch_lightning", "lightning.fabric"))}
    verbosity = transformers.logging.get_verbosity()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        for category in (DeprecationWarning, FutureWarning):  # torch's deprecations, met in Lightning's code
            warnings.filterwarnings("ignore", category=category, module="pytorch_lightning")
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        transformers.logging.set_verbosity_error()
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)
            for lg, level in loggers.items():
                lg.setLevel(level)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(PEER_FLAGS))
    ap.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS),
                    help="the bare loop always runs: every ratio is against it")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, nargs=2, default=[5, 25], metavar=("N1", "N2"),
                    help="steps per call; step time = (t(N2) - t(N1)) / (N2 - N1) within it")
    for flag, default in (("--batch-size", 8), ("--seq-len", 128), ("--width", 256), ("--layers", 4), ("--heads", 4)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--vocab", type=int, default=8192, help="at least 256: the rows are the corpus's bytes")
    ap.add_argument("--eval-rows", type=int, default=64, help="held-out rows every trained model is scored on")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and train()'s row order")
    ap.add_argument("--threads", type=int, help="torch threads for every runner (default: train()'s choice)")
    ap.add_argument("--device", help="cpu or cuda (default: cuda where there is one)")
    ap.add_argument("--compile", action="store_true", help="torch.compile in every runner (for CUDA)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    if not 1 <= args.steps[0] < args.steps[1] or args.repeats < 1 or args.vocab < 256:
        ap.error("--steps N1 N2 needs 1 <= N1 < N2, --repeats at least 1 and --vocab at least 256")
    args.runners = ["bare", *(r for r in dict.fromkeys(args.runners) if r != "bare")]
    return args


def main(argv=None) -> int:
    args = parse(argv)
    missing = missing_peers(args.runners)
    if missing:
        print(f"bench/peers.py: {', '.join(missing)} not installed here; pip install .[bench] "
              "(or leave that runner out with --runners)", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    # The HF Trainer's bf16 runs recompile each time: past torch's limit of 8 per function they would run eager unsaid
    calls = (args.repeats + 1) * len(args.shapes) * len(args.precisions)
    room = torch._dynamo.config.patch(recompile_limit=calls + 8) if args.compile else contextlib.nullcontext()
    with quiet_peers(args.runners), run_threads() as threads, room:
        found = setups(args, device)
        samples = measure(found, args)
    rows = table(found, args.runners, samples)
    n1, n2 = args.steps
    params = {s.shape: sum(v.numel() for k, v in s.initial.items() if "lm_head" not in k) for s in found}  # tied
    print(f"{device_name(device)} · torch {torch.__version__} · {threads.reason} · {args.repeats} interleaved "
          f"repeats, step = (t{n2} - t{n1}) / {n2 - n1} within each call · batch {args.batch_size} x {args.seq_len} · "
          + ", ".join(f"{s} {p / 1e6:.3g}M parameters" for s, p in params.items())
          + (" · compiled" if args.compile else ""))
    print(markdown(rows))
    if args.json:
        write_json(args.json, {"meta": run_metadata(device), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
