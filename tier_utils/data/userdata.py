"""Reading the user's data into texts (and labels): a text file, a folder of .txt files, a CSV / JSONL /
Parquet table, or a `datasets` dataset (`hf-dataset:NAME[/CONFIG][:SPLIT]`, or a folder `save_to_disk` wrote).

Each source says how its validation part was made: the dataset's own validation split when it has one,
else a held-out part that shares nothing with training (the text's tail; whole rows of a table).
"""
from __future__ import annotations

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
    import pandas as pd

    kind = TABLE_SUFFIXES[path.suffix.lower()]
    try:
        if kind == "csv":
            frame = pd.read_csv(path, sep="\t" if path.suffix.lower() == ".tsv" else ",")
        elif kind == "json":
            frame = pd.read_json(path, lines=path.suffix.lower() == ".jsonl")
        else:
            frame = pd.read_parquet(path)
    except ImportError as exc:
        raise DataError(f"reading {path.name} needs {one_line(exc)}; pip install pyarrow") from exc
    except (ValueError, OSError) as exc:
        raise DataError(f"cannot read {path.name} as {kind} ({one_line(exc)[:160]}); check the file") from exc
    columns = {str(c): frame[c].tolist() for c in frame.columns}
    texts, label_values = _columns(columns, path.name, text_column, label_column, reading)
    return Texts(texts, None, label_values, None, f"table {path.name} ({len(texts)} rows)", rows=True)


def _columns(columns: dict, where: str, text_column, label_column, reading: Reading) -> tuple[list[str], list | None]:
    """The text column's strings and the second column's values (a classifier's labels, a pair's targets)."""
    if reading is PAIRS and TRANSLATION_COLUMN in columns and text_column not in columns:
        return _translation(columns[TRANSLATION_COLUMN], where, text_column, label_column)
    if reading.second is None and text_column is None and not any(c in columns for c in reading.text) and any(
            c in columns for c in TARGET_COLUMNS):
        raise DataError(f"{where} holds source-target pairs (columns {', '.join(columns)}), which a sequence-to-"
                        "sequence model reads; give this model running text, or name its text with --text-column")
    text_col = _pick(columns, text_column, reading.text, where, reading.text_what, reading.text_flag)
    texts = ["" if v is None else str(v) for v in columns[text_col]]
    if not any(texts):
        raise DataError(f"the column {text_col!r} of {where} is empty; give rows with text")
    if reading.second is None:
        return texts, None
    label_col = _pick(columns, label_column, reading.second, where, reading.second_what, reading.second_flag)
    return texts, list(columns[label_col])


def _translation(rows: list, where: str, source: str | None, target: str | None) -> tuple[list[str], list[str]]:
    """A `translation` column of {language: text} dicts (as translation datasets keep them): the two languages named."""
    languages = sorted({k for row in rows if isinstance(row, dict) for k in row})
    if source is None or target is None:
        raise DataError(f"{where} holds a translation column ({', '.join(languages)}); name its two languages with "
                        "--source-lang and --target-lang (source_column= and target_column= in a DataSource)")
    missing = [lang for lang in (source, target) if lang not in languages]
    if missing:
        raise DataError(f"{where}'s translation column has no {', '.join(missing)}; its languages are "
                        f"{', '.join(languages)}")
    return [str(row.get(source, "")) for row in rows], [str(row.get(target, "")) for row in rows]


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


def class_ids(values: list, num_classes: int | None, where: str) -> tuple[torch.Tensor, list]:
    """Labels as class ids: whole numbers are used as they are, other values (strings) are numbered in
    sorted order. Ids outside the classifier's classes are refused."""
    if all(isinstance(v, (int, bool)) or (isinstance(v, float) and v.is_integer()) for v in values):
        ids, names = [int(v) for v in values], None
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
