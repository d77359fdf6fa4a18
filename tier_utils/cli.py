"""`python -m tier_utils <verb>`: argument parsing, exit codes and `--json`; the logic is the API's.

Exit codes: 0 success, 1 a check FAILed, 2 bad input (one line on stderr naming the fix), 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import ast
import sys
import warnings

from .errors import TierError
from .models import DEFAULT_MODEL
from .precision import PRECISION_NAMES, canonical_precision
from .results import write_json


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
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def _model_arg(value: str) -> tuple[str, object]:
    key, sep, raw = value.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. d_model=256), got {value!r}")
    try:
        return key, ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        return key, raw  # a bare string such as activation=gelu


def add_common(parser: argparse.ArgumentParser, batch_size: int | None = None) -> None:
    """The options every verb shares: model, model kwargs, device, precision, batch size, json, progress."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="built-in name, path/file.py:Name, package.module:Name or hf:ModelClass "
                             f"(default {DEFAULT_MODEL})")
    parser.add_argument("--model-arg", action="append", type=_model_arg, default=[], metavar="KEY=VALUE",
                        help="keyword argument for building the model (repeatable), e.g. d_model=256")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda if available)")
    parser.add_argument("--precision", type=_precision, default="auto",
                        help=f"{', '.join(PRECISION_NAMES)} (Lightning/torch spellings accepted; default auto)")
    if batch_size is not None:
        parser.add_argument("--batch-size", type=_positive_int, default=batch_size)
    parser.add_argument("--json", metavar="PATH", help="write a machine-readable summary here")
    parser.add_argument("--no-progress", action="store_true", help="turn progress bars off")


def model_kwargs(args) -> dict:
    return dict(args.model_arg)


def _run_info(args) -> tuple[dict, int]:
    from .info import info

    result = info(args.model, args.precision, args.device, **model_kwargs(args))
    with _wide_pandas():
        print(result.table.to_string(index=False))
    return result.to_json(), 0


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
    return parser


def _warning_line(message, category, filename, lineno, file=None, line=None):
    # A user-facing warning is one line, not Python's file:line + source dump.
    print(f"warning: {message}", file=sys.stderr)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # argparse exits 2 on bad arguments
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line
            summary, code = args.run(args)
    except (TierError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        write_json(args.json, summary)
    return code
