"""`python -m tier_utils <verb>`: argument parsing, exit codes and `--json`; the logic is the API's.

Exit codes: 0 success, 1 a check FAILed, 2 bad input (one line on stderr naming the fix), 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import ast
import sys
import warnings

from .compiling import COMPILE_MODES
from .errors import ModelForwardError, TierError, one_line
from .files import write_json
from .models import DEFAULT_MODEL
from .precision import PRECISION_NAMES, canonical_precision
from .train_config import TrainConfig
from .validation import whole_number, writable_dir, writable_file


def _precision(value: str) -> str:
    try:
        canonical_precision(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    try:
        return whole_number(n, "value")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int_list(value: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]."""
    try:
        return [_positive_int(v) for v in value.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 1 such as 1,4; got {value!r}") from None


def _model_arg(value: str) -> tuple[str, object]:
    key, sep, raw = value.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. d_model=256), got {value!r}")
    try:
        return key, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key, raw  # a bare string such as activation=gelu


def add_common(parser: argparse.ArgumentParser, batch_size: int | None = None, precision: bool = True,
               device: bool = True) -> None:
    """The options every verb shares: model, model kwargs, device, precision, batch size, json, progress.

    precision=False leaves out --precision, for a verb that takes several (bench's --precisions);
    device=False leaves out --device, for a verb that runs on the CPU only (export).
    """
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="built-in name, path/file.py:Name, package.module:Name or hf:ModelClass "
                             f"(default {DEFAULT_MODEL})")
    parser.add_argument("--model-arg", action="append", type=_model_arg, default=[], metavar="KEY=VALUE",
                        help="keyword argument for building the model (repeatable), e.g. d_model=256")
    if device:
        parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    if precision:
        parser.add_argument("--precision", type=_precision, default="auto",
                            help=f"{', '.join(PRECISION_NAMES)} (Lightning/torch spellings accepted; default auto)")
    if batch_size is not None:
        parser.add_argument("--batch-size", type=_positive_int, default=batch_size)
    parser.add_argument("--json", metavar="PATH", help="write a machine-readable summary here")
    parser.add_argument("--no-progress", action="store_true", help="turn progress bars off")


def add_compile_mode(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-mode", choices=COMPILE_MODES, default=TrainConfig.compile_mode,
                        help="torch.compile mode; reduce-overhead uses CUDA graphs "
                             f"(default: {TrainConfig.compile_mode})")


_COMPILE_CHOICES = {"off": False, "on": True, "both": "both"}  # bench --compile -> amp_benchmark(compile=)


def model_kwargs(args) -> dict:
    return dict(args.model_arg)


def _run_info(args) -> tuple[dict, int]:
    from .info import info

    result = info(args.model, args.precision, args.device, **model_kwargs(args))
    with _wide_pandas():
        print(result.table.to_string(index=False))
    return result.to_json(), 0


def _run_smoke(args) -> tuple[dict, int]:
    from .smoke import smoke

    report = smoke(args.model, batch_sizes=args.batch_sizes, seq_lens=args.seq_lens, precision=args.precision,
                   checks=args.checks, device=args.device, progress=not args.no_progress, **model_kwargs(args))
    with _wide_pandas():
        print(report.table.to_string(index=False))
    print(report.headline())
    return report.to_json(), 0 if report.passed else 1


def _run_train(args) -> tuple[dict, int]:
    from pathlib import Path

    from .files import jsonable
    from .models import load_model
    from .seeding import seed_everything
    from .train import TrainConfig, TrainingDiverged, train

    out = Path(args.out)
    names = ("precision", "batch_size", "seq_len", "lr", "weight_decay", "warmup_steps", "grad_clip", "seed",
             "deterministic", "num_workers", "eval_every", "eval_batches", "log_every", "checkpoint_every", "resume",
             "device", "compile", "compile_mode")
    settings = {k: getattr(args, k) for k in names}
    settings.update(grad_accum_steps=args.grad_accum, progress=not args.no_progress,
                    checkpoint_dir=str(out / "checkpoints"), loggers=args.log, log_project=args.log_project,
                    log_run_name=args.log_run_name, mlflow_uri=args.mlflow_uri)  # logs: DIR/logs
    settings.update({k: getattr(args, k) for k in ("epochs", "max_steps") if getattr(args, k) is not None})
    config = TrainConfig(**settings)  # bad settings fail here, before anything is built or written
    code = 0
    try:
        seed_everything(config.seed)  # so --seed also fixes the initial weights
        result = train(load_model(args.model, **model_kwargs(args)), args.data, config)
    except TrainingDiverged as exc:
        if exc.result is None:
            raise
        result, code = exc.result, 1
        if exc.result.summary["rank"] == 0:
            print(f"error: {exc}", file=sys.stderr)
    s = result.summary
    if s["rank"] != 0:  # under torchrun only rank 0 prints and writes
        args.json = None
        return jsonable(s), code
    files = [result.to_csv(out / "metrics.csv"), result.save_plot(out / "training.png")]
    if s["checkpoint"]:
        files.append(s["checkpoint"])
    print(f"trained {s['model']} ({s['task']}, {s['parameters']:,} parameters) for {s['steps']} steps "
          f"({s['epochs']} epochs, global batch {s['global_batch']}) in {s['precision']} on {s['device_name']}")
    print(f"precision: {s['precision_reason']}")
    final = [f"{k.replace('_', ' ')} {s[k]:.4g}" for k in ("train_loss", "val_loss", "perplexity", "accuracy")
             if s[k] is not None and s[k] == s[k]]  # None/NaN: not measured (perplexity of a classifier)
    if final:
        scored = f" (validation: n={s['val_targets']:,} targets)" if s["val_targets"] else ""
        print("final: " + " · ".join(final) + scored)
    if s["tokens_per_s"]:
        t, ms = s["tokens_per_s"], s["step_time_ms"]
        print(f"throughput: {t['median']:,.0f} tokens/s median (IQR {t['iqr']:,.0f}, n={t['n']} log windows) · "
              f"step {ms['median']:.1f} ms median (IQR {ms['iqr']:.1f})")
    if s["precision"] == "fp16":
        print(f"skipped steps (fp16 overflow): {s['skipped_steps']}")
    print(f"optimizer: {s['optimizer']} · compile: {s['compile_reason']}")
    print("wrote: " + ", ".join(str(f) for f in files))
    if result.interrupted:
        print("interrupted: partial results written; rerun with --resume to continue", file=sys.stderr)
        code = 130
    return jsonable({**s, "files": [str(f) for f in files]}), code


def _run_analyze(args) -> tuple[dict, int]:
    from .analysis import analyze

    report = analyze(args.model, data=args.data, analyses=args.analyses, precision=args.precision, device=args.device,
                     batch_size=args.batch_size, n_batches=args.n_batches, seq_len=args.seq_len,
                     progress=not args.no_progress, **model_kwargs(args))
    with _wide_pandas():
        print(report.table.drop(columns="threshold").to_string(index=False))
    d = report.data
    print(f"{report.model['model']} · {report.precision['precision']} ({report.precision['reason']}) · "
          f"{d['batches']} x {d['batch_size']} x {d['seq_len']} tokens of {d['source']} data · "
          f"{sum(report.seconds.values()):.1f} s · worst status {report.status}")
    return report.to_json(), 1 if report.status == "FAIL" else 0


def _precision_list(value: str) -> list[str]:
    from .bench import precision_list  # the API's parsing: canonical names, fp32 first, 'auto' refused

    try:
        return precision_list([v for v in value.split(",") if v.strip()])
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _run_bench(args) -> tuple[dict, int]:
    from .bench import amp_benchmark
    from .models import load_model
    from .verdicts import Thresholds

    thresholds = Thresholds(speedup=args.min_speedup, memory_reduction=args.min_memory_reduction,
                            memory=args.memory, accuracy_diff=args.max_accuracy_diff)
    result = amp_benchmark(load_model(args.model, **model_kwargs(args)), data=args.data, precisions=args.precisions,
                           batch_size=args.batch_size, seq_len=args.seq_len, warmup_steps=args.warmup_steps,
                           timed_steps=args.timed_steps, repeats=args.repeats, accuracy_steps=args.accuracy_steps,
                           thresholds=thresholds, force=args.force, device=args.device,
                           progress=not args.no_progress, lr=args.lr, val_batches=args.val_batches,
                           compile=_COMPILE_CHOICES[args.compile], compile_mode=args.compile_mode)
    m, c = result.metadata, result.config
    print(f"{c['model']} · {m['device_name']} · torch {m['torch']} · batch {c['batch_size']} x {c['seq_len']} "
          f"tokens · {c['repeats']} repeats of {c['timed_steps']} timed steps · {c['accuracy_steps']} accuracy steps")
    with _wide_pandas():
        table = result.table.map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
        print(table.set_index(["precision", "mode"]).T.to_string())
        print()
        print(result.verdicts.to_string(index=False))
    print(f"worst status: {result.status}")
    return result.to_json(), 1 if result.status == "FAIL" else 0


def _run_search(args) -> tuple[dict, int]:
    from .models import load_model
    from .search import search

    result = search(load_model(args.model, **model_kwargs(args)), data=args.data, n_trials=args.trials, timeout=args.timeout, storage=args.storage,
                    study_name=args.study_name, seed=args.seed, progress=not args.no_progress,
                    precision=args.precision, max_steps=args.max_steps,
                    eval_every=args.eval_every, seq_len=args.seq_len, device=args.device)
    with _wide_pandas():
        print(result.table.map(lambda v: f"{v:.4g}" if isinstance(v, float) else v).to_string(index=False))
    summary = result.to_json()
    if summary["best"]:
        print(f"best: trial {summary['best']['trial']} · val loss {summary['best']['val_loss']:.4f} · "
              f"{summary['best']['params']}")
    return summary, 0


def _run_export(args) -> tuple[dict, int]:
    from .export import export

    result = export(args.model, args.out, format=args.format, precision=args.precision, data=args.data,
                    repeats=args.repeats, **model_kwargs(args))
    c, m = result.config, result.metadata
    print(f"exported {c['model']} ({c['task']}) to {result.path} ({c['format']}, {c['precision']}, "
          f"{c['bytes']:,} bytes; inputs {', '.join(c['inputs'])} with dynamic batch and sequence up to {c['max_len']})")
    with _wide_pandas():
        print(result.table.to_string(index=False))
    for row in result.latency:
        print(f"latency {row['shape']} {row['runner']}: {row['median_ms']:.3f} ms median (IQR {row['iqr_ms']:.3f}, "
              f"n={row['n']}) on {m['device_name']}, {m['dtype']}")
    print(f"parity: {result.status}")
    return result.to_json(), 1 if result.status == "FAIL" else 0


def _run_all(args) -> tuple[dict, int]:
    from .measure import machine_load
    from .report import run_all

    print(f"all: smoke, analysis, training, AMP benchmark ({machine_load() or 'load unknown'})", file=sys.stderr)
    result = run_all(args.model, args.out, data=args.data, precision=args.precision, device=args.device,
                     fast=args.fast, batch_size=args.batch_size, seed=args.seed, progress=not args.no_progress,
                     **model_kwargs(args))
    print(result.summary_text())
    return result.to_json(), 1 if result.model_status == "FAIL" else 0


def _run_colab(args):
    from .colab import point_at

    changed = point_at(args.repo, args.root)
    print(f"{len(changed)} file(s) now point at {args.repo}: " + ", ".join(str(p) for p in changed)
          if changed else f"already pointing at {args.repo}; nothing changed")
    return None, 0


def _wide_pandas():
    import pandas as pd

    return pd.option_context("display.width", 200, "display.max_colwidth", 120, "display.max_rows", 500)


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # One line, not argparse's usage dump: say what is wrong and where help is.
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m tier_utils",
                                     description="Smoke-test, analyse, train and benchmark a PyTorch transformer.")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = verbs.add_parser("info", help="device, precision decision and model summary")
    add_common(p)
    p.set_defaults(run=_run_info)

    p = verbs.add_parser("smoke", help="tier 1: shapes, gradient flow, stability, init, memory, latency, determinism")
    add_common(p)
    p.add_argument("--batch-sizes", type=_positive_int_list, default=[1, 4], metavar="B,B",
                   help="batch sizes for memory and latency (default 1,4)")
    p.add_argument("--seq-lens", type=_positive_int_list, default=None, metavar="T,T",
                   help="sequence lengths for memory and latency (default: the model's max length)")
    p.add_argument("--checks", default=None, metavar="NAME,NAME",
                   help="check groups to run (default all): shapes, gradients, stability, init, memory, latency, "
                        "determinism")
    p.set_defaults(run=_run_smoke)

    p = verbs.add_parser("analyze", help="tier 2: attention, robustness, attribution, precision headroom, op dtypes")
    add_common(p, batch_size=8)
    p.add_argument("--analyses", default=None, metavar="NAME,NAME",
                   help="analyses to run (default all): attention, robustness, attribution, headroom, dtypes")
    p.add_argument("--data", default=None, help="text file or 'synthetic' (default: the bundled corpus)")
    p.add_argument("--n-batches", type=_positive_int, default=2, help="validation batches to analyse (default 2)")
    p.add_argument("--seq-len", type=_positive_int, default=64, help="tokens per example (capped at the model's max)")
    p.set_defaults(run=_run_analyze)

    p = verbs.add_parser("train", help="train with AMP, metrics, checkpoints and exact resume (torchrun-ready)")
    add_common(p, batch_size=16)
    p.add_argument("--out", required=True, metavar="DIR", help="folder for metrics.csv, training.png, checkpoints/")
    p.add_argument("--data", default=None, help="text file or 'synthetic' (default: the bundled corpus)")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, help="passes over the training set (default 1)")
    length.add_argument("--max-steps", type=int, help="optimizer steps (wins over epochs)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (0: off)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--deterministic", action="store_true", help="torch deterministic algorithms")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=50, help="steps between evaluations (0: epoch ends only)")
    p.add_argument("--eval-batches", type=int, default=20, help="validation batches per evaluation")
    p.add_argument("--log-every", type=int, default=None,
                   help="steps per history row (default: every step on short runs, else 10)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps between checkpoints")
    p.add_argument("--resume", action="store_true", help="continue from DIR/checkpoints/last.pt if it exists")
    p.add_argument("--log", default="", metavar="NAME,NAME",
                   help="experiment loggers, written under DIR/logs: tensorboard, wandb, mlflow")
    p.add_argument("--log-project", default="tier_utils", help="W&B project / MLflow experiment")
    p.add_argument("--log-run-name", default=None, help="default: model-precision-UTC time")
    p.add_argument("--mlflow-uri", default=None, help="MLflow folder or tracking URI (default DIR/logs/mlflow)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the training step (compile time reported apart; eager if it can't compile)")
    add_compile_mode(p)
    p.set_defaults(run=_run_train)

    p = verbs.add_parser("bench", help="tier 3: fp32 vs bf16 vs fp16 speed, MFU, memory, accuracy, with verdicts")
    add_common(p, batch_size=8, precision=False)
    p.add_argument("--precisions", type=_precision_list, default=["fp32", "bf16", "fp16"], metavar="P,P",
                   help="precisions to compare; fp32 (the baseline) is always included (default fp32,bf16,fp16)")
    p.add_argument("--data", default=None, help="text file or 'synthetic' (default: the bundled corpus)")
    p.add_argument("--seq-len", type=_positive_int, default=64)
    p.add_argument("--warmup-steps", type=int, default=3, help="untimed steps before each timed repeat")
    p.add_argument("--timed-steps", type=_positive_int, default=10, help="timed optimizer steps per repeat")
    p.add_argument("--repeats", type=_positive_int, default=5, help="repeats per precision, interleaved")
    p.add_argument("--accuracy-steps", type=int, default=50, help="training steps for accuracy parity (0: skip)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--force", action="store_true", help="run precisions this device has no native support for")
    p.add_argument("--min-speedup", type=float, default=1.5, help="speedup vs fp32 to PASS (default 1.5)")
    p.add_argument("--min-memory-reduction", type=float, default=0.40,
                   help="memory reduction vs fp32 to PASS, a fraction (default 0.40)")
    p.add_argument("--memory", choices=["activations", "total", "peak_allocated"], default="activations",
                   help="which memory --min-memory-reduction applies to (default activations)")
    p.add_argument("--max-accuracy-diff", type=float, default=0.01, help="val accuracy gap to fp32 (default 0.01)")
    p.add_argument("--val-batches", type=_positive_int, default=20,
                   help="validation batches after each accuracy run (default 20)")
    p.add_argument("--compile", choices=list(_COMPILE_CHOICES), default="off",
                   help="torch.compile the steps: off, on, or both (each precision eager and compiled, interleaved)")
    add_compile_mode(p)
    p.set_defaults(run=_run_bench)

    p = verbs.add_parser("search", help="tier 3: Optuna search over lr, weight decay, warm-up, batch size on val loss")
    add_common(p)
    p.add_argument("--trials", type=_positive_int, default=8, help="finished trials the study should hold (default 8)")
    p.add_argument("--timeout", type=float, default=None, help="stop starting trials after this many seconds")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="e.g. sqlite:///study.db: persist the study; rerun with the same --study-name to continue")
    p.add_argument("--study-name", default="tier_utils")
    p.add_argument("--data", default=None, help="text file or 'synthetic' (default: the bundled corpus)")
    p.add_argument("--max-steps", type=_positive_int, default=60, help="optimizer steps per trial (default 60)")
    p.add_argument("--eval-every", type=_positive_int, default=10, help="steps between val-loss reports (pruning)")
    p.add_argument("--seq-len", type=_positive_int, default=64)
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    p.set_defaults(run=_run_search)

    p = verbs.add_parser("export", help="export to ONNX or a torch.export program (.pt2) with a parity check "
                                        "against eager")
    add_common(p, device=False)
    p.set_defaults(precision="fp32")  # the API's default: the weights as trained
    p.add_argument("--format", choices=["onnx", "pt2"], default="onnx")
    p.add_argument("--out", required=True, metavar="PATH", help="the artifact to write, e.g. model.onnx")
    p.add_argument("--data", default=None, help="text file or 'synthetic' for the parity batches (default: corpus)")
    p.add_argument("--repeats", type=_positive_int, default=10, help="timed forwards per shape and runner")
    p.set_defaults(run=_run_export)

    p = verbs.add_parser("all", help="the main job: smoke, analyze, a short training run and the AMP benchmark, "
                                     "with an HTML report")
    add_common(p)
    p.add_argument("--out", default="runs/report", metavar="DIR",
                   help="folder for the CSV tables, PNG plots, JSON and index.html (default runs/report)")
    p.add_argument("--data", default=None, help="text file or 'synthetic' (default: the bundled corpus)")
    p.add_argument("--batch-size", type=_positive_int, default=None, help="default 8 (4 with --fast)")
    p.add_argument("--fast", action="store_true", help="shorter runs: fewer steps, repeats and batches")
    p.add_argument("--seed", type=int, default=0, help="initial weights and training data order (default 0)")
    p.set_defaults(run=_run_all)

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
    from pathlib import Path

    out = getattr(args, "out", None)
    if out is not None and args.verb == "export":  # export's --out is the artifact file itself
        writable_file(out, "--out", folder_made_by_run=True)
        out = None
    elif out is not None:
        writable_dir(out, "--out")
    if args.json:
        inside_out = out is not None and Path(out).resolve() in Path(args.json).resolve().parents
        writable_file(args.json, "--json", folder_made_by_run=inside_out)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits 2 on bad arguments
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            _check_outputs(args)
            summary, code = args.run(args)
        if args.json:
            write_json(args.json, summary)
    except ModelForwardError as exc:  # the model itself fails, not the user's input
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except (TierError, ValueError, OSError) as exc:
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code
