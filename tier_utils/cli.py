"""`python -m tier_utils <verb>`: argument parsing, exit codes and `--json`; the logic is the API's.

Exit codes: 0 success, 1 a check FAILed (or the model's forward raised, or training diverged), 2 bad input (one
line on stderr naming the fix), 130 Ctrl-C; each error class carries its code (core/errors.py).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import shutil
import sys
import textwrap
import warnings
from dataclasses import fields
from pathlib import Path

import pandas as pd

from .analysis import AnalysisConfig, analyze
from .benchmark.amp import amp_benchmark
from .benchmark.config import BENCH_RUN_ONLY, BenchConfig, Thresholds
from .benchmark.strategies import strategy_benchmark
from .colab import point_at
from .core.errors import OutputError, TierError, TrainingDiverged, one_line
from .core.files import atomic_write_bytes, jsonable, write_json
from .core.inputs import writable_dir, writable_file
from .core.threads import machine_load, run_threads
from .engine.lora import quiet_peft
from .exporting.exporter import ExportConfig, export
from .mainjob import run_all
from .models.loading import load_model
from .options import (
    DATA_HELP,
    KeepsValidation,
    Parser,
    add_chat,
    add_common,
    add_data,
    add_memory,
    add_parameters,
    add_settings,
    chat_of,
    data_of,
    memory_of,
    model_kwargs,
    settings_from,
    whole,
)
from .planning.device_report import InfoConfig, info
from .planning.planner import FitConfig, fit
from .planning.ranks import RanksConfig, plan_ranks
from .presets import FAST, JOB
from .smoketest.suite import SmokeConfig, smoke
from .training.comparison import compare
from .training.config import CHECKPOINTS_FOLDER, METRICS_FILE, PLOT_FILE, TrainConfig
from .training.loop import train
from .training.stopping import interrupts_deferred
from .tuning.study import SearchConfig, search


def _run_info(args) -> tuple[dict, int]:
    result = info(args.model, settings_from(args, InfoConfig), model_kwargs=model_kwargs(args))
    _show(result.table)
    return result.to_json(), 0


def _run_smoke(args) -> tuple[dict, int]:
    report = smoke(args.model, settings_from(args, SmokeConfig, chat=chat_of(args)), data=data_of(args),
                   model_kwargs=model_kwargs(args))
    if report.rank != 0:  # sharded under torchrun: rank 0's report holds every rank's rows
        args.json = None
        return None, 0 if report.passed else 1
    _show(report.table)
    print(report.headline())
    return report.to_json(), 0 if report.passed else 1


def _run_train(args) -> tuple[dict, int]:
    out = Path(args.out)
    # Bad settings fail here, before anything is built or written; logs go beside: DIR/logs.
    config = settings_from(args, TrainConfig, checkpoint_dir=str(out / CHECKPOINTS_FOLDER), memory=memory_of(args))
    code = 0
    try:
        # seeded before it builds the model
        result = train(args.model, data_of(args), config, model_kwargs=model_kwargs(args))
    except TrainingDiverged as exc:
        if exc.result is None:
            raise
        result, code = exc.result, exc.exit_code
        if exc.result.summary.rank == 0:
            print(f"error: {exc}", file=sys.stderr)
    s = result.summary
    if s.rank != 0:  # under torchrun only rank 0 prints and writes
        args.json = None
        return jsonable(s), code
    with interrupts_deferred() if result.interrupted else contextlib.nullcontext():  # a second Ctrl-C: still saved
        files = [result.to_csv(out / METRICS_FILE), result.save_plot(out / PLOT_FILE)]
        files += [atomic_write_bytes(out / f"{part}.csv", frame.to_csv(index=False).encode())  # e.g. samples.csv
                  for part, frame in result.more_tables().items()]
    files += [f for f in (s.checkpoint, s.best_checkpoint, s.consolidated, s.hf_folder) if f]
    print(f"trained {s.model} for {s.steps} steps ({s.epochs} epochs)")
    _show(result.table)  # the summary as the notebook shows it
    print("wrote: " + ", ".join(str(f) for f in files))
    if result.interrupted:
        kept = f"; --resume continues from {s.checkpoint}" if s.checkpoint else \
            "; no checkpoint was saved yet (--checkpoint-every N saves one every N steps)"
        print(f"interrupted after step {s.steps}: wrote {', '.join(Path(f).name for f in files)}{kept}",
              file=sys.stderr)
        code = 130
    return jsonable({**s.to_dict(), "files": [str(f) for f in files]}), code


def _run_compare(args) -> tuple[dict, int]:
    result = compare(args.run_a, args.run_b)
    _show(result.table)
    if len(result.differences):
        _show(result.differences)
    print(result.summary_line())
    return result.to_json(), result.exit_code


def _run_analyze(args) -> tuple[dict, int]:
    report = analyze(args.model, data_of(args), settings_from(args, AnalysisConfig, chat=chat_of(args)),
                     model_kwargs=model_kwargs(args))
    _show(report.table.drop(columns="threshold"))
    d = report.data
    read = f"{d.described.data} (tokenizer {d.described.tokenizer})" if d.described else "no data (it did not run)"
    print(f"{report.model['model']} · {report.precision.name} ({report.precision.reason}) · "
          f"{d.batches} x {d.batch_size} x {d.seq_len} tokens of {read} · "
          f"{sum(report.seconds.values()):.1f} s · worst status {report.status}")
    return report.to_json(), 1 if report.status == "FAIL" else 0


def _run_bench(args) -> tuple[dict, int]:
    # Thresholds' memory is --memory (which bytes a reduction counts); BenchConfig's is the memory settings.
    config = settings_from(args, BenchConfig, thresholds=settings_from(args, Thresholds),
                           memory=memory_of(args), chat=chat_of(args))  # --device, --no-progress too
    if config.strategy is not None:
        return _run_strategy_bench(args, config)
    result = amp_benchmark(args.model, data_of(args), config, model_kwargs=model_kwargs(args))
    m, run, s = result.metadata, result.config, result.config.settings
    print(f"{run.model} · {m['device_name']} · torch {m['torch']} · batch {s.batch_size} x {s.seq_len} tokens · "
          f"{s.repeats} repeats of {s.timed_steps} timed steps · {s.accuracy_steps} accuracy steps")
    if run.fit.reason:
        print(run.fit.reason)
    if run.lora:
        print(run.lora["detail"])
    _show(result.table.set_index(["precision", "mode"]).T, index=True)
    print()
    _show(result.verdicts)
    print(result.answer())  # the mode to use here, the faster one's cost, the failed verdicts
    print(f"worst status: {result.status}")
    return result.to_json(), 1 if result.status == "FAIL" else 0


def _run_strategy_bench(args, config: BenchConfig) -> tuple[dict | None, int]:
    result = strategy_benchmark(args.model, data_of(args), config, model_kwargs=model_kwargs(args))
    if result.rank != 0:  # under torchrun only rank 0 prints and writes
        args.json = None
        return None, 0
    print(result.headline())
    _show(result.overview())
    print()
    _show(result.table[["strategy", "precision", "mode", "rank", "n", "step_ms_median", "step_ms_iqr",
                        "tokens_per_s_median", "peak_memory_mib", "param_mib", "step_ms_rank_ratio",
                        "peak_mib_rank_ratio"]])
    return result.to_json(), 0


def _run_search(args) -> tuple[dict, int]:
    result = search(load_model(args.model, **model_kwargs(args)), data_of(args),
                    settings_from(args, SearchConfig, trial=settings_from(args, TrainConfig,
                                                                                   memory=memory_of(args))))
    _show(result.table)
    print(result.summary_line())  # what the trials trained, and the best one
    return result.to_json(), 0


def _run_export(args) -> tuple[dict, int]:
    result = export(args.model, args.out, data_of(args), settings_from(args, ExportConfig, chat=chat_of(args)),
                    model_kwargs=model_kwargs(args))
    c, m = result.config, result.metadata
    print(f"exported {c.model} ({c.task}) to {result.path} ({c.format}, {c.precision}, {c.bytes:,} bytes; "
          f"inputs {', '.join(c.inputs)} with dynamic batch and sequence up to {c.max_len})")
    _show(result.table)
    for row in result.latency:
        print(f"latency {row['shape']} {row['runner']}: {row['median_ms']:.3f} ms median (IQR {row['iqr_ms']:.3f}, "
              f"n={row['n']}) on {m['device_name']}, {m['dtype']}")
    print(f"parity: {result.status}")
    return result.to_json(), 1 if result.status == "FAIL" else 0


def _run_fit(args) -> tuple[dict, int]:
    result = fit(args.model, settings_from(args, FitConfig, chat=chat_of(args)), data=data_of(args),
                 model_kwargs=model_kwargs(args))
    width = shutil.get_terminal_size((FALLBACK_WIDTH, 24)).columns
    print(textwrap.fill(result.headline(), width))
    table = result.overview()  # indexed by mode: every row says which
    here = list(result.HERE_COLUMNS)
    _show(table[here], index=True)
    print("largest batch on each GPU (predicted):")
    _show(table.drop(columns=here), index=True)
    print(textwrap.fill(result.summary_line(), width))
    if args.json:  # every column and each row's detail, beside the JSON
        csv = atomic_write_bytes(Path(args.json).with_suffix(".csv"), result.full_table().to_csv(index=False).encode())
        print(f"every column and each row's detail: {csv} (and {args.json})")
    return result.to_json(), 0


def _run_ranks(args) -> tuple[dict, int]:
    result = plan_ranks(args.model, settings_from(args, RanksConfig), model_kwargs=model_kwargs(args))
    print(result.headline())
    _show(result.overview())
    print("smallest N that trains (batch 1 per rank):")
    _show(result.smallest())
    return result.to_json(), 0


def _run_all(args) -> tuple[dict, int]:
    print(f"all: smoke, analysis, training, AMP benchmark · {machine_load()}", file=sys.stderr)
    result = run_all(args.model, args.out, data=data_of(args), precision=args.precision, device=args.device,
                     fast=args.fast, batch_size=args.batch_size, seed=args.seed, progress=args.progress,
                     model_kwargs=model_kwargs(args), memory=memory_of(args), data_format=args.data_format,
                     loss_on=args.loss_on, chat_template=args.chat_template)
    print(result.summary_text())
    return result.to_json(), 1 if result.model_status == "FAIL" else 0


def _run_colab(args):
    changed = point_at(args.repo, args.root)
    print(f"{len(changed)} file(s) now point at {args.repo}: " + ", ".join(str(p) for p in changed)
          if changed else f"already pointing at {args.repo}; nothing changed")
    return None, 0


ELLIPSIS = "…"
MIN_CELL = 16  # characters a cut cell keeps: less says nothing
FALLBACK_WIDTH = 120  # where stdout is no terminal (a pipe, a log file): the house's line length


def _show(table, index: bool = False) -> None:
    """A table on the terminal: floats to 4 significant digits, as wide as the terminal at most (the longest
    texts cut with "…"; the full text is in --json and the CSV)."""
    width = shutil.get_terminal_size((FALLBACK_WIDTH, 24)).columns
    shown = table.map(lambda v: f"{v:.4g}" if isinstance(v, float) else "-" if v is pd.NA else v)
    print(fit_width(shown, width, index))


def fit_width(table, width: int, index: bool = False) -> str:
    """`table` as text no wider than `width`: the column with the longest text cut, again, until it fits or
    no text is longer than MIN_CELL."""
    shown = table.copy()
    while True:
        text = shown.to_string(index=index)
        over = max(map(len, text.splitlines()), default=0) - width
        longest = {i: shown.iloc[:, i].map(lambda v: len(v) if isinstance(v, str) else 0).max()
                   for i in range(shown.shape[1])}
        column = max(longest, key=longest.get, default=None)
        if over <= 0 or column is None or longest[column] <= MIN_CELL:
            return text
        keep = max(MIN_CELL, longest[column] - over)
        shown.iloc[:, column] = shown.iloc[:, column].map(functools.partial(_cut, keep=keep))


def _cut(value, keep: int):
    return value[:keep - 1] + ELLIPSIS if isinstance(value, str) and len(value) > keep else value


def build_parser() -> argparse.ArgumentParser:
    """The verbs, their options generated from the settings dataclasses (and run_all's signature)."""


    # The console script `tier-utils` and `python -m tier_utils` run the same main(): help names the one typed.
    prog = "tier-utils" if Path(sys.argv[0]).name == "tier-utils" else "python -m tier_utils"
    parser = Parser(prog=prog,
                     description="Smoke-test, analyse, train and benchmark a PyTorch transformer.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("info", help="device, precision decision and model summary")
    add_common(p, InfoConfig, progress=False)
    p.set_defaults(run=_run_info)

    p = verbs.add_parser("smoke", help="tier 1: shapes, gradient flow, stability, init, memory, latency, determinism")
    add_common(p, SmokeConfig)
    add_settings(p, SmokeConfig, ("batch_sizes", "seq_lens", "checks", "strategy"))
    p.add_argument("--data", default=None, metavar="SOURCE", help="add the longest batch this data makes to the "
                   "memory and latency lengths (default: no data read): " + DATA_HELP.split(" (default")[0])
    add_data(p, data=False)
    add_chat(p)
    p.set_defaults(run=_run_smoke)

    p = verbs.add_parser("analyze", help="tier 2: attention, robustness, attribution, precision headroom, op dtypes")
    add_common(p, AnalysisConfig)
    add_settings(p, AnalysisConfig, ("analyses", "batch_size", "n_batches", "seq_len"))
    add_data(p)
    add_chat(p)
    p.set_defaults(run=_run_analyze)

    p = verbs.add_parser("train", help="train with AMP, metrics, checkpoints and exact resume (torchrun-ready)")
    add_common(p)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for metrics.csv, training.png, checkpoints/, "
                                                               "logs/")
    add_data(p)
    add_settings(p.add_mutually_exclusive_group(), TrainConfig, ("epochs", "max_steps"))  # max_steps would win
    add_settings(p, TrainConfig, {f.name for f in fields(TrainConfig)} - {"precision", "device", "progress",
                                                                           "checkpoint_dir", "log_dir", "epochs",
                                                                           "max_steps", "memory"})
    add_memory(p)
    # Its files, probed before training: a folder in their place fails no run.
    p.set_defaults(run=_run_train, writes=(METRICS_FILE, PLOT_FILE))

    p = verbs.add_parser("bench", help="tier 3: fp32 vs bf16 vs fp16 speed, MFU, memory, accuracy, with verdicts")
    add_common(p, precision=False)
    add_data(p)
    # --device and --no-progress come with add_common; the benchmark's loggers are the API's only.
    add_settings(p, BenchConfig, {f.name for f in fields(BenchConfig)} - {"thresholds", "memory", "chat",
                                                                           *BENCH_RUN_ONLY})
    add_settings(p, Thresholds)
    add_memory(p, checkpointing=False)  # --activation-checkpointing: each precision's checkpointed rows
    add_chat(p)
    p.set_defaults(run=_run_bench)

    p = verbs.add_parser("search", help="tier 3: Optuna search over lr, weight decay, warm-up, batch size on val loss")
    add_common(p)
    add_data(p)
    add_settings(p, SearchConfig, {f.name for f in fields(SearchConfig)} - {"progress", "trial"})
    add_settings(p, TrainConfig, ("batch_size", "seq_len", "max_steps", "eval_every", "eval_batches", "val_fraction",
                                  "seed"),
                 defaults=vars(SearchConfig().trial))
    add_memory(p)
    add_chat(p)  # TrainConfig's fields: each trial reads chat rows so
    p.set_defaults(run=_run_search)

    p = verbs.add_parser("export", help="export to ONNX or a torch.export program (.pt2) with a parity check "
                                        "against eager")
    add_common(p, precision=False, device=False, progress=False)
    p.add_argument("--out", required=True, metavar="PATH", help="the artifact to write, e.g. model.onnx")
    add_settings(p, ExportConfig, ("format", "precision", "repeats"))
    p.add_argument("--data", default=None, metavar="SOURCE", help="the parity batches' text: " + DATA_HELP)
    add_data(p, data=False)
    add_chat(p)
    p.set_defaults(run=_run_export)

    p = verbs.add_parser("fit", help="every mode (precision, activation checkpointing, LoRA over each base, QLoRA, "
                                     "8-bit AdamW) at your batch and length: the cheapest that fits here and "
                                     "predicted for T4/L4/A100/H100")
    add_common(p, FitConfig, precision=False)
    add_settings(p, FitConfig, ("batch_size", "seq_len", "target_len", "precisions", "checkpointing", "lora",
                                "optimizers", "validate"))
    p.add_argument("--data", default=None, metavar="SOURCE", help="plan at the longest batch this data makes at "
                   "--seq-len (default: no data read, the plan is at --seq-len): " + DATA_HELP.split(" (default")[0])
    add_data(p, data=False)
    add_chat(p)
    p.set_defaults(run=_run_fit)

    p = verbs.add_parser("ranks", help="per rank under DDP and FSDP for N ranks: bytes held, the largest batch per "
                                       "rank here and predicted for 2/4/8 T4/L4/A100/H100, the smallest N per mode")
    add_common(p, RanksConfig)
    add_settings(p, RanksConfig, ("seq_len", "ranks"))
    p.set_defaults(run=_run_ranks)

    p = verbs.add_parser("all", help="the main job: smoke, analyze, a short training run and the AMP benchmark, "
                                     "with an HTML report")
    add_common(p)
    p.add_argument("--out", default=inspect.signature(run_all).parameters["out_dir"].default, metavar="DIR",
                   help="folder for the CSV tables, PNG plots, JSON and index.html (default: %(default)s)")
    add_parameters(p, run_all, {
        "data": DATA_HELP,
        "fast": f"a quick run, for CI or a notebook on a CPU: {FAST.train.max_steps} training steps of "
                f"{FAST.batch_size} x {FAST.seq_len} tokens, {FAST.bench.repeats} benchmark repeats of "
                f"{FAST.bench.timed_steps} steps (without it: {JOB.train.max_steps} training steps, "
                f"{JOB.bench.repeats} repeats of {JOB.bench.timed_steps})",
        "batch_size": (f"sequences per batch (none: {JOB.batch_size}, {FAST.batch_size} with --fast)",
                       whole),
        "seed": "initial weights and training data order"})
    add_memory(p)
    add_chat(p)  # chat rows, read so in every tier
    p.add_argument("--eval-every", "--val-fraction", action=KeepsValidation)
    add_data(p, data=False)
    p.set_defaults(run=_run_all)

    p = verbs.add_parser("compare", help="run B against run A on the same validation examples: the paired verdict "
                                          "per metric, the settings that differ; exit 1 on a measurable loss "
                                          "regression")
    for name in ("RUN_A", "RUN_B"):
        p.add_argument(name.lower(), metavar=name, help="a train --out folder, a checkpoint folder or its scores.json")
    p.add_argument("--json", metavar="PATH", help="write a machine-readable summary here")
    p.set_defaults(run=_run_compare)

    p = verbs.add_parser("colab", help="point the Colab badges and colab_setup.sh at your fork")
    p.add_argument("--repo", required=True, metavar="USER/NAME", help="your GitHub repository, e.g. alice/tier_utils")
    p.add_argument("--root", default=".", metavar="DIR", help="the checkout to change (default: here)")
    p.set_defaults(run=_run_colab, json=None)
    return parser


def _warning_line(message, category, filename, lineno, file=None, line=None):
    # A user-facing warning is one line, not Python's file:line + source dump.
    print(f"warning: {message}", file=sys.stderr)


def _check_outputs(args) -> None:
    """Every path the verb will write, probed before any model is built: a bad one costs no run."""
    out = getattr(args, "out", None)
    if out is not None and args.verb == "export":  # export's --out is the artifact file itself
        writable_file(out, "--out", folder_made_by_run=True)
        out = None
    elif out is not None:
        writable_dir(out, "--out")
        taken = [name for name in getattr(args, "writes", ()) if (Path(out) / name).is_dir()]
        if taken:
            raise OutputError(f"--out {out} holds a folder named {taken[0]} where {args.verb} writes its file; move "
                              "it or give another --out")
    if args.json:
        inside_out = out is not None and Path(out).resolve() in Path(args.json).resolve().parents
        writable_file(args.json, "--json", folder_made_by_run=inside_out)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits 2 on bad arguments
    try:
        with warnings.catch_warnings(), quiet_peft():  # peft's and bitsandbytes' lines with nothing to act on
            warnings.showwarning = _warning_line
            _check_outputs(args)
            with run_threads():  # chosen once, before the verb's first line: every tier it runs keeps it
                summary, code = args.run(args)
        if args.json:
            write_json(args.json, summary)
    except TierError as exc:  # each class says its code: 2 for the input, 1 for a finding about the model or run
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return exc.exit_code
    except (ValueError, OSError) as exc:  # a bad setting (a config's check) or an unusable path
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code
