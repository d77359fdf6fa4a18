"""Image files the vision tests share, made here (no downloads): a ViT folder save_pretrained wrote with its image
processor, and shapes drawn with Pillow in the ImageFolder layout."""
import random

import pytest
import torch

from tier_utils.data.images import draw_shape


def vit_folder(folder, classes: int = 4, side: int = 32):
    """A ViT classifier of `classes` classes at side x side, and its image processor, written by save_pretrained."""
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=side, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                    num_attention_heads=2, intermediate_size=64, num_labels=classes)
    torch.manual_seed(0)
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    processor = getattr(transformers, "ViTImageProcessorPil", None) or transformers.ViTImageProcessor
    processor(size={"height": side, "width": side}).save_pretrained(folder)
    return folder


def shapes_folder(root, classes=("circle", "square"), per_class: int = 10):
    """Shapes in the ImageFolder layout (a subfolder per class), in mixed sizes and modes (RGB, L, RGBA, P)."""
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            image = draw_shape(c, random.Random(i), side=24 + i % 3 * 8)
            image.convert(("RGB", "L", "RGBA", "P")[i % 4]).save(root / c / f"{i}.png")
    return root
