"""What the notebooks say about their own run: `about()` prints the facts of the run (the model and where it
came from, its tokenizer, the data and how validation was split, the loss at initialisation against a uniform
guess), computed from the results rather than written for the default model; `summary()` ends a notebook with
what ran, the verdict line, the files it wrote (links that open in JupyterLab) and what to try next."""
from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from .adapter.adapter import adapt
from .core.display import html_table
from .core.results import verdict_line
from .models.builtins import BUILTIN_MODELS
from .report import write_report
from .training.history import TrainResult

# What to try after each notebook, by its tier.
NEXT = {
    "smoke": ["tier2_analysis.ipynb: the same model box, to see how the model uses its inputs and which precision "
              "it can afford",
              "tier3_training.ipynb: train it, and time fp32 against bf16 and fp16 on this device",
              "the CLI does the same: python -m tier_utils smoke MODEL --json smoke.json"],
    "analysis": ["analysis.plot('robustness') (or any analysis's name) draws one analysis in detail; "
                 "analysis.frames holds their numbers",
                 "tier3_training.ipynb trains the model; its checkpoint (runs/notebook/checkpoints/last.pt) can "
                 "come back here in the model box",
                 "every tier at once, with a report page: python -m tier_utils all MODEL"],
    "train": ["train longer: MAX_STEPS in the parameters cell, or tier_utils.train(model, data, "
              "config=study.best_config)",
              "tier2_analysis.ipynb with runs/notebook/checkpoints/last.pt in its model box analyses what this run "
              "trained",
              "the benchmark at a size this device's arithmetic shows: a bigger batch size in the panel, or a GPU"],
}


def about(cfg, *results) -> str:
    """The facts of the run as lines, from `results` (one or more, as the run recorded them): model (its spec
    and where it lives), tokenizer, data and how validation was split, and for a training run its first logged
    loss against ln(V), a uniform guess over the vocabulary."""
    facts = [_facts(r) for r in results if isinstance(r, TrainResult) or isinstance(getattr(r, "model", None), dict)]
    if not facts:
        raise ValueError("about() needs a smoke, analysis or training result: the others record no model")
    model, tokenizer, _ = facts[0]
    lines = [f"model: {_where(cfg)} → {model}", f"tokenizer: {tokenizer}"]
    lines += [f"data: {data}" for data in dict.fromkeys(d for _, _, d in facts if d)][:1]
    lines += [_first_loss(r) for r in results if isinstance(r, TrainResult)][:1]
    return "\n".join(lines)


def _where(cfg) -> str:
    spec = cfg.model
    if spec in BUILTIN_MODELS:
        sizes = ", ".join(f"{k}={v}" for k, v in cfg.model_arguments().items())
        return f"built-in {spec} ({sizes or 'its default sizes'})"
    path = Path(spec.split(":", 1)[0] if spec.endswith(".py") or ".py:" in spec else spec).expanduser()
    where = str(path.resolve())
    return spec if not path.exists() or where == spec else f"{spec} (at {where})"


def _facts(result) -> tuple[str, str, str | None]:
    """(model, tokenizer, data) as the run recorded them."""
    if isinstance(result, TrainResult):
        s = result.summary
        return (f"{s.model} ({s.parameters:,} parameters, {s.task})", s.tokenizer,
                f"{s.data}; validation: {s.validation}")
    m = result.model
    model = m.get("provenance", {}).get("summary") or f"{m['model']} ({m['parameters']:,} parameters, {m['task']})"
    described = getattr(getattr(result, "data", None), "described", None)
    data = None if described is None else (f"{described.data}; validation: {described.validation} "
                                           f"({described.train_examples:,} train / {described.val_examples:,} "
                                           "validation examples)")
    return model, m["tokenizer"], data


def _first_loss(result: TrainResult) -> str:
    steps = result.history[result.history["kind"] == "step"]
    adapter = adapt(result.model)
    classes = adapter.task.width(adapter)
    what = "classes" if adapter.task.has_classes else "vocabulary"
    uniform = f"uniform ln({classes:,}) = {math.log(classes):.2f} nats (a guess spread evenly over the {what})"
    if steps.empty:
        return f"loss: no step logged; {uniform}"
    first, last = steps.iloc[0], steps.iloc[-1]
    return (f"loss: {first['train_loss']:.2f} at step {int(first['step'])} (initialisation) → {last['train_loss']:.2f}"
            f" at step {int(last['step'])}; {uniform}")


@dataclass
class Summary:
    """A notebook's last cell: `results` by name, their verdict line, the report folder and files, what next."""

    tier: str
    facts: str
    results: dict
    files: list[Path]

    @property
    def verdicts(self) -> str:
        return verdict_line(self.results)

    def table(self) -> pd.DataFrame:
        """Each result's verdict and its own summary line."""
        return pd.DataFrame([(name, r.verdict or "", r.summary_line()) for name, r in self.results.items()],
                            columns=["ran", "verdict", "summary"])

    def __repr__(self) -> str:
        files = "\n".join(f"  {_shown(f)}" for f in self.files)
        steps = "\n".join(f"  - {n}" for n in NEXT[self.tier])
        return (f"{self.facts}\n{self.table().to_string(index=False)}\n{self.verdicts}\nfiles:\n{files}\n"
                f"next:\n{steps}")

    def _repr_html_(self) -> str:
        facts = "<br>".join(html.escape(line) for line in self.facts.splitlines())
        links = "".join(f"<li>{_link(f)}</li>" for f in self.files)
        steps = "".join(f"<li>{html.escape(n)}</li>" for n in NEXT[self.tier])
        return (f"<h3>Summary</h3><p>{facts}</p>{html_table(self.table())}<p><b>{html.escape(self.verdicts)}</b></p>"
                f"<p>Files this notebook wrote (they open in JupyterLab):</p><ul>{links}</ul>"
                f"<p>What to try next:</p><ul>{steps}</ul>")


def _shown(path: Path) -> str:
    """The path relative to the notebook's folder (the kernel's working directory) where it lies inside it."""
    try:
        return os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd().resolve()) else str(path)
    except ValueError:  # another drive (Windows)
        return str(path)


def _link(path: Path) -> str:
    shown = html.escape(_shown(path))
    # JupyterLab opens a relative link of an output in its own viewer (HTML, image, CSV, folder browser).
    return f"<a href='{shown}' target='_blank'>{shown}</a>" if not os.path.isabs(_shown(path)) else shown


def summary(cfg, results: dict, out_dir, tier: str, files=()) -> Summary:
    """Write `results` (by name) as a report folder under `out_dir` (index.html with the verdict line at the top,
    each table as CSV, each plot as PNG, each result's JSON), and return the notebook's summary of them.
    `files`: what else the notebook wrote (a checkpoint folder, an exported model), linked too."""
    if tier not in NEXT:
        raise ValueError(f"tier must be one of {', '.join(NEXT)}, got {tier!r}")
    index = write_report(results, out_dir, title=f"tier_utils {tier} notebook: {cfg.model}")
    written = [index] + [Path(out_dir) / f"{name}.png" for name in results if (Path(out_dir) / f"{name}.png").exists()]
    written += [Path(f) for f in files if Path(f).exists()]
    return Summary(tier, about(cfg, *results.values()), results, written)
