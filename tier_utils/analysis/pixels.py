"""An image model's pixels in tier 2: the perturbations robustness applies (noise, blur, brightness), gradients with
respect to the pixels (a model without attention's saliency map, integrated gradients), attention rollout over the
patches, and heat maps drawn over the images a person sees.

Pixel values arrive normalised by the model's processing; an image is drawn from them stretched to [0, 1] per image
(its colours kept), so it looks as the model's input does whatever the processor's mean and std were.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pandas as pd
import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # matplotlib is imported when a figure is drawn, not with the package
    from matplotlib.figure import Figure

    from .common import Context

SHOWN = 8  # images a figure draws: the first batch's first ones
PERTURBATIONS = ("noise", "blur", "brightness")
LEVELS = (0.0, 0.1, 0.25, 0.5)
REFERENCE_LEVEL = 0.25  # the level a finding quotes
# Blur's sigma at level 1, as a share of the image side: 1/16, about one patch of a ViT-B/16 at 224 px, so a level
# blurs the same share of any image.
BLUR_SHARE = 1 / 16
UNITS = {"noise": "x each image's pixel std (Gaussian noise)", "blur": "x side/16 (Gaussian blur sigma)",
         "brightness": "x each channel's range added (brightness)"}
# Tokens ahead of the patches that rollout may find (CLS, DeiT's distillation token, a few registers): more than this
# and the tokens are read as no square grid of patches.
MAX_PREFIX = 5
# A logit's change measured against its attributions must span this many of its dtype's rounding steps: the two
# ends' rounding (about one step) is then at most 3% of it, well inside the 10% completeness tolerance.
RESOLVED = 32
TOP_SHARE = 0.1  # a heat map's concentration: the share of its mass on its top 10% of cells
OVERLAY_COLUMNS = ["image", "label", "prediction", "correct", "top_share"]


def perturb(kind: str, pixels: torch.Tensor, level: float, g: torch.Generator) -> torch.Tensor:
    """`pixels` (B, C, H, W) under one perturbation of strength `level`: Gaussian noise of std `level` x each image's
    pixel std; a Gaussian blur of sigma `level` x side / 16; a brightness shift of `level` x each channel's range
    (unclipped: the normalised values have no white to saturate at)."""
    if kind == "noise":
        scale = pixels.float().std(dim=(1, 2, 3), keepdim=True) * level
        return pixels + (torch.randn(pixels.shape, generator=g).to(pixels.device) * scale).to(pixels.dtype)
    if kind == "blur":
        return _blur(pixels, level * BLUR_SHARE * pixels.size(-1))
    if kind == "brightness":
        return pixels + level * (pixels.amax((2, 3), keepdim=True) - pixels.amin((2, 3), keepdim=True))
    raise ValueError(f"unknown pixel perturbation {kind!r}; choose from: {', '.join(PERTURBATIONS)}")


def _blur(pixels: torch.Tensor, sigma: float) -> torch.Tensor:
    """A separable Gaussian blur per channel, edges reflected (no dark border for the model to notice)."""
    radius = min(math.ceil(3 * sigma), min(pixels.shape[-2:]) - 1)  # reflection needs a radius inside the image
    if sigma <= 0 or radius < 1:
        return pixels
    x = torch.arange(-radius, radius + 1, dtype=torch.float32, device=pixels.device)
    kernel = torch.exp(-x ** 2 / (2 * sigma ** 2))
    kernel = kernel / kernel.sum()
    C = pixels.size(1)
    out = F.pad(pixels.float(), (radius, radius, 0, 0), mode="reflect")
    out = F.conv2d(out, kernel.view(1, 1, 1, -1).expand(C, 1, 1, -1), groups=C)
    out = F.pad(out, (0, 0, radius, radius), mode="reflect")
    return F.conv2d(out, kernel.view(1, 1, -1, 1).expand(C, 1, -1, 1), groups=C).to(pixels.dtype)


def pixel_gradients(ctx: Context, pixels: torch.Tensor, target: torch.Tensor | None = None):
    """(d logit / d pixels (B, C, H, W) float32, the logits differentiated (B,), their classes (B,)): each row's
    predicted class unless `target` is given. One backward serves every row: a row's logit reads only its own."""
    leaf = pixels.detach().requires_grad_()
    with torch.enable_grad(), ctx.precision.autocast():
        logits = ctx.adapter.logits(leaf).float()
    target = logits.argmax(-1) if target is None else target
    chosen = logits.gather(1, target[:, None]).squeeze(1)
    (grad,) = torch.autograd.grad(chosen.sum(), leaf)
    return grad.float(), chosen.detach(), target


def integrated_gradients(ctx: Context, image: torch.Tensor, steps: int, chunk: int) -> tuple[torch.Tensor, float, int]:
    """Integrated gradients (Sundararajan et al. 2017) of one image's predicted class along the straight path from
    zeros (the processing's mean colour) to it, by the midpoint rule over `steps`, `chunk` images a forward:
    ((C, H, W) attribution, the share of the logit's change the attributions miss (completeness: 0 when exact; NaN
    where the change is within the logits' rounding), the class)."""
    _, end, target = pixel_gradients(ctx, image[None])
    alphas = torch.cat([torch.zeros(1), (torch.arange(steps) + 0.5) / steps]).to(image.device)
    total, start = torch.zeros(image.shape, device=image.device), None
    for part in alphas.split(chunk):
        grad, along, _ = pixel_gradients(ctx, part.view(-1, 1, 1, 1) * image[None], target.expand(len(part)))
        if start is None:  # the first row is the baseline: its logit is the start, its gradient no step's
            start, grad = float(along[0]), grad[1:]
        total += grad.sum(0)
    attribution = image.float() * total / steps
    change = float(end[0]) - start
    # A change within RESOLVED rounding steps of the logits (bf16 keeps 8 bits) is mostly rounding: no gap.
    resolution = RESOLVED * torch.finfo(ctx.precision.compute_dtype).eps * max(abs(float(end[0])), abs(start))
    gap = abs(float(attribution.sum()) - change) / abs(change) if abs(change) > resolution else math.nan
    return attribution, gap, int(target[0])


def rollout(layers: list[torch.Tensor]) -> torch.Tensor:
    """Attention rollout (Abnar & Zuidema 2020): each layer's head-averaged map (B, T, T), plus the identity for the
    residual path, rows renormalised, multiplied through the layers from the first. (B, T, T): how much each token's
    last representation draws on each input token."""
    T = layers[0].size(-1)
    eye = torch.eye(T)
    rolled = eye.expand_as(layers[0])
    for a in layers:
        a = a.float() + eye
        rolled = (a / a.sum(-1, keepdim=True)) @ rolled
    return rolled


def patch_grid(rolled: torch.Tensor) -> torch.Tensor | None:
    """(B, g, g): what the first token (the CLS token, where the model has one) draws from each patch, or with no
    token ahead of the patches what they draw on average; None where the tokens are no square grid of patches behind
    at most MAX_PREFIX others (a Swin's windows, a model whose tokens are not patches)."""
    T = rolled.size(-1)
    g = math.isqrt(T)
    prefix = T - g * g
    if g < 2 or prefix > MAX_PREFIX:
        return None
    drawn = rolled[:, 0] if prefix else rolled.mean(1)
    return drawn[:, prefix:].reshape(-1, g, g)


@dataclass(frozen=True)
class Overlay:
    """Images, a heat map over each (any grid: it is stretched over the image), and their labels and predictions by
    class name."""

    what: str  # what the heat is, for the figure's title
    pixels: torch.Tensor  # (n, C, H, W) on the CPU
    heats: torch.Tensor | None  # (n, h, w) non-negative, or None: the images alone
    labels: list[str]
    predictions: list[str]

    def frame(self) -> pd.DataFrame:
        """One row per image: its label and prediction, and how concentrated its heat map is (None without one)."""
        shares = [None] * len(self.labels) if self.heats is None else top_share(self.heats).tolist()
        return pd.DataFrame({"image": range(len(self.labels)), "label": self.labels, "prediction": self.predictions,
                             "correct": [a == b for a, b in zip(self.labels, self.predictions)],
                             "top_share": shares}, columns=OVERLAY_COLUMNS)

    def without_heats(self) -> Overlay:
        return Overlay("predictions", self.pixels, None, self.labels, self.predictions)


def overlay(ctx: Context, what: str, batch: dict, predictions: torch.Tensor, heats: torch.Tensor | None) -> Overlay:
    """The first images of `batch` (as many as `heats` has rows, at most SHOWN), named by class."""
    n = min(SHOWN, len(predictions) if heats is None else len(heats))
    name = ctx.class_name
    return Overlay(what, batch["pixel_values"][:n].detach().float().cpu(),
                   None if heats is None else heats[:n].detach().float().cpu(),
                   [name(int(y)) for y in batch["labels"][:n]], [name(int(p)) for p in predictions[:n]])


def top_share(heats: torch.Tensor) -> torch.Tensor:
    """(n,) the share of each heat map's mass on its top TOP_SHARE of cells (TOP_SHARE itself: a flat map)."""
    flat = heats.flatten(1).abs()
    k = max(1, math.ceil(flat.size(1) * TOP_SHARE))
    return flat.sort(1, descending=True).values[:, :k].sum(1) / flat.sum(1).clamp_min(1e-30)


def picture(pixels: torch.Tensor):
    """(H, W, 3) or (H, W) floats in [0, 1]: one image's normalised pixel values stretched back to a picture."""
    x = pixels.float()
    x = (x - x.min()) / (x.max() - x.min()).clamp_min(1e-12)
    return x[0].numpy() if x.size(0) == 1 else x[:3].permute(1, 2, 0).numpy()


def draw(ax, shown: Overlay, i: int) -> None:
    """Image `i`, its heat map over it where there is one, titled by label and prediction (green: right)."""
    pixels = shown.pixels[i]
    ax.imshow(picture(pixels), cmap="gray" if pixels.size(0) == 1 else None)
    if shown.heats is not None:
        H, W = pixels.shape[-2:]
        ax.imshow(shown.heats[i].numpy(), cmap="inferno", alpha=0.55, interpolation="bilinear", vmin=0,
                  extent=(-0.5, W - 0.5, H - 0.5, -0.5))
    right = shown.labels[i] == shown.predictions[i]
    ax.set_title(f"true {shown.labels[i]}\npredicted {shown.predictions[i]}", fontsize=8,
                 color="tab:green" if right else "tab:red")
    ax.axis("off")


def grid_figure(shown: Overlay, fig=None) -> Figure:
    """Every image of `shown` in a grid, four to a row (into `fig`, a Figure or SubFigure, where given)."""
    cols = min(4, len(shown.labels))
    rows = math.ceil(len(shown.labels) / cols)
    if fig is None:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(2.3 * cols, 2.5 * rows + 0.4), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for i, ax in enumerate(axes):
        if i < len(shown.labels):
            draw(ax, shown, i)
        else:
            fig.delaxes(ax)  # no blank panels in the last row
    right = sum(a == b for a, b in zip(shown.labels, shown.predictions))
    fig.suptitle(f"{shown.what}: {right} of {len(shown.labels)} predicted right", fontsize=10)
    return fig
