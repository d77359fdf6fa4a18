"""Every tier's figures, rendered and held to readability rules a newcomer would check by eye.

The rules (`problems`): a panel that is drawn has data, a label on both axes and at least two
labelled ticks inside its view on a numeric axis (so the lowest value never sits below the lowest
tick); tick labels
are at least MIN_FONT_PT and at most MAX_TICKS per axis; step and trial axes tick on whole numbers;
colour that carries meaning (several labelled series, bars in several colours) has a legend or a
colour bar; a panel switched off shows an image or says why (no blank panels).
"""
import math

import pytest
import torch
import torch.nn as nn
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.category import StrCategoryLocator
from matplotlib.ticker import FixedLocator
from tiny import tiny

from tier_utils import amp_benchmark, analyze, load_model, search, smoke, train
from tier_utils.core.plotting import MAX_TICKS, MIN_FONT_PT, short_name

WHOLE_NUMBER_AXES = ("step", "trial")


def _labelled_ticks(ax, axis):
    lo, hi = sorted(axis.get_view_interval())
    ticks = zip(axis.get_majorticklocs(), axis.get_ticklabels())
    return [(loc, lab) for loc, lab in ticks if lab.get_visible() and lab.get_text() and lo - 1e-9 <= loc <= hi + 1e-9]


def problems(fig) -> list[str]:
    FigureCanvasAgg(fig).draw()  # lays out ticks and labels as they will be saved
    found = []
    for i, ax in enumerate(fig.axes):
        where = f"panel {i} {ax.get_title()!r}"
        if hasattr(ax, "_colorbar"):
            if not (ax.get_ylabel() or ax.get_xlabel()):
                found.append(f"{where}: colour bar without a label")
            continue
        if not ax.axison:  # an image needs no axes; anything else switched off must say why
            if not ax.images and not any(t.get_text().strip() for t in ax.texts):
                found.append(f"{where}: a blank panel")
            continue
        if not (ax.lines or ax.patches or ax.collections or ax.images):
            found.append(f"{where}: an empty panel")
        for name, axis, label in (("x", ax.xaxis, ax.get_xlabel()), ("y", ax.yaxis, ax.get_ylabel())):
            shared = ax.get_shared_x_axes() if name == "x" else ax.get_shared_y_axes()
            if len(shared.get_siblings(ax)) > 1 and not any(lab.get_visible() for lab in axis.get_ticklabels()):
                continue  # a shared axis labelled on its sibling panel
            if not label.strip():
                found.append(f"{where}: no {name}-axis label")
            ticks = _labelled_ticks(ax, axis)
            categorical = isinstance(axis.get_major_locator(), (FixedLocator, StrCategoryLocator))
            if len(ticks) < 2 and not categorical:
                found.append(f"{where}: {name} axis has {len(ticks)} labelled tick(s) in view")
            if len(ticks) > MAX_TICKS:
                found.append(f"{where}: {len(ticks)} {name} ticks")
            small = [lab.get_text() for _, lab in ticks if lab.get_fontsize() < MIN_FONT_PT]
            if small:
                found.append(f"{where}: {name} tick labels below {MIN_FONT_PT} pt: {small[:3]}")
            if any(w in label.lower() for w in WHOLE_NUMBER_AXES) and axis.get_scale() == "linear":
                fractional = [loc for loc, _ in ticks if not math.isclose(loc, round(loc))]
                if fractional:
                    found.append(f"{where}: {name} axis ({label}) ticks at fractions {fractional[:3]}")
        labelled = {a.get_label() for a in ax.lines + ax.collections + ax.containers
                    if not str(a.get_label()).startswith("_")}
        colours = {tuple(p.get_facecolor()) for p in ax.patches if p.get_visible()}
        if (len(labelled) > 1 or len(colours) > 1) and ax.get_legend() is None and not ax.images:
            found.append(f"{where}: colours carry meaning but there is no legend")
    return found


@pytest.fixture(scope="module")
def model():
    return tiny()


def _figures(result, *names):
    return {name or "overview": result.plot(name) if name else result.plot() for name in names or (None,)}


def test_the_rules_catch_an_unreadable_plot():
    from matplotlib.figure import Figure

    fig = Figure()
    ax_bad, ax_blank = fig.subplots(1, 2)
    ax_bad.plot([0.5, 1.0, 1.5], [1, 2, 3])
    ax_bad.set_xlabel("step")
    ax_bad.set_xticks([0.5, 1.0, 1.5], ["a", "b", "c"], fontsize=5)
    ax_blank.set_axis_off()
    found = "\n".join(problems(fig))
    for expected in ("no y-axis label", "below 7 pt", "fractions", "a blank panel"):
        assert expected in found


def test_short_name_keeps_the_end_of_a_module_path():
    assert short_name("blocks.0.attn") == "blocks.0.attn"
    # the layer index stays: "…self_attn.out_proj" alone would not say which layer
    assert short_name("transformer.encoder.layers.11.self_attn.out_proj") == "…11.self_attn.out_proj"
    assert len(short_name("x" * 80)) <= 22


def test_smoke_and_analysis_plots_are_readable(model):
    tier1 = smoke(model, batch_sizes=(1, 2), seq_lens=(16,), progress=False)
    figures = {f"smoke {k}": f for k, f in _figures(tier1).items()}
    report = analyze(model, batch_size=2, n_batches=1, seq_len=16, progress=False, device="cpu")
    names = [n for n, o in report.outcomes.items() if o.ran]
    assert names, "no analysis ran on the tiny model"
    figures.update({f"analysis {k}": f for k, f in _figures(report, None, *names).items()})
    found = {name: problems(fig) for name, fig in figures.items()}
    assert {name: p for name, p in found.items() if p} == {}


class _PixelPooler(nn.Module):
    """An image classifier without attention: its figures are the gradient saliency map's."""

    image_size = 16

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 4, 3, padding=1), nn.Linear(4, 4)

    def forward(self, pixel_values):
        return self.head(self.conv(pixel_values).relu().mean((2, 3)))


@pytest.mark.parametrize("vision", ["tiny-vit", "cnn"])
def test_image_analysis_plots_are_readable(vision):
    torch.manual_seed(0)
    model = load_model("tiny-vit", image_size=16, patch_size=8, d_model=32, n_layer=1, n_head=2) \
        if vision == "tiny-vit" else _PixelPooler()
    # Six images: the grids' last row holds two.
    report = analyze(model, batch_size=6, n_batches=1, progress=False, device="cpu", precision="fp32")
    figures = {**_figures(report, None, *report.outcomes), **report.more_plots()}
    found = {name: problems(fig) for name, fig in figures.items()}
    assert {name: p for name, p in found.items() if p} == {}


@pytest.mark.filterwarnings("ignore::tier_utils.core.precision.SlowPrecisionWarning")  # fp16 on a CPU without it
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_training_plot_is_readable_and_shows_every_step_of_a_short_run(model, precision):
    result = train(model, precision=precision, max_steps=12, eval_every=6, eval_batches=1, batch_size=2,
                   seq_len=16, warmup_steps=4, progress=False, device="cpu")
    steps = result.history.query("kind == 'step'")["step"].tolist()
    assert steps == list(range(1, 13))  # the warm-up's 4 steps each have their row
    assert problems(result.plot()) == []


def test_benchmark_plot_is_readable_with_and_without_fp16(model):
    for precisions in (("fp32",), ("fp32", "fp16")):
        result = amp_benchmark(model, precisions=precisions, force=True, batch_size=2, seq_len=16, untimed_steps=1,
                               timed_steps=1, repeats=1, accuracy_steps=4, eval_batches=1, progress=False,
                               device="cpu")
        assert problems(result.plot()) == [], precisions


def test_search_plots_are_readable(model):
    study = search(model, n_trials=3, max_steps=4, eval_every=2, eval_batches=1, batch_size=2, seq_len=16,
                   progress=False, device="cpu")
    for kind in ("history", "importances"):
        assert problems(study.plot(kind)) == [], kind


def test_no_plot_changes_global_matplotlib_state(model):
    # Optuna's plots switch pyplot to its ggplot style; every later figure in the kernel would be restyled.
    import matplotlib

    before = dict(matplotlib.rcParams)
    _figures(smoke(model, checks=["gradients", "memory"], batch_sizes=(1,), seq_lens=(16,), progress=False))
    train(model, max_steps=2, eval_every=0, eval_batches=1, batch_size=2, seq_len=16, progress=False,
          device="cpu").plot()
    amp_benchmark(model, precisions=("fp32",), batch_size=2, seq_len=16, untimed_steps=1, timed_steps=1, repeats=1,
                  accuracy_steps=2, eval_batches=1, progress=False, device="cpu").plot()
    study = search(model, n_trials=2, max_steps=2, eval_every=1, eval_batches=1, batch_size=2, seq_len=16,
                   progress=False, device="cpu")
    study.plot("history")
    study.plot("importances")
    changed = {k for k, v in matplotlib.rcParams.items() if str(before.get(k)) != str(v)}
    assert changed == set()
