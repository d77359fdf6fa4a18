"""Images for an image classifier: its processing (the model's image processor, or a declared size, mean and std),
the user's image folders and tables decoded with Pillow, and the bundled shapes drawn on the fly.

An image model's `ImageProcessing` stands where a language model's tokenizer does: it turns the user's raw data
into the model's inputs (`pixel_values`, (C, S, S) floats), results name it, and a trained folder saves it.
"""
from __future__ import annotations

import contextlib
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np  # always installed: pandas and matplotlib need it
import torch
from torch.utils.data import Dataset

from ..core.errors import DataError, ModelSpecError, one_line
from .userdata import LABEL_COLUMNS, class_ids, hf_dataset_spec, load_hf_dataset

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
LABELS_FILE = "labels.json"
PATH_COLUMNS = ("image", "path", "file", "filename", "image_path")
IMAGE_COLUMNS = ("image", "img", "picture", "photo")  # a `datasets` image column, where no feature types one
VAL_FOLDERS = ("val", "validation")
# With no processor and nothing declared: ImageNet-free defaults that map [0, 1] pixels to [-1, 1] (ViT's own).
DEFAULT_MEAN = DEFAULT_STD = (0.5, 0.5, 0.5)
SHAPES = ("circle", "square", "triangle", "cross")  # the bundled demo's classes
# The crop's share of the image's area: torchvision's default starts at 0.08, for ImageNet's large photos; on a
# fine-tuning set of small images (the shapes: one object on a plain ground) crops that small often miss the
# object, and the label goes with it.
AUGMENT_SCALE = (0.25, 1.0)


@dataclass(frozen=True)
class ImageProcessing:
    """How images become `pixel_values`: the model's image processor where it has one, else resize to `size` and
    normalise with `mean` and `std` (per channel, on [0, 1] pixels)."""

    size: int
    channels: int = 3
    mean: tuple[float, ...] = DEFAULT_MEAN
    std: tuple[float, ...] = DEFAULT_STD
    processor: object = None  # transformers' image processor (PIL backend)
    name: str = "resize and normalise"
    augment: bool = False  # a random resized crop and flip of each image before its processing (training's only)

    def __call__(self, images: list) -> torch.Tensor:
        """(N, C, S, S) float pixel values for a list of PIL images of any mode and size."""
        images = [im.convert("L" if self.channels == 1 else "RGB") for im in images]  # grayscale, RGBA, palette
        if self.augment:
            images = [cropped_and_flipped(im) for im in images]
        if self.processor is not None:
            return torch.as_tensor(self.processor(images, return_tensors="pt")["pixel_values"]).float()
        from PIL import Image

        arrays = [np.asarray(im.resize((self.size, self.size), Image.BILINEAR), dtype=np.float32) / 255.0
                  for im in images]
        x = torch.from_numpy(np.stack(arrays))
        x = x.unsqueeze(1) if x.dim() == 3 else x.permute(0, 3, 1, 2)
        mean, std = (torch.tensor(v[:self.channels]).view(1, -1, 1, 1) for v in (self.mean, self.std))
        return (x - mean) / std

    def save(self, folder) -> None:
        """Saved beside the weights as transformers' image processor, so the folder loads with its processing."""
        processor = self.processor
        if processor is None:  # the declared resize and normalisation, as ViT's processor (transformers 5: its PIL one)
            import transformers

            kind = getattr(transformers, "ViTImageProcessorPil", None) or transformers.ViTImageProcessor
            processor = kind(size={"height": self.size, "width": self.size}, image_mean=list(self.mean),
                             image_std=list(self.std))
        processor.save_pretrained(folder)


def cropped_and_flipped(image, scale: tuple[float, float] = AUGMENT_SCALE, ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop box (an area share in `scale` and an aspect ratio in `ratio`, drawn up to ten
    times, else the whole image) then a left-right flip half the time; the processing resizes it back. Drawn from
    torch's RNG, which the run seeds and its loader seeds per worker: reruns draw the same crops, a resume too."""
    w, h = image.size
    for _ in range(10):
        area = w * h * float(torch.empty(1).uniform_(*scale))
        aspect = math.exp(float(torch.empty(1).uniform_(math.log(ratio[0]), math.log(ratio[1]))))
        cw, ch = round(math.sqrt(area * aspect)), round(math.sqrt(area / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = int(torch.randint(0, w - cw + 1, ())), int(torch.randint(0, h - ch + 1, ()))
            image = image.crop((x, y, x + cw, y + ch))
            break
    return image.transpose(0) if float(torch.rand(())) < 0.5 else image  # 0: PIL's FLIP_LEFT_RIGHT


def has_image_processor(folder: Path) -> bool:
    return (Path(folder) / "preprocessor_config.json").is_file()


def load_image_processing(spec, size: int, channels: int, mean=None, std=None) -> ImageProcessing:
    """The processing for a model: its image processor (a folder, `hf:NAME`, or a processor object) through
    transformers' PIL backend, else the declared size, mean and std (stated defaults where none)."""
    declared = ImageProcessing(size, channels, tuple(mean or DEFAULT_MEAN), tuple(std or DEFAULT_STD))
    if spec is None or isinstance(spec, ImageProcessing):
        return spec or declared
    if not isinstance(spec, (str, Path)):  # a processor object
        return ImageProcessing(size, channels, declared.mean, declared.std, spec, type(spec).__name__)
    name = str(spec).removeprefix("hf:")
    import transformers
    from transformers import AutoImageProcessor

    # transformers 5 picks torchvision when installed, else falls back to PIL with a warning on each build: ask for
    # PIL, the one always there; transformers 4 takes use_fast=False for the same (slow = PIL) processor.
    backend = {"backend": "pil"} if int(transformers.__version__.split(".")[0]) >= 5 else {"use_fast": False}
    try:
        processor = AutoImageProcessor.from_pretrained(name, **backend)  # no weights in it: no dtype to decide
    except (OSError, ValueError) as exc:
        raise ModelSpecError(f"cannot load the image processor of {spec} ({one_line(exc)[:160]}); give the folder "
                             "save_pretrained wrote with its preprocessor_config.json") from exc
    return ImageProcessing(size, channels, declared.mean, declared.std, processor, type(processor).__name__)


class ImageFiles(Dataset):
    """Labelled images, decoded as they are read: files with Pillow (each was checked when the set was made), or a
    `datasets` image column (its Image feature decodes each row)."""

    def __init__(self, images: Sequence, labels: list[int], processing: ImageProcessing):
        self.images, self.labels, self.processing = images, torch.as_tensor(labels, dtype=torch.long), processing

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> dict:
        from PIL import Image

        item = self.images[i]
        with Image.open(item) if isinstance(item, (str, Path)) else contextlib.nullcontext(item) as image:
            return {"pixel_values": self.processing([image])[0], "labels": self.labels[i]}

    def example_source(self, i: int) -> str | None:
        """Where example `i` was read from, as the regressed examples name it: its file under its class folder
        (None: a `datasets` row, which has no file)."""
        item = self.images[i]
        return f"{Path(item).parent.name}/{Path(item).name}" if isinstance(item, (str, Path)) else None


class DrawnImages(Dataset):
    """Images drawn on the fly from a seed per index (nothing stored): the bundled shapes, one of SHAPES on a
    plain background at a random place, size and colour, or random noise with random labels (speed-only runs)."""

    def __init__(self, n: int, processing: ImageProcessing, seed: int, classes: int | None = None):
        self.n, self.processing, self.seed, self.classes = n, processing, seed, classes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        rng = random.Random(self.seed * 1_000_003 + i)
        if self.classes is not None:  # noise: the loss means nothing
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
            pixels = torch.randn(self.processing.channels, self.processing.size, self.processing.size, generator=g)
            return {"pixel_values": pixels, "labels": torch.tensor(rng.randrange(self.classes))}
        label = i % len(SHAPES)
        return {"pixel_values": self.processing([draw_shape(SHAPES[label], rng)])[0], "labels": torch.tensor(label)}


def draw_shape(shape: str, rng: random.Random, side: int = 64):
    """One shape, filled in a random colour on a random dark background, at a random place and size."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (side, side), tuple(rng.randrange(0, 80) for _ in range(3)))
    draw, colour = ImageDraw.Draw(image), tuple(rng.randrange(150, 256) for _ in range(3))
    r = rng.randrange(side // 6, side // 3)
    cx, cy = rng.randrange(r, side - r), rng.randrange(r, side - r)
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "square":
        draw.rectangle((cx - r, cy - r, cx + r, cy + r), fill=colour)
    elif shape == "triangle":
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    else:
        w = max(2, r // 3)
        draw.rectangle((cx - r, cy - w, cx + r, cy + w), fill=colour)
        draw.rectangle((cx - w, cy - r, cx + w, cy + r), fill=colour)
    return image


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


def is_image_folder(path) -> bool:
    """A folder holding images and no .txt files (what a language model can't read)."""
    folder = Path(str(path)).expanduser()
    return folder.is_dir() and not any(folder.rglob("*.txt")) and any(_images(folder))


def _images(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


def read_images(data, num_classes: int | None) -> LabelledImages:
    """An image folder (ImageFolder layout, or images with a labels.json), with its own val/ or validation/ split
    where it has one, or a CSV / JSONL / Parquet table of image path and label; every file checked to decode."""
    found = image_layout(data)
    _check_classes(found, num_classes)
    for files in (found.images, found.val_images):
        for p in files if isinstance(files, list) else ():  # files; a dataset's column decodes as it is read
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
        table = json.loads((folder / LABELS_FILE).read_text())
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
    return _labelled(images, [p.relative_to(folder).parts[0] if p.parent != folder else "" for p in images],
                     f"image folder {folder.name}")


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
    import pandas as pd

    kind = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet"}.get(path.suffix.lower(), "json")
    frame = (pd.read_csv(path, sep="\t" if path.suffix.lower() == ".tsv" else ",") if kind == "csv" else
             pd.read_parquet(path) if kind == "parquet" else pd.read_json(path, lines=path.suffix.lower() == ".jsonl"))
    column = next((c for c in PATH_COLUMNS if c in frame.columns), None)
    label = next((c for c in LABEL_COLUMNS if c in frame.columns), None)
    if column is None or label is None:
        raise DataError(f"{path.name} has no image path and label columns ({'/'.join(PATH_COLUMNS[:3])} and "
                        f"{'/'.join(LABEL_COLUMNS)}; it has {', '.join(map(str, frame.columns[:6]))}), but an "
                        "image classifier reads images; give a table of image paths and labels")
    paths = [Path(p) if Path(p).is_absolute() else path.parent / p for p in frame[column].astype(str)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"{path.name} names {len(missing)} image files that are not there ({', '.join(missing[:3])});"
                        " paths are read relative to the table's folder")
    return _labelled(paths, frame[label].tolist(), f"table {path.name}")


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
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.verify()  # reads the whole file's structure without decoding its pixels
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{path} is not an image Pillow can decode ({one_line(exc)[:100]}); replace or remove "
                        "it") from exc


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
