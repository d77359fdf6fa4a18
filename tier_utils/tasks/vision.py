"""Image classification: a ViT, DeiT, Swin, ResNet or ConvNeXt classifier (transformers'), or a hand-written module
that declares the task or takes `pixel_values`; (B, C, S, S) pixels in, (B, classes) logits out."""
from __future__ import annotations

from dataclasses import replace

import torch
from torch.utils.data import Subset

from ..core.errors import DataError
from ..data.collate import PadCollator
from ..data.datasets import DataRequest, DataSplits, given_splits, is_tensor_data, split_off
from ..data.image_files import image_layout, is_datasets_object, read_images, stratified_split
from ..data.images import SHAPES, DrawnImages, ImageFiles, ImageProcessing, has_image_processor, load_image_processing
from ..data.userdata import is_user_source
from .base import Task, register_task

# A hand-written image model that declares no size (and has no processor): the size most image classifiers take.
DEFAULT_IMAGE_SIZE = 224
DEMO_IMAGES = (512, 128)  # the bundled shapes: training and validation images, drawn from different seeds
_SIZE_KEYS = ("image_size", "img_size", "input_size")
_CHANNEL_KEYS = ("num_channels", "in_chans", "in_channels", "channels")


class ImageClassification(Task):
    """An image classifier: pixel values in, one class per image. Its length axis is the image's side."""

    name = "image-classification"
    aliases = ("image_classification", "vision")
    auto_class = "AutoModelForImageClassification"
    architectures = ("ForImageClassification",)
    marks = ("pretrained_cfg",)  # a timm model: its forward takes the pixels as its first argument
    has_classes = True
    head_modules = ("classifier",)  # ViT's, Swin's, ConvNeXt's, ResNet's
    takes_new_head = True  # a pretrained backbone fine-tuned on the user's classes: a new head
    input_key = "pixel_values"
    reads_tokens = False
    reads_pixels = True
    unit = "image"
    row = "image"
    random_input = "random pixels"
    # A ViT's activations are mostly saved in fp32 around its bf16 matmuls (layer norms, GELU, the residual stream,
    # the pixels): autocast saved 19.6% on a ViT-Small at 224 x 224 (bench/RESULTS.md), a true figure that 0.40 FAILed.
    amp_memory_reduction = 0.15
    size_names = ("channels", "image_size")
    export_inputs = ("pixel_values",)
    preprocessor_what = "image processor"
    data_hint = ("empty: the bundled shapes; or an image folder (a subfolder per class, or a labels.json), a table "
                 "of image paths and labels, hf-dataset:NAME")
    augments = True  # a random resized crop and flip of each training image (data.images.cropped_and_flipped)
    without_preprocessor = ("resizing to the model's image size with mean and std 0.5; pass tokenizer= (--tokenizer) "
                            "with the folder of the image processor it was trained with")

    def recognizes(self, architecture: str, config=None, params: frozenset = frozenset()) -> bool:
        return super().recognizes(architecture, config, params) or "pixel_values" in params

    def example_inputs(self, adapter, batch: int, length: int, generator: torch.Generator) -> dict:
        """Random normalised pixels at the model's own image size (a ViT's position table fixes it)."""
        side, channels = adapter.max_len, adapter.vocab_size
        return {"pixel_values": torch.randn(batch, channels, side, side, generator=generator)}

    def stability_inputs(self, adapter, length: int) -> dict[str, torch.Tensor]:
        """A black, a saturated and a high-contrast noise image (normalised pixels far past a photo's range)."""
        shape = (2, adapter.vocab_size, adapter.max_len, adapter.max_len)
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(2)).sign() * 10
        return {"black image (pixels -1)": torch.full(shape, -1.0),
                "saturated image (pixels 10)": torch.full(shape, 10.0), "noise of +-10": noise}

    def probe_input(self, adapter, length: int) -> torch.Tensor:
        return torch.zeros(1, adapter.vocab_size, adapter.max_len, adapter.max_len, device=adapter.device)

    def describe_input(self, adapter, length: int) -> str:
        return f"(1, {adapter.vocab_size}, {adapter.max_len}, {adapter.max_len}) batch of pixel values"

    def input_facts(self, model, spec, max_len: int | None) -> tuple[int, int, ImageProcessing, str | None]:
        """(channels, image size, processing, a note where the size is tier_utils' default): the model's processor
        where it has one, else its config's or its own declared size, mean and std (timm's pretrained_cfg too)."""
        config = getattr(model, "config", None)
        timm = getattr(model, "pretrained_cfg", None) or {}
        channels = _first((config, model), _CHANNEL_KEYS) or (timm.get("input_size") or (3,))[0]
        size = max_len or _first((config, model), _SIZE_KEYS) or (timm.get("input_size") or (0, 0, None))[-1]
        processing = load_image_processing(spec, size or DEFAULT_IMAGE_SIZE, channels,
                                           getattr(model, "mean", None) or timm.get("mean"),
                                           getattr(model, "std", None) or timm.get("std"))
        size = size or _processor_size(processing.processor)
        note = None
        if not size:
            size = DEFAULT_IMAGE_SIZE
            note = (f"{type(model).__name__} declares no image size: {size} x {size} (tier_utils' default; declare "
                    "image_size, or pass max_len=N)")
        return int(channels), int(size), replace(processing, size=size), note

    def preprocessor_in(self, folder) -> bool:
        return has_image_processor(folder)

    def batch_words(self, batch: int, length: int) -> str:
        return f"batch {batch} images of {length} x {length}"

    def length_words(self, length: int) -> str:
        return f"{length}x{length} pixels"

    def shape_label(self, adapter, batch: int, length: int) -> str:
        """An image batch is at the model's own side, whatever length the caller planned."""
        return f"{self.rows(batch)} of {adapter.max_len}x{adapter.max_len}"

    def units(self, batch: dict) -> int:
        return len(batch[self.input_key])

    def datasets(self, data, request: DataRequest) -> DataSplits:
        """None: the bundled shapes; "synthetic": random pixels; (pixel_values, labels) tensors; an image folder,
        a table of image paths and labels, or a `datasets` dataset with image and label columns (given, as
        hf-dataset:NAME, or a folder save_to_disk wrote). augment: the decoded ones' training images."""
        given = given_splits(data, request)
        if request.augment and (given is not None or is_tensor_data(data) or data == "synthetic"):
            raise DataError("augment crops and flips images as they are decoded (an image folder, a table, a dataset, "
                            "the bundled shapes), and this data is pixels already; drop augment (--augment)")
        if given is not None:
            return given
        if not isinstance(request.tokenizer, ImageProcessing):  # no model's processing given: seq_len is the side
            request = replace(request, tokenizer=ImageProcessing(request.seq_len))
        processing, classes = request.tokenizer, request.num_classes
        if data is None:
            return self.demo(request)
        if isinstance(data, str) and data == "synthetic":
            return DataSplits(DrawnImages(512, processing, request.seed, classes or 2),
                              DrawnImages(64, processing, request.seed + 1, classes or 2), "synthetic",
                              "synthetic random pixels", processing.name, "a second random draw")
        if is_tensor_data(data):
            return self.tensor_splits(data, request)
        if isinstance(data, list):
            raise DataError("text given to an image classifier; give an image folder (one subfolder per class) or a "
                            "table of image paths and labels, or a language model for the text")
        return _file_splits(read_images(data, classes), request)

    def activation_sizes(self, adapter, length: int, target: int | None = None) -> tuple[tuple, tuple[float, float]]:
        """One and two images at the model's own side (a position table fixes it), the bytes per image split by
        what grows with the resolution: a transformer's patch grid with its area (c*S^2), its extra tokens (CLS,
        DeiT's distillation token) with the side only as an approximation (a*S, exact at S); a CNN's pixels."""
        side = adapter.max_len
        tokens = image_tokens(adapter.model, side)
        patches, extra = tokens if tokens is not None else (side * side, 0)
        return ((1, side), (2, side)), (extra / (patches + extra), patches / (patches + extra))

    def describe_length(self, adapter, length: int) -> str:
        """Fit's words for its length axis: the resolution, and the tokens per image the model makes of it."""
        tokens = image_tokens(adapter.model, length)
        made = "no tokens (no attention: its activations grow with the pixels)" if tokens is None else (
            f"{sum(tokens)} tokens per image ({tokens[0]} patches" + (f" + {tokens[1]}" if tokens[1] else "") + ")"
            + (f", a quarter as many at each of its {_stages(adapter.model) - 1} later stages"
               if _stages(adapter.model) > 1 else ""))
        return f"images of {length} x {length}, {made}"

    def data_classes(self, data) -> list[str] | None:
        """An image folder's, table's or dataset's classes (from its layout; nothing decoded). Not the bundled
        shapes': a pretrained model run on the demo (`all` with no data) keeps its own head."""
        return image_layout(data).classes if is_user_source(data) or is_datasets_object(data) else None

    def collator(self, request: DataRequest) -> PadCollator:
        """Images come out of the model's processing at one size: a batch is stacked, nothing padded."""
        return PadCollator()

    def demo(self, request: DataRequest) -> DataSplits:
        processing = request.tokenizer
        if request.num_classes is not None and request.num_classes < len(SHAPES):
            raise DataError(f"the bundled shapes have {len(SHAPES)} classes but the model has {request.num_classes}; "
                            f"build it with num_labels={len(SHAPES)} (num_classes for a module)")
        train, val, augmented = *DEMO_IMAGES, _training(request)
        return DataSplits(DrawnImages(train, augmented, request.seed), DrawnImages(val, processing, request.seed + 7),
                          "synthetic", f"bundled shapes ({', '.join(SHAPES)}), drawn on the fly", augmented.name,
                          "images drawn from another seed", list(SHAPES))

    def tensor_splits(self, data, request: DataRequest) -> DataSplits:
        if not (isinstance(data, tuple) and len(data) == 2 and data[0].dim() == 4 and data[1].dim() == 1):
            raise DataError("image tensors must be a (pixel_values (N, C, H, W), labels (N,)) pair")
        pixels, labels = data
        if not pixels.is_floating_point() or len(pixels) != len(labels):
            raise DataError("image tensors need float pixel_values and one label per image")
        rows = [{"pixel_values": p, "labels": y} for p, y in zip(pixels, labels.long())]
        train, val = split_off(rows, request.val_fraction, request.seed)
        return DataSplits(train, val, "tensors", "the tensors given", request.tokenizer.name,
                          f"a seeded random {request.val_fraction:.0%} of the images")


def _training(request: DataRequest) -> ImageProcessing:
    """The training images' processing: the model's, after a random resized crop and flip where augment is on."""
    processing = request.tokenizer
    if not request.augment:
        return processing
    return replace(processing, augment=True, name=f"{processing.name} after a random resized crop and flip")


def _file_splits(found, request: DataRequest) -> DataSplits:
    processing, augmented = request.tokenizer, _training(request)
    if found.val_images is not None:
        train = ImageFiles(found.images, found.labels, augmented)
        val = ImageFiles(found.val_images, found.val_labels, processing)
        how = found.val_how
    else:
        keep, held = stratified_split(found.labels, request.val_fraction, request.seed)
        train = Subset(ImageFiles(found.images, found.labels, augmented), keep)
        val = Subset(ImageFiles(found.images, found.labels, processing), held)
        how = f"a seeded stratified {request.val_fraction:.0%} of each class ({len(held)} images)"
    return DataSplits(train, val, "images", found.described(), augmented.name, how, found.classes)


def image_tokens(model, side: int) -> tuple[int, int] | None:
    """(patch tokens, extra tokens) a vision transformer makes of a side x side image: ViT's patches and its CLS,
    DeiT's two (CLS and distillation), Swin's first stage (its patch merging quarters them at each later stage, no
    CLS); None for a model with no attention (a CNN), which has no tokens."""
    modules = list(model.modules())
    if not any(isinstance(m, torch.nn.MultiheadAttention) or "Attention" in type(m).__name__ for m in modules):
        return None
    config, embed = getattr(model, "config", None), getattr(model, "patch_embed", None)
    patch = _first((config, embed), ("patch_size",)) or next(
        (m.stride[0] for m in modules if isinstance(m, torch.nn.Conv2d) and m.stride == m.kernel_size
         and m.stride[0] > 1), 1)
    extra = getattr(model, "num_prefix_tokens", None)  # timm's own count
    if extra is None:  # a position table's rows beyond its own side's patches: ViT's CLS, DeiT's CLS and distiller
        own = ((_first((config, model), _SIZE_KEYS) or side) // patch) ** 2
        rows = next((p.shape[1] for name, p in model.named_parameters() if "pos" in name.lower() and p.dim() == 3
                     and p.shape[0] == 1), own)
        extra = max(0, rows - own)
    return (side // patch) ** 2, int(extra)


def _stages(model) -> int:
    """How many stages the model's patches pass, merged between them (Swin: its config's depths; 0: none said)."""
    return len(getattr(getattr(model, "config", None), "depths", None) or ())


def _first(objs, keys) -> int | None:
    for obj in objs:
        for key in keys:
            value = getattr(obj, key, None) if obj is not None else None
            value = value[0] if isinstance(value, (tuple, list)) and value else value
            if isinstance(value, int) and value > 0:
                return value
    return None


def _processor_size(processor) -> int | None:
    """The side a transformers image processor hands the model: its crop where it crops, else its resize."""
    for size in (getattr(processor, "crop_size", None), getattr(processor, "size", None)):
        size = dict(size) if size is not None and hasattr(size, "keys") else {}
        side = size.get("height") or size.get("shortest_edge")
        if side:
            return int(side)
    return None


IMAGE_CLASSIFICATION = register_task(ImageClassification())
