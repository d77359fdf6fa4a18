"""The planner per rank: DDP's and FSDP's bytes per rank from the model's own pieces, the smallest N per mode,
the CLI verb."""
import json

import pytest
import torch

from tier_utils import TinyGPT
from tier_utils.cli import main
from tier_utils.core.budget import ActivationFit, Budget
from tier_utils.planning.planner import GPU_COLUMNS, device_room, gpu_room, static_bytes
from tier_utils.planning.ranks import CPU_RANK_PROCESS_BYTES, RankPlan, RanksResult, plan_ranks

MODEL = dict(d_model=32, n_layer=3, n_head=2, max_len=32)


def test_ddp_holds_everything_per_rank_and_fsdp_a_shard_plus_the_units_in_flight():
    torch.manual_seed(0)
    model = TinyGPT(**MODEL)
    result = plan_ranks(model, seq_len=32, precision="fp32", device="cpu", ranks=(1, 2, 4), progress=False)
    p, t = result.plan, result.full_table().set_index(["mode", "ranks"])
    whole = sum(static_bytes(model).values())
    block = sum(q.numel() for q in model.blocks[0].parameters())
    root = sum(q.numel() for q in model.parameters()) - 3 * block
    assert p.block_params == block and p.root_params == root
    assert (p.weight_bytes, p.reduce_bytes) == (4, 4)  # fp32: gathered, and reduced, as stored
    for n in (1, 2, 4):
        # DDP: the whole static state and its gradient buckets (one more copy of the gradients) on every rank
        grads = 4 * sum(q.numel() for q in model.parameters())
        assert t.loc[("ddp", n), "static_per_rank_gib"] * 2**30 == whole + grads
        assert t.loc[("fsdp", n), "static_per_rank_gib"] * 2**30 == pytest.approx(whole / n, abs=1)
        # the root's and the running block's weights and gradients, the next block's all-gather output, the
        # previous block's reduce-scatter input
        assert t.loc[("fsdp", n), "in_flight_gib"] * 2**30 == root * (4 + 4) + block * (4 + 4 + 4 + 4)
        assert t.loc[("fsdp", n), "root_reduce_gib"] * 2**30 == root * (4 + 4)  # its gradients, reduce-scatter input
        # foreach AdamW's temporary (one copy of the weights it steps) is the optimizer step's own peak
        weights = 4 * sum(q.numel() for q in model.parameters())
        assert t.loc[("fsdp", n), "optimizer_step_gib"] * 2**30 == -(-weights // n)
        backward = p.in_flight("fsdp", n) + p.fit.k + 2 * p.per_sequence()
        assert p.step_bytes("fsdp", n, 2) == int(-(-whole // n) + max(backward, root * 8, -(-weights // n)))
    # CPU ranks share this machine's RAM: more of them leave each a smaller batch
    assert t.loc[("ddp", 4), "this_device"] < t.loc[("ddp", 1), "this_device"]
    mixed = plan_ranks(model, seq_len=32, precision="bf16", device="cpu", ranks=(2,), progress=False).plan
    assert (mixed.weight_bytes, mixed.reduce_bytes) == (2, 4)  # gathered in bf16, reduced in fp32
    assert mixed.in_flight("fsdp", 2) == root * (2 + 2) + block * (2 + 2 + 2 + 4)
    assert mixed.root_reduce("fsdp", 2) == root * (2 + 4) and mixed.in_flight("ddp", 2) == 0


def test_the_root_reduce_is_the_peak_of_a_model_that_is_mostly_root():
    # a 1 GiB root (an embedding, say) and tiny blocks, no activations: FSDP's last reduce holds the root's
    # gradients and their fp32 reduce-scatter input at once, more than backward's gathered bf16 weights and grads
    fit = ActivationFit(k=0, a=0, c=0, output_per_token=0, measured=())
    plan = RankPlan({"weights_bytes": 2**32, "grads_bytes": 2**32, "optimizer_state_bytes": 2**33},
                    root_params=2**30, block_params=10, weight_bytes=2, reduce_bytes=4, fit=fit, length=8)
    assert plan.root_reduce("fsdp", 2) == 6 * 2**30 > plan.in_flight("fsdp", 2)
    assert plan.step_bytes("fsdp", 2, 1) == 2**33 + 6 * 2**30
    assert plan.largest_batch("fsdp", 2, 2**33 + 6 * 2**30 - 1) == 0


def test_a_cpu_rank_adds_its_process_and_a_gpu_rank_does_not():
    fit = ActivationFit(k=0, a=1e5, c=0, output_per_token=0, measured=())
    plan = RankPlan({"weights_bytes": 2**28, "grads_bytes": 2**28, "optimizer_state_bytes": 2**29},
                    root_params=10**6, block_params=10**6, weight_bytes=4, reduce_bytes=4, fit=fit, length=128)
    model = {"model": "m", "parameters": 2**26}
    cpu = RanksResult(plan, (2,), "fp32", model, Budget("cpu", 64 * 2**30, "test"), {})
    gpu = RanksResult(plan, (2,), "fp32", model, Budget("cuda", 64 * 2**30, "test"), {})
    assert cpu.process_bytes == CPU_RANK_PROCESS_BYTES > 0 and gpu.process_bytes == 0
    for mode in ("ddp", "fsdp"):
        assert cpu.rank_bytes(mode, 2, 3) == plan.step_bytes(mode, 2, 3) + CPU_RANK_PROCESS_BYTES
        assert gpu.rank_bytes(mode, 2, 3) == plan.step_bytes(mode, 2, 3)
    t = cpu.table.set_index("mode")
    room = device_room(cpu.budget) / 2 - CPU_RANK_PROCESS_BYTES  # each CPU rank's share of RAM, less its process
    assert t.loc["fsdp", "this_device"] == plan.largest_batch("fsdp", 2, room)
    assert "process's own" in t.loc["fsdp", "detail"] and "process's own" not in gpu.table.detail[0]


def test_the_smallest_n_per_mode_is_where_batch_one_first_fits_per_card():
    gib = 2**30
    # 16 GiB of static state with small units: DDP fits the 40 and 80 GB cards alone, FSDP more over more ranks.
    fit = ActivationFit(k=0, a=1e5, c=0, output_per_token=0, measured=())
    plan = RankPlan({"weights_bytes": 4 * gib, "grads_bytes": 4 * gib, "optimizer_state_bytes": 8 * gib},
                    root_params=10**7, block_params=10**7, weight_bytes=4, reduce_bytes=4, fit=fit, length=128)
    budget = Budget("cpu", 64 * gib, "test")
    result = RanksResult(plan, (1, 2, 4, 8), "fp32", {"model": "m", "parameters": 10**9}, budget, {})
    smallest = result.smallest().set_index("mode")
    for column, card in GPU_COLUMNS.items():
        want = next(n for n in (1, 2, 4, 8) if plan.step_bytes("fsdp", n, 1) <= gpu_room(card.memory_mib))
        assert smallest.loc["fsdp", column] == want
        ddp = smallest.loc["ddp", column]  # DDP's copy per rank never shrinks: 1 or none
        assert ddp == 1 if plan.step_bytes("ddp", 1, 1) <= gpu_room(card.memory_mib) else pd_isna(ddp)
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
