"""Issue 50, item 6: a run whose final loss is not finite exits 1 with one line naming the first non-finite step and
the likeliest cause (weights non-finite at load, every step skipped by fp16's GradScaler, the learning rate); a
weight fp16 makes inf is named before training. Tiny models made here."""
import os
import warnings

import pytest
import torch
from IPython.core.interactiveshell import InteractiveShell
from tiny import TINY, TINY_ARGS, tiny

from tier_utils.cli import main
from tier_utils.core.device import GPU_PROFILE_ENV
from tier_utils.core.errors import TrainingDiverged
from tier_utils.core.precision import SlowPrecisionWarning
from tier_utils.training.loop import train

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RUN = dict(batch_size=4, seq_len=16, eval_batches=1, progress=False, device="cpu")
CLI_RUN = ["--batch-size", "4", "--seq-len", "16", "--eval-batches", "1", "--no-progress", "--device", "cpu"]
# logits x 7e4: inside fp32's range, past fp16's (65504) under fp16 autocast, whose every step then overflows
LOUD = '''
from tier_utils import TinyGPT


class Loud(TinyGPT):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs) * 7e4
'''
SKIPPED = "likeliest cause: fp16's GradScaler skipped every step (4 of 4)"


@pytest.fixture(autouse=True)
def _quiet_slow_precision():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowPrecisionWarning)
        yield


@pytest.fixture
def loud(tmp_path) -> str:
    (tmp_path / "loud.py").write_text(LOUD)
    return f"{tmp_path / 'loud.py'}:Loud"


@pytest.fixture(scope="module")
def big_weight_llama(tmp_path_factory) -> str:
    """A tiny Llama saved in bf16 (transformers' LlamaConfig, save_pretrained) holding one weight of 1e6."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("llama-1e6")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                         vocab_size=256)).to(torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = 1e6
    model.save_pretrained(folder)
    return str(folder)


def test_a_weight_fp16_makes_inf_is_named_before_training_and_bf16_runs_it(big_weight_llama, tmp_path, capsys,
                                                                           monkeypatch):
    # Before: auto picked fp16 on the T4, all 4 steps were skipped, losses NaN, exit 0.
    monkeypatch.setenv(GPU_PROFILE_ENV, "T4")
    args = ["train", "--model", big_weight_llama, "--data", "synthetic", "--max-steps", "4", *CLI_RUN]
    assert main([*args, "--out", str(tmp_path / "fp16")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: fp16 would overflow: model.layers.0.mlp.up_proj.weight holds values beyond")
    assert "bf16 or fp32 will run it" in err
    assert not (tmp_path / "fp16" / "metrics.csv").exists()  # refused before training: nothing written
    assert main([*args, "--out", str(tmp_path / "bf16"), "--precision", "bf16"]) == 0


def test_every_step_skipped_exits_1_naming_the_first_step_and_the_scaler(loud, tmp_path, capsys):
    # Before: 4 skipped steps, train_loss NaN, exit 0 with no word.
    code = main(["train", "--model", loud, *TINY_ARGS, "--precision", "fp16", "--max-steps", "4", *CLI_RUN,
                 "--out", str(tmp_path)])
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert code == 1 and len(errors) == 1
    assert " at step 1 in fp16 and the run ended with train_loss nan; " in errors[0] and SKIPPED in errors[0]
    assert (tmp_path / "metrics.csv").exists()  # what the run has is still written


def test_the_same_line_in_a_notebook(loud, capsys, monkeypatch):
    monkeypatch.delenv("TIER_UTILS_DEBUG", raising=False)
    shell = InteractiveShell.instance()
    try:
        shell.run_cell(f"import tier_utils\ntier_utils.train(tier_utils.load_model({loud!r}, **{TINY!r}), "
                       f"precision='fp16', max_steps=4, **{RUN!r})")
    finally:
        InteractiveShell.clear_instance()
    shown = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(shown) == 1 and "error: " in shown[0] and SKIPPED in shown[0], shown


def test_weights_non_finite_at_load_are_the_cause_not_the_learning_rate():
    model = tiny(seed=0)
    with torch.no_grad():
        model.head.weight[0, 0] = float("nan")
    with pytest.raises(TrainingDiverged) as info:
        train(model, precision="fp32", max_steps=4, **RUN)
    message = str(info.value)
    assert message.startswith("loss became nan at step 1 in fp32; likeliest cause: non-finite weights at load: "
                              "head.weight held NaN or inf")
    assert "lower lr" not in message and info.value.result.summary.diverged == message


def test_a_run_that_diverges_on_its_own_still_names_the_learning_rate():
    # Steps that ran fine before the overflowing ones: neither at load nor "every step".
    model = tiny(seed=0)
    calls = []
    model.head.weight.register_hook(lambda grad: calls.append(1) or (grad * float("inf") if len(calls) > 2 else grad))
    with pytest.raises(TrainingDiverged) as info:
        train(model, precision="fp16", max_steps=30, log_every=5, eval_every=0, **RUN)
    assert info.value.step == 19 and "likeliest cause: the learning rate; lower lr" in str(info.value)
