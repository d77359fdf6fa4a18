"""fit keeps to the budget it states: its probes are cut to fewer blocks where the whole model's would not fit,
extrapolated and said so, and the caller's model comes back bit for bit."""
import pytest
import torch
from profile_peak import peak_allocated

from tier_utils import TinyGPT
from tier_utils.core.budget import FREE_MEMORY_ENV
from tier_utils.engine.step import ROUNDING_SAMPLE, TrainStep, make_optimizer, rounding_sample
from tier_utils.planning.planner import fit
from tier_utils.planning.probe import PROBE_DEPTHS

# Wide and short: the probes' dtype copies of the weights outweigh their activations, as on a big model.
WIDE = dict(d_model=256, n_layer=12, n_head=4, max_len=8)
FREE = 24 << 20  # a stated budget (the safe share, half) of 12 MiB: the whole model's probe holds more


def _fit(model):
    return fit(model, seq_len=8, batch_size=1, device="cpu", progress=False)


def test_a_probe_over_the_budget_runs_on_fewer_blocks_within_it_and_predicts_the_same(monkeypatch):
    torch.manual_seed(0)
    model = TinyGPT(**WIDE)
    monkeypatch.setenv(FREE_MEMORY_ENV, "100GiB")  # the whole model's probe fits: measured as before
    whole, whole_peak = peak_allocated(lambda: _fit(model))
    monkeypatch.setenv(FREE_MEMORY_ENV, str(FREE))
    cut, cut_peak = peak_allocated(lambda: _fit(model))
    limit = cut.budget.limit
    assert limit == FREE // 2
    # The criterion fails the whole model's probing (bf16-true's converted copy beside the weights, autocast's
    # bf16 copies), and the cut probe keeps within the budget fit states.
    assert whole_peak > limit >= cut_peak, (whole_peak, limit, cut_peak)
    detail = cut.full_table().set_index("mode").detail
    assert detail.str.contains(f"probed with {PROBE_DEPTHS[0]} and {PROBE_DEPTHS[1]} of 12 blocks", regex=False).all()
    assert detail.str.contains("extrapolated to 12 (predicted)", regex=False).all()
    assert not whole.full_table().detail.str.contains("probed with").any()
    # Identical blocks: what one block adds, measured between two depths, gives the whole model's bytes.
    for a, b in zip(whole.configs, cut.configs):
        assert a.name == b.name and a.static == b.static
        assert b.per_sequence(8) == pytest.approx(a.per_sequence(8), rel=0.01), a.name
        assert b.fixed() == pytest.approx(a.fixed(), rel=0.01), a.name


def test_fit_gives_the_model_back_bit_for_bit():
    """The true modes convert the weights to 2 bytes to measure them; fit puts the originals back, not an fp32
    copy of their bf16 rounding."""
    torch.manual_seed(0)
    model = TinyGPT(d_model=32, n_layer=2, n_head=2, max_len=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit(model, seq_len=16, device="cpu", progress=False)
    after = model.state_dict()
    assert all(after[k].dtype == v.dtype and torch.equal(after[k], v) for k, v in before.items())


def test_the_rounded_away_count_compares_a_bounded_sample_of_each_parameter(monkeypatch):
    big = torch.arange(10 * ROUNDING_SAMPLE + 3, dtype=torch.float32)
    sample = rounding_sample(big)
    assert sample.numel() <= ROUNDING_SAMPLE and sample.data_ptr() == big.data_ptr()  # a view: nothing copied
    assert sample[0] == 0 and sample[-1] >= big.numel() - 11  # evenly spaced through the whole tensor
    small = torch.ones(3, 5)
    assert torch.equal(rounding_sample(small), small.reshape(-1))  # a small one whole
    # A step counts at most the sample of each parameter.
    monkeypatch.setattr("tier_utils.engine.step.ROUNDING_SAMPLE", 7)
    from tier_utils.adapter.adapter import adapt
    from tier_utils.core.precision import resolve_precision

    torch.manual_seed(0)
    adapter = adapt(TinyGPT(d_model=16, n_layer=1, n_head=2, max_len=8))
    step = TrainStep(adapter, resolve_precision("fp32", "cpu", warn=False), make_optimizer(adapter.model, 1e-3, 0.1),
                     count_rounding=True)
    out = step([adapter.example_batch(2, 8)])
    rounded, updated = out.rounding
    params = [p for p in adapter.model.parameters() if p.requires_grad]
    assert 0 < updated <= sum(min(7, p.numel()) for p in params) and 0 <= rounded <= updated
