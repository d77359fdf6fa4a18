"""The main job: every tier on one model, and a folder report (CSV tables, PNG plots, index.html).

`write_report` is generic over result objects (anything with `.table`, `.plot()` and `.status`, as every Result has);
`run_all` runs tier 1, tier 2, a short training run, the fit planner and the AMP benchmark, then writes one.
"""
from __future__ import annotations

import copy
import html
import math
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path

import pandas as pd
import torch

from .adapter.adapter import adapt
from .analysis import analyze
from .benchmark.amp import BenchmarkResult, amp_benchmark
from .benchmark.size import MEMORY_FRACTION, fp32_measure, grow_batch
from .benchmark.verdicts import step_agreement
from .core.errors import ModelForwardError, TierError, TrainingDiverged
from .core.files import atomic_write_bytes, holds_lock, jsonable, write_json
from .core.inputs import writable_dir
from .core.measure import Load, cpu_load, load_average
from .core.plotting import save_png
from .core.precision import resolve_device, resolve_precision
from .core.results import CHECK_COLUMNS, STATUSES, Check, Result, TierFailure, checks_table, run_metadata, worst_status
from .models.builtins import DEFAULT_MODEL, DEMO_MODEL
from .models.loading import load_model
from .planning.planner import fit
from .planning.ranks import plan_ranks
from .presets import FAST, JOB
from .smoketest.suite import smoke
from .training.config import TrainConfig
from .training.history import TrainResult, TrainSummary
from .training.loop import train

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")

# A dashboard: the page never scrolls sideways; a long table scrolls inside its own box. Words wrap only
# between words (no `anywhere`/`break-all`, which split "float32" into "float3 2" in a squeezed column;
# `.w` keeps "7.334e-08" whole); a long token (a path, an op name) gets break points after its separators
# instead (`_breakable`).
_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;padding:0 1em;color:#222}
.scroll{overflow:auto;max-width:100%;max-height:30em;margin:.5em 0}
table{border-collapse:collapse;font-size:13px}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top;overflow-wrap:break-word}
th{background:#f3f3f3;position:sticky;top:0}
img{max-width:100%;height:auto;border:1px solid #eee}.meta{color:#666;font-size:13px;overflow-wrap:break-word}
.w{white-space:nowrap}.PASS{color:#176f2c}.WARN{color:#9a6700}.FAIL{color:#b42318;font-weight:bold}.SKIP{color:#666}"""
_LONG = 20  # characters: a token this long may break after its separators
_AFTER_SEPARATORS = re.compile(r"(?<=[_./,:=-])")
_PLAIN = re.compile(r"[(\[]*[\w']*[)\]:;,.!?%]*")  # no line-break opportunity inside


def write_report(results: dict, out_dir, title: str = "tier_utils report", metadata: dict | None = None) -> Path:
    """Write each result's table as `<name>.csv` (a benchmark's verdicts also as `<name>_verdicts.csv`), its
    plot as `<name>.png`, its JSON as `<name>.json`, and an `index.html` showing them together (plain HTML,
    relative links). The page shows each tier's verdict columns (check, status, value, threshold, detail,
    after the columns naming the row), a benchmark's verdicts rather than its measurements; the CSV links
    hold every column. Returns index.html.

    metadata: the run's device/torch/time stamp shown under the title (default: `run_metadata()`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sections, nav = [], []
    for name, result in results.items():
        if not _NAME.match(name):
            raise ValueError(f"result name {name!r} is not a plain file name; use letters, digits, _ or -")
        frames = {name: result.table}
        if hasattr(result, "verdicts"):  # what to read; the measurements stay one click away
            frames[f"{name}_verdicts"] = result.verdicts
        for stem, frame in frames.items():
            atomic_write_bytes(out / f"{stem}.csv", frame.to_csv(index=False).encode())
        write_json(out / f"{name}.json", result.to_json())
        fig = result.plot()
        if fig is not None:
            save_png(fig, out / f"{name}.png")
        status = result.status
        badge = f" <span class='{status}'>{status}</span>" if status else ""
        nav.append(f"<a href='#{name}'>{html.escape(name)}</a>{badge}")
        shown = result.verdicts if hasattr(result, "verdicts") else result.table
        files = [f"{stem}.csv" for stem in frames] + [f"{name}.json"]
        sections.append(_section(name, badge, shown, files, fig is not None))
    meta = metadata if metadata is not None else run_metadata()
    agreement = checks_table(consistency(results, _load(meta)))
    if len(agreement):  # before the tiers: it says how far to trust their timings
        atomic_write_bytes(out / "consistency.csv", agreement.to_csv(index=False).encode())
        sections.insert(0, _section("consistency", "", agreement, ["consistency.csv"], False))
    meta_line = " · ".join(f"{html.escape(str(k))}: {html.escape(str(v))}" for k, v in meta.items())
    page = (f"<!doctype html>\n<html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head>\n<body><h1>{html.escape(title)}</h1>\n"
            f"<p class='meta'>{meta_line}</p>\n<p>{' · '.join(nav)}</p>\n" + "\n".join(sections)
            + "\n</body></html>\n")
    return atomic_write_bytes(out / "index.html", page.encode())


def _section(name: str, badge: str, table: pd.DataFrame, files: list[str], has_plot: bool) -> str:
    shown = _for_page(table)
    hidden = len(table.columns) - len(shown.columns)
    note = f" (the page leaves out {hidden} column{'s' if hidden != 1 else ''}; the CSV has all)" if hidden else ""
    links = " · ".join(f"<a href='{f}'>{f}</a>" for f in files)
    rows = shown.to_html(index=False, border=0, escape=False)
    for s in STATUSES:  # colour the verdict cells
        rows = rows.replace(f"<td>{s}</td>", f"<td class='{s}'>{s}</td>")
    parts = [f"<section id='{name}'><h2>{html.escape(name)}{badge}</h2>", f"<p>{links}{note}</p>",
             f"<div class='scroll'>{rows}</div>"]
    if has_plot:
        parts.append(f"<p><img src='{name}.png' alt='{html.escape(name)} plot'></p>")
    parts.append("</section>")
    return "\n".join(parts)


def _for_page(table: pd.DataFrame) -> pd.DataFrame:
    """The table as the page shows it: a verdict table's columns naming the row (left of `check`) and its
    verdict columns, no column that is empty throughout, every cell as escaped HTML. The statuses are the
    table's own: the page, `.table` and the CLI read alike."""
    columns = list(table.columns)
    if {"check", "status"} <= set(columns):
        columns = columns[:columns.index("check")] + [c for c in CHECK_COLUMNS if c in columns]
    shown = table[columns].astype(object).where(table[columns].notna(), None).map(_cell)
    return shown.loc[:, [c for c in shown.columns if (shown[c] != "").any()]]


def _cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return " ".join(_breakable(word) for word in text.split(" "))


def _breakable(word: str) -> str:
    """`word` as HTML: a long token (a path, an op name) may wrap after its separators; a word never
    breaks inside."""
    parts = _AFTER_SEPARATORS.split(word) if len(word) >= _LONG else [word]
    # A browser may also wrap inside at a hyphen or slash ("7.334e-" / "08"): such a part can't wrap.
    return "<wbr>".join(html.escape(p) if _PLAIN.fullmatch(p) else f"<span class='w'>{html.escape(p)}</span>"
                        for p in parts)


def consistency(results: dict, load: Load | None = None) -> list[Check]:
    """Rows about two tiers that timed the same thing far apart: training's step against the benchmark's
    at the same model, precision, mode and batch (one rank, no accumulation)."""
    rows = []
    for train_result in (r for r in results.values() if isinstance(r, TrainResult)):
        s, c = train_result.summary, train_result.config
        if c is None:  # a result built without its run's settings: nothing to match a benchmark against
            continue
        mode = "compiled" if s.compiled else "eager"
        for bench in (r for r in results.values() if isinstance(r, BenchmarkResult)):
            b = bench.config.settings
            rec = next((r for r in bench.records if (r.precision, r.mode) == (s.precision, mode) and r.speed), None)
            same = (s.model, c.batch_size, c.seq_len) == (bench.config.model, b.batch_size, b.seq_len)
            if rec is None or s.step_time_ms is None or s.world_size != 1 or c.grad_accum_steps != 1 or not same:
                continue
            row = step_agreement(s.step_time_ms, rec.speed.step_ms,
                                 f"{s.model}, {s.precision} {mode}, batch {b.batch_size} x {b.seq_len} tokens", load)
            rows += [row] if row else []
    return rows


def _load(meta: dict) -> Load:
    """The load a run's metadata recorded (run_all's), else the load now."""
    return Load(meta["load_average_1m"], meta["cpu_count"]) if "load_average_1m" in meta else cpu_load()


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
                         "index": self.index, "bench_size": self.bench_size, "run_metadata": self.metadata,
                         "consistency": checks_table(consistency(self.results, _load(self.metadata)))})

    def summary_text(self, width: int = 110) -> str:
        """The one-screen summary the CLI prints: non-PASS rows of tiers 1-2, training, benchmark verdicts."""
        r, m = self.results, self.metadata
        busy = m.get("load_average_1m") is not None and m["load_average_1m"] > m["cpu_count"]
        threads = m.get("threads_reason") or f"{m['threads']} torch threads"
        lines = [f"{m['device_name']} · torch {m['torch']} · {threads}"
                 + (f" · machine busy: load {m['load_average_1m']:.1f} on {m['cpu_count']} cores, "
                    "so the timings below are slower than on an idle machine" if busy else "")]
        if "tokenizer" in m:
            lines.append(f"{m['model']} · tokenizer {m['tokenizer']} · data: {m['data']}")
        r = {n: t for n, t in r.items() if not isinstance(t, TierFailure)}
        lines += [f"{f.tier}: FAIL, it raised {f.error}" for f in self.results.values() if isinstance(f, TierFailure)]
        if "smoke" in r:
            lines += _verdict_block("smoke", self, r["smoke"].table[["check", "status", "value", "detail"]], width)
        if "analysis" in r:
            block = _verdict_block("analysis", self, r["analysis"].table[["analysis", "check", "status", "value",
                                                                          "detail"]], width)
            if provenance := r["analysis"].model.get("provenance"):  # the shipped demo model, not fresh weights
                block.insert(1, f"  on {provenance['summary']}")
            lines += block
        if "train" in r:
            lines.append(_train_line(r["train"].summary, self.seconds["train"]))
        if "fit" in r:
            lines.append(r["fit"].summary_line())
        if "ranks" in r:
            lines.append(r["ranks"].summary_line())
        if "amp_benchmark" in r:
            v, run = r["amp_benchmark"].verdicts, r["amp_benchmark"].config
            lines += _verdict_block("amp_benchmark", self, v[v["precision"] != "fp32"], width, only_problems=False)
            size = f"  at batch {run.settings.batch_size} x {run.settings.seq_len} tokens"
            if self.bench_size:
                size += f", grown from batch {self.bench_size['from_batch_size']}: {self.bench_size['reason']}"
            if run.fit.reason:
                size += f"; {run.fit.reason}"
            lines.append(size)
        lines += [f"consistency: {c.status} {c.detail}" for c in consistency(r, _load(m))]
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
        line += f" · {t.median:,.0f} tokens/s median (IQR {t.iqr:,.0f}, n={t.n})"
    return line + f" · {seconds:.1f} s"


@holds_lock("out_dir")  # one run per report folder
def run_all(model=DEFAULT_MODEL, out_dir="runs/report", *, data=None, precision=TrainConfig.precision,
            device=TrainConfig.device, fast: bool = False, batch_size: int | None = None, seed: int = TrainConfig.seed,
            progress: bool = TrainConfig.progress, model_kwargs: dict | None = None) -> AllResult:
    """Tier 1, tier 2, a short training run and the AMP benchmark on one model, then `write_report`.

    model: a load_model spec (`model_kwargs` build it) or an nn.Module; every tier starts from the same
    initial weights (training works on a copy), except that with the default model and no model_kwargs,
    tier 2 analyses the shipped trained demo model (`tiny-gpt-trained`) and the report names it.
    Run lengths: presets.JOB, or presets.FAST with fast=True; `batch_size` replaces the preset's. Training
    that diverges is recorded as FAIL with its partial history; a model whose forward raises gets smoke and
    analysis FAIL rows and no training or benchmark; bad input raises as in each tier. Ctrl-C raises KeyboardInterrupt
    (the CLI exits 130) and writes no report.
    """
    writable_dir(out_dir, "out_dir")  # before an hour of work, not after it
    preset = FAST if fast else JOB
    if batch_size is not None:
        preset = replace(preset, batch_size=batch_size)
    torch.manual_seed(seed)
    base = load_model(model, **(model_kwargs or {}))
    # Tier 2 on fresh weights only shows what an untrained model does: with the default model left as is,
    # it analyses the shipped trained demo model instead. Tiers 1 and 3 start from fresh weights.
    default = isinstance(model, str) and model.strip() == DEFAULT_MODEL and not model_kwargs
    analysed = load_model(DEMO_MODEL) if default else base
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)  # decided once: every tier runs this one
    ran_on = {"model": type(base).__name__}  # what the report names: model, tokenizer, data
    try:
        adapter = adapt(base)
        # the job fits its window to the model, no warning
        preset, runnable = replace(preset, seq_len=min(preset.seq_len, adapter.max_len)), True
        described = adapter.datasets(data, preset.seq_len, seed).describe()  # bad data fails here, before any tier runs
        ran_on.update(tokenizer=described.tokenizer, data=described.data)
    except ModelForwardError:
        runnable = False  # smoke and analyze report it as FAIL rows; training and the benchmark can't run
    sizing = {}
    steps = {
        "smoke": lambda: smoke(base, preset.smoke_config(precision=prec, device=dev, progress=progress)),
        "analysis": lambda: analyze(analysed, data, preset.analysis_config(precision=prec, device=dev,
                                                                            progress=progress)),
        # A copy: training changes weights, and the benchmark must start from the same ones as the rest.
        "train": lambda: _train(copy.deepcopy(base), data, preset.train_config(precision=prec, device=dev, seed=seed,
                                                                               progress=progress)),
        # predictions only
        "fit": lambda: fit(base, preset.fit_config(device=dev, validate=False, progress=progress)),
        "ranks": lambda: plan_ranks(base, seq_len=preset.seq_len, precision=prec, device=dev, progress=progress),
        "amp_benchmark": lambda: amp_benchmark(base, data, preset.bench_config(batch_size=_bench_batch(
            base, dev, preset.batch_size, preset.seq_len, sizing), device=dev, progress=progress)),
    }
    if not runnable:
        del steps["train"], steps["fit"], steps["ranks"], steps["amp_benchmark"]
    results, statuses, seconds = {}, {}, {}
    for name, run in steps.items():
        start = time.perf_counter()
        try:
            results[name] = run()
        except TierError as exc:
            if not isinstance(exc, ModelForwardError):
                raise  # the user's input, not the model: one line, its exit code (2), no report
            results[name] = TierFailure.of(name, exc)
        except Exception as exc:  # the model broke this tier: a FAIL in the report, and the other tiers run
            results[name] = TierFailure.of(name, exc)
        seconds[name] = time.perf_counter() - start
        statuses[name] = results[name].status
    # The 1-minute load average covers the benchmark: above the core count, other jobs slowed the timings.
    meta = {**ran_on, **run_metadata(dev, prec.dtype), "load_average_1m": load_average(),
            "cpu_count": os.cpu_count()}
    title = f"tier_utils report: {type(base).__name__}" + (f", tier 2 on {DEMO_MODEL}" if analysed is not base else "")
    index = write_report(results, out_dir, title=title, metadata=meta)
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
    result.model.zero_grad(set_to_none=True)  # the report keeps the trained copy; its gradients, not
    return result

