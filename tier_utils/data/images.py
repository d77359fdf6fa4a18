"""Images for an image classifier: its processing (the model's image processor, or a declared size, mean and std),
the user's image files decoded with Pillow (data.image_files reads their layout), and the bundled shapes drawn on the
fly.

An image model's `ImageProcessing` stands where a language model's tokenizer does: it turns the user's raw data
into the model's inputs (`pixel_values`, (C, S, S) floats), results name it, and a trained folder saves it.
"""
from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np  # always installed: pandas and matplotlib need it
import torch
from torch.utils.data import Dataset

from ..core.errors import DataError, ModelSpecError, one_line

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
        item = self.images[i]
        if not isinstance(item, (str, Path)):  # a dataset's decoded image
            return {"pixel_values": self.processing([item])[0], "labels": self.labels[i]}
        with opened(item) as image:  # checked before training; a file changed since is named too
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


@contextlib.contextmanager
def opened(path: Path):
    """A Pillow image of `path`, any error opening or decoding it (a truncated file, a decompression bomb: Pillow
    refuses images past its MAX_IMAGE_PIXELS) one line naming the file."""
    from PIL import Image

    try:
        image = Image.open(path)  # UnidentifiedImageError is an OSError
    except (Image.DecompressionBombError, OSError, SyntaxError, ValueError) as exc:
        raise _undecodable(path, exc) from exc
    with image:
        try:
            yield image  # its pixels are decoded where they are first read (a truncated file fails there)
        except (Image.DecompressionBombError, OSError, SyntaxError) as exc:
            raise _undecodable(path, exc) from exc


def _undecodable(path: Path, exc: Exception) -> DataError:
    return DataError(f"{path} is not an image Pillow can decode ({one_line(exc)[:100]}); replace or remove it")
