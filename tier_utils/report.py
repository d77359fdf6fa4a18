"""The main job: every tier on one model, and a folder report (CSV tables, PNG plots, index.html).

`write_report` is generic over result objects (anything with `.table`, `.plot()` and `.status`, as every Result has);
`run_all` runs tier 1, tier 2, a short training run, the fit planner and the AMP benchmark, then writes one.
"""
from __future__ import annotations

import copy
import html
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from .adapter import adapt
from .analysis import analyze
from .bench import amp_benchmark
from .bench_size import MEMORY_FRACTION, fp32_measure, grow_batch
from .errors import ModelForwardError
from .files import atomic_write_bytes, holds_lock, jsonable, write_json
from .fit import fit
from .history import TrainSummary
from .measure import load_average
from .models import DEFAULT_MODEL, load_model
from .plotting import save_png
from .precision import resolve_device, resolve_precision
from .results import STATUSES, Result, run_metadata, worst_status
from .settings import FAST, JOB, BenchConfig, TrainConfig, pick
from .smoke import smoke
from .train import TrainingDiverged, train
from .validation import writable_dir

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")

# A dashboard: the page never scrolls sideways; a wide or long table scrolls inside its own box.
_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#222}
.scroll{overflow:auto;max-width:100%;max-height:30em;margin:.5em 0}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3;position:sticky;top:0}
td{max-width:40em;overflow-wrap:anywhere}
img{max-width:100%;height:auto;border:1px solid #eee}.meta{color:#666;font-size:13px;overflow-wrap:anywhere}
.PASS{color:#176f2c}.WARN{color:#9a6700}.FAIL{color:#b42318;font-weight:bold}.SKIP,.measured{color:#666}"""
MEASURED = "measured"  # shown for a PASS row without a threshold: a measurement, not a verdict


def write_report(results: dict, out_dir, title: str = "tier_utils report", metadata: dict | None = None) -> Path:
    """Write each result's table as `<name>.csv`, its plot as `<name>.png`, its JSON as `<name>.json`
    and an `index.html` showing them together (plain HTML, relative image links). Returns index.html.

    metadata: the run's device/torch/time stamp shown under the title (default: `run_metadata()`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections, nav = [], []
    for name, result in results.items():
        if not _NAME.match(name):
            raise ValueError(f"result name {name!r} is not a plain file name; use letters, digits, _ or -")
        # A benchmark's verdicts are a table of their own, shown first: they are what to read.
        tables = {f"{name}_verdicts": result.verdicts} if hasattr(result, "verdicts") else {}
        tables[name] = result.table
        for stem, table in tables.items():
            atomic_write_bytes(out / f"{stem}.csv", table.to_csv(index=False).encode())
        write_json(out / f"{name}.json", result.to_json())
        fig = result.plot()
        if fig is not None:
            save_png(fig, out / f"{name}.png")
        status = result.status
        badge = f" <span class='{status}'>{status}</span>" if status else ""
        nav.append(f"<a href='#{name}'>{html.escape(name)}</a>{badge}")
        sections.append(_section(name, badge, tables, fig is not None))
    meta = metadata if metadata is not None else run_metadata()
    meta_line = " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items())
    page = (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head>\n<body><h1>{html.escape(title)}</h1>\n"
            f"<p class='meta'>{meta_line}</p>\n<p>{' · '.join(nav)}</p>\n" + "\n".join(sections)
            + "\n</body></html>\n")
    return atomic_write_bytes(out / "index.html", page.encode())


def _section(name: str, badge: str, tables: dict, has_plot: bool) -> str:
    links = [f"<a href='{stem}.csv'>{stem}.csv</a>" for stem in tables] + [f"<a href='{name}.json'>{name}.json</a>"]
    parts = [f"<section id='{name}'><h2>{html.escape(name)}{badge}</h2>", f"<p>{' · '.join(links)}</p>"]
    for table in tables.values():
        rows = _for_page(table).to_html(index=False, border=0, na_rep="", float_format=lambda x: f"{x:.4g}")
        for s in (*STATUSES, MEASURED):  # colour the verdict cells (to_html has escaped every cell already)
            rows = rows.replace(f"<td>{s}</td>", f"<td class='{s}'>{s}</td>")
        parts.append(f"<div class='scroll'>{rows}</div>")
    if has_plot:
        parts.append(f"<p><img src='{name}.png' alt='{html.escape(name)} plot'></p>")
    parts.append("</section>")
    return "\n".join(parts)


def _for_page(table: pd.DataFrame) -> pd.DataFrame:
    """The table as the page shows it (the CSV keeps it whole): empty cells blank, all-empty columns
    dropped, and a PASS with no threshold marked as a measurement (latency, memory), not a verdict."""
    shown = table.astype(object).where(table.notna(), "")
    if {"status", "threshold"} <= set(shown.columns):
        measured = (shown["status"] == "PASS") & (shown["threshold"].astype(str) == "")
        shown.loc[measured, "status"] = MEASURED
    return shown.loc[:, [c for c in shown.columns if (shown[c].astype(str) != "").any()]]


@dataclass(repr=False)
class AllResult(Result):
    """What `run_all` returns: each tier's result, its status and seconds, and the report's index.html."""

    results: dict
    statuses: dict  # tier -> worst PASS/WARN/FAIL/SKIP, or None (training has no verdicts unless it diverged)
    seconds: dict
    index: Path
    metadata: dict
    bench_size: dict | None = None  # grow_batch()'s choice on a GPU; None where the default size was used

    @property
    def model_status(self) -> str:
        """The worst status of the model's own checks (smoke, analysis, training), not the benchmark's.

        The benchmark's verdicts judge this device's precisions against targets (a CPU seldom
        reaches a 1.5x bf16 speedup); they are reported, but don't make the model's run fail.
        """
        return worst_status(s for n, s in self.statuses.items() if s and n != "amp_benchmark")

    @property
    def table(self) -> pd.DataFrame:
        return pd.DataFrame([{"tier": n, "status": self.statuses[n] or "", "seconds": round(self.seconds[n], 1),
                              "csv": f"{n}.csv", "png": f"{n}.png"} for n in self.results])

    def plot(self, name: str = "train"):
        """One tier's figure (the report folder holds all of them as PNG)."""
        if name not in self.results:
            raise ValueError(f"no tier {name!r} in this run; it has: {', '.join(self.results)}")
        return self.results[name].plot()

    def to_json(self) -> dict:
        return jsonable({"status": self.status, "model_status": self.model_status, "tiers": self.table,
                         "index": self.index, "bench_size": self.bench_size, "run_metadata": self.metadata})

    def summary_text(self, width: int = 110) -> str:
        """The one-screen summary the CLI prints: non-PASS rows of tiers 1-2, training, benchmark verdicts."""
        r, m = self.results, self.metadata
        busy = m.get("load_average_1m") is not None and m["load_average_1m"] > m["cpu_count"]
        lines = [f"{m['device_name']} · torch {m['torch']} · {m['threads']} threads"
                 + (f" · machine busy: load {m['load_average_1m']:.1f} on {m['cpu_count']} cores, "
                    "so the timings below are slower than on an idle machine" if busy else "")]
        if "smoke" in r:
            lines += _verdict_block("smoke", self, r["smoke"].table[["check", "status", "value", "detail"]], width)
        if "analysis" in r:
            lines += _verdict_block("analysis", self, r["analysis"].table[["analysis", "check", "status", "value",
                                                                           "detail"]], width)
        if "train" in r:
            lines.append(_train_line(r["train"].summary, self.seconds["train"]))
        if "fit" in r:
            lines.append(r["fit"].summary_line())
        if "amp_benchmark" in r:
            v, c = r["amp_benchmark"].verdicts, r["amp_benchmark"].config
            lines += _verdict_block("amp_benchmark", self, v[v["precision"] != "fp32"], width, only_problems=False)
            size = f"  at batch {c['batch_size']} x {c['seq_len']} tokens"
            if self.bench_size:
                size += f", grown from batch {self.bench_size['from_batch_size']}: {self.bench_size['reason']}"
            if c["fit"]["reason"]:
                size += f"; {c['fit']['reason']}"
            lines.append(size)
        lines.append(f"model checks: {self.model_status} · benchmark verdicts: {self.statuses.get('amp_benchmark')} "
                     f"· report: {self.index}")
        return "\n".join(lines)


def _verdict_block(name: str, res: AllResult, table, width: int, only_problems: bool = True) -> list[str]:
    counts = table["status"].value_counts()
    head = f"{name}: {res.statuses[name]} ({', '.join(f'{counts[s]} {s}' for s in STATUSES if s in counts)}) " \
           f"in {res.seconds[name]:.1f} s"
    rows = table[table["status"] != "PASS"] if only_problems else table
    if rows.empty:
        return [head]
    shown = rows.drop(columns="detail")
    shown["value"] = shown["value"].map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)
    lines = shown.to_string(index=False).splitlines()
    room = max(20, width - 2 - max(len(line) for line in lines) - 2)
    details = ["detail"] + [d if len(d) <= room else d[:room - 3] + "..." for d in map(str, rows["detail"])]
    return [head] + [f"  {line}  {d}" for line, d in zip(lines, details)]


def _train_line(s: TrainSummary, seconds: float) -> str:
    losses = " · ".join(f"{k} {v:.4f}" for k in ("train_loss", "val_loss") if (v := getattr(s, k)) is not None)
    line = f"train: {s.steps} steps, global batch {s.global_batch}, {s.precision}, {losses}"
    if t := s.tokens_per_s:
        line += f" · {t['median']:,.0f} tokens/s median (IQR {t['iqr']:,.0f}, n={t['n']})"
    return line + f" · {seconds:.1f} s"


@holds_lock("out_dir")  # one run per report folder
def run_all(model=DEFAULT_MODEL, out_dir="runs/report", *, data=None, precision="auto", device=None,
            fast: bool = False, batch_size: int | None = None, seed: int = 0, progress: bool = True,
            **model_kwargs) -> AllResult:
    """Tier 1, tier 2, a short training run and the AMP benchmark on one model, then `write_report`.

    model: a load_model spec (kwargs build it) or an nn.Module; every tier starts from the same
    initial weights (training works on a copy). Run lengths: settings.JOB, or settings.FAST with
    fast=True. Training that diverges is recorded as FAIL with its partial history; a model whose
    forward raises gets smoke and analysis FAIL rows and no training or benchmark; bad input raises
    as in each tier. Ctrl-C raises KeyboardInterrupt (the CLI exits 130) and writes no report.
    """
    writable_dir(out_dir, "out_dir")  # before an hour of work, not after it
    sizes = {**(FAST if fast else JOB), **({} if batch_size is None else {"batch_size": batch_size})}
    torch.manual_seed(seed)
    base = load_model(model, **model_kwargs)
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)  # decided once: every tier runs this one
    train_cfg = pick(TrainConfig, sizes, precision=prec, device=dev, seed=seed, progress=progress)
    bench_cfg = pick(BenchConfig, sizes)
    b, t = train_cfg.batch_size, train_cfg.seq_len
    try:
        t, runnable = min(t, adapt(base).max_len), True  # the job fits its window to the model, no warning
    except ModelForwardError:
        runnable = False  # smoke and analyze report it as FAIL rows; training and the benchmark can't run
    sizing = {}
    steps = {
        "smoke": lambda: smoke(base, batch_sizes=(1, b), seq_lens=(t,), precision=prec, device=dev,
                               progress=progress),
        "analysis": lambda: analyze(base, data=data, precision=prec, device=dev, batch_size=b,
                                    n_batches=sizes["n_batches"], seq_len=t, progress=progress),
        # A copy: training changes weights, and the benchmark must start from the same ones as the rest.
        "train": lambda: _train(copy.deepcopy(base), data, replace(train_cfg, seq_len=t)),
        "fit": lambda: fit(base, seq_len=t, device=dev, validate=False, progress=progress),  # predictions only
        "amp_benchmark": lambda: amp_benchmark(base, data, replace(bench_cfg, seq_len=t, batch_size=_bench_batch(
            base, dev, b, t, sizing)), device=dev, progress=progress),
    }
    if not runnable:
        del steps["train"], steps["fit"], steps["amp_benchmark"]
    results, statuses, seconds = {}, {}, {}
    for name, run in steps.items():
        start = time.perf_counter()
        results[name] = run()
        seconds[name] = time.perf_counter() - start
        statuses[name] = results[name].status
    # The 1-minute load average covers the benchmark: above the core count, other jobs slowed the timings.
    meta = {**run_metadata(dev, prec.dtype), "load_average_1m": load_average(), "cpu_count": os.cpu_count()}
    index = write_report(results, out_dir, title=f"tier_utils report: {type(base).__name__}", metadata=meta)
    return AllResult(results, statuses, seconds, index, meta, sizing.get("chosen"))


def _bench_batch(model, dev, batch_size: int, seq_len: int, sizing: dict) -> int:
    """The benchmark's batch: on a GPU, grown until fp32's step is mostly arithmetic (a tiny model at
    the default batch is launch-bound there, and every precision then times the same); else as given."""
    if dev.type != "cuda":
        return batch_size
    budget = int(MEMORY_FRACTION * torch.cuda.get_device_properties(dev).total_memory)
    was_training = model.training
    model.to(dev).train()
    try:
        sizing["chosen"] = grow_batch(batch_size, fp32_measure(adapt(model), seq_len), budget)
    finally:
        model.train(was_training)
    return sizing["chosen"]["batch_size"]


def _train(model, data, config: TrainConfig):
    """A short training run; divergence keeps its partial result (its summary says where).
    Ctrl-C during it stops the whole job: train() hands back its partial result, we re-raise."""
    try:
        result = train(model, data, config)
    except TrainingDiverged as exc:
        if exc.result is None:
            raise
        return exc.result
    if result.interrupted:
        raise KeyboardInterrupt
    return result

