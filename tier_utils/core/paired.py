"""Per-example scores and the paired verdict between two sets of them: a fine-tune against its base, one run against
another, on the same validation examples.

`ExampleScores` is a table keyed by example index with named metrics (a metric an example has no score for is NaN:
generation scores only a few sources), so any task plugs in by naming its metrics. `paired_verdict` judges one metric
by the mean of the paired differences and a seeded bootstrap interval (scipy.stats.bootstrap, paired, percentile:
BCa returns NaN when every difference is equal); `Pairing` holds every metric's verdict and the examples that
got worse most, and draws each example's score before against after.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd

MIN_PAIRS = 30  # fewer paired examples: the interval only, no verdict (a bootstrap of a few is no test)
CONFIDENCE = 0.95
RESAMPLES = 2000
SHOWN_WORST = 5  # the examples that got worse most, shown with their text
# Where a larger score is worse; every other metric (accuracies, chrF, exact match) is better larger.
LOWER_IS_BETTER = frozenset({"loss"})
NO_DIFFERENCE, IMPROVED, REGRESSED = "no measurable difference", "improved", "regressed"


@dataclass
class ExampleScores:
    """Scores by example: `index` (the example's position in the validation split), `metrics` (name -> one float
    per example, NaN where unscored) and `text` (what the example is, e.g. its decoded input; None: an image)."""

    index: list[int]
    metrics: dict[str, list[float]]
    text: list[str | None] = field(default_factory=list)

    @classmethod
    def merged(cls, parts: list[ExampleScores]) -> ExampleScores:
        """Several ranks' shares as one table, by example index (the ranks hold disjoint examples)."""
        names = list(dict.fromkeys(name for p in parts for name in p.metrics))
        rows = sorted((i, k, p) for p in parts for k, i in enumerate(p.index))
        return cls([i for i, _, _ in rows], {n: [_at(p.metrics.get(n), k) for _, k, p in rows] for n in names},
                   [_at(p.text, k, None) for _, k, p in rows])

    def with_metrics(self, index: list[int], metrics: dict[str, list[float]]) -> ExampleScores:
        """These scores with more metrics for some of the examples (a generating task's on its few sources)."""
        where = {i: k for k, i in enumerate(self.index)}
        extra = {n: [math.nan] * len(self.index) for n in metrics}
        for k, i in enumerate(index):
            if i in where:
                for n, values in metrics.items():
                    extra[n][where[i]] = float(values[k])
        return ExampleScores(self.index, {**self.metrics, **extra}, self.text)

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame({"example": self.index, **self.metrics,
                             "text": self.text or [None] * len(self.index)})

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ExampleScores:
        # JSON keeps an unscored example's NaN as null
        return cls(list(d["index"]), {k: [math.nan if v is None else float(v) for v in vs]
                                      for k, vs in d["metrics"].items()}, list(d.get("text") or []))


def _at(values, k: int, missing=math.nan):
    return values[k] if values is not None and k < len(values) else missing


@dataclass
class Verdict:
    """One metric's paired verdict: after minus before, its mean and bootstrap interval, the share of the examples
    that got worse, and the verdict (`too_few`: under MIN_PAIRS, the interval only)."""

    metric: str
    n: int
    before: float
    after: float
    difference: float
    low: float
    high: float
    verdict: str
    worse_share: float
    too_few: bool  # under MIN_PAIRS pairs that differ (identical scores are no measurable difference at any n)

    def describe(self) -> str:
        """"loss −0.42 [−0.47, −0.38], improved (n=320, 3% of examples worse)"."""
        if self.n == 0:
            return f"{self.metric}: no example scored by both"
        said = f"fewer than {MIN_PAIRS} pairs, interval only" if self.too_few else self.verdict
        return (f"{self.metric} {_signed(self.difference)} [{_signed(self.low)}, {_signed(self.high)}], {said} "
                f"(n={self.n}, {self.worse_share:.0%} of examples worse)")


def _signed(x: float) -> str:
    return f"{x:+.3g}".replace("-", "\u2212")


def paired_verdict(metric: str, before, after, seed: int = 0) -> Verdict:
    """`after` against `before` (the same examples, in order; NaN pairs dropped): "improved" or "regressed" where
    the bootstrap interval of the mean difference lies wholly on one side of zero, else "no measurable
    difference"; identical scores are no measurable difference whatever their number."""
    before, after = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    keep = ~(np.isnan(before) | np.isnan(after))
    before, after = before[keep], after[keep]
    n = len(before)
    if n == 0:
        return Verdict(metric, 0, math.nan, math.nan, math.nan, math.nan, math.nan, NO_DIFFERENCE, 0.0, True)
    diff = after - before
    sign = -1.0 if metric in LOWER_IS_BETTER else 1.0  # a gain's sign
    low, high = _interval(before, after, seed) if n > 1 and np.ptp(diff) > 0 else (diff.mean(), diff.mean())
    identical, verdict = bool(np.all(diff == 0)), NO_DIFFERENCE
    if not identical and (low > 0 or high < 0):
        verdict = IMPROVED if (low if sign > 0 else -high) > 0 else REGRESSED
    return Verdict(metric, n, float(before.mean()), float(after.mean()), float(diff.mean()), float(low), float(high),
                   verdict, float(np.mean(sign * diff < 0)), n < MIN_PAIRS and not identical)


def _interval(before: np.ndarray, after: np.ndarray, seed: int) -> tuple[float, float]:
    from scipy.stats import bootstrap

    ci = bootstrap((before, after), lambda b, a, axis: np.mean(a - b, axis=axis), paired=True, vectorized=True,
                   method="percentile", confidence_level=CONFIDENCE, n_resamples=RESAMPLES,
                   rng=np.random.default_rng(seed)).confidence_interval
    return float(ci.low), float(ci.high)


@dataclass
class Pairing:
    """Two score tables on the same examples (`before`: the base or run A; `after`: the fine-tune or run B), each
    metric's verdict, and the examples that got worse most by the first metric (the loss)."""

    before: ExampleScores
    after: ExampleScores
    verdicts: list[Verdict]
    worst: list[dict]  # {"example", "metric", "before", "after", "text"}

    @classmethod
    def of(cls, before: ExampleScores, after: ExampleScores, seed: int = 0) -> Pairing:
        shared = sorted(set(before.index) & set(after.index))
        a, b = _aligned(before, shared), _aligned(after, shared)
        names = [n for n in before.metrics if n in after.metrics]
        verdicts = [paired_verdict(n, a.metrics[n], b.metrics[n], seed) for n in names]
        return cls(a, b, verdicts, _worst(a, b, names[0]) if names else [])

    @classmethod
    def from_dict(cls, d: dict) -> Pairing:
        return cls(ExampleScores.from_dict(d["before"]), ExampleScores.from_dict(d["after"]),
                   [Verdict(**v) for v in d["verdicts"]], list(d["worst"]))

    def to_dict(self) -> dict:
        return {"before": self.before.to_dict(), "after": self.after.to_dict(),
                "verdicts": [asdict(v) for v in self.verdicts], "worst": self.worst}

    @property
    def headline(self) -> Verdict | None:
        """The loss's verdict (the first metric), the one a last line says."""
        return self.verdicts[0] if self.verdicts else None

    def regressed(self) -> bool:
        """A measurable regression of the loss on at least MIN_PAIRS examples (what fails a CI job)."""
        v = self.headline
        return v is not None and not v.too_few and v.verdict == REGRESSED

    def table(self) -> pd.DataFrame:
        """One row per metric: n, the means before and after, the mean difference and its interval, the verdict."""
        rows = [{"metric": v.metric, "n": v.n, "before": v.before, "after": v.after, "difference": v.difference,
                 f"ci{CONFIDENCE:.0%}_low": v.low, f"ci{CONFIDENCE:.0%}_high": v.high,
                 "verdict": f"interval only (n<{MIN_PAIRS})" if v.too_few and v.n else v.verdict,
                 "worse_share": v.worse_share} for v in self.verdicts]
        return pd.DataFrame(rows)

    def worst_table(self) -> pd.DataFrame:
        return pd.DataFrame(self.worst, columns=["example", "metric", "before", "after", "text"])

    def plot(self, title: str, before: str = "base", after: str = "fine-tune"):
        """Each example's score before against after, one panel per metric, with the line of no change."""
        from matplotlib.figure import Figure

        names = [v.metric for v in self.verdicts if v.n]
        fig = Figure(figsize=(4 * max(1, len(names)), 4), layout="constrained")
        for ax, name in zip(np.atleast_1d(fig.subplots(1, max(1, len(names)))), names):
            x, y = np.asarray(self.before.metrics[name]), np.asarray(self.after.metrics[name])
            ax.scatter(x, y, s=10, alpha=0.6)
            lo, hi = np.nanmin([x, y]), np.nanmax([x, y])
            ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="no change")
            v = next(v for v in self.verdicts if v.metric == name)
            ax.set(xlabel=f"{name}: {before}", ylabel=f"{name}: {after}", title=f"{v.verdict} (n={v.n})")
            ax.legend(loc="best", fontsize=8)
        fig.suptitle(title)
        return fig


def _aligned(scores: ExampleScores, shared: list[int]) -> ExampleScores:
    where = {i: k for k, i in enumerate(scores.index)}
    return ExampleScores(shared, {n: [vs[where[i]] for i in shared] for n, vs in scores.metrics.items()},
                         [_at(scores.text, where[i], None) for i in shared])


def _worst(before: ExampleScores, after: ExampleScores, name: str) -> list[dict]:
    """The SHOWN_WORST examples whose `name` score got worse most (none that did not get worse)."""
    sign = -1.0 if name in LOWER_IS_BETTER else 1.0
    b, a = np.asarray(before.metrics[name]), np.asarray(after.metrics[name])
    loss = np.nan_to_num(sign * (b - a), nan=-np.inf)  # how much worse each example got
    order = [k for k in np.argsort(-loss, kind="stable")[:SHOWN_WORST] if loss[k] > 0]
    return [{"example": before.index[k], "metric": name, "before": float(b[k]), "after": float(a[k]),
             "text": _at(before.text, k, None) or f"example #{before.index[k]} of the validation split"}
            for k in order]
