"""How a setting becomes a command-line option: each settings dataclass field (or, for `all`, a parameter of
`run_all`) gives its flag, type, choices, default and help; `settings_from` turns the parsed options back into the
config. The parser says a wrong option in one line, with the nearest real one."""
from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import json
import sys
import textwrap
import types
import typing
from dataclasses import fields

from .core.errors import LoraError, MemorySettingError
from .core.inputs import whole_number
from .core.memory_settings import LoraSettings, MemorySettings
from .data.chat_formats import ChatOptions
from .models.builtins import DEFAULT_MODEL
from .training.config import TrainConfig


def _optional(convert):
    """A converter for a setting that may be None: 'none' gives None."""
    def parse(value: str):
        return None if value.strip().lower() == "none" else convert(value)
    parse.__name__ = convert.__name__  # argparse names the type in its "invalid int value" message
    return parse


def _or_words(convert, words: tuple[str, ...]):
    """A converter that also takes the setting's words (eval_every's "never"), in any case."""
    def parse(value: str):
        word = value.strip().lower()
        return word if word in words else convert(value)
    parse.__name__ = convert.__name__
    return parse


def _int_list(value: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; the API checks each is >= 1."""
    try:
        return [int(v) for v in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers such as 1,4; got {value!r}") from None


_int_list.metavar = "N,N"


def whole(value: str) -> int:
    """A whole number >= 1, checked while parsing: for an option whose API checks it only after work began."""
    try:
        return whole_number(int(value), "value")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}") from None


_WORDS = {"true": True, "false": False, "none": None}  # as a shell user writes them, in any case


def _model_arg(value: str) -> tuple[str, object]:
    """KEY=VALUE: true/false/none in any case, a Python literal (1e-3, 'x', (1, 2), True), a JSON list
    ([1, true, null]), else the text itself (activation=gelu)."""
    key, sep, raw = value.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. d_model=256), got {value!r}")
    if raw.strip().lower() in _WORDS:
        return key, _WORDS[raw.strip().lower()]
    for parse in (ast.literal_eval, json.loads):
        try:
            return key, parse(raw)
        except (ValueError, SyntaxError):  # json's errors are ValueErrors
            pass
    return key, raw


def _add_option(parser, name: str, default, kind, meta: dict) -> None:
    """One option: `--name` (or meta's flag), its type from `kind`, its default shown in the help."""
    flag = "--" + (meta.get("flag") or name).replace("_", "-")
    text = meta.get("help", "")
    if kind is bool:
        if default:
            # The help says what the switch, on by default, does; "turn off " + it read as one garbled sentence.
            parser.add_argument(f"--no-{flag[2:]}", dest=name, action="store_false",
                                help=f"turn off what is on by default: {text}")
        else:
            parser.add_argument(flag, dest=name, action="store_true", help=text)
        return
    optional = isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind)
    base = next((t for t in typing.get_args(kind) if t is not type(None)), kind) if optional else kind
    if base is bool:  # on, off, or None: left to the API (its help says what it then does)
        parser.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=default, help=text)
        return
    convert = meta.get("type") or _CONVERTERS.get(base) or (base if base in (int, float) else str)
    if meta.get("words"):
        convert = _or_words(convert, meta["words"])
    metavar = None if meta.get("choices") else (
        getattr(convert, "metavar", None) or _METAVAR_NAMES.get(name) or _METAVARS.get(base, "TEXT"))
    if meta.get("words"):
        metavar = "/".join((metavar, *(w.upper() for w in meta["words"])))  # e.g. N/NEVER
    parser.add_argument(flag, dest=name, default=default, type=_optional(convert) if optional else convert,
                        choices=meta.get("choices"), metavar=metavar, help=_with_default(text, default))


def _lora_arg(value: str) -> str | None:
    """'r=8,alpha=16[,bits=4][,targets=q_proj,v_proj]', a rank, or 0/off, checked while parsing (a bad one is
    argparse's one-line error); MemorySettings reads it, as given (--lora off beside --qlora is a contradiction)."""
    try:
        MemorySettings(lora=value)
    except (LoraError, MemorySettingError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


_lora_arg.metavar = "SPEC"

# Types a plain int/float/str conversion won't parse (a plain tuple is names: its class splits the string).
_CONVERTERS = {tuple[int, ...]: _int_list, LoraSettings: _lora_arg}
# What a value looks like, by its type (a tuple setting is a list of names)...
_METAVARS = {int: "N", float: "X", str: "TEXT", tuple: "NAME,NAME"}
# ...or, where the type says too little, by the option's name.
_METAVAR_NAMES = {"data": "SOURCE", "precision": "NAME", "optimizer": "NAME", "device": "NAME", "format": "NAME",
                  "mlflow_uri": "URI", "storage": "URI"}


def _with_default(text: str, default) -> str:
    """The help with its default said once: as given when the text already says it; "(none: X)" read as
    "(default: X)" when none is the default; else "(default: value)" appended."""
    if "(default:" in text:
        return text
    if default is None and "(none: " in text:
        return text.replace("(none: ", "(default: ", 1)
    return f"{text} (default: {_shown(default)})"


def _shown(default) -> str:
    if isinstance(default, (tuple, list)):
        return ",".join(map(str, default)) or "none"
    return "none" if default is None else str(default)


def add_settings(parser, cls, names=None, defaults: dict | None = None) -> None:
    """Options for the fields of settings dataclass `cls` (all, or `names`): flag, type, choices and help
    from the field; the default from the field, or from `defaults` (a verb's own, read from its config:
    search's trials)."""
    kinds = typing.get_type_hints(cls)
    for f in fields(cls):
        if names is None or f.name in names:
            default = (defaults or {}).get(f.name, f.default)
            _add_option(parser, f.name, default, kinds[f.name], f.metadata)


def add_memory(parser, checkpointing: bool = True) -> None:
    """The memory settings' options (MemorySettings' fields): --lora, --base-dtype, --base-bits, --optimizer,
    --checkpointing/--no-checkpointing (`checkpointing`=False leaves it to the verb), and --qlora."""
    add_settings(parser, MemorySettings, ("lora", "base_dtype", "base_bits", "optimizer"))
    parser.add_argument("--qlora", action="store_true", help="QLoRA: LoRA adapters (--lora's, else r=8,alpha=16) "
                                                             "over a 4-bit NF4 base (bitsandbytes)")
    if checkpointing:
        field = MemorySettings.__dataclass_fields__["checkpointing"]
        parser.add_argument("--checkpointing", dest="checkpointing", action=argparse.BooleanOptionalAction,
                            default=field.default, help=_with_default(field.metadata["help"], field.default))
        for old, new in RENAMED.items():
            parser.add_argument(old, dest="checkpointing", action=_Renamed, new=new)


# Flags renamed, old spelling -> new: the old one still works for a release, with a one-line notice on stderr, and
# an unknown flag's "did you mean" names the new one.
RENAMED = {"--activation-checkpointing": "--checkpointing", "--no-activation-checkpointing": "--no-checkpointing"}


class _Renamed(argparse.Action):
    """An old spelling of a renamed on/off flag (hidden from help): sets what the new one sets, and says so."""

    def __init__(self, option_strings, dest, new: str, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is now {self.new}; the old spelling goes in a later release",
              file=sys.stderr)
        setattr(namespace, self.dest, not self.new.startswith("--no-"))


def memory_of(args) -> MemorySettings:
    """The MemorySettings the parsed options say (--qlora: a 4-bit base under --lora's adapters); MemorySettings
    refuses any two that contradict each other, in one line."""
    given = {f.name: getattr(args, f.name) for f in fields(MemorySettings) if hasattr(args, f.name)}
    return MemorySettings.qlora(**given) if getattr(args, "qlora", False) else MemorySettings(**given)


def add_parameters(parser, func, helps: dict) -> None:
    """Options for `func`'s parameters named in `helps` (name -> help, or (help, converter)), their
    defaults and types read from its signature: the API's default is the CLI's."""
    params, kinds = inspect.signature(func).parameters, typing.get_type_hints(func)
    for name, text in helps.items():
        text, convert = text if isinstance(text, tuple) else (text, None)
        default = params[name].default
        _add_option(parser, name, default, kinds.get(name, type(default)), {"help": text, "type": convert})


def settings_from(args, cls, **given):
    """An instance of `cls` from the parsed options that are its fields, and `given`."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)
                  and f.name not in given}, **given)


def add_common(parser: argparse.ArgumentParser, settings=TrainConfig, precision: bool = True, device: bool = True,
               progress: bool = True) -> None:
    """The options every verb shares: model, model kwargs, device, precision, json, progress; the last three
    from the fields of `settings`, the verb's settings class.

    precision=False leaves out --precision, for a verb that takes several (bench's --precisions) or has
    its own default (export); device=False leaves out --device, for a verb that runs on the CPU only;
    progress=False leaves --no-progress out of the help, for a verb that shows no progress bar.
    """
    parser.add_argument("--model", default=DEFAULT_MODEL, metavar="SPEC",
                        help="built-in name, a save_pretrained folder, hf:ORG/NAME (hub), hf:ModelClass (random "
                             "weights), path/file.py:Name, package.module:Name or a tier_utils checkpoint "
                             f"(runs/x/checkpoints/last.pt) (default: {DEFAULT_MODEL})")
    parser.add_argument("--model-arg", action="append", type=_model_arg, default=[], metavar="KEY=VALUE",
                        help="keyword argument for building the model (repeatable), e.g. d_model=256")
    parser.add_argument("--weights", metavar="FILE", help="a .safetensors file or torch state dict to load into "
                                                          "the model")
    parser.add_argument("--tokenizer", metavar="SPEC", help="a tokenizer folder, hf:ORG/NAME or 'bytes' (default: "
                                                            "the model's own; bytes for built-ins)")
    add_settings(parser, settings, [n for n, on in (("precision", precision), ("device", device),
                                                     ("progress", progress)) if on])
    if not progress:  # still accepted, unlisted: scripts (colab_setup.sh) pass it to every verb alike
        parser.add_argument("--no-progress", dest="progress", action="store_false", help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="write a machine-readable summary here")


def model_kwargs(args) -> dict:
    given = {k: getattr(args, k) for k in ("weights", "tokenizer") if getattr(args, k, None) is not None}
    return {**dict(args.model_arg), **given}


def add_data(parser, data: bool = True) -> None:
    """--data (unless the verb made its own) and the columns a table or dataset is read from."""
    if data:
        parser.add_argument("--data", default=None, metavar="SOURCE", help=DATA_HELP)
    # A seq2seq model's source and target columns are the same two settings under the names its users say.
    parser.add_argument("--text-column", "--source-column", "--source-lang", dest="text_column", metavar="NAME",
                        help="a table's or dataset's text column (default: text, sentence, content or document; "
                             "for a seq2seq pair's source: input, source, src, text, document or question; in a "
                             "translation column of dicts, the source language)")
    parser.add_argument("--label-column", "--target-column", "--target-lang", dest="label_column", metavar="NAME",
                        help="its label column, for a classifier (default: label, labels or class; for a seq2seq "
                             "pair's target: target, output, tgt, summary or answer; in a translation column, the "
                             "target language)")


def add_chat(parser) -> None:
    """--data-format, --loss-on, --chat-template: TrainConfig's fields, for every verb that reads chat rows."""
    add_settings(parser, TrainConfig, [f.name for f in fields(ChatOptions)])


def chat_of(args) -> ChatOptions:
    """How the parsed options say chat rows are read; a bad value (a file that is no template): one line."""
    return settings_from(args, ChatOptions)


def data_of(args):
    """The data as the API takes it: a path with columns becomes a DataSource."""
    from .data.userdata import data_source

    return data_source(args.data, args.text_column, args.label_column)


class KeepsValidation(argparse.Action):
    """`all`'s --eval-every and --val-fraction: its report is measured on validation data, which it keeps; one line
    saying so, and how to train without it."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"all keeps its validation (its training and benchmark verdicts are measured on it), so it "
                     f"takes no {option_string}; to train without validation: python -m tier_utils train "
                     "--eval-every never")


class _Help(argparse.HelpFormatter):
    def _split_lines(self, text, width):
        # Wrapped between words only: argparse's default splits "hf-dataset:NAME" after its hyphen.
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, formatter_class=_Help, **kwargs):  # the verbs' parsers are Parsers too
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message):
        # One line, not argparse's usage dump: say what is wrong and where help is.
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        # argparse reports an unknown option from the top parser, which knows no verb's options: hand it to
        # the verb's parser, whose help lists them, with the nearest real option.
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            verbs = next(a for a in self._actions if isinstance(a, argparse._SubParsersAction)).choices
            verb = verbs[parsed.verb]
            options = [o for a in verb._actions for o in a.option_strings]
            near = [RENAMED.get(m, m) for x in extras if x.startswith("-")  # a renamed flag by its new spelling
                    for m in difflib.get_close_matches(x.split("=")[0].replace("_", "-"), options, n=1)]
            verb.error(f"unrecognized arguments: {' '.join(extras)}" + (f"; did you mean {near[0]}?" if near else ""))
        return parsed


DATA_HELP = ("a text file, a folder of .txt, an image folder (a subfolder per class, or a labels.json), a "
             ".csv/.jsonl/.parquet table, hf-dataset:NAME[/CONFIG][:SPLIT] or 'synthetic' (default: the model's "
             "bundled demo: the corpus, or shapes for an image model)")
