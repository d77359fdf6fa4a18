"""Step time of `tier_utils.train()` beside its peers (a bare PyTorch loop, the Hugging Face Trainer, the Lightning
Trainer), side by side in one run on the same model, weights, rows, order, optimizer, schedule and clipping.

What every runner shares, so that what differs is the loop around the step:
- the model: a GPT-2 shape (GPT2LMHeadModel) and a Llama shape (LlamaForCausalLM, tied embeddings, an MLP of the same
  size), dropout off (each runner would draw its own masks); one initial state_dict loaded into each call's copy;
- the rows: the bundled corpus's windows in the order train()'s ShardedSampler gives for --seed, which the peers
  read in sequence (none shuffles its own);
- AdamW from `make_optimizer` (foreach on a CPU, fused on CUDA; decay on matrices only; the precision's eps),
  `make_scheduler` over the call's steps, clipping at TrainConfig's 1.0;
- the loss: the window's mean next-token cross-entropy (no padding), in fp32 (autocast's rule for cross-entropy;
  accelerate hands the Trainer fp32 logits);
- the precision: fp32, or bf16 autocast over fp32 weights (HF bf16=True, Lightning "bf16-mixed").
So they end at the same held-out loss: in fp32 bit for bit; in bf16 Lightning differs in the last bits (it sums the
clipping norm over its optimizer's groups, matrices first; the others over model.parameters()).

The measurement: each runner is called for N1 and N2 steps (--steps), whole calls timed from a fresh model on the
host to the trained one: its step time free of set-up is (t(N2) - t(N1)) / (N2 - N1), its fixed cost
t(N1) - N1 x step. An untimed warm-up round goes first (imports, allocator growth, --compile's compilation). Repeats
are interleaved, the runners' order rotated each time, so a drift in the machine's load hits them all. Each N2
call's model is scored on the same --eval-rows held-out rows in fp32 by one function. The verdict against the bare
loop is the AMP benchmark's rule (`benchmark.verdicts.speedup`): overlapping IQRs are "no measurable difference".
The torch thread count is decided once for every runner (train()'s rule, `run_threads`; --threads fixes it).

Needs the peers: `pip install .[bench]`. The table for bench/RESULTS.md, then on CUDA with every runner compiled:

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
from tier_utils.engine.step import make_optimizer, make_scheduler
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
    cfg = setup.cfg
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, setup.precision.adamw_eps)
    return optimizer, make_scheduler(optimizer, cfg.warmup_steps, steps)


def run_bare(model, setup: Setup, steps: int) -> None:
    """The loop a careful user writes: autocast forward and loss, backward, clip, step, schedule."""
    model.to(setup.device).train()
    stepped = torch.compile(model) if setup.cfg.compile else model
    optimizer, scheduler = optimization(model, setup, steps)
    rows = Subset(setup.rows, range(steps * setup.cfg.batch_size))
    with_autocast = setup.precision.autocasts
    for batch in make_loader(rows, setup.cfg.batch_size, shuffle=False, device=setup.device):
        batch = to_device(batch, setup.device)
        with torch.autocast(setup.device.type, dtype=setup.precision.compute_dtype, enabled=with_autocast):
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
    pl = lightning()

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


def lightning():
    """Lightning's pytorch package: the unified `lightning` where installed, else `pytorch_lightning`."""
    if importlib.util.find_spec("lightning") is not None:
        import lightning.pytorch as pl
    else:
        import pytorch_lightning as pl
    return pl


def missing_peers(runners) -> list[str]:
    """The packages the chosen runners need and this environment lacks."""
    needs = {"transformers": True, "accelerate": "hf" in runners}
    missing = [name for name, needed in needs.items() if needed and importlib.util.find_spec(name) is None]
    if "lightning" in runners and not any(importlib.util.find_spec(n) for n in ("lightning", "pytorch_lightning")):
        missing.append("pytorch-lightning")
    return missing


def call(runner: str, setup: Setup, steps: int, args) -> tuple[float, torch.nn.Module]:
    """One whole call's seconds, from a fresh model with the initial weights on the host to the trained model."""
    model = build_model(setup.shape, args)
    model.load_state_dict(setup.initial)
    sync = torch.cuda.synchronize if setup.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    RUN[runner](model, setup, steps)
    sync()
    return time.perf_counter() - t0, model


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


def timed_pair(runner: str, setup: Setup, args, rep: int) -> tuple[float, float, float]:
    """(ms per step, fixed seconds, held-out loss) from one N1 and one N2 call, N2 first on odd repeats."""
    (n1, n2), seconds, loss = args.steps, {}, None
    for n in ((n1, n2) if rep % 2 == 0 else (n2, n1)):
        seconds[n], model = call(runner, setup, n, args)
        loss = held_out_loss(model, setup) if n == n2 else loss
    step = (seconds[n2] - seconds[n1]) / (n2 - n1)
    return step * 1e3, seconds[n1] - n1 * step, loss


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
                for key, value in zip(("step_ms", "fixed_s", "loss"), timed_pair(runner, setup, args, rep)):
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
    """The peers' chatter off for the run, and back after: Lightning's lines on every fit, its deprecation warnings
    and its few-workers hint (every runner loads in the main process alike), the Trainer's notes."""
    import transformers

    if "lightning" in runners:
        lightning()  # its import sets its loggers to INFO: first, so the levels set here hold
    loggers = [logging.getLogger(n) for n in ("lightning.pytorch", "pytorch_lightning", "lightning.fabric")]
    levels = [lg.level for lg in loggers]
    verbosity = transformers.logging.get_verbosity()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        for category in (DeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category, module=r"(pytorch_)?lightning")
        for lg in loggers:
            lg.setLevel(logging.WARNING)
        transformers.logging.set_verbosity_error()
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)
            for lg, level in zip(loggers, levels):
                lg.setLevel(level)


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["gpt2", "llama"], choices=["gpt2", "llama"])
    ap.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=list(PEER_FLAGS))
    ap.add_argument("--runners", nargs="+", default=list(RUNNERS), choices=list(RUNNERS),
                    help="the bare loop always runs: every ratio is against it")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, nargs=2, default=[5, 25], metavar=("N1", "N2"),
                    help="steps of the two timed calls; step time = (t(N2) - t(N1)) / (N2 - N1)")
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
    with quiet_peers(args.runners), run_threads() as threads:
        found = setups(args, device)
        samples = measure(found, args)
    rows = table(found, args.runners, samples)
    n1, n2 = args.steps
    params = {s.shape: sum(v.numel() for k, v in s.initial.items() if "lm_head" not in k) for s in found}  # tied
    print(f"{device_name(device)} · torch {torch.__version__} · {threads.reason} · {args.repeats} interleaved "
          f"repeats, step = (t{n2} - t{n1}) / {n2 - n1} of whole calls · batch {args.batch_size} x {args.seq_len} · "
          + ", ".join(f"{s} {p / 1e6:.3g}M parameters" for s, p in params.items())
          + (" · compiled" if args.compile else ""))
    print(markdown(rows))
    if args.json:
        write_json(args.json, {"meta": run_metadata(device), "args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
