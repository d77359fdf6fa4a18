"""The planner per rank: for N ranks under each strategy that runs on ranks (DDP, FSDP2 and any registered), the
bytes each rank holds and the largest batch per rank, on this machine and predicted on the GPU table with 2, 4 and
8 of each card; the smallest N at which the model trains under each. This module measures the pieces (RankPlan),
holds each strategy class's formula over them (BYTE_MODELS: a strategy without one of its own takes its base
class's) and tabulates.

Per rank, at batch B and length T (S: the static bytes of the fit planner, weights + gradients + AdamW state):
- DDP: every rank holds S, plus DDP's gradient buckets (one more copy of the gradients: torch's default
  gradient_as_bucket_view=False), plus the activations of its B sequences.
- FSDP: S / N (each rank its shard), plus the units in flight while a block runs its backward, as FSDP2 holds
  them (torch.distributed.fsdp._fully_shard): the root's gathered weights and unsharded gradients (the root is
  gathered through the whole forward and backward, and its gradients are reduced last); the running block's
  gathered weights and unsharded gradients; the next block's all-gather output (prefetched); the previous
  block's reduce-scatter input (kept until this block's reduce starts, in the reduce dtype: fp32 for the mixed
  modes); plus the activations of its B sequences. Weights gather and gradients come back in the
  MixedPrecisionPolicy's param dtype.
Activations are the fit planner's measured fit (planner.plan), the same for both modes. Two more phases can be
a rank's peak after backward's activations are gone: FSDP's reduce of the root (its unsharded gradients and
their reduce-scatter input), and the optimizer step, where foreach AdamW holds one temporary the size of the
weights it steps (the rank's shard under FSDP); a rank's peak is the largest phase.

A CPU rank is a process in this machine's RAM: besides its tensors it holds what a run adds that no tensor
count sees (the process group, the data, the loop's Python objects and the modules it imports), stated as
CPU_RANK_PROCESS_BYTES and measured by bench/fsdp_cpu.py on a model too small to need memory of its own. N CPU
ranks share the machine's RAM, so here each rank gets 1/N of it, less that; a GPU rank has its card (the GPU
table's margin covers the CUDA context). Every figure but this device's free memory is predicted, and says so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
import torch

from ..adapter.adapter import resolve_model
from ..core.budget import ActivationFit, Budget, gib, read_budget
from ..core.files import jsonable
from ..core.memory_settings import MemorySettings
from ..core.precision import resolve_device, resolve_precision
from ..core.results import Result, run_metadata
from ..core.settings import check_fields, device_field, merge, precision_field, progress_field, setting
from ..engine.activation_checkpointing import repeated_blocks
from ..engine.strategies import DDP, FSDP, Strategy, launched_strategies, strategy_class
from ..models.builtins import DEFAULT_MODEL
from .planner import GPU_COLUMNS, MARGIN_NOTE, device_room, gpu_room, gpus_mib, plan, static_bytes

# What a CPU rank's training run holds beyond its tensors (process group, data, Python objects, modules imported
# as the run starts): measured by bench/fsdp_cpu.py on a 74,688-parameter GPT-2 (bench/RESULTS.md, issue 33): a
# rank's peak RSS increase 0.081-0.082 GiB under DDP and FSDP, of which its tensors 0.003 GiB.
CPU_RANK_PROCESS_BYTES = 80 << 20


@dataclass
class RanksConfig:
    """What `ranks` plans: the length, the precision (resolved on this device) and the rank counts."""

    seq_len: int | None = setting(None, "tokens per sequence (none: the model's max length)", low=1)
    precision: str = precision_field()
    ranks: tuple[int, ...] = setting((1, 2, 4, 8), "rank counts to plan for, e.g. 1,2,4,8")
    device: str | torch.device | None = device_field()
    progress: bool = progress_field()

    def __post_init__(self):
        self.ranks = tuple(sorted({int(n) for n in self.ranks}))
        if not self.ranks or min(self.ranks) < 1:
            raise ValueError(f"ranks must be whole numbers >= 1, e.g. 1,2,4,8; got {self.ranks!r}")
        check_fields(self)


@dataclass
class RankPlan:
    """The measured pieces of the per-rank prediction, for one model, precision and length."""

    static: dict  # weights_bytes, grads_bytes, optimizer_state_bytes of the whole model (fp32 master weights)
    root_params: int  # parameters FSDP's root unit gathers (all not in a repeated block)
    block_params: int  # parameters of the largest repeated block (0: none)
    weight_bytes: int  # bytes per element of a gathered weight and of its unsharded gradient (the param dtype)
    reduce_bytes: int  # bytes per element of a reduce-scatter input (the reduce dtype)
    fit: ActivationFit
    length: int

    def static_per_rank(self, strategy, n: int) -> int:
        """The weights, gradients and AdamW state a rank holds under `strategy` (a class, or its name)."""
        return byte_model(strategy).static(self, n)

    def in_flight(self, strategy, n: int) -> int:
        """What a rank holds beside its static state while a block runs its backward (FSDP's units in flight)."""
        return byte_model(strategy).in_flight(self, n)

    def root_reduce(self, strategy, n: int) -> int:
        """What a rank holds after backward's activations are gone, before the optimizer step (FSDP's root reduce)."""
        return byte_model(strategy).root_reduce(self, n)

    def optimizer_transient(self, strategy, n: int) -> int:
        """foreach AdamW's temporary during the step: one copy of the weights this rank steps."""
        return byte_model(strategy).optimizer_transient(self, n)

    def per_sequence(self) -> float:
        return self.fit.per_sequence(self.length) + self.fit.output_per_token * self.length

    def step_bytes(self, strategy, n: int, batch: int) -> int:
        """Predicted peak tensor bytes of one rank during a training step at `batch` sequences per rank: its
        static state plus the largest of backward's (units in flight, activations), FSDP's root reduce and the
        optimizer step's transient."""
        backward = self.in_flight(strategy, n) + self.fit.k + batch * self.per_sequence()
        return int(self.static_per_rank(strategy, n) + max(backward, self.root_reduce(strategy, n),
                                                           self.optimizer_transient(strategy, n)))

    def largest_batch(self, strategy, n: int, room: float) -> int:
        if self.step_bytes(strategy, n, 0) > room:
            return 0
        return max(0, int((room - self.static_per_rank(strategy, n) - self.in_flight(strategy, n) - self.fit.k)
                          // self.per_sequence()))


class WholeModel:
    """A rank holding the whole model (one process, and a strategy on ranks with no formula of its own): its whole
    static state, nothing in flight beside it, foreach AdamW's temporary the size of the weights."""

    def __init__(self, strategy: type[Strategy]):
        self.strategy = strategy

    def static(self, plan: RankPlan, n: int) -> int:
        return sum(plan.static.values())

    def in_flight(self, plan: RankPlan, n: int) -> int:
        return 0

    def root_reduce(self, plan: RankPlan, n: int) -> int:
        return 0

    def optimizer_transient(self, plan: RankPlan, n: int) -> int:
        return plan.static["weights_bytes"]


class DDPBuckets(WholeModel):
    """DDP: the whole model, plus its gradient buckets unless they are views of the gradients (the strategy's
    gradient_as_bucket_view)."""

    def static(self, plan, n):
        buckets = 0 if self.strategy.gradient_as_bucket_view else plan.static["grads_bytes"]
        return super().static(plan, n) + buckets


class FSDPShards(WholeModel):
    """FSDP2: 1/N of the static state, the units in flight while a block runs its backward, the root's reduce, and
    the optimizer's temporary over this rank's shard."""

    def static(self, plan, n):
        return -(-sum(plan.static.values()) // n)

    def in_flight(self, plan, n):
        """The root's and the running block's gathered weights and unsharded gradients, the next block's all-gather
        output, the previous block's reduce-scatter input."""
        w, r = plan.weight_bytes, plan.reduce_bytes
        return plan.root_params * 2 * w + plan.block_params * (2 * w + w + r)

    def root_reduce(self, plan, n):
        """After backward's activations are gone: the root's unsharded gradients and their reduce-scatter input (its
        gathered weights are freed first)."""
        return plan.root_params * (plan.weight_bytes + plan.reduce_bytes)

    def optimizer_transient(self, plan, n):
        return -(-plan.static["weights_bytes"] // n)


BYTE_MODELS = {Strategy: WholeModel, DDP: DDPBuckets, FSDP: FSDPShards}  # a subclass takes its base's


def byte_model(strategy) -> WholeModel:
    """The per-rank formula of `strategy` (a class, or its name): its own, or its nearest base class's."""
    cls = strategy_class(strategy)
    return next(BYTE_MODELS[c] for c in cls.__mro__ if c in BYTE_MODELS)(cls)


def rank_plan(adapter, precision, length: int) -> RankPlan:
    """Measure the pieces on the adapter's (unsharded) model: static bytes, unit sizes, the activation fit."""
    model = adapter.model
    blocks = repeated_blocks(model)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    policy = precision.mixed_precision_policy()  # what FSDP gathers in and reduces in (None: the stored dtype)
    weight = (policy.param_dtype or precision.param_dtype).itemsize
    reduce = policy.reduce_dtype.itemsize if policy.reduce_dtype is not None else weight
    (config,), _ = plan(adapter, [precision.name], length)
    return RankPlan(static_bytes(model, precision), root, block, weight, reduce, config.fit, length)


@dataclass(repr=False)
class RanksResult(Result):
    plan: RankPlan
    ranks: tuple[int, ...]
    precision: str
    model: dict
    budget: Budget
    metadata: dict
    at: str = ""  # the length planned, in the task's words ("T=32", "32x32 pixels")
    # The strategies planned (every registered one that runs on torchrun's ranks), decided as the result is made.
    strategies: tuple = field(default_factory=lambda: tuple(strategy_class(n) for n in launched_strategies()))

    @property
    def process_bytes(self) -> int:
        """What a rank here holds beyond its tensors: CPU_RANK_PROCESS_BYTES in this machine's RAM; 0 on a GPU,
        whose process lives in host memory."""
        return CPU_RANK_PROCESS_BYTES if self.budget.device == "cpu" else 0

    def rank_bytes(self, strategy, n: int, batch: int) -> int:
        """A rank's predicted peak on this device during a step: its tensors (RankPlan.step_bytes) and, on a
        CPU, its process's own (the figure bench/fsdp_cpu.py checks against each rank's peak RSS increase)."""
        return self.plan.step_bytes(strategy, n, batch) + self.process_bytes

    def _here(self, n: int) -> float:
        room = device_room(self.budget)
        return room / n if self.budget.device == "cpu" else room  # CPU ranks share this machine's RAM

    # What every plan here assumes of the memory: no LoRA, QLoRA, checkpointing or 8-bit optimizer is planned per rank.
    MEMORY = MemorySettings().describe()

    @property
    def table(self) -> pd.DataFrame:
        """At most 12 columns: per mode and rank count, the static bytes a rank holds, its largest batch here and on
        each card, and the detail; each phase's bytes in full_table() (ranks.csv, the JSON)."""
        keep = ["mode", "ranks", "static_per_rank_gib", "this_device", *GPU_COLUMNS, "status", "detail"]
        return self.full_table()[keep[:10] + keep[-2:]]

    def full_table(self) -> pd.DataFrame:
        p, rows = self.plan, []
        for strategy in self.strategies:
            mode = strategy.name
            for n in self.ranks:
                here = p.largest_batch(strategy, n, self._here(n) - self.process_bytes)
                row = {"mode": mode, "ranks": n, "static_per_rank_gib": p.static_per_rank(strategy, n) / 2**30,
                       "in_flight_gib": p.in_flight(strategy, n) / 2**30,
                       "root_reduce_gib": p.root_reduce(strategy, n) / 2**30,
                       "optimizer_step_gib": p.optimizer_transient(strategy, n) / 2**30,
                       "per_sample_gib": p.per_sequence() / 2**30, "process_gib": self.process_bytes / 2**30,
                       "this_device": here}
                row.update({column: p.largest_batch(strategy, n, gpu_room(card.memory_mib))
                            for column, card in GPU_COLUMNS.items()})
                row["status"] = "PASS" if here >= 1 else "WARN"
                process = f", its process's own {gib(self.process_bytes)} included" if self.process_bytes else ""
                row["detail"] = (f"{mode} on {n} rank(s): {gib(self.rank_bytes(strategy, n, max(here, 1)))} per rank "
                                 f"at batch {max(here, 1)} per rank, {self._at()} (predicted{process}); this device "
                                 f"gives each rank {gib(self._here(n))}")
                rows.append(row)
        return pd.DataFrame(rows)

    def smallest(self) -> pd.DataFrame:
        """Per mode, the smallest N (of those planned) at which batch 1 per rank fits, here and on each GPU."""
        t = self.table
        columns = ["this_device", *GPU_COLUMNS]
        rows = []
        for mode in (strategy.name for strategy in self.strategies):
            fits = t[t["mode"] == mode]
            rows.append({"mode": mode, **{c: next((int(n) for n, b in zip(fits.ranks, fits[c]) if b >= 1), None)
                                          for c in columns}})
        return pd.DataFrame(rows)

    def headline(self) -> str:
        return (f"ranks: {self.model['model']} ({self.model['parameters']:,} parameters) at {self._at()}, "
                f"{self.precision}, {self.MEMORY}: per-rank bytes and largest batch per rank under "
                f"{self._labels(' and ')} (predicted; {MARGIN_NOTE})")

    def overview(self) -> pd.DataFrame:
        return self.table.drop(columns=["detail"])

    def summary_line(self) -> str:
        """One line for `all`: the smallest N per mode on the first GPU of the table and here."""
        s = self.smallest().set_index("mode")
        gpu = next(iter(GPU_COLUMNS))

        def said(v):
            return f"N={int(v)}" if pd.notna(v) else f"none up to {max(self.ranks)}"

        def each(column):
            return ", ".join(f"{c.label} {said(s.loc[c.name, column])}" for c in self.strategies)

        return (f"ranks: smallest N that trains at {self._at()} ({self.precision}, {self.MEMORY}), predicted: "
                f"{gpu.replace(' (predicted)', '')} {each(gpu)}; here {each('this_device')}")

    def _at(self) -> str:
        return self.at or f"T={self.plan.length}"

    def _labels(self, between: str) -> str:
        return between.join(c.label for c in self.strategies)

    def to_json(self) -> dict:
        p = self.plan
        return jsonable({"status": self.status, "seq_len": p.length, "precision": self.precision, "model": self.model,
                         "budget": self.budget.to_dict(), "margin": MARGIN_NOTE, "gpus_mib": gpus_mib(),
                         "static_bytes": p.static, "root_params": p.root_params, "block_params": p.block_params,
                         "weight_bytes_per_param": p.weight_bytes, "reduce_bytes_per_param": p.reduce_bytes,
                         "process_bytes": self.process_bytes, "activation_fit": p.fit,
                         "memory": self.MEMORY, "table": self.full_table(), "smallest": self.smallest(),
                         "run_metadata": self.metadata})

    def plot(self):
        from matplotlib.figure import Figure

        t = self.full_table()
        fig = Figure(figsize=(8, 4), layout="constrained")
        ax = fig.add_subplot()
        for strategy in self.strategies:
            rows = t[t["mode"] == strategy.name]
            ax.plot(rows.ranks, rows.static_per_rank_gib + rows.in_flight_gib, marker="o",
                    label=f"{strategy.label} (predicted)")
        for card in GPU_COLUMNS.values():
            ax.axhline(gpu_room(card.memory_mib) / 2**30, lw=0.6, ls=":", color="grey")
            ax.annotate(card.label, (max(self.ranks), gpu_room(card.memory_mib) / 2**30), fontsize=7, ha="right",
                        va="bottom")
        ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="static + in-flight GiB per rank")
        ax.set_xticks(self.ranks, [str(n) for n in self.ranks])
        ax.legend(fontsize=8)
        ax.set_title(self.headline()[:150], fontsize=8)
        return fig


def plan_ranks(model=DEFAULT_MODEL, config: RanksConfig | dict | None = None, *, model_kwargs: dict | None = None,
               **overrides) -> RanksResult:
    """What each rank holds under each strategy that runs on ranks (DDP, FSDP and any registered) for each N in
    `ranks`, and the largest batch per rank here and predicted on the GPU table; `.smallest()` names the smallest N
    per strategy. It reads no data.

    model: an nn.Module, an adapter or a load_model spec (`model_kwargs` build it).
    config / overrides: a RanksConfig (or dict) and/or its field names as keywords."""
    cfg = merge(RanksConfig, config, overrides, "ranks")
    dev = resolve_device(cfg.device)
    adapter = resolve_model(model, **(model_kwargs or {}))
    adapter.model.to(dev)
    budget = read_budget(dev)
    adapter.require_trainable()
    precision = resolve_precision(cfg.precision, dev, warn=False)
    length = adapter.fit_length(cfg.seq_len or adapter.max_len)
    return RanksResult(rank_plan(adapter, precision, length), cfg.ranks, precision.name, adapter.summary(), budget,
                       run_metadata(dev, precision.dtype), adapter.task.length_words(length))
