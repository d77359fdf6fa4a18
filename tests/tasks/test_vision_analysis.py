"""Tier 2 on image classifiers: attention rollout over the patches, a gradient saliency map for a model without
attention, pixel robustness and pixel attribution, and the report's prediction grid; tiny models, a few seconds."""
import pytest
import torch
import torch.nn as nn
from matplotlib.figure import Figure

import tier_utils
from tier_utils import load_model
from tier_utils.analysis import pixels
from tier_utils.data.images import SHAPES

TINY_VIT = dict(image_size=16, patch_size=8, d_model=32, n_layer=2, n_head=2)
QUICK = dict(batch_size=4, n_batches=1, device="cpu", progress=False, precision="fp32")


class CornerReader(nn.Module):
    """A classifier without attention that reads only the top-left 4 x 4 pixels: its saliency lies there alone."""

    image_size = 16

    def __init__(self):
        super().__init__()
        self.head = nn.Linear(3 * 4 * 4, 4)

    def forward(self, pixel_values):
        return self.head(pixel_values[:, :, :4, :4].flatten(1))


def test_tiny_vit_gets_attention_rollout_over_its_patches_named_by_class():
    torch.manual_seed(0)
    report = tier_utils.analyze(load_model("tiny-vit", **TINY_VIT), analyses="attention", **QUICK)
    rows = {c: s for c, s in zip(report.table.check, report.table.status)}
    assert rows["attention rollout"] == "PASS" and "collapsed heads" in rows
    shown = report.outcomes["attention"].artifacts["overlay"]
    assert shown.heats.shape == (4, 2, 2)  # 16 px in patches of 8: a 2 x 2 grid behind the CLS token
    assert set(report.frames["attention_rollout"].label) <= set(SHAPES)  # the bundled shapes by name
    fig = report.plot("attention")
    assert len(fig.subfigs) == 2 and len(fig.subfigs[0].axes) == 4  # the images above, the maps below


def test_rollout_follows_the_first_token_to_the_patch_it_attends():
    T = 5  # CLS and a 2 x 2 grid
    looks = torch.eye(T)[None].clone()
    looks[0, 0] = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])  # CLS attends patch 2 (row 1, column 0) only
    grid = pixels.patch_grid(pixels.rollout([looks, torch.eye(T)[None]]))
    assert grid.shape == (1, 2, 2) and int(grid.flatten().argmax()) == 2
    assert torch.allclose(pixels.rollout([torch.full((1, T, T), 1 / T)]).sum(-1), torch.ones(1, T))  # rows stay 1
    assert pixels.patch_grid(torch.eye(18)[None]).shape == (1, 4, 4)  # DeiT: CLS and distillation tokens ahead
    assert pixels.patch_grid(torch.eye(24)[None]) is None  # 16 patches behind 8 tokens: no grid


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_a_transformers_vit_gets_its_rollout_through_either_attention(implementation):
    transformers = pytest.importorskip("transformers")
    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=2,
                                    num_attention_heads=2, intermediate_size=32, num_labels=4,
                                    attn_implementation=implementation)
    torch.manual_seed(0)
    report = tier_utils.analyze(transformers.ViTForImageClassification(config), analyses="attention", **QUICK)
    rows = dict(zip(report.table.check, report.table.status))
    assert rows["attention rollout"] == "PASS", report.table.detail.tolist()
    assert "2 layers" in report.table.set_index("check").detail["attention rollout"]


class SoftmaxViT(nn.Module):
    """A ViT whose attention is a softmax written by hand: found by its square scores, whatever the patch count."""

    image_size = 16

    def __init__(self):
        super().__init__()
        self.patches, self.cls = nn.Conv2d(3, 8, 4, stride=4), nn.Parameter(torch.randn(1, 1, 8))
        self.qkv, self.head = nn.Linear(8, 24), nn.Linear(8, 4)

    def forward(self, pixel_values):
        x = self.patches(pixel_values).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(len(x), -1, -1), x], 1)
        q, k, v = self.qkv(x).chunk(3, -1)
        x = x + (q @ k.transpose(1, 2) / 8 ** 0.5).softmax(-1) @ v
        return self.head(x[:, 0])


def test_a_hand_written_softmax_vit_gets_its_rollout_over_a_grid_the_model_decides():
    torch.manual_seed(0)
    report = tier_utils.analyze(SoftmaxViT(), analyses="attention", **QUICK)
    rows = report.table.set_index("check")
    assert rows.status["attention rollout"] == "PASS" and "softmax capture" in rows.detail["collapsed heads"]
    assert report.outcomes["attention"].artifacts["overlay"].heats.shape == (4, 4, 4)  # 16 px in patches of 4


def test_a_model_without_attention_says_so_and_gets_a_gradient_saliency_map():
    torch.manual_seed(0)
    report = tier_utils.analyze(CornerReader(), analyses="attention", **QUICK)
    rows = report.table.set_index("check")
    assert rows.status["attention maps"] == "SKIP" and "CNN" in rows.detail["attention maps"]
    assert rows.status["gradient saliency"] == "PASS"
    heats = report.outcomes["attention"].artifacts["overlay"].heats
    assert heats[:, :4, :4].gt(0).all() and heats[:, 4:].eq(0).all() and heats[:, :, 4:].eq(0).all()
    assert report.frames["saliency"].top_share.tolist() == pytest.approx([1.0] * 4)  # 16 of 256 pixels hold it all
    assert isinstance(report.plot("attention"), Figure) and isinstance(report.plot(), Figure)


def test_pixel_robustness_measures_noise_blur_and_brightness_and_drift_grows_with_strength():
    torch.manual_seed(0)
    report = tier_utils.analyze(load_model("tiny-vit", **TINY_VIT), analyses="robustness", **QUICK)
    df = report.frames["robustness"]
    assert list(df.perturbation.unique()) == list(pixels.PERTURBATIONS)
    assert (df[df.level == 0].agreement == 1.0).all() and (df[df.level == 0].logit_drift == 0).all()
    for _, grp in df.groupby("perturbation"):  # a stronger perturbation moves the logits further
        assert grp.logit_drift.is_monotonic_increasing and grp.logit_drift.iloc[-1] > 0
    assert set(report.table.check) == set(pixels.PERTURBATIONS)
    assert "0.25 x each image's pixel std" in report.table.set_index("check").detail["noise"]


def test_perturbations_keep_the_shape_and_blur_keeps_a_flat_image_flat():
    g = torch.Generator().manual_seed(0)
    flat = torch.full((2, 3, 16, 16), 0.3)
    assert torch.allclose(pixels.perturb("blur", flat, 0.5, g), flat)
    brighter = pixels.perturb("brightness", torch.linspace(0, 1, 2 * 3 * 256).view(2, 3, 16, 16), 0.25, g)
    assert brighter.shape == (2, 3, 16, 16)
    with pytest.raises(ValueError, match="choose from: noise, blur, brightness"):
        pixels.perturb("rotation", flat, 0.1, g)


def test_pixel_attribution_draws_integrated_gradients_that_sum_to_the_logit_change(monkeypatch):
    from tier_utils.analysis import attribution

    monkeypatch.setattr(attribution, "BUDGET_S", 1e6)  # every image, however busy the machine
    torch.manual_seed(0)
    model = load_model("tiny-vit", **TINY_VIT)
    report = tier_utils.analyze(model, analyses="attribution", **QUICK)
    row = report.table.iloc[0]
    frame = report.frames["attribution"]
    assert row.check == "pixel attribution" and row.status == "PASS", row.detail
    assert len(frame) == 4 and (frame.completeness_gap <= 0.1).all()
    assert report.outcomes["attribution"].artifacts["overlay"].heats.shape == (4, 16, 16)
    assert isinstance(report.plot("attribution"), Figure)
    monkeypatch.setattr(attribution, "BUDGET_S", 0.0)  # a model so big one image is all the budget holds
    row = tier_utils.analyze(model, analyses="attribution", **QUICK).table.iloc[0]
    assert "1 of 4 images, as many as fit the 0 s budget" in row.detail


def test_pixel_attribution_of_a_corner_reader_lies_in_its_corner():
    report = tier_utils.analyze(CornerReader(), analyses="attribution", **QUICK)
    heats = report.outcomes["attribution"].artifacts["overlay"].heats
    assert heats[:, 4:].eq(0).all() and heats[:, :, 4:].eq(0).all() and heats.sum() > 0
    assert report.frames["attribution"].completeness_gap.max() < 1e-4  # a linear model: integrated exactly


def test_the_report_shows_an_image_models_predictions_and_attention_overlay(tmp_path):
    from tier_utils.report import write_report

    torch.manual_seed(0)
    report = tier_utils.analyze(load_model("tiny-vit", **TINY_VIT), analyses="attention", **QUICK)
    assert set(report.more_plots()) == {"predictions", "attention_overlay"}
    page = write_report({"analysis": report}, tmp_path).read_text()
    for png in ("analysis.png", "analysis_predictions.png", "analysis_attention_overlay.png"):
        assert (tmp_path / png).is_file() and f"src='{png}'" in page


@pytest.mark.slow
def test_all_on_tiny_vit_writes_the_three_tier_report_with_its_predictions(tmp_path):
    from tier_utils.mainjob import run_all

    result = run_all("tiny-vit", tmp_path, fast=True, progress=False, device="cpu", model_kwargs=TINY_VIT)
    assert result.model_status in ("PASS", "WARN") and {"smoke", "analysis", "train"} <= set(result.results)
    page = result.index.read_text()
    assert "src='analysis_predictions.png'" in page and "src='analysis_attention_overlay.png'" in page


def test_a_logit_change_within_rounding_leaves_completeness_unmeasured_rather_than_failed():
    model = CornerReader()
    with torch.no_grad():  # logits near 1e6 that the pixels move by about 1e-5: far below fp32's rounding there
        model.head.weight.fill_(1e-6)
        model.head.bias.fill_(1e6)
    report = tier_utils.analyze(model, analyses="attribution", **QUICK)
    row = report.table.iloc[0]
    assert row.status == "PASS" and "too little from a mean-colour image for fp32 logits to measure" in row.detail
    assert report.frames["attribution"].completeness_gap.isna().all()
