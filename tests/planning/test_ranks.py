"""The planner per rank: DDP's and FSDP's bytes per rank from the model's own pieces, the smallest N per mode,
the CLI verb."""
import json

import pytest
import torch

from tier_utils import TinyGPT
from tier_utils.cli import main
from tier_utils.core.budget import ActivationFit, Budget
from tier_utils.planning.planner import GPUS, gpu_room, static_bytes
from tier_utils.planning.ranks import RankPlan, RanksResult, plan_ranks

MODEL = dict(d_model=32, n_layer=3, n_head=2, max_len=32)


def test_ddp_holds_everything_per_rank_and_fsdp_a_shard_plus_the_units_in_flight():
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    result = plan_ranks(model, seq_len=32, precision="fp32", device="cpu", ranks=(1, 2, 4), progress=False)
    p, t = result.plan, result.table.set_index(["mode", "ranks"])
    whole = sum(static_bytes(model).values())
    block = sum(q.numel() for q in model.blocks[0].parameters())
    assert p.block_params == block
    assert p.root_params == sum(q.numel() for q in model.parameters()) - 3 * block
    assert p.gathered_bytes == 8  # fp32: the gathered weight and its unsharded gradient
    for n in (1, 2, 4):
        # DDP: the whole static state and its gradient buckets (one more copy of the gradients) on every rank
        grads = 4 * sum(q.numel() for q in model.parameters())
        assert t.loc[("ddp", n), "static_per_rank_gib"] * 2**30 == whole + grads
        assert t.loc[("fsdp", n), "static_per_rank_gib"] * 2**30 == pytest.approx(whole / n, abs=1)
        assert t.loc[("fsdp", n), "in_flight_gib"] * 2**30 == (p.root_params + 2 * block) * 8
        # foreach AdamW's temporary (one copy of the weights it steps) is the optimizer step's own peak
        weights = 4 * sum(q.numel() for q in model.parameters())
        assert t.loc[("fsdp", n), "optimizer_step_gib"] * 2**30 == -(-weights // n)
        backward = p.in_flight("fsdp", n) + p.fit.k + 2 * p.per_sequence()
        assert p.step_bytes("fsdp", n, 2) == int(-(-whole // n) + max(backward, -(-weights // n)))
    # CPU ranks share this machine's RAM: more of them leave each a smaller batch
    assert t.loc[("ddp", 4), "this_device"] < t.loc[("ddp", 1), "this_device"]
    mixed = plan_ranks(model, seq_len=32, precision="bf16", device="cpu", ranks=(2,), progress=False)
    assert mixed.plan.gathered_bytes == 2 + 2 + 4  # bf16 weight and gradient, and the fp32 copy reduced


def test_the_smallest_n_per_mode_is_where_batch_one_first_fits_per_card():
    gib = 2**30
    # 16 GiB of static state with small units: DDP fits the 40 and 80 GB cards alone, FSDP more over more ranks.
    fit = ActivationFit(k=0, a=1e5, c=0, output_per_token=0, measured=())
    plan = RankPlan({"weights_bytes": 4 * gib, "grads_bytes": 4 * gib, "optimizer_state_bytes": 8 * gib},
                    root_params=10**7, block_params=10**7, gathered_bytes=8, fit=fit, length=128)
    budget = Budget("cpu", 64 * gib, "test")
    result = RanksResult(plan, (1, 2, 4, 8), "fp32", {"model": "m", "parameters": 10**9}, budget, {})
    smallest = result.smallest().set_index("mode")
    for name, mib in GPUS.items():
        want = next(n for n in (1, 2, 4, 8) if plan.step_bytes("fsdp", n, 1) <= gpu_room(mib))
        assert smallest.loc["fsdp", f"{name} (predicted)"] == want
        ddp = smallest.loc["ddp", f"{name} (predicted)"]  # DDP's copy per rank never shrinks: 1 or none
        assert ddp == 1 if plan.step_bytes("ddp", 1, 1) <= gpu_room(mib) else pd_isna(ddp)
    assert smallest.loc["fsdp", "T4 16 GB (predicted)"] == 2 and pd_isna(smallest.loc["ddp", "L4 24 GB (predicted)"])
    assert "T4 16 GB DDP none up to 8, FSDP N=2" in result.summary_line()


def pd_isna(value) -> bool:
    import pandas as pd

    return bool(pd.isna(value))


def test_ranks_cli_writes_its_table_and_the_smallest_n(tmp_path, capsys):
    out = tmp_path / "ranks.json"
    args = [a for k, v in MODEL.items() for a in ("--model-arg", f"{k}={v}")]
    assert main(["ranks", "--model", "tiny-gpt", *args, "--device", "cpu", "--precision", "fp32", "--ranks", "2,4",
                 "--seq-len", "16", "--no-progress", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["mode"], r["ranks"]) for r in data["table"]] == [("ddp", 2), ("ddp", 4), ("fsdp", 2), ("fsdp", 4)]
    assert [r["mode"] for r in data["smallest"]] == ["ddp", "fsdp"] and data["seq_len"] == 16
    assert "smallest N that trains" in capsys.readouterr().out
