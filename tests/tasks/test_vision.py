"""Image classification through the tiers: a ViT folder save_pretrained wrote (with its image processor), the
built-in tiny-vit, a hand-written ViT module; trained on an image folder made with Pillow here."""
import warnings

import pytest
import torch
import torch.nn as nn
import vision_files

import tier_utils
from tier_utils import load_model
from tier_utils.core.errors import DataError

TINY_VIT = dict(image_size=16, patch_size=8, d_model=32, n_layer=1, n_head=2)


@pytest.fixture(scope="module")
def vit_folder(tmp_path_factory):
    return vision_files.vit_folder(tmp_path_factory.mktemp("vit"))


@pytest.fixture(scope="module")
def shapes_folder(tmp_path_factory):
    return vision_files.shapes_folder(tmp_path_factory.mktemp("shapes"))


def test_a_vit_folder_loads_with_its_image_processor_and_no_torchvision_warning(vit_folder):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        adapter = tier_utils.adapt(load_model(str(vit_folder)))
    assert adapter.task.name == "image-classification" and adapter.name == "ViTForImageClassification"
    assert (adapter.max_len, adapter.vocab_size, adapter.num_classes) == (32, 3, 4)  # image side, channels
    assert "ViTImageProcessor" in adapter.tokenizer.name
    assert {"channels": 3, "image_size": 32}.items() <= adapter.summary().items()
    assert not [w for w in caught if "torchvision" in str(w.message)]
    batch = adapter.example_batch(2)
    assert batch["pixel_values"].shape == (2, 3, 32, 32) and adapter.batch_logits(batch).shape == (2, 4)


def test_a_vit_folder_fine_tunes_a_new_head_on_an_image_folder_and_saves_its_processor(vit_folder, shapes_folder,
                                                                                       tmp_path):
    with pytest.warns(UserWarning, match="new head starts at random"):
        model = load_model(str(vit_folder), num_labels=2)
    result = tier_utils.train(model, str(shapes_folder), max_steps=4, batch_size=4, eval_batches=1,
                              progress=False, device="cpu", save_hf=str(tmp_path / "out"))
    s = result.summary
    assert s.task == "image-classification" and s.unit == "image" and s.accuracy is not None
    assert "images/s" in result.summary_line() and "stratified" in s.validation
    assert (tmp_path / "out" / "preprocessor_config.json").is_file()
    again = tier_utils.adapt(load_model(str(tmp_path / "out")))
    assert again.num_classes == 2 and "ViTImageProcessor" in again.tokenizer.name
    assert again.model.config.id2label == {0: "circle", 1: "square"}  # the data's class names


def test_smoke_on_a_vit_folder_passes_with_image_probes(vit_folder):
    report = tier_utils.smoke(str(vit_folder), checks=["shapes", "gradients", "stability"], device="cpu",
                              progress=False)
    rows = {c.check: c for c in report.checks}
    assert report.passed, [c for c in report.checks if c.status == "FAIL"]
    assert rows["shapes: batch rows independent"].status == "PASS"
    assert rows["stability: black image (pixels -1)"].status == "PASS"
    assert rows["shapes: padded batch + attention_mask"].status == "SKIP"
    assert "gradients: loss on random pixels" in rows  # an image model's texts say images and pixels


class HandViT(nn.Module):
    """A ViT written by hand: patches, a CLS token, positions, one encoder layer, a head; declares its size only."""

    image_size = 16

    def __init__(self, classes: int = 3):
        super().__init__()
        self.patches = nn.Conv2d(3, 16, 8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, 16) * 0.02)
        self.positions = nn.Parameter(torch.randn(1, 5, 16) * 0.02)
        self.encoder = nn.TransformerEncoderLayer(16, 2, 32, 0.0, batch_first=True)
        self.head = nn.Linear(16, classes)

    def forward(self, pixel_values):
        x = self.patches(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1) + self.positions
        return self.head(self.encoder(x)[:, 0])


def test_a_hand_written_vit_is_recognised_by_pixel_values_and_every_embedding_gets_a_gradient():
    torch.manual_seed(0)
    adapter = tier_utils.adapt(HandViT())
    assert adapter.task.name == "image-classification" and (adapter.max_len, adapter.num_classes) == (16, 3)
    report = tier_utils.smoke(adapter, checks=["shapes", "gradients", "latency"], device="cpu", progress=False,
                              batch_sizes=(2,))
    rows = {c.check: c for c in report.checks}
    assert rows["gradients: every parameter gets one"].status == "PASS"  # patches, CLS, positions and head
    assert "images/s" in rows["latency: B=2 T=16 (median ms)"].detail


def test_a_module_that_declares_the_task_and_no_size_gets_the_stated_default():
    class Pooled(nn.Module):
        task = "image-classification"

        def __init__(self):
            super().__init__()
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            return self.head(x.mean((2, 3)))

    adapter = tier_utils.adapt(Pooled())
    assert adapter.max_len == 224 and "declares no image size" in adapter.max_len_note
    assert adapter.tokenizer.mean == (0.5, 0.5, 0.5)


def test_tiny_vit_trains_on_the_bundled_shapes_and_an_image_folder_fails_a_language_model(shapes_folder):
    torch.manual_seed(0)
    result = tier_utils.train(load_model("tiny-vit", **TINY_VIT), max_steps=6, batch_size=8, eval_batches=2,
                              progress=False, device="cpu")
    assert result.summary.data.startswith("bundled shapes") and result.summary.val_targets == 16
    with pytest.raises(DataError, match="is a folder of images, but the causal-lm task reads text"):
        tier_utils.train("tiny-gpt", str(shapes_folder), max_steps=1, progress=False, device="cpu")


@pytest.mark.slow
def test_tiny_vit_learns_the_bundled_shapes():
    torch.manual_seed(0)
    result = tier_utils.train("tiny-vit", max_steps=150, batch_size=32, lr=3e-3, eval_every=150, progress=False,
                              device="cpu")
    assert result.summary.accuracy > 0.5  # chance: 0.25


def test_analysis_draws_rollout_and_runs_headroom_and_export_takes_pixels(tmp_path):
    torch.manual_seed(0)
    model = load_model("tiny-vit", **TINY_VIT)
    report = tier_utils.analyze(model, analyses=["attention", "headroom"], batch_size=4, n_batches=1, device="cpu",
                                progress=False)
    rows = {(r["analysis"], r["status"]) for r in report.table.to_dict("records")}
    assert ("attention", "PASS") in rows and ("headroom", "PASS") in rows  # the rollout's row
    assert "sequences" not in " ".join(report.table.detail.astype(str))  # its rows are images
    exported = tier_utils.export(model, path=str(tmp_path / "vit.pt2"), format="pt2", repeats=1)
    assert exported.config.inputs == ["pixel_values"] and all(c.status == "PASS" for c in exported.checks)
    # its shapes in images and pixels (they read "(1x8)" and "(4x32)": a token model's batch and length)
    assert exported.config.parity_shapes == ["1 image of 16x16", "4 images of 16x16"]
    assert set(exported.latency_table.index.get_level_values("shape")) == {"1 image of 16x16", "4 images of 16x16"}
    ranks = tier_utils.plan_ranks(model, ranks=(1, 2), device="cpu", progress=False)
    assert "at 16x16 pixels, " in ranks.headline() and "T=" not in ranks.summary_line()
    assert "full fine-tune, AdamW" in ranks.summary_line() and len(ranks.table.columns) <= 12


@pytest.mark.slow
def test_the_amp_benchmark_reports_an_image_classifier_in_images():
    torch.manual_seed(0)
    result = tier_utils.amp_benchmark(load_model("tiny-vit", **TINY_VIT), precisions=("fp32", "bf16"), batch_size=8,
                                      repeats=1, timed_steps=1, accuracy_steps=2, eval_batches=1, progress=False,
                                      device="cpu")
    assert "batch 8 images of 16 x 16" in result.summary_line() and result.config.task == "image-classification"


def test_lora_trains_the_new_head_beside_its_adapters(vit_folder):
    from tier_utils.core.memory_settings import MemorySettings

    with pytest.warns(UserWarning, match="new head starts at random"):
        model = load_model(str(vit_folder), num_labels=3)
    head = model.classifier.weight.detach().clone()
    result = tier_utils.train(model, "synthetic", max_steps=2, batch_size=4, eval_batches=1, progress=False,
                              device="cpu", memory=MemorySettings(lora="r=4,alpha=8"), precision="fp32", lr=1e-2)
    trained = result.model.get_base_model().classifier
    assert not torch.equal(trained.weight.detach(), head)  # the random head learned; frozen, it would not
