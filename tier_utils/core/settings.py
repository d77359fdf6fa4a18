"""How a setting is declared once: `setting()` gives a dataclass field its default, help text, option name,
choices and bounds; `check_fields` checks a config against them with one-line messages; `merge` applies keyword
overrides and refuses an unknown name.

Each tier's config lives beside its tier (TrainConfig, BenchConfig and Thresholds, SearchConfig, SmokeConfig,
AnalysisConfig, ExportConfig, FitConfig, InfoConfig), built from these pieces; the CLI verbs are generated from
their fields, and the widgets and the main job read the same defaults.
"""
from __future__ import annotations

import functools
import math
import operator
import types
import typing
from dataclasses import MISSING, field, fields, replace

from .precision import BASELINE, PRECISIONS, canonical_precision


def setting(default=MISSING, help: str = "", *, flag: str | None = None, choices=None, low=None, above=None,
            below=None, high=None, factory=None, words: tuple[str, ...] = ()):
    """A dataclass field carrying what the CLI and validation need: its help text, an option name when
    it is not the field's (`flag`), `choices`, bounds (`low`/`high` inclusive, `above`/`below` exclusive) and
    `words`: spellings a number field also takes, outside its bounds (eval_every's "never")."""
    meta = {"help": help, "flag": flag, "choices": choices, "low": low, "above": above, "below": below, "high": high,
            "words": words}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def check_fields(config) -> None:
    """Each field against its choices (str fields) and bounds: whole numbers for int fields (True and numpy
    ints refused here, where the message is clear, not deep inside torch later), finite numbers for float ones.
    The types are the real ones (`typing.get_type_hints`), with or without `from __future__ import annotations`."""
    kinds = _kinds(type(config))
    for f in fields(config):
        m, value, (kind, optional) = f.metadata, getattr(config, f.name), kinds[f.name]
        if m.get("choices") and kind is str and not optional and value not in m["choices"]:
            raise ValueError(f"{f.name} must be one of {', '.join(m['choices'])}, got {value!r}")
        if (m.get("low") is None and m.get("above") is None) or (value is None and optional) or \
                value in m.get("words", ()):
            continue
        whole = kind is int
        ok = not isinstance(value, bool) and isinstance(value, int if whole else (int, float)) and math.isfinite(value)
        bounds = {">=": m["low"], ">": m["above"], "<": m["below"], "<=": m["high"]}
        bounds = {op: bound for op, bound in bounds.items() if bound is not None}
        if not (ok and all(_OPERATORS[op](value, bound) for op, bound in bounds.items())):
            said = " and ".join(f"{op} {bound}" for op, bound in bounds.items()) + "".join(
                f" or {word!r}" for word in m.get("words", ()))
            raise ValueError(f"{f.name} must be a {'whole number' if whole else 'number'} {said}, got {value!r}")


@functools.cache
def _kinds(cls) -> dict[str, tuple[object, bool]]:
    """Each field's type without None, and whether None is allowed (`int | None` -> (int, True))."""
    kinds = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        rest = tuple(a for a in args if a is not type(None))
        kinds[name] = (rest[0] if len(rest) == 1 else rest, len(rest) < len(args))
    return kinds


_OPERATORS = {">=": operator.ge, ">": operator.gt, "<": operator.lt, "<=": operator.le}

# The settings most tiers have, declared here once: each tier's config takes its field from these, so every verb
# offers them alike.
def precision_field():
    """`precision`: a name (resolved for the device when the tier starts) or a Precision already decided."""
    return setting("auto", f"auto, {', '.join(PRECISIONS)} (Lightning/torch spellings accepted)")


def device_field():
    """`device`: None (the GPU when there is one), a name or a torch.device, resolved when the tier starts."""
    return setting(None, "cpu, cuda or cuda:N (none: cuda if available)")


def progress_field():
    return setting(True, "progress bars")


def merge(cls, config, overrides: dict, what: str):
    """`config` (an instance of `cls`, a dict of its fields or None: the defaults) with `overrides` applied;
    an unknown name is a ValueError naming `what` settings they are and listing the valid ones."""
    if isinstance(config, dict):
        config, overrides = None, {**config, **overrides}
    if config is not None and not isinstance(config, cls):
        raise ValueError(f"config must be a {cls.__name__} or a dict, got {type(config).__name__}")
    valid = [f.name for f in fields(cls)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(f"unknown {what} setting(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return replace(config or cls(), **overrides)


def precision_list(precisions) -> tuple[str, ...]:
    """Canonical names to benchmark, fp32 first (the baseline, added if missing), duplicates dropped."""
    if isinstance(precisions, str):
        precisions = [p for p in precisions.split(",") if p.strip()]
    if not precisions:
        raise ValueError("no precision to benchmark; list them, e.g. fp32,bf16,fp16")
    names = [BASELINE]
    for p in precisions:
        name = canonical_precision(p)
        if name == "auto":
            raise ValueError("'auto' is not a precision to benchmark; list them, e.g. fp32,bf16,fp16")
        if name not in names:
            names.append(name)
    return tuple(names)


def check_switch(config, name: str) -> None:
    if not isinstance(getattr(config, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(config, name)!r}")
