"""Tier 1 on a model in the current recipe: zero-initialised residual projections, scalar gates, T > 1 asserted."""
import pytest
import torch
from styles import ZeroInitGPT

from tier_utils import smoke
from tier_utils.smoketest.checks import _own_limit


@pytest.fixture(scope="module")
def recipe():
    torch.manual_seed(0)
    model = ZeroInitGPT()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = smoke(model, batch_sizes=(1,), seq_lens=(16,), device="cpu", progress=False)  # every group
    return model, before, report.table.set_index("check")


def test_modern_recipe_gets_no_fail_and_names_the_scheme(recipe):
    model, before, rows = recipe
    assert "FAIL" not in set(rows.status), rows.to_string()
    zero = rows.loc["gradients: non-zero"]
    assert zero.status == "PASS" and "zero-init residual scheme" in zero.detail
    assert "after one optimizer step on a copy" in zero.detail and "every gradient flows" in zero.detail
    assert "blocks.0.attn.c_q.weight" in zero.detail and "blocks.0.attn.c_proj.weight" in zero.detail
    const = rows.loc["init: constant weight matrices"]
    assert const.status == "PASS" and "4 all-zero residual output projections" in const.detail
    assert rows.loc["gradients: vanishing layers"].status == "PASS"
    gates = rows.loc["gradients: scalars and 1-d tensors"]
    assert "backout_lambda" in gates.detail and "judged apart" in gates.detail
    # the re-check stepped a copy: the model's own weights are as they were
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_the_models_own_shape_limit_is_a_warn_quoting_it(recipe):
    _, _, rows = recipe
    one = rows.loc["shapes: seq len 1"]
    assert one.status == "WARN" and one.value == "refused"
    assert "the model's own limit: Training forward pass should have T > 1 (AssertionError at styles.py:" in one.detail
    assert rows.loc["shapes: batch 1"].status == "PASS"


class StillZero(ZeroInitGPT):
    """A gate frozen at zero by the forward itself: one step changes nothing, so zero stays a FAIL."""

    def forward(self, input_ids):
        for block in self.blocks:
            block.lambdas.data.zero_()
        return super().forward(input_ids)


def test_zero_gradients_that_stay_zero_after_the_step_fail():
    torch.manual_seed(0)
    rows = smoke(StillZero(), checks="gradients", device="cpu", progress=False).table.set_index("check")
    zero = rows.loc["gradients: non-zero"]
    assert zero.status == "FAIL" and "still exactly zero after one optimizer step" in zero.detail


def test_a_crash_inside_a_layer_stays_a_fail():
    def deep():
        torch.ones(2, 3) @ torch.ones(2, 3)  # torch's own shape error

    with pytest.raises(RuntimeError) as err:
        deep()
    assert _own_limit(err.value) is None

    def torch_value_error():
        torch.nn.functional.cross_entropy(torch.ones(2, 3), torch.ones(3, dtype=torch.long))

    with pytest.raises(ValueError) as err:
        torch_value_error()
    assert _own_limit(err.value) is None  # raised inside torch: not the model's own limit

    def bare():
        T = 1
        assert T > 1

    with pytest.raises(AssertionError) as err:
        bare()
    assert _own_limit(err.value).startswith("assert ")  # pytest's rewrite fills the message in; else the line
    assert "(AssertionError at test_recipes.py:" in _own_limit(err.value)
