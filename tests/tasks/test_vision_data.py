"""Image data around a model: the head of a pretrained classifier follows the data's classes, every bad image input
through the CLI (one line, exit 2, nothing written), `datasets` image columns, augmentation, fit's tokens per
image, a timm-style module."""
import json
import random

import pytest
import torch
import vision_files

import tier_utils
from tier_utils.cli import main
from tier_utils.core.paired import Pairing


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A ViT folder of 4 classes, and image folders good and bad."""
    d = tmp_path_factory.mktemp("vision")
    vision_files.vit_folder(d / "vit", classes=4)
    vision_files.shapes_folder(d / "three", classes=("circle", "square", "cross"), per_class=6)
    vision_files.shapes_folder(d / "broken", per_class=3)
    (d / "broken" / "square" / "bad.png").write_bytes(b"\x89PNG not really")
    vision_files.shapes_folder(d / "one", classes=("circle",), per_class=3)
    (d / "listed").mkdir()
    (d / "listed" / "labels.json").write_text(json.dumps({"a.png": "circle", "gone.png": "square"}))
    (d / "notes").mkdir()
    (d / "notes" / "a.txt").write_text("some text " * 50)
    (d / "empty").mkdir()
    (d / "text.txt").write_text("plain text, no images. " * 50)
    return d


def test_a_pretrained_classifier_takes_the_datas_classes_and_trains_the_new_head_under_lora(files, tmp_path):
    from tier_utils.core.memory_settings import MemorySettings

    with pytest.warns(UserWarning, match="new head starts at random"):
        result = tier_utils.train(str(files / "vit"), str(files / "three"), max_steps=2, batch_size=4,
                                  eval_batches=1, progress=False, device="cpu", precision="fp32",
                                  memory=MemorySettings(lora="r=4,alpha=8"), save_hf=str(tmp_path / "out"),
                                  merge=True)
    assert result.model.get_base_model().classifier.out_features == 3  # the folder's head had 4
    assert result.summary.new_head.startswith("classifier: new for the data's 3 classes (circle, cross, square)")
    assert "beside LoRA's adapters" in result.summary.new_head
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["id2label"] == {"0": "circle", "1": "cross", "2": "square"} and saved["label2id"]["square"] == 2
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()
    confusion = result.more_tables()["confusion"]  # the last evaluation's, named by class
    assert list(confusion["true class"]) == ["circle", "cross", "square"] and "predicted cross" in confusion
    assert confusion.iloc[:, 1:].to_numpy().sum() == result.summary.val_targets
    assert [t.get_text() for t in result.plot_confusion().axes[0].get_yticklabels()] == ["circle", "cross", "square"]
    # Against its base (LoRA's adapters off: the new head at its random start), each image named by its file.
    assert "head was untrained" in result.summary.versus_base["base"]
    after = Pairing.from_dict(result.summary.versus_base["pairing"]).after
    assert after.text and all(t.split("/")[0] in ("circle", "cross", "square") and t.endswith(".png")
                              for t in after.text)


def test_top5_accuracy_reaches_the_summary_of_a_classifier_of_more_than_5_classes():
    result = tier_utils.train("tiny-vit", "synthetic", model_kwargs=dict(image_size=16, d_model=16, n_layer=1,
                                                                         num_classes=8),
                              max_steps=1, batch_size=4, eval_batches=2, progress=False, device="cpu")
    assert 0 <= result.summary.top5_accuracy <= 1 and result.summary.top5_accuracy >= result.summary.accuracy
    assert len(result.summary.confusion) == 8 and "top-5 accuracy" in set(result.table.metric)
    assert "perplexity" not in set(result.table.metric)  # a classifier has none: no "nan" row


TINY = ["--model", "tiny-vit", "--model-arg", "image_size=16", "--model-arg", "d_model=16", "--model-arg", "n_layer=1"]
# (args, the one line's needle); {d}: the fixture folder. Each fails before a step, so the table is fast.
BAD = [
    ([*TINY, "--data", "{d}/broken"], "bad.png is not an image Pillow can decode"),
    ([*TINY, "--data", "{d}/listed"], "labels.json names 2 files not in"),
    ([*TINY, "--data", "{d}/one"], "holds one class (circle)"),
    ([*TINY, "--data", "{d}/text.txt"], "not an image folder or a table of image paths"),
    ([*TINY, "--data", "{d}/notes"], "holds text, but an image classifier reads images"),
    ([*TINY, "--data", "{d}/empty"], "holds no images"),
    ([*TINY, "--model-arg", "num_classes=2", "--data", "{d}/three"], "has 3 classes but the model's head has 2"),
    (["--model", "tiny-gpt", "--data", "{d}/three"], "is a folder of images, but the causal-lm task reads text"),
]


@pytest.mark.parametrize("args,needle", BAD, ids=[a[-1].rpartition("/")[2] + f"-{i}" for i, (a, _) in enumerate(BAD)])
def test_bad_image_input_is_one_line_exit_2_and_nothing_written(files, tmp_path, capsys, args, needle):
    out, json_path = tmp_path / "run", tmp_path / "train.json"
    before = sorted(p.name for p in files.rglob("*"))
    code = main(["train", "--out", str(out), *[a.format(d=files) for a in args], "--max-steps", "1", "--device",
                 "cpu", "--no-progress", "--json", str(json_path)])
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and not line.startswith("warning")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], lines
    assert not out.exists() and not json_path.exists()
    assert sorted(p.name for p in files.rglob("*")) == before


def test_a_datasets_dataset_with_image_and_label_columns(tmp_path):
    datasets = pytest.importorskip("datasets")
    from tier_utils.data.images import ImageProcessing, draw_shape
    from tier_utils.tasks import IMAGE_CLASSIFICATION, build_datasets

    shapes = ["circle", "square", "cross"]
    rows = {"img": [draw_shape(shapes[i % 3], random.Random(i)) for i in range(12)],
            "label": [i % 3 for i in range(12)]}
    features = datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(names=shapes)})
    given = datasets.Dataset.from_dict(rows, features=features)
    splits = build_datasets(given, IMAGE_CLASSIFICATION, tokenizer=ImageProcessing(16), val_fraction=0.25)
    assert splits.classes == shapes and (len(splits.train), len(splits.val)) == (9, 3)
    assert splits.train[0]["pixel_values"].shape == (3, 16, 16)
    datasets.DatasetDict({"train": given, "test": given.select(range(3))}).save_to_disk(tmp_path / "saved")
    saved = build_datasets(str(tmp_path / "saved"), IMAGE_CLASSIFICATION, tokenizer=ImageProcessing(16))
    assert saved.validation == "the dataset's own 'test' split" and len(saved.val) == 3
    assert IMAGE_CLASSIFICATION.data_classes(given) == shapes  # what a pretrained head is sized to


def test_augmentation_is_off_by_default_and_crops_and_flips_only_training_images(files):
    from tier_utils.core.errors import DataError
    from tier_utils.data.images import ImageProcessing
    from tier_utils.tasks import IMAGE_CLASSIFICATION, build_datasets

    def read(augment):
        return build_datasets(str(files / "three"), IMAGE_CLASSIFICATION, tokenizer=ImageProcessing(16),
                              val_fraction=0.25, augment=augment)

    plain, augmented = read(False), read(True)
    torch.manual_seed(0)
    draws = [augmented.train[0]["pixel_values"] for _ in range(3)]
    assert plain.train[0]["pixel_values"].equal(plain.train[0]["pixel_values"])  # off: the image as it is
    assert not draws[0].equal(draws[1]) and not draws[1].equal(draws[2]) and draws[0].shape == (3, 16, 16)
    assert augmented.val[0]["pixel_values"].equal(plain.val[0]["pixel_values"])  # validation never augmented
    assert "random resized crop and flip" in augmented.tokenizer
    with pytest.raises(DataError, match="the causal-lm task has no augmentation"):
        build_datasets(None, "causal-lm", augment=True)
    torch.manual_seed(0)
    result = tier_utils.train("tiny-vit", str(files / "three"), model_kwargs=dict(image_size=16, d_model=16, n_layer=1),
                              augment=True, max_steps=2, batch_size=4, eval_batches=1, progress=False, device="cpu")
    assert "random resized crop and flip" in result.summary.tokenizer and result.config.augment


def test_augmented_runs_draw_the_same_crops_with_and_without_checkpoints(files, tmp_path):
    def run(**checkpoints):
        return tier_utils.train("tiny-vit", str(files / "three"), augment=True, max_steps=3, batch_size=4,
                                eval_batches=1, progress=False, device="cpu", precision="fp32",
                                model_kwargs=dict(image_size=16, d_model=16, n_layer=1), **checkpoints)

    plain, checkpointed = run(), run(checkpoint_dir=str(tmp_path / "ckpt"))
    assert plain.history["train_loss"].tolist() == checkpointed.history["train_loss"].tolist()


def test_fit_plans_an_image_model_at_its_resolution_within_15_percent_of_a_real_steps_peak():
    from profile_peak import peak_allocated

    from tier_utils.core.precision import resolve_precision
    from tier_utils.engine.step import TrainStep, make_optimizer

    torch.manual_seed(0)
    adapter = tier_utils.adapt(tier_utils.load_model("tiny-vit", image_size=64, patch_size=4, d_model=32, n_layer=1,
                                                     n_head=2))
    result = tier_utils.fit(adapter, precisions="fp32,bf16", lora=0, optimizers="adamw", checkpointing=False,
                            device="cpu", progress=False)
    assert result.seq_len == 64 and "images of 64 x 64, 257 tokens per image (256 patches + 1)" in result.headline()
    # A token length (all's preset passes one) plans the side the model runs at, and the headline says which.
    assert "images of 64 x 64" in tier_utils.fit(adapter, seq_len=32, precisions="fp32", lora=0, optimizers="adamw",
                                                 checkpointing=False, device="cpu", progress=False).headline()
    batch = adapter.example_batch(8)
    # Held before the step and through it (the patch embedding saves the pixels), as on a device.
    held = sum(t.numel() * t.element_size() for t in [*adapter.model.parameters(), *batch.values()])
    for row in result.configs:
        adapter.model.zero_grad(set_to_none=True)
        step = TrainStep(adapter, resolve_precision(row.precision, "cpu", warn=False),
                         make_optimizer(adapter.model, 1e-3, 0.1))
        _, peak = peak_allocated(lambda s=step: s([batch]))  # the gradients and AdamW's state made in it too
        predicted = row.step_bytes(8, result.seq_len)
        assert abs(predicted / (held + peak) - 1) <= 0.15, (row.precision, predicted, held + peak)


def test_tokens_per_image_come_from_the_model():
    transformers = pytest.importorskip("transformers")
    from tier_utils.tasks.vision import image_tokens

    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=32,
                 patch_size=8)
    assert image_tokens(transformers.ViTForImageClassification(transformers.ViTConfig(**small)), 32) == (16, 1)
    assert image_tokens(transformers.DeiTForImageClassificationWithTeacher(transformers.DeiTConfig(**small)),
                        64) == (64, 2)  # patches at the side asked, its CLS and distillation tokens
    swin = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1], num_heads=[1, 1],
                                   window_size=4)
    adapter = tier_utils.adapt(transformers.SwinForImageClassification(swin))
    assert image_tokens(adapter.model, 32) == (64, 0)  # its first stage's
    assert adapter.task.describe_length(adapter, 32).endswith("a quarter as many at each of its 1 later stages")
    resnet = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1])
    assert image_tokens(transformers.ResNetForImageClassification(resnet), 32) is None  # a CNN has none


class TimmStyle(torch.nn.Module):
    """What timm builds, without timm: `pretrained_cfg` (its input size, mean and std), `num_classes`, a patch
    embedding that knows its patch size, and forward(x) -> logits taking the pixels positionally."""

    def __init__(self, classes: int = 3):
        super().__init__()
        self.pretrained_cfg = {"input_size": (3, 16, 16), "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225)}
        self.num_classes, self.num_prefix_tokens = classes, 1
        self.patch_embed = torch.nn.Conv2d(3, 16, 8, stride=8)
        self.attn = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = torch.nn.Linear(16, classes)

    def forward(self, x):
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        return self.head(self.attn(tokens, tokens, tokens)[0].mean(1))


def test_a_timm_style_module_is_an_image_classifier_by_its_pretrained_cfg(files):
    from tier_utils.tasks.vision import image_tokens

    adapter = tier_utils.adapt(TimmStyle())
    assert adapter.task.name == "image-classification" and (adapter.max_len, adapter.num_classes) == (16, 3)
    assert adapter.tokenizer.mean == (0.485, 0.456, 0.406) and image_tokens(adapter.model, 16) == (4, 1)
    result = tier_utils.train(adapter, str(files / "three"), max_steps=2, batch_size=4, eval_batches=1,
                              progress=False, device="cpu")
    assert result.summary.accuracy is not None and result.summary.unit == "image"


def test_the_notebooks_model_is_resolved_with_its_data_so_a_folders_head_follows_it(files, tmp_path):
    """A ViT folder of 2 classes typed in beside an image folder of 3: the notebooks build the model with
    cfg.build_model(), which sizes the head to the data as the CLI does (it stopped with "a model built in Python
    keeps its head")."""
    from tier_utils.run_config import RunConfig

    two = vision_files.vit_folder(tmp_path / "vit2", classes=2)
    cfg = RunConfig(model=str(two), data=str(files / "three"), device="cpu")
    with pytest.warns(UserWarning, match="new head starts at random"):
        model = cfg.build_model()
    assert model.config.num_labels == 3
    result = tier_utils.train(model, cfg.data, cfg.train_config(max_steps=1, batch_size=4, eval_batches=1,
                                                                progress=False))
    assert result.summary.classes == ["circle", "cross", "square"]


def test_the_panel_takes_an_image_folder_and_the_model_typed_in_sets_the_task(files):
    from tier_utils.run_config import RunConfig
    from tier_utils.widgets import config_panel

    cfg = RunConfig(device="cpu")
    panel = config_panel(cfg)
    assert "bundled corpus" in panel.data_input.placeholder
    panel.model_select.value = "tiny-vit"
    assert "runs as image-classification" in panel.status.value and "max_len" not in cfg.model_arguments()
    assert panel.data_input.placeholder.startswith("empty: the bundled shapes; or an image folder")
    panel.model_select.value = str(files / "vit")  # a save_pretrained folder: its config says the task
    assert "runs as image-classification" in panel.status.value
    panel.model_select.value = "tiny-vit"
    panel.data_input.value = str(files / "three")
    model = cfg.build_model()
    result = tier_utils.train(model, cfg.data, cfg.train_config(max_steps=1, batch_size=4, eval_batches=1,
                                                                progress=False))
    assert result.summary.data == "image folder three (3 classes: circle, cross, square)"
    assert result.summary.task == "image-classification"
