"""Tiers on models of real size: smoke, analyze and `all --fast` on GPT-2-small and GPT-2-medium configs
(random weights, `hf:GPT2LMHeadModel`), and smoke and `fit` on a Llama-3.2-1B-shaped config (1.24 B
parameters, `hf:LlamaForCausalLM` with its sizes and a 2048-token context), each one's wall time and peak RSS
next to one plain training step of the same model at 1 x 1024, all measured in this run.

Each measurement runs in its own subprocess (the CLI, as a user runs it; the step as a bare torch loop), so
its peak RSS is that child's alone (os.wait4's ru_maxrss). The plain step: forward with labels, backward,
optimizer step, fp32, no autocast, one sequence of 1024 tokens; two steps, the second timed (the first pays
one-time allocations). Its optimizer is AdamW, except on the 1 B config, where AdamW's 9.9 GB of state does
not fit beside the model on this machine: plain SGD there (the same forward and backward). Targets (issue 24)
for GPT-2-small on a 2-core CPU: smoke <= 6 steps and <= 4 GiB peak RSS, analyze <= 6 steps; (issue 32)
`all --fast` <= 4 GiB peak RSS on GPT-2-small, and on the 1 B config smoke's peak RSS within weights +
gradients + the budget smoke states (the safe share of free memory its JSON records), fit's within weights + the
budget it states (it runs no backward).

The machine is watched while a child runs: if available RAM falls under --min-free-gib, the child is
killed and the script stops (a shared machine must not be pushed into swap or the OOM killer).

`--models llama-3b` (issue 42): `fit` on a Llama-3.2-3B shape (3.2 B parameters) at 1 x 1024, the model built in
bf16 (as the hub stores it; 6.4 GB of RSS, no fp32 copy) in a child, and the row `fit` names for a T4: the
cheapest mode predicted to fit there (LoRA over an fp16 base, with AdamW8bit and checkpointing as needed).

`--models t5-small`: smoke and `all --fast` on a T5-small shape (60 M parameters, an encoder-decoder) under the
GPT-2-small budgets; its plain step feeds the same 1024 tokens as source and target.

`--models vit-base,vit-small`: smoke on a ViT-Base/16 shape (86 M parameters, 224 x 224), smoke and `all --fast` on
a ViT-Small/16 shape (22 M) on the bundled shapes, under the GPT-2-small budgets; their plain step is 8 images.

    python bench/scale.py [--models small,medium,llama-1b,llama-3b,t5-small,vit-base,vit-small] [--verbs smoke,fit]
                          [--threads N]
                          [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from tier_utils.core.device import cpu_name
from tier_utils.core.files import write_json
from tier_utils.core.measure import load_average

# name: (transformers class, its config's sizes, the optimizer of the plain step, the verbs measured)
CONFIGS = {"small": ("GPT2LMHeadModel", {"n_embd": 768, "n_layer": 12, "n_head": 12}, "AdamW",  # 124 M
                     ("smoke", "analyze", "all --fast")),
           "medium": ("GPT2LMHeadModel", {"n_embd": 1024, "n_layer": 24, "n_head": 16}, "AdamW",  # 355 M
                      ("smoke", "analyze", "all --fast")),
           # Llama-3.2-1B's sizes (1.24 B parameters, tied embeddings), its context cut to 2048 tokens.
           "llama-1b": ("LlamaForCausalLM", {"vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                                             "num_hidden_layers": 16, "num_attention_heads": 32,
                                             "num_key_value_heads": 8, "max_position_embeddings": 2048,
                                             "tie_word_embeddings": True, "rope_theta": 500000.0}, "SGD",
                        ("smoke", "fit")),
           # T5-small's sizes (60 M parameters): an encoder-decoder under the GPT-2-small budgets (issue 48).
           "t5-small": ("T5ForConditionalGeneration", {"vocab_size": 32128, "d_model": 512, "d_kv": 64, "d_ff": 2048,
                                                       "num_layers": 6, "num_heads": 8, "pad_token_id": 0,
                                                       "eos_token_id": 1, "decoder_start_token_id": 0}, "AdamW",
                        ("smoke", "all --fast")),
           # ViT-Base/16 (86 M parameters, 224 x 224) and ViT-Small/16 (22 M): image classifiers (issue 49), with the
           # bundled shapes' 4 classes (random weights: nothing pretrained for the data to resize).
           "vit-base": ("ViTForImageClassification", {"hidden_size": 768, "num_hidden_layers": 12,
                                                      "num_attention_heads": 12, "intermediate_size": 3072,
                                                      "image_size": 224, "patch_size": 16, "num_labels": 4}, "AdamW",
                        ("smoke",)),
           "vit-small": ("ViTForImageClassification", {"hidden_size": 384, "num_hidden_layers": 12,
                                                       "num_attention_heads": 6, "intermediate_size": 1536,
                                                       "image_size": 224, "patch_size": 16, "num_labels": 4},
                         "AdamW", ("smoke", "all --fast"))}
NAMES = {"small": "GPT-2-small", "medium": "GPT-2-medium", "llama-1b": "Llama-3.2-1B-shaped",
         "t5-small": "T5-small-shaped", "vit-base": "ViT-Base-shaped", "vit-small": "ViT-Small-shaped"}
# The plain step's batch: one sequence of 1024 tokens (its own target too), or for an image classifier 8 images of
# 224 x 224 (1,576 patch tokens, about as many as the text's).
_TEXT_BATCH = "ids = torch.randint(0, model.config.vocab_size, (1, 1024)); batch = dict(input_ids=ids, labels=ids)"
_IMAGE_BATCH = "batch = dict(pixel_values=torch.randn(8, 3, 224, 224), labels=torch.randint(0, 2, (8,)))"
# Llama-3.2-3B's sizes (3.21 B parameters, tied embeddings), fit at 1 x 1024 only: see _T4_FIT.
LLAMA_3B = {"vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
            "num_attention_heads": 24, "num_key_value_heads": 8, "max_position_embeddings": 1024,
            "tie_word_embeddings": True, "rope_theta": 500000.0}
_T4_FIT = """
import json, sys, time, torch, transformers
from tier_utils import fit
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)  # stored as the hub stores it: no fp32 copy of 3.2 B weights
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{kwargs}))
torch.set_default_dtype(torch.float32)
start = time.perf_counter()
plan = fit(model, batch_size=1, seq_len=1024, precisions="fp32,bf16,fp16", device="cpu", progress=False,
           validate=False)
seconds = time.perf_counter() - start
t4 = plan.cheapest()["T4 16 GB (predicted)"]
row = plan.full_table().set_index("mode").loc[t4.name] if t4 else None
print(plan.headline())
print(plan.summary_line())
print(json.dumps({{"seconds": seconds, "t4_mode": t4 and t4.name, "t4_step_gib": row is not None and row.step_gib,
                  "t4_bytes_per_param": row is not None and row.bytes_per_param,
                  "t4_largest_batch": row is not None and int(row["T4 16 GB (predicted)"])}}))
"""
TARGETS = {"smoke": 6.0, "analyze": 6.0}  # steps, for GPT-2-small
RSS_TARGET_GIB = 4.0  # smoke's and all --fast's, for GPT-2-small
_STEP = """
import sys, time, torch, transformers
torch.manual_seed(0)
cls = getattr(transformers, {cls!r})
model = cls(cls.config_class(**{kwargs})).train()
opt = getattr(torch.optim, {optimizer!r})(model.parameters(), lr=1e-4)
{batch}
times = []
for _ in range(2):
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    opt.step()
    times.append(time.perf_counter() - t0)
print(times[0], times[1])
"""


CHILD_ENV = dict(os.environ)


class TooLittleMemory(RuntimeError):
    pass


# Runs the command as its only child: RUSAGE_CHILDREN is then that child's own peak RSS (KiB on Linux).
_WRAP = ("import resource, subprocess, sys; rc = subprocess.call(sys.argv[1:]); "
         "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
         "sys.exit(rc)")


def measure(argv: list[str], min_free: int) -> dict:
    """Run argv in a subprocess: wall time, peak RSS (GiB), exit code, stdout. Killed if available RAM drops
    below `min_free`."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", _WRAP, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, start_new_session=True, env=CHILD_ENV)
    low, done = [], threading.Event()

    def watch():
        while not done.wait(0.5):
            available = psutil.virtual_memory().available
            if available < min_free:
                low.append(available)
                os.killpg(child.pid, signal.SIGKILL)  # the wrapper and what it runs
                return

    threading.Thread(target=watch, daemon=True).start()
    try:
        out, err = child.communicate()
    except BaseException:  # Ctrl-C: the child is in its own session, so it must be ended here
        os.killpg(child.pid, signal.SIGKILL)
        raise
    finally:
        done.set()
    wall = time.perf_counter() - start
    if low:
        raise TooLittleMemory(f"killed {' '.join(argv[2:5])}: available RAM fell to {low[0] / 2**30:.1f} GiB")
    if child.returncode not in (0, 1):  # 1: a check FAILed; the run is still a measurement
        raise RuntimeError(f"{' '.join(argv)} exited {child.returncode}: {err[-1500:]}")
    rss = [line.split()[1] for line in err.splitlines() if line.startswith("peak_rss_kib ")]
    return {"seconds": wall, "rc": child.returncode, "stdout": out, "peak_rss_gib": int(rss[-1]) / 2**20}


def model_args(cls: str, kwargs: dict) -> list[str]:
    return ["--model", f"hf:{cls}", *[a for k, v in kwargs.items() for a in ("--model-arg", f"{k}={v}")]]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="small,medium",
                        help="comma-separated: small, medium, llama-1b, t5-small, vit-base, vit-small (run in "
                             "this order)")
    parser.add_argument("--min-free-gib", type=float, default=6.0, help="abort when available RAM falls below")
    parser.add_argument("--threads", type=int, default=os.cpu_count(),
                        help="torch threads of every child, the plain step's included (default: one per core)")
    parser.add_argument("--verbs", help="comma-separated: only these of each model's verbs (default: all)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    # The same count everywhere: tier_utils would otherwise pick its own from the load, which the previous
    # child has just raised, and the step and the tiers would run on different thread counts.
    CHILD_ENV["OMP_NUM_THREADS"] = str(args.threads)
    names = [n for n in CONFIGS if n in args.models.split(",")]
    t4 = "llama-3b" in args.models.split(",")
    py, min_free = sys.executable, int(args.min_free_gib * 2**30)
    print(f"{cpu_name()} · {os.cpu_count()} cores · {psutil.virtual_memory().total / 2**30:.0f} GiB RAM · "
          f"load {load_average()} · {args.threads} torch threads in every child", flush=True)
    rows, stopped = [], None
    try:
        for name in names:
            measure_model(name, py, min_free, rows, args.verbs.split(",") if args.verbs else None)
        if t4:
            rows.append(t4_fit(py, min_free))
    except TooLittleMemory as exc:
        stopped = str(exc)
        print(f"stopped: {exc}", flush=True)
    for other in ("t5-small", "vit-base", "vit-small"):  # under the GPT-2-small budgets
        row = next((r for r in rows if r["model"] == NAMES[other]), None)
        said = [verb for verb in ("smoke", "all --fast") if row and verb in row]
        if said:
            steps = (f"smoke {row['smoke']['steps']:.2f} <= {TARGETS['smoke']:g} steps: "
                     + ("met" if row["smoke"]["steps"] <= TARGETS["smoke"] else "NOT met") + " · ") \
                if "smoke" in said else ""
            print(f"targets, {row['model']}: " + steps
                  + " · ".join(f"{verb} peak RSS {row[verb]['peak_rss_gib']:.2f} <= {RSS_TARGET_GIB:g} GiB: "
                               + ("met" if row[verb]["peak_rss_gib"] <= RSS_TARGET_GIB else "NOT met")
                               for verb in said), flush=True)
    small = next((r for r in rows if r["model"] == "GPT-2-small"), None)
    if small and all(verb in small for verb in (*TARGETS, "all --fast")):
        met = ["met" if small[verb]["steps"] <= limit else "NOT met" for verb, limit in TARGETS.items()]
        rss = small["smoke"]["peak_rss_gib"]
        all_rss = small["all --fast"]["peak_rss_gib"]
        print("targets, GPT-2-small: " + " · ".join(f"{verb} {small[verb]['steps']:.2f} <= {limit:g} steps: {m}"
                                                    for (verb, limit), m in zip(TARGETS.items(), met))
              + f" · smoke peak RSS {rss:.2f} <= {RSS_TARGET_GIB:g} GiB: "
              + ("met" if rss <= RSS_TARGET_GIB else "NOT met")
              + f" · all --fast peak RSS {all_rss:.2f} <= {RSS_TARGET_GIB:g} GiB: "
              + ("met" if all_rss <= RSS_TARGET_GIB else "NOT met"))
    big = next((r for r in rows if r["model"] == NAMES["llama-1b"]), None)
    for verb, held in (("smoke", "weights + gradients"), ("fit", "weights")):
        if big and verb in big:
            s = big[verb]
            print(f"target, {big['model']}: {verb} peak RSS {s['peak_rss_gib']:.2f} <= {held} + stated budget = "
                  f"{s['allowed_gib']:.2f} GiB: " + ("met" if s["peak_rss_gib"] <= s["allowed_gib"] else "NOT met"),
                  flush=True)
    if args.json:
        write_json(args.json, {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": args.threads,
                               "load_average_1m": load_average(), "rows": rows, "stopped": stopped})
    return 3 if stopped else 0


def measure_model(name: str, py: str, min_free: int, rows: list, only: list | None = None) -> None:
    """One model's row, appended to `rows` before its verbs run (those in `only`, if given): a run stopped
    half-way keeps what it measured."""
    cls, kwargs, optimizer, verbs = CONFIGS[name]
    verbs = [v for v in verbs if only is None or v in only]
    batch = _IMAGE_BATCH if cls.endswith("ForImageClassification") else _TEXT_BATCH
    step = measure([py, "-c", _STEP.format(cls=cls, kwargs=kwargs, optimizer=optimizer, batch=batch)], min_free)
    first_s, step_s = map(float, step["stdout"].split())
    row = {"model": NAMES[name], "class": cls, **kwargs, "step_optimizer": optimizer, "step_s": step_s,
           "first_step_s": first_s, "step_peak_rss_gib": step["peak_rss_gib"], "load_average_1m": load_average()}
    rows.append(row)
    shape = "8 x 224 x 224 images" if batch == _IMAGE_BATCH else "1 x 1024"
    print(f"{NAMES[name]}: plain fp32 step ({optimizer}) at {shape}: {step_s:.1f} s (first {first_s:.1f} s), "
          f"peak RSS {step['peak_rss_gib']:.2f} GiB", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        words = {"smoke": ["smoke"], "analyze": ["analyze"], "fit": ["fit"],
                 "all --fast": ["all", "--fast", "--out", str(Path(tmp) / "all")]}
        for verb in verbs:
            out = Path(tmp) / "out.json"
            got = measure([py, "-m", "tier_utils", *words[verb], *model_args(cls, kwargs), "--no-progress",
                           "--json", str(out)], min_free)
            row[verb] = {"seconds": got["seconds"], "steps": got["seconds"] / step_s,
                         "peak_rss_gib": got["peak_rss_gib"], "exit_code": got["rc"]}
            line = (f"  {verb:<11} {got['seconds']:7.1f} s = {got['seconds'] / step_s:5.2f} steps · peak RSS "
                    f"{got['peak_rss_gib']:.2f} GiB")
            if verb in ("smoke", "fit"):  # next to what it states it may use
                row[verb].update(stated_budget(json.loads(out.read_text()), gradients=verb == "smoke"))
                held = (f" + gradients {row[verb]['weights_gib']:.2f}" if verb == "smoke" else "")
                line += (f" (weights {row[verb]['weights_gib']:.2f}{held} + stated budget "
                         f"{row[verb]['budget_gib']:.2f} = {row[verb]['allowed_gib']:.2f} GiB)")
            print(line + f" · exit {got['rc']} · load {load_average()}", flush=True)
            if verb == "all --fast":  # where its time went
                tiers = json.loads(out.read_text())["tiers"]
                row[verb]["tier_seconds"] = {t["tier"]: t["seconds"] for t in tiers}
                print("    " + " · ".join(f"{t['tier']} {t['seconds']:.0f} s" for t in tiers), flush=True)


def t4_fit(py: str, min_free: int) -> dict:
    """fit on the Llama-3.2-3B shape at 1 x 1024 in a child: the mode it names for a T4 (predicted), printed."""
    got = measure([py, "-c", _T4_FIT.format(kwargs=LLAMA_3B)], min_free)
    lines = got["stdout"].strip().splitlines()
    found = json.loads(lines[-1])
    print("\n".join(lines[:-1]), flush=True)
    print(f"Llama-3.2-3B-shaped at 1x1024: fit {found['seconds']:.0f} s, peak RSS {got['peak_rss_gib']:.2f} GiB; "
          f"T4 (predicted): {found['t4_mode'] or 'no mode fits'}"
          + (f", step {found['t4_step_gib']:.2f} GiB, {found['t4_bytes_per_param']:.2f} static bytes per parameter, "
             f"largest batch {found['t4_largest_batch']}" if found["t4_mode"] else ""), flush=True)
    return {"model": "Llama-3.2-3B-shaped", **LLAMA_3B, "fit_peak_rss_gib": got["peak_rss_gib"], **found}


def stated_budget(report: dict, gradients: bool) -> dict:
    """Smoke's or fit's JSON: its weights, and the safe share of free memory it says its probes plan for (GiB);
    what it may hold: weights, gradients where it runs a backward (smoke; fit runs forwards only), the share."""
    weights = report["model"]["parameter_bytes"] / 2**30
    limit = report["budget"]["limit_bytes"] / 2**30
    return {"weights_gib": weights, "budget_gib": limit, "allowed_gib": (1 + gradients) * weights + limit,
            "budget_source": report["budget"]["source"], "free_gib": report["budget"]["free_bytes"] / 2**30}


if __name__ == "__main__":
    sys.exit(main())
