"""Reading the user's data into texts (and labels): a text file, a folder of .txt files, a CSV / JSONL /
Parquet table, or a `datasets` dataset (`hf-dataset:NAME[/CONFIG][:SPLIT]`, or a folder `save_to_disk` wrote).

Each source says how its validation part was made: the dataset's own validation split when it has one,
else a held-out part that shares nothing with training (the text's tail; whole rows of a table).
"""
from __future__ import annotations

import json
import math
import numbers
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.errors import DataError, one_line
from ..core.hub import hub_reachable

HF_DATASET_PREFIX = "hf-dataset:"
TABLE_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# The column names tried, in order, when the user names none.
TEXT_COLUMNS = ("text", "sentence", "content", "document")
LABEL_COLUMNS = ("label", "labels", "class")
# A pair's two sides (a seq2seq task's source and target), and the column of `translation` dicts datasets keep.
SOURCE_COLUMNS = ("input", "source", "src", "text", "document", "question")
TARGET_COLUMNS = ("target", "output", "tgt", "summary", "answer")
TRANSLATION_COLUMN = "translation"
VAL_SPLITS = ("validation", "valid", "val", "test")


@dataclass(frozen=True)
class DataSource:
    """A path or `hf-dataset:` spec with the columns to read (None: the first of TEXT_COLUMNS /
    LABEL_COLUMNS present). A plain string works where these columns are the defaults."""

    path: str
    text_column: str | None = None
    label_column: str | None = None

    def __str__(self) -> str:
        return self.path


def data_source(data, text_column: str | None = None, label_column: str | None = None):
    """The data as tiers take it: a path with columns becomes a DataSource, anything else stays as it is."""
    if text_column is None and label_column is None:
        return data
    if not is_user_source(data) or data is None:
        raise DataError("text_column / label_column (--text-column / --label-column) need a table or dataset as data")
    return DataSource(str(data), text_column, label_column)


@dataclass(frozen=True)
class Reading:
    """Which columns a task reads from a table: its text (the names tried in order) and, where it has one, a second
    column (a classifier's labels, a seq2seq task's targets), each with what to call it and the flag naming it."""

    text: tuple[str, ...] = TEXT_COLUMNS
    second: tuple[str, ...] | None = None
    text_what: str = "text"
    second_what: str = "label"
    text_flag: str = "--text-column"
    second_flag: str = "--label-column"


PLAIN = Reading()  # running text: a language model's
LABELLED = Reading(second=LABEL_COLUMNS)
PAIRS = Reading(SOURCE_COLUMNS, TARGET_COLUMNS, "source", "target", "--source-column", "--target-column")


@dataclass
class Texts:
    """What a source holds: training texts, validation texts (None: the caller holds a part out), labels
    (class ids, or None for language modelling), its name, and how the validation part was made."""

    train: list[str]
    val: list[str] | None
    train_labels: list | None
    val_labels: list | None
    name: str
    validation: str | None = None
    rows: bool = False  # each text is a row of its own (a table's, a dataset's), not part of one running text


def is_user_source(data) -> bool:
    return isinstance(data, (str, Path, DataSource)) and str(data) != "synthetic"


def read_source(data, reading: Reading = PLAIN) -> Texts:
    """The texts (and the second column `reading` names: labels, targets) of a path, `hf-dataset:` spec or
    DataSource."""
    text_column = getattr(data, "text_column", None)
    label_column = getattr(data, "label_column", None)
    text = str(data).strip()
    spec = hf_dataset_spec(data)
    if spec is not None:
        return _read_hf_dataset(spec, text_column, label_column, reading)
    path = Path(text).expanduser()
    if path.is_dir():
        return _read_folder(path, reading)
    if not path.is_file():
        raise DataError(f"data {text!r} not found; give a text file, a folder of .txt files, a .csv/.jsonl/.parquet "
                        "table, hf-dataset:NAME, 'synthetic' or None for the bundled corpus")
    if path.suffix.lower() in TABLE_SUFFIXES:
        return _read_table(path, text_column, label_column, reading)
    if reading.second is not None:
        raise _no_second(reading, "plain text")
    return Texts([_read_text(path)], None, None, None, f"text file {path.name}")


def hf_dataset_spec(data) -> str | None:
    """What `load_hf_dataset` takes for `data` that names a `datasets` dataset (`hf-dataset:NAME...`, or a folder
    save_to_disk wrote); None for any other data."""
    text = str(data).strip()
    if text.startswith(HF_DATASET_PREFIX):
        return text[len(HF_DATASET_PREFIX):]
    path = Path(text).expanduser()
    disk = path.is_dir() and any((path / f).is_file() for f in ("dataset_dict.json", "dataset_info.json"))
    return text if disk else None


def _no_second(reading: Reading, what: str) -> DataError:
    """Running text given where a task reads a second column."""
    if reading.second_what == "label":
        return DataError(f"{what} has no labels for classification; give a .csv/.jsonl/.parquet table with a label "
                         "column (--label-column), (input_ids, labels) tensors or a Dataset")
    return DataError(f"{what} has no {reading.text_what}-{reading.second_what} pairs, which a sequence-to-sequence "
                     f"model needs; give a .csv/.jsonl/.parquet table with {reading.text_what} and "
                     f"{reading.second_what} columns ({reading.text_flag}, {reading.second_flag})")


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    if not raw:
        raise DataError(f"data file {str(path)!r} is empty; give a UTF-8 text file with some text in it")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Still usable, but most likely the wrong file: say so.
        warnings.warn(f"data file {str(path)!r} is not UTF-8 text (first bad byte at offset {exc.start}); "
                      "training on it with undecodable bytes replaced - give a text file if that is not meant",
                      stacklevel=3)
        return raw.decode("utf-8", errors="replace")


def _read_folder(path: Path, reading: Reading) -> Texts:
    files = sorted(path.rglob("*.txt"))
    if not files:
        raise DataError(f"the folder {path} holds no .txt files; give a folder of UTF-8 .txt files or one file")
    if reading.second is not None:
        raise _no_second(reading, "a folder of text files")
    return Texts(["\n\n".join(_read_text(f) for f in files)], None, None, None,
                 f"folder {path.name} ({len(files)} .txt files)")


def _read_table(path: Path, text_column, label_column, reading: Reading) -> Texts:
    columns = read_columns(path)
    texts, label_values = _columns(columns, path.name, text_column, label_column, reading)
    return Texts(texts, None, label_values, None, f"table {path.name} ({len(texts)} rows)", rows=True)


def read_columns(path: Path) -> dict[str, list]:
    """A table's columns as the user wrote its cells: no type guessing ("0044" stays text, "None" and "NA" are
    text, a column of whole numbers with a null keeps its whole numbers); only an empty CSV cell or a JSON null is
    missing (None). One line naming the file and the row where it can't be read."""
    kind = TABLE_SUFFIXES[path.suffix.lower()]
    try:
        if kind == "csv":
            import pandas as pd

            frame = pd.read_csv(path, sep="\t" if path.suffix.lower() == ".tsv" else ",", dtype=str,
                                keep_default_na=False, na_values=[""])
            columns = {str(c): [None if v != v else v for v in frame[c].tolist()] for c in frame.columns}
        elif kind == "json":
            columns = _json_columns(path)
        else:
            import pyarrow.parquet as pq

            columns = {str(c): v for c, v in pq.read_table(path).to_pydict().items()}
    except DataError:
        raise
    except ImportError as exc:
        raise DataError(f"reading {path.name} needs {one_line(exc)}; pip install pyarrow") from exc
    except (ValueError, OSError) as exc:
        raise DataError(f"cannot read {path.name} as {kind} ({one_line(exc)[:160]}); check the file") from exc
    if not columns or not any(columns.values()):
        raise DataError(f"{path.name} has no rows; give a table with a header and at least one row")
    return columns


@dataclass
class Rows:
    """A table's or dataset's rows as dicts of their cells (chat and instruction data: one example per row), the
    source's own validation rows where it has them, its name and how validation was made."""

    train: list[dict]
    val: list[dict] | None
    name: str
    validation: str | None = None
    message_column: str | None = None  # --text-column naming a column of message lists


def read_rows(data, wants=lambda columns: True) -> Rows | None:
    """The rows of a table (its cells read as written: `read_columns`), a `datasets` dataset or a list of dicts,
    where `wants(column names)`; None for any other data (running text: files, folders, strings)."""
    if isinstance(data, list) and data and all(isinstance(r, dict) for r in data):
        return Rows(data, None, f"{len(data)} rows given") if wants(data[0].keys()) else None
    if not is_user_source(data):
        return None
    spec, path = hf_dataset_spec(data), Path(str(data).strip()).expanduser()
    if spec is not None:
        loaded, name, train_split, val_split = load_hf_dataset(spec)
        if not wants(loaded[train_split].column_names):  # a dataset of running text is never turned into rows
            return None
        return Rows(loaded[train_split].to_list(), loaded[val_split].to_list() if val_split else None,
                    f"{name} [{train_split}]", f"the dataset's own {val_split!r} split" if val_split else None)
    if not (path.is_file() and path.suffix.lower() in TABLE_SUFFIXES):
        return None
    columns = read_columns(path)
    if not wants(columns.keys()):
        return None
    rows = [dict(zip(columns, cells)) for cells in zip(*columns.values())]
    return Rows(rows, None, f"table {path.name} ({len(rows)} rows)")


def _json_columns(path: Path) -> dict[str, list]:
    """JSON Lines (one object a line) or a JSON list of objects, with json's own types."""
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path.name} line {n} is not JSON ({exc.msg}); one JSON object a line") from exc
    else:
        rows = json.loads(text)
        rows = rows if isinstance(rows, list) else [rows]
    bad = next((n for n, row in enumerate(rows, 1) if not isinstance(row, dict)), None)
    if bad is not None:
        raise DataError(f"{path.name} row {bad} is a {type(rows[bad - 1]).__name__}, not an object; each row must be "
                        '{"column": value, ...}')
    names = list(dict.fromkeys(k for row in rows for k in row))
    return {str(k): [row.get(k) for row in rows] for k in names}


def _columns(columns: dict, where: str, text_column, label_column, reading: Reading) -> tuple[list[str], list | None]:
    """The text column's strings and the second column's values (a classifier's labels, a pair's targets), rows
    without a usable value in either dropped and counted (`usable_rows`)."""
    if reading is PAIRS and TRANSLATION_COLUMN in columns and text_column not in columns:
        return _translation(columns[TRANSLATION_COLUMN], where, text_column, label_column)
    if reading.second is None and text_column is None and not any(c in columns for c in reading.text) and any(
            c in columns for c in TARGET_COLUMNS):
        raise DataError(f"{where} holds source-target pairs (columns {', '.join(columns)}), which a sequence-to-"
                        "sequence model reads; give this model running text, or name its text with --text-column")
    text_col = _pick(columns, text_column, reading.text, where, reading.text_what, reading.text_flag)
    picked = {text_col: columns[text_col]}
    if reading.second is not None:
        label_col = _pick(columns, label_column, reading.second, where, reading.second_what, reading.second_flag)
        picked[label_col] = columns[label_col]
    kept = usable_rows({c: [text_value(v) for v in values] for c, values in picked.items()}, where)
    texts = kept[text_col]
    return (texts, None) if reading.second is None else (texts, kept[label_col])


def text_value(value) -> str | None:
    """A cell as the text the user wrote, or None where it holds none: missing (an empty cell, a JSON null), blank, or
    not text (a list or dict: never its Python text; a bool). A number in a JSON or Parquet column is its text."""
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and type(value).__name__ != "bool_":
        if isinstance(value, numbers.Integral):
            return str(int(value))
        return str(float(value)) if math.isfinite(value) else None
    return None


def usable_rows(values: dict[str, list], where: str, why: str = "is missing, empty or not text") -> dict[str, list]:
    """The one rule for every reader: a row whose value in any of `values`' columns is None (missing, empty, blank or
    of the wrong type, as the reader decided; `why` says it) is dropped, with one line per column naming it, the count
    and the first row numbers (from 1); no row left is refused in one line."""
    n = len(next(iter(values.values())))
    bad = {c: [i for i, v in enumerate(column) if v is None] for c, column in values.items()}
    dropped = sorted({i for rows in bad.values() for i in rows})
    if len(dropped) == n:
        columns = " and ".join(repr(c) for c, rows in bad.items() if rows)
        raise DataError(f"{where} has no usable row: every row's {columns} {why}; fill it, or name another column")
    for column, rows in bad.items():
        if rows:
            warnings.warn(f"{where}: dropped {len(rows)} of {n} rows whose {column!r} {why} (rows {_first(rows)}); "
                          "the other rows train", stacklevel=4)
    keep = set(range(n)) - set(dropped)
    return {c: [v for i, v in enumerate(column) if i in keep] for c, column in values.items()}


def _first(rows: list[int], shown: int = 5) -> str:
    """The first row numbers (from 1), and how many more."""
    listed = ", ".join(str(i + 1) for i in rows[:shown])
    return listed + (f" and {len(rows) - shown} more" if len(rows) > shown else "")


def _translation(rows: list, where: str, source: str | None, target: str | None) -> tuple[list[str], list[str]]:
    """A `translation` column of {language: text} dicts (as translation datasets keep them): the two languages named;
    a row without both (a null row, a missing language) is dropped by `usable_rows`' rule."""
    languages = sorted({k for row in rows if isinstance(row, dict) for k in row})
    if source is None or target is None:
        raise DataError(f"{where} holds a translation column ({', '.join(languages)}); name its two languages with "
                        "--source-lang and --target-lang (source_column= and target_column= in a DataSource)")
    missing = [lang for lang in (source, target) if lang not in languages]
    if missing:
        raise DataError(f"{where}'s translation column has no {', '.join(missing)}; its languages are "
                        f"{', '.join(languages)}")
    sides = {lang: [text_value(row.get(lang)) if isinstance(row, dict) else None for row in rows]
             for lang in (source, target)}
    kept = usable_rows({f"{TRANSLATION_COLUMN}.{lang}": side for lang, side in sides.items()}, where)
    return kept[f"{TRANSLATION_COLUMN}.{source}"], kept[f"{TRANSLATION_COLUMN}.{target}"]


def _pick(columns: dict, given: str | None, tried: tuple, where: str, what: str, flag: str) -> str:
    if given is not None:
        if given not in columns:
            raise DataError(f"{where} has no column {given!r}; its columns are {', '.join(columns)} (set {flag})")
        return given
    found = next((c for c in tried if c in columns), None)
    if found is None:
        raise DataError(f"{where} has no {what} column ({' / '.join(tried)}); its columns are {', '.join(columns)}: "
                        f"name one with {flag}")
    return found


def _read_hf_dataset(spec: str, text_column, label_column, reading: Reading) -> Texts:
    """NAME[/CONFIG][:SPLIT], or a folder `save_to_disk` wrote. The split trains; the dataset's own
    validation split (validation, valid, val, test) validates, else a part is held out by the caller."""
    loaded, name, train_split, val_split = load_hf_dataset(spec)

    def part(s: str) -> tuple[list[str], list | None]:
        if len(loaded[s]) == 0:
            raise DataError(f"the {s!r} split of {name} is empty; pick another split")
        return _columns({c: loaded[s][c] for c in loaded[s].column_names}, f"{name} [{s}]", text_column,
                        label_column, reading)

    train, train_labels = part(train_split)
    val, val_labels = part(val_split) if val_split else (None, None)
    return Texts(train, val, train_labels, val_labels, f"{name} [{train_split}]",
                 f"the dataset's own {val_split!r} split" if val_split else None, rows=True)


def load_hf_dataset(spec: str):
    """(a DatasetDict, its name, the split that trains, the split that validates or None) for NAME[/CONFIG][:SPLIT]
    or a folder `save_to_disk` wrote."""
    try:
        import datasets
    except ImportError as exc:
        raise DataError("hf-dataset: data needs the datasets package; pip install 'tier_utils[hf]' "
                        "(or datasets)") from exc
    where, _, split = spec.partition(":") if not Path(spec).expanduser().exists() else (spec, "", "")
    if Path(where).expanduser().exists():
        try:
            loaded = datasets.load_from_disk(str(Path(where).expanduser()))
        except (FileNotFoundError, ValueError) as exc:
            raise DataError(f"{where} is not a folder datasets' save_to_disk wrote ({one_line(exc)[:120]})") from exc
        name = f"dataset {Path(where).name}"
    else:
        if not hub_reachable():
            raise DataError(f"cannot load {HF_DATASET_PREFIX}{spec}: the Hugging Face hub is not reachable from here "
                            "(no network); save_to_disk it where there is network and pass the folder")
        loaded = _load_hub_dataset(datasets, where)
        name = f"{HF_DATASET_PREFIX}{where}"
    if isinstance(loaded, datasets.Dataset):
        if split:
            raise DataError(f"{where} is a single split; drop ':{split}'")
        loaded = datasets.DatasetDict({"train": loaded})
    train_split = split or "train"
    if train_split not in loaded:
        raise DataError(f"{name} has no split {train_split!r}; its splits are {', '.join(loaded)}")
    return loaded, name, train_split, next((s for s in VAL_SPLITS if s in loaded and s != train_split), None)


def _load_hub_dataset(datasets, where: str):
    """NAME, ORG/NAME, NAME/CONFIG or ORG/NAME/CONFIG: with one slash both readings are tried."""
    parts = where.split("/")
    tries = [("/".join(parts[:2]), "/".join(parts[2:]))] if len(parts) > 2 else [(where, None)]
    if len(parts) == 2:
        tries.append((parts[0], parts[1]))
    for name, config in tries[:-1]:
        try:
            return datasets.load_dataset(name, config)
        except Exception:  # datasets raises many kinds for "no such dataset / config": try the other reading
            pass
    try:
        return datasets.load_dataset(*tries[-1])
    except Exception as exc:
        raise DataError(f"cannot load {HF_DATASET_PREFIX}{where} ({one_line(exc)[:160]}); check the name and config "
                        "(NAME[/CONFIG][:SPLIT])") from exc


def _whole_number(value) -> int | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) and number.is_integer() else None


def class_ids(values: list, num_classes: int | None, where: str) -> tuple[torch.Tensor, list]:
    """Labels as class ids: whole numbers (as numbers or as their text: "3", "03" and "3.0" are class 3) are used as
    they are, other values (strings) are numbered in sorted order. Ids outside the classifier's classes are refused."""
    whole = [_whole_number(v) for v in values]
    if all(w is not None for w in whole):
        ids, names = whole, None
    else:
        names = sorted({str(v) for v in values})
        ids = [names.index(str(v)) for v in values]
    top, low = max(ids), min(ids)
    if low < 0 or (num_classes is not None and top >= num_classes):
        bad = low if low < 0 else top
        classes = f"{len(names)} label values ({', '.join(names[:6])})" if names else f"class id {bad}"
        raise DataError(f"{where} has {classes}, outside the classifier's {num_classes} classes "
                        f"(0..{num_classes - 1}); build the model with more classes (num_labels / num_classes) or "
                        "fix the labels")
    return torch.tensor(ids, dtype=torch.long), names or []
