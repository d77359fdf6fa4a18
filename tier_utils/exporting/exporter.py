"""Model export: ONNX (torch.onnx) or a torch.export program (.pt2), checked against eager.

The model (a copy, on the CPU, in eval mode, cast to the export precision) is wrapped so it takes
token ids (plus the attention mask for a classifier, whose padding matters) and returns the
logits tensor, then captured once with torch.export with dynamic batch and sequence axes. ONNX is
translated from that program. Parity runs the artifact (onnxruntime for ONNX, the reloaded
ExportedProgram for pt2) and eager on real batches of two shapes that differ from the traced one,
and times both on the CPU.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import logging
import re
import warnings
from dataclasses import asdict, dataclass, replace

import pandas as pd
import torch

from ..adapter.adapter import extract_logits, resolve_model
from ..core.display import round_to_spread
from ..core.errors import ExportError, describe, one_line
from ..core.files import atomic_write_bytes, jsonable
from ..core.measure import StepTimer, summarize
from ..core.precision import BASELINE, Precision, Tolerances, precision_setting, resolve_precision
from ..core.results import Check, Result, checks_table, run_metadata
from ..core.settings import check_fields, merge, setting
from ..core.threads import chooses_threads
from ..data.chat_formats import ChatOptions
from ..data.datasets import DataDescription, make_loader
from ..engine.quantization import merge_to_plain, quantized_layers

FORMATS = ("onnx", "pt2")
SCHEMA = "tier_utils.export/1"
# Parity's tolerances are the precision's own (Precision.tolerances(): max |artifact - eager| / max |eager logits|
# PASS up to the first, WARN up to the second; argmax agreement where eager's top-2 margin is decisive): low
# precisions get room for different kernels rounding differently.


@dataclass
class ExportConfig:
    """What `export` writes and how parity times it.

    format: "onnx" (torch.onnx from a torch.export program; needs onnx, onnxscript and onnxruntime)
        or "pt2" (torch.export.save).
    precision: the dtype the weights are exported in (fp32, bf16, fp16; auto resolves for the CPU).
    example: token ids (B, T) or a batch dict to trace with; None: a validation batch of the data.
    repeats: timed forwards per shape and runner for the latency rows.
    """

    format: str = setting("onnx", "onnx or pt2")
    precision: str | Precision = setting(BASELINE, "the dtype the weights are exported in")
    example: torch.Tensor | dict | None = setting(None, "token ids (B, T) or a batch dict to trace with")
    repeats: int = setting(10, "timed forwards per shape and runner", low=1)
    chat: ChatOptions = setting(factory=ChatOptions)  # how the data's chat rows are read

    def __post_init__(self):
        self.format = str(self.format).lower()
        if self.format not in FORMATS:  # an ExportError, as every export problem is (so no `choices`)
            raise ExportError(f"unknown export format {self.format!r}; use one of: {', '.join(FORMATS)}")
        self.precision = precision_setting(self.precision)
        check_fields(self)


class _Logits(torch.nn.Module):
    """The adapter's call, as a module torch.export can capture: ids (and mask) in, logits out."""

    def __init__(self, adapter):
        super().__init__()
        self.adapter = adapter
        self.model = adapter.model  # registered, so the program holds its weights

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None):
        # An encoder-decoder's decoder inputs are an input of the program (teacher forcing), not made inside it.
        given = {} if decoder_input_ids is None else {"decoder_input_ids": decoder_input_ids}
        return extract_logits(self.adapter.forward(input_ids, attention_mask, **given), self.adapter.name)


@dataclass(frozen=True)
class ExportRun:
    """What an export wrote: the model, the format and weight dtype, the inputs and the shapes traced and
    checked, the parity batches' data (DataSplits.describe's fields), the artifact's size and the tolerances its
    parity is judged by; `to_dict()` is the JSON's "config"."""

    model: str
    task: str
    format: str
    precision: str
    precision_reason: str
    inputs: list
    trace_shape: list
    parity_shapes: list
    max_len: int
    described: DataDescription
    repeats: int
    bytes: int
    rel_tolerance: tuple
    argmax_agreement: tuple

    def to_dict(self) -> dict:
        """The data's fields flat beside the others, as the JSON has always had them."""
        d = asdict(self)
        described = d.pop("described")
        return {**d, **described}


@dataclass(repr=False)
class ExportResult(Result):
    """What `export` wrote and how the artifact compares with eager."""

    path: str
    config: ExportRun
    metadata: dict
    checks: list
    latency: list  # per shape and runner: n, median/IQR ms

    @property
    def table(self) -> pd.DataFrame:
        """Parity rows: relative max |Δ| and argmax agreement per batch shape."""
        return checks_table(self.checks)

    def summary_line(self) -> str:
        c = self.config
        return f"export {c.model} to {self.path} ({c.format}, {c.precision}): parity {self.verdict}"

    @property
    def latency_table(self) -> pd.DataFrame:
        """Per batch shape and runner (the index), n and the milliseconds rounded to their spread; `.latency`
        keeps them whole."""
        return round_to_spread(pd.DataFrame(self.latency)).set_index(["shape", "runner"])

    def plot(self):
        from matplotlib.figure import Figure

        lat = pd.DataFrame(self.latency)
        fig = Figure(figsize=(7, 4), layout="constrained")
        ax = fig.subplots()
        shapes, runners = list(dict.fromkeys(lat["shape"])), list(dict.fromkeys(lat["runner"]))
        width = 0.8 / len(runners)
        for i, runner in enumerate(runners):
            rows = lat[lat["runner"] == runner].set_index("shape").loc[shapes]
            ax.bar([j + i * width for j in range(len(shapes))], rows["median_ms"], width,
                   yerr=rows["iqr_ms"] / 2, capsize=3, label=f"{runner} (n={int(rows['n'].iloc[0])})")
        ax.set_xticks([j + width * (len(runners) - 1) / 2 for j in range(len(shapes))], shapes)
        ax.set(ylabel="ms per forward (median, IQR bars)", xlabel="batch x tokens",
               title=f"{self.config.model} · {self.config.format} · {self.config.precision} · "
                     f"{self.metadata['device_name']}")
        ax.legend()
        return fig

    def to_json(self) -> dict:
        return jsonable({"schema": SCHEMA, "status": self.status, "path": self.path, "config": self.config,
                         "metadata": self.metadata, "parity": self.table, "latency": self.latency})


@chooses_threads  # the run's torch thread count, chosen as it starts
def export(model, path, data=None, config: ExportConfig | dict | None = None, *, model_kwargs: dict | None = None,
           **overrides) -> ExportResult:
    """Export `model` (an nn.Module, adapter or load_model spec, built with `model_kwargs`) to `path` and check
    it against eager. Batch and sequence axes are dynamic (sequence up to max_len).

    data: None (the bundled corpus) or any form build_datasets takes: the parity batches, and the traced
        one unless the config gives an example.
    config / overrides: an ExportConfig (or dict) and/or its field names as keywords.
    A model torch.export cannot capture raises ExportError naming the construct and where it is.
    """
    cfg = merge(ExportConfig, config, overrides, "export")
    fmt = cfg.format
    prec = resolve_precision(cfg.precision, "cpu", warn=False)
    if fmt == "onnx":
        _require("onnxruntime", "onnxscript", "onnx")
    source = resolve_model(model, **(model_kwargs or {}))
    # A copy: the caller's model keeps its device, dtype and mode.
    adapter = replace(source, model=_exportable(copy.deepcopy(source.model), prec.dtype).to("cpu", prec.dtype).eval())
    wrapper = _Logits(adapter).eval()
    keys = adapter.task.export_inputs
    t_trace = min(16, adapter.max_len)
    shapes = [(1, max(2, t_trace // 2)), (4, min(adapter.max_len, 64))]
    splits = adapter.datasets(data, max(s[1] for s in shapes), chat=cfg.chat)
    trace = (_example(cfg.example, keys, adapter) if cfg.example is not None
             else _batch(splits, 2, t_trace, keys, adapter))
    program = _capture(wrapper, trace, adapter, fmt)
    payload = _serialize(program, trace, keys, fmt, adapter.name)
    written = atomic_write_bytes(path, payload)
    runner, skip = _runner(fmt, payload, keys)
    checks, latency, labels = [], [], []
    with torch.inference_mode():
        for b, t in shapes:
            batch = _batch(splits, b, t, keys, adapter)
            # the batch as padded: to its longest row, at most t
            label = adapter.task.shape_label(adapter, len(batch[0]), batch[0].shape[1])
            labels.append(label)
            if runner is None:
                checks += [Check(f"{name} ({label})", "SKIP", detail=skip) for name in ("logits rel max |Δ|",
                                                                                       "argmax agreement")]
                continue
            checks += _parity(wrapper(*batch).float(), runner(batch).float(), prec.tolerances(), label)
            latency += _latency(wrapper, runner, batch, label, cfg.repeats, fmt)
    labels = [adapter.task.shape_label(adapter, b, t) for b, t in shapes]
    config = ExportRun(adapter.name, adapter.task.name, fmt, prec.name, prec.reason, inputs=list(keys),
                       trace_shape=list(trace[0].shape), parity_shapes=labels,
                       max_len=adapter.max_len, described=splits.describe(), repeats=cfg.repeats, bytes=len(payload),
                       rel_tolerance=prec.tolerances().export, argmax_agreement=prec.tolerances().agreement)
    metadata = {**run_metadata("cpu", prec.dtype), "runtime": _runtime_version(fmt)}
    return ExportResult(str(written), config, metadata, checks, latency)


def _exportable(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """`model` as torch.export can capture it: a 4-bit (QLoRA) model merged and dequantised into `dtype`
    (engine.quantization.merge_to_plain: its adapters folded into the base, the plain model `--merge` writes), since
    bitsandbytes' Params4bit is a tensor subclass torch.export refuses; any other model as it is."""
    return merge_to_plain(model, dtype) if quantized_layers(model) else model


def _require(*modules: str) -> None:
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ExportError(f"ONNX export needs {', '.join(missing)}: pip install \"tier_utils[export]\"")


def _runtime_version(fmt: str) -> str:
    if fmt == "onnx":
        import onnxruntime

        return f"onnxruntime {onnxruntime.__version__}"
    return f"torch.export {torch.__version__}"


def _example(example, keys, adapter) -> tuple:
    if isinstance(example, torch.Tensor):
        example = {"input_ids": example}
    if not isinstance(example, dict) or "input_ids" not in example:
        raise ExportError("example must be token ids (B, T) or a batch dict with input_ids")
    ids = example["input_ids"].long().cpu()
    return _inputs({"attention_mask": torch.ones_like(ids), **example, "input_ids": ids}, keys, adapter)


def _batch(splits, b: int, t: int, keys, adapter) -> tuple:
    """The first `b` validation examples, padded as the task pads a batch and cut to `t` tokens (each side of a pair
    to `t`)."""
    batch = next(iter(make_loader(splits.val, min(b, len(splits.val)), collate=splits.collate, shuffle=False)))
    return tuple(x[:, :t].contiguous() for x in _inputs(batch, keys, adapter))


def _inputs(batch: dict, keys, adapter) -> tuple:
    """The program's inputs from a batch: the task's own (an encoder-decoder's decoder inputs, from its targets)
    where the batch holds none."""
    made = adapter.task.model_inputs(adapter, batch[adapter.task.input_key], batch.get("labels"))
    return tuple(batch[k] if k in batch else made[k] for k in keys)


def _reason(exc: BaseException) -> str:
    """The root cause's first line, and the user's code it points at when torch says."""
    root = exc
    while root.__cause__ is not None and root.__cause__ is not root:
        root = root.__cause__
    text = str(root)
    where = re.search(r'File "([^"]+)", line (\d+), in (\w+)', text.split("The following call raised this error:")[-1])
    at = f" at {where.group(1)}:{where.group(2)} in {where.group(3)}()" if where else ""
    return describe(root, text=text.strip().splitlines()[0] if text.strip() else None) + at


@contextlib.contextmanager
def _quiet():
    """On failure torch.export prints the partial graph to stderr and logs notes: the one-line error says
    what matters, so they are held back (on success too: they are notes on torch's internals)."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _capture(wrapper, trace: tuple, adapter, fmt: str):
    from torch.export import Dim

    batch, seq = Dim("batch", max=4096), Dim("seq", max=adapter.max_len)
    target = Dim("target", max=adapter.max_len)  # an encoder-decoder's target length, apart from its source's
    # Token inputs: dynamic batch and length (a decoder's its own); an image model's pixels: dynamic batch at its
    # own image size.
    dynamic = tuple(({0: batch, 1: target if key.startswith("decoder") else seq} if adapter.task.reads_tokens
                     else {0: batch}) for key in adapter.task.export_inputs[:len(trace)])
    try:
        with _quiet():
            return torch.export.export(wrapper, trace, dynamic_shapes=dynamic)
    except Exception as exc:
        raise ExportError(f"cannot export {adapter.name} to {fmt}: torch.export stopped on {_reason(exc)}; make "
                          "that code traceable (no Python branch or .item() on tensor values; torch.cond for a "
                          "data-dependent branch)") from exc


def _serialize(program, trace: tuple, keys, fmt: str, name: str) -> bytes:
    if fmt == "pt2":
        buf = io.BytesIO()
        torch.export.save(program, buf)
        return buf.getvalue()
    try:
        with _quiet():  # and torch.onnx's notes on axis names and decompositions
            onnx_program = torch.onnx.export(program, trace, input_names=list(keys), output_names=["logits"],
                                             dynamo=True, verbose=False)
    except Exception as exc:
        raise ExportError(f"cannot export {name} to onnx: {_reason(exc)}; that op has no ONNX translation, "
                          "try format='pt2'") from exc
    return onnx_program.model_proto.SerializeToString()


def _runner(fmt: str, payload: bytes, keys):
    """A callable batch -> logits tensor for the written artifact, or (None, why) if this runtime can't run it."""
    if fmt == "pt2":
        program = torch.export.load(io.BytesIO(payload)).module()
        return (lambda batch: program(*batch)), None
    import onnxruntime as ort

    options = ort.SessionOptions()
    # torch's thread count, and no spinning between runs: spinning threads would starve the eager runs
    # interleaved with them, and a fair latency comparison uses the same cores.
    options.intra_op_num_threads = torch.get_num_threads()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = ort.InferenceSession(payload, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # e.g. no CPU kernel for bf16 in onnxruntime
        return None, f"onnxruntime cannot load it on this CPU: {one_line(exc)[:200]}"
    return (lambda batch: torch.from_numpy(session.run(None, {k: v.numpy() for k, v in zip(keys, batch)})[0])), None


def _parity(eager: torch.Tensor, out: torch.Tensor, tolerances: Tolerances, label: str) -> list[Check]:
    diff = (out - eager).abs()
    max_abs = diff.max().item()
    rel = max_abs / max(eager.abs().max().item(), 1e-12)
    pass_at, warn_at = tolerances.export
    status = "PASS" if rel <= pass_at else "WARN" if rel <= warn_at else "FAIL"
    checks = [Check(f"logits rel max |Δ| ({label})", status, rel, pass_at,
                    f"max |Δ| {max_abs:.3g} over {eager.numel():,} logits, relative to max |eager| "
                    f"(WARN up to {warn_at:g})")]
    top2 = eager.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) > 2 * max_abs  # a near-tie may flip without anything wrong
    agree = out.argmax(-1) == eager.argmax(-1)
    n = int(decisive.sum())
    value = agree[decisive].float().mean().item() if n else 1.0
    pass_at, warn_at = tolerances.agreement
    status = "PASS" if value >= pass_at else "WARN" if value >= warn_at else "FAIL"
    checks.append(Check(f"argmax agreement ({label})", status, value, pass_at,
                        f"over n={n} of {agree.numel()} positions not tied within 2 x max |Δ|; all positions: "
                        f"{agree.float().mean().item():.4f} (WARN down to {warn_at:g})"))
    return checks


def _latency(wrapper, runner, batch, label: str, repeats: int, fmt: str) -> list[dict]:
    """CPU milliseconds per forward, eager and artifact interleaved (drift hits both alike), 2 untimed each."""
    name = "onnxruntime" if fmt == "onnx" else "torch.export"
    calls = {"eager": lambda: wrapper(*batch), name: lambda: runner(batch)}
    for call in calls.values():
        call(), call()
    timers = {k: StepTimer("cpu") for k in calls}
    for _ in range(repeats):
        for k, call in calls.items():
            with timers[k].region():
                call()
    stats = {k: summarize(timer.milliseconds()) for k, timer in timers.items()}
    return [{"shape": label, "runner": k, "n": s.n, "median_ms": s.median, "iqr_ms": s.iqr, "min_ms": s.min,
             "max_ms": s.max} for k, s in stats.items()]
