"""Image data: the folder layouts, tables of paths, the validation split, Pillow's modes, and every bad input in one
line."""
import io
import json
import random

import pytest
import torch

from tier_utils.core.errors import DataError
from tier_utils.data.images import ImageProcessing, draw_shape
from tier_utils.tasks import IMAGE_CLASSIFICATION, build_datasets

PROCESSING = ImageProcessing(16)
MODES = ("RGB", "L", "RGBA", "P")  # grayscale, alpha and palette images are converted


def _save(path, shape, i):
    path.parent.mkdir(parents=True, exist_ok=True)
    image = draw_shape(shape, random.Random(i), side=20 + i % 3 * 7)  # mixed sizes
    image.convert(MODES[i % len(MODES)]).save(path)


def image_folder(root, classes=("circle", "square"), per_class=6):
    for c in classes:
        for i in range(per_class):
            _save(root / c / f"{i}.png", c, i)
    return root


def read(data, num_classes=None, val_fraction=0.25):
    return build_datasets(data, IMAGE_CLASSIFICATION, tokenizer=PROCESSING, num_classes=num_classes,
                          val_fraction=val_fraction)


def test_an_image_folder_is_read_by_class_with_a_stratified_split(tmp_path):
    splits = read(image_folder(tmp_path, per_class=8))
    assert splits.classes == ["circle", "square"]
    labels = [int(splits.val[i]["labels"]) for i in range(len(splits.val))]
    assert sorted(labels) == [0, 0, 1, 1]  # a quarter of each class
    assert len(splits.train) == 12 and "stratified" in splits.validation
    item = splits.train[0]
    assert item["pixel_values"].shape == (3, 16, 16) and item["pixel_values"].dtype == torch.float32


def test_a_folders_own_val_split_is_used(tmp_path):
    image_folder(tmp_path / "train")
    image_folder(tmp_path / "val", per_class=2)
    splits = read(tmp_path)
    assert (len(splits.train), len(splits.val)) == (12, 4) and splits.validation == "the folder's own validation split"


def test_labels_json_and_a_table_of_paths(tmp_path):
    for i, shape in enumerate(["circle", "square", "cross"] * 2):
        _save(tmp_path / f"{i}.png", shape, i)
    (tmp_path / "labels.json").write_text(json.dumps({f"{i}.png": s for i, s in
                                                      enumerate(["circle", "square", "cross"] * 2)}))
    assert read(tmp_path, val_fraction=0.4).classes == ["circle", "cross", "square"]
    table = tmp_path / "images.csv"
    table.write_text("path,label\n" + "".join(f"{i}.png,{i % 2}\n" for i in range(6)))
    assert len(read(table).train) == 4


def test_one_channel_processing_converts_colour_images(tmp_path):
    splits = build_datasets(image_folder(tmp_path), IMAGE_CLASSIFICATION, tokenizer=ImageProcessing(8, channels=1))
    assert splits.train[0]["pixel_values"].shape == (1, 8, 8)


@pytest.mark.parametrize("case, message", [
    ("broken", r"broken\.png is not an image Pillow can decode"),
    ("missing", r"labels\.json names 1 files not in"),
    ("one class", r"holds one class \(circle\)"),
    ("empty", r"holds no images"),
    ("text", r"holds text, but an image classifier reads images"),
    ("too many classes", r"has 2 classes but the model's head has 1"),
])
def test_bad_image_data_is_one_line(tmp_path, case, message):
    if case == "broken":
        image_folder(tmp_path)
        (tmp_path / "square" / "broken.png").write_bytes(b"\x89PNG not really")
    elif case == "missing":
        _save(tmp_path / "a.png", "circle", 0)
        (tmp_path / "labels.json").write_text(json.dumps({"a.png": 0, "gone.png": 1}))
    elif case == "one class":
        image_folder(tmp_path, classes=("circle",))
    elif case == "text":
        (tmp_path / "notes.txt").write_text("some text")
    elif case == "too many classes":
        image_folder(tmp_path)
    with pytest.raises(DataError, match=message) as info:
        read(tmp_path, num_classes=1 if case == "too many classes" else None)
    assert "\n" not in str(info.value)


def test_text_for_an_image_model_and_images_for_a_language_model_are_one_line(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("plain text " * 20)
    with pytest.raises(DataError, match="not an image folder or a table of image paths"):
        read(notes)
    with pytest.raises(DataError, match="text given to an image classifier"):
        read(["a sentence", "another"])
    with pytest.raises(DataError, match="is a folder of images, but the causal-lm task reads text"):
        build_datasets(image_folder(tmp_path / "pics"), "causal-lm")


def test_the_bundled_shapes_and_random_pixels_need_no_files():
    demo = read(None)
    assert demo.classes == ["circle", "square", "triangle", "cross"] and demo.source == "synthetic"
    assert demo.train[5]["pixel_values"].equal(demo.train[5]["pixel_values"])  # drawn again, the same image
    noise = read("synthetic", num_classes=3)
    assert noise.train[0]["pixel_values"].shape == (3, 16, 16) and int(noise.train[0]["labels"]) < 3


def test_the_classes_found_are_named_and_hidden_files_skipped(tmp_path):
    image_folder(tmp_path, classes=("circle", "square", "cross"))
    _save(tmp_path / ".ipynb_checkpoints" / "0-checkpoint.png", "circle", 0)  # JupyterLab's, beside the user's
    _save(tmp_path / "circle" / ".ipynb_checkpoints" / "1-checkpoint.png", "circle", 1)
    (tmp_path / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    (tmp_path / "square" / "._0.png").write_bytes(b"\x00\x05\x16\x07 AppleDouble")  # macOS's resource fork
    splits = read(tmp_path)
    assert splits.classes == ["circle", "cross", "square"]
    assert "3 classes: circle, cross, square" in splits.describe().data
    assert len(splits.train) + len(splits.val) == 18


@pytest.mark.parametrize("case, message", [
    ("empty class", r"the class folder \S+zebra holds no images; add its images, or remove the folder"),
    ("truncated", r"truncated\.jpg is not an image Pillow can decode \(image file is truncated"),
    ("bomb", r"bomb\.png is not an image Pillow can decode \(Image size \(\d+ pixels\) exceeds limit"),
    ("labels not json", r"labels\.json is not JSON \(.*\); write one object mapping each image file"),
    ("labels a list", r"labels\.json holds a list, but labels\.json maps each image file to its label"),
    ("labels pairs", r"labels\.json holds a list, but"),
    ("labels of lists", r"labels\.json holds an object with non-label values"),
    ("no labelled row", r"images\.csv has no usable row: every row's .label. is missing"),
])
def test_bad_image_files_are_one_line_naming_the_file(tmp_path, case, message):
    image_folder(tmp_path / "set")
    data = tmp_path / "set"
    if case == "empty class":
        (data / "zebra").mkdir()
    elif case == "truncated":
        buffer = io.BytesIO()
        draw_shape("circle", random.Random(0), side=64).save(buffer, "JPEG")
        (data / "square" / "truncated.jpg").write_bytes(buffer.getvalue()[:-200])
    elif case == "bomb":  # a PNG whose header declares 30000 x 30000: Pillow refuses it at open
        (data / "circle" / "bomb.png").write_bytes(_png_header(30000, 30000))
    elif case.startswith("labels") or case == "no labelled row":
        data = tmp_path / "flat"
        _save(data / "a.png", "circle", 0)
        _save(data / "b.png", "square", 1)
        table = {"labels not json": "{'a.png': 'circle',", "labels a list": json.dumps(["circle", "square"]),
                 "labels pairs": json.dumps([["a.png", "circle"], ["b.png", "square"]]),
                 "labels of lists": json.dumps({"a.png": ["circle"], "b.png": ["square"]})}.get(case)
        if table is None:
            (data / "images.csv").write_text("path,label\na.png,\nb.png,  \n")
            data = data / "images.csv"
        else:
            (data / "labels.json").write_text(table)
    with pytest.raises(DataError, match=message) as info:
        read(data)
    assert "\n" not in str(info.value) and "Traceback" not in str(info.value)


def test_a_file_broken_after_the_check_is_named_where_it_is_read(tmp_path):
    splits = read(image_folder(tmp_path, per_class=4), val_fraction=0)
    for path in (tmp_path / "circle").iterdir():
        path.write_bytes(b"\x89PNG gone")
    with pytest.raises(DataError, match=r"circle/\d\.png is not an image Pillow can decode"):
        [splits.train[i] for i in range(len(splits.train))]


def test_rows_of_a_table_without_a_label_are_dropped_and_counted(tmp_path):
    image_folder(tmp_path, per_class=4)
    rows = [f"{c}/{i}.png,{c}" for c in ("circle", "square") for i in range(4)]
    rows[1], rows[5] = "circle/1.png,", "square/1.png,"  # empty cells pandas reads as NaN: no class "nan"
    table = tmp_path / "images.csv"
    table.write_text("path,label\n" + "\n".join(rows) + "\n")
    with pytest.warns(UserWarning, match=r"images\.csv: dropped 2 of 8 rows whose 'label' is missing, empty or not "
                                         r"text \(rows 2, 6\)"):
        splits = read(table)
    assert splits.classes == ["circle", "square"] and len(splits.train) + len(splits.val) == 6


def _png_header(width: int, height: int) -> bytes:
    """A PNG's signature and IHDR chunk declaring width x height (no pixels: Pillow refuses it before reading them)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
