"""The user's image files: folders (a subfolder per class, or a labels.json), tables of image paths and labels, and
`datasets` image columns, read from their layout into files and class ids, each file decoded once before training.
Hidden files and folders (JupyterLab's .ipynb_checkpoints/, macOS's .DS_Store) are not the user's images."""
from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import DataError, one_line
from ..core.progress import progress_bar
from .images import opened
from .userdata import LABEL_COLUMNS, class_ids, hf_dataset_spec, load_hf_dataset, read_columns, text_value, usable_rows

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LABELS_FILE = "labels.json"
PATH_COLUMNS = ("image", "path", "file", "filename", "image_path")
IMAGE_COLUMNS = ("image", "img", "picture", "photo")  # a `datasets` image column, where no feature types one
VAL_FOLDERS = ("val", "validation")
CHECK_BAR_FILES = 1000  # from this many files, decoding each once before training shows a bar (seconds to minutes)


@dataclass
class LabelledImages:
    """What an image source holds: its images (files, or a `datasets` image column) and class ids, its own
    validation part where it has one, class names."""

    images: Sequence
    labels: list[int]
    classes: list[str]
    name: str
    val_images: Sequence | None = None
    val_labels: list[int] | None = None
    val_how: str = "the folder's own validation split"

    def described(self) -> str:
        """Its name and the classes found (each result names them: an unexpected or missing class shows there)."""
        shown = ", ".join(map(str, self.classes[:12])) + (f", ... ({len(self.classes) - 12} more)"
                                                           if len(self.classes) > 12 else "")
        return f"{self.name} ({len(self.classes)} classes: {shown})"


def is_image_folder(path) -> bool:
    """A folder holding images and no .txt files (what a language model can't read)."""
    folder = Path(str(path)).expanduser()
    texts = (p for p in folder.rglob("*.txt") if not _hidden(p.relative_to(folder)))
    return folder.is_dir() and not any(texts) and any(_images(folder))


def _images(folder: Path) -> list[Path]:
    """The folder's image files, hidden ones and those in hidden folders skipped (JupyterLab's
    .ipynb_checkpoints/, macOS's .DS_Store and ._ files)."""
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
                  and not _hidden(p.relative_to(folder)))


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def read_images(data, num_classes: int | None) -> LabelledImages:
    """An image folder (ImageFolder layout, or images with a labels.json), with its own val/ or validation/ split
    where it has one, or a CSV / JSONL / Parquet table of image path and label; every file checked to decode."""
    found = image_layout(data)
    _check_classes(found, num_classes)
    # Files; a dataset's column decodes as it is read. A bar where decoding them all takes a while.
    files = [p for part in (found.images, found.val_images) if isinstance(part, list) for p in part]
    for p in progress_bar(files, desc="decoding images", unit="image", enabled=len(files) >= CHECK_BAR_FILES):
        _check_decodes(p)
    return found


def image_layout(data) -> LabelledImages:
    """What an image folder or table holds (files, class ids and names), read from its layout alone: nothing is
    decoded, so the class names are known before a model is loaded for them."""
    if is_datasets_object(data):
        return _read_dataset(data if "Dict" in type(data).__name__ else {"train": data}, "the dataset given",
                             "train", None)
    if hf_dataset_spec(data) is not None:
        return _read_dataset(*load_hf_dataset(hf_dataset_spec(data)))
    path = Path(str(data)).expanduser()
    if path.is_file() and path.suffix.lower() in (".csv", ".tsv", ".jsonl", ".json", ".parquet"):
        found = _read_table(path)
    elif path.is_dir():
        split = next((path / v for v in VAL_FOLDERS if (path / v).is_dir()), None)
        found = _read_folder(path / "train" if split is not None and (path / "train").is_dir() else path,
                             exclude=split)
        if split is not None:
            _add_validation(found, _read_folder(split), split)
    elif path.is_file():
        raise DataError(f"{path.name} is not an image folder or a table of image paths, but an image classifier reads "
                        "images; give a folder with one subfolder per class, images with a labels.json, or a "
                        ".csv/.jsonl of path and label")
    else:
        raise DataError(f"data {str(data)!r} not found; give an image folder (one subfolder per class, or images "
                        "with a labels.json) or a .csv/.jsonl/.parquet of image path and label")
    return found


def _read_folder(folder: Path, exclude: Path | None = None) -> LabelledImages:
    if (folder / LABELS_FILE).is_file():
        table = _labels_json(folder / LABELS_FILE)
        missing = sorted(f for f in table if not (folder / f).is_file())
        if missing:
            raise DataError(f"{folder / LABELS_FILE} names {len(missing)} files not in {folder} "
                            f"({', '.join(missing[:3])}); fix labels.json or add the files")
        return _labelled([folder / f for f in table], list(table.values()), f"image folder {folder.name} "
                         f"with {LABELS_FILE}")
    images = [p for p in _images(folder) if exclude is None or exclude not in p.parents]
    if not images:
        if any(folder.rglob("*.txt")):
            raise DataError(f"{folder} holds text, but an image classifier reads images; give an image folder, or a "
                            "language model for the text")
        raise DataError(f"the folder {folder} holds no images ({', '.join(IMAGE_SUFFIXES[:4])}, ...); give a folder "
                        "with one subfolder of images per class")
    values = [p.relative_to(folder).parts[0] if p.parent != folder else "" for p in images]
    empty = sorted(d.name for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")
                   and d != exclude and d.name not in values)
    if empty and "" not in values:
        more = f" (nor do {len(empty) - 1} more: {', '.join(empty[1:4])})" if len(empty) > 1 else ""
        raise DataError(f"the class folder {folder / empty[0]} holds no images{more}; add its images, or remove the "
                        "folder to train without that class")
    return _labelled(images, values, f"image folder {folder.name}")


def _labels_json(path: Path) -> dict:
    """A labels.json: one object mapping each image file to its label; any other shape refused naming the file."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not JSON ({one_line(exc)[:100]}); write one object mapping each image file to "
                        'its label, e.g. {"a.png": "cat", "b.png": "dog"}') from exc
    if not isinstance(table, dict) or not all(isinstance(v, (str, int)) for v in table.values()):
        shape = "an object with non-label values" if isinstance(table, dict) else f"a {type(table).__name__}"
        raise DataError(f"{path} holds {shape}, but labels.json maps each image file to its label (text or a class "
                        'id): write it as {"a.png": "cat", "b.png": "dog"}')
    return table


def _add_validation(found: LabelledImages, val: LabelledImages, split: Path) -> None:
    """The folder's own validation part, its class ids numbered as the training part's."""
    names = [val.classes[i] for i in val.labels]
    unknown = sorted(set(names) - set(found.classes))
    if unknown:
        raise DataError(f"{split} holds classes the training part has not ({', '.join(unknown[:4])}); give both "
                        "parts the same class subfolders")
    found.val_images, found.val_labels = val.images, [found.classes.index(c) for c in names]


def _labelled(images: Sequence, values: list, name: str) -> LabelledImages:
    if "" in values:
        raise DataError(f"{name} has images outside any class subfolder; put each image in its class's subfolder, "
                        f"or list them in a {LABELS_FILE}")
    ids, names = class_ids(values, None, name)
    return LabelledImages(images, ids.tolist(), names or [str(i) for i in range(int(ids.max()) + 1)], name)


def _read_table(path: Path) -> LabelledImages:
    """A table of image paths and labels, its cells read as written and a row without both dropped and counted
    (userdata's one rule: a label "nan" never trains)."""
    columns = read_columns(path)
    column = next((c for c in PATH_COLUMNS if c in columns), None)
    label = next((c for c in LABEL_COLUMNS if c in columns), None)
    if column is None or label is None:
        raise DataError(f"{path.name} has no image path and label columns ({'/'.join(PATH_COLUMNS[:3])} and "
                        f"{'/'.join(LABEL_COLUMNS)}; it has {', '.join(list(columns)[:6])}), but an "
                        "image classifier reads images; give a table of image paths and labels")
    kept = usable_rows({c: [text_value(v) for v in columns[c]] for c in (column, label)}, path.name)
    paths = [Path(p) if Path(p).is_absolute() else path.parent / p for p in kept[column]]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"{path.name} names {len(missing)} image files that are not there ({', '.join(missing[:3])});"
                        " paths are read relative to the table's folder")
    return _labelled(paths, kept[label], f"table {path.name}")


def is_datasets_object(data) -> bool:
    """A `datasets` Dataset or DatasetDict given as data (known without importing datasets)."""
    return type(data).__module__.startswith("datasets.") and hasattr(data, "column_names")


def _read_dataset(loaded, name: str, train_split: str, val_split: str | None) -> LabelledImages:
    """A `datasets` dataset's image and label columns: the image column is the one its features type as an Image
    (else the first of IMAGE_COLUMNS), a ClassLabel names its classes; its own validation split where it has one."""
    if train_split not in loaded:
        raise DataError(f"{name} has no {train_split!r} split; its splits are {', '.join(loaded)}")
    rows = loaded[train_split]
    features = getattr(rows, "features", {}) or {}
    image = next((c for c, f in features.items() if type(f).__name__ == "Image"),
                 next((c for c in IMAGE_COLUMNS if c in rows.column_names), None))
    label = next((c for c in LABEL_COLUMNS if c in rows.column_names), None)
    if image is None or label is None:
        raise DataError(f"{name} has no image and label columns ({'/'.join(IMAGE_COLUMNS[:2])}, an Image feature, "
                        f"and {'/'.join(LABEL_COLUMNS)}; it has {', '.join(rows.column_names[:6])}), but an image "
                        "classifier reads images; give a dataset with an image column and a label column")
    found = _labelled(rows[image], list(rows[label]), f"{name} [{train_split}]")
    found.classes = list(getattr(features.get(label), "names", None) or found.classes)  # a ClassLabel's names
    if val_split is not None:
        values = list(loaded[val_split][label])
        unknown = sorted({str(v) for v in values if not isinstance(v, int)} - set(found.classes))
        if unknown:
            raise DataError(f"the {val_split!r} split of {name} holds labels the training split has not "
                            f"({', '.join(unknown[:4])}); give both splits the same classes")
        found.val_images, found.val_how = loaded[val_split][image], f"the dataset's own {val_split!r} split"
        found.val_labels = [v if isinstance(v, int) else found.classes.index(str(v)) for v in values]
    return found


def _check_classes(found: LabelledImages, num_classes: int | None) -> None:
    if len(set(found.labels)) < 2:
        raise DataError(f"{found.name} holds one class ({found.classes[0] if found.classes else '?'}); a classifier "
                        "needs at least two: add a subfolder of images per class")
    if num_classes is not None and len(found.classes) > num_classes:
        raise DataError(f"{found.name} has {len(found.classes)} classes but the model's head has {num_classes} "
                        f"and a model built in Python keeps its head; build it with {len(found.classes)} "
                        f"(num_classes={len(found.classes)}, --model-arg num_classes=N), or give a save_pretrained "
                        "folder, whose head follows the data")


def _check_decodes(path: Path) -> None:
    """Every pixel decoded once before training (verify() reads a file's structure, not a JPEG's pixels, so a
    truncated one would pass it and fail mid-run)."""
    with opened(path) as image:
        image.load()


def stratified_split(labels: list[int], fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, val) indices: `fraction` of each class held out (at least one of any class with two or more; none
    for 0)."""
    rng, train, val = random.Random(seed), [], []
    for c in sorted(set(labels)):
        members = [i for i, y in enumerate(labels) if y == c]
        rng.shuffle(members)
        k = min(len(members) - 1, max(1, round(len(members) * fraction))) if fraction else 0
        val += members[:k]
        train += members[k:]
    return sorted(train), sorted(val)
