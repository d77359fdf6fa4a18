"""train --strategy fsdp with LoRA and with compile, under torchrun: 2 CPU ranks with gloo, fp32, deterministic, a
2-block tiny GPT; both runs in one launch.

LoRA's adapters (peft) over the frozen base are sharded with it and train as one process with the same global
batch does, within 1e-5, and the consolidated last.pt holds the adapters (save_hf of such a run is refused);
torch.compile of the sharded model (aot_eager here: dynamo and AOTAutograd's graphs around FSDP's hooks, without a
C++ build) runs its steps compiled, with the same losses.
"""
from __future__ import annotations

import json
import warnings

import pandas as pd
import pytest
from torchrun import TWO_BLOCK_ARGS, TWO_BLOCKS, ok, text_file, torchrun, worker_script

from tier_utils import TrainConfig, load_model
from tier_utils.core.memory_settings import MemorySettings
from tier_utils.engine.lora import describe_lora
from tier_utils.training.loop import train

pytestmark = pytest.mark.slow
PER_RANK_BATCH, STEPS = 2, 4


def _losses(history: pd.DataFrame) -> list[float]:
    return history.query("kind == 'step'")["train_loss"].tolist()


def test_lora_and_compile_run_sharded(tmp_path):
    text = text_file(tmp_path / "text.txt")
    worker = tmp_path / "worker.py"
    worker.write_text(worker_script(cheap_compile=True))
    common = ["--model", "tiny-gpt", *TWO_BLOCK_ARGS, "--device", "cpu", "--precision", "fp32", "--batch-size",
              str(PER_RANK_BATCH), "--seq-len", "16", "--max-steps", str(STEPS), "--log-every", "1", "--eval-every",
              "0", "--eval-batches", "1", "--deterministic", "--no-progress", "--data", str(text), "--strategy", "fsdp"]
    ok(torchrun([str(worker), "train", *common, "--lora", "r=4,alpha=8", "--consolidate", "--out",
                 str(tmp_path / "lora"), "--json", str(tmp_path / "lora.json"), "--next",
                 "train", *common, "--compile", "--out", str(tmp_path / "compiled"), "--json",
                 str(tmp_path / "compiled.json")]))
    lora, compiled = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("lora", "compiled"))
    kwargs = dict(model_kwargs=TWO_BLOCKS, precision="fp32", device="cpu", batch_size=2 * PER_RANK_BATCH, seq_len=16,
                  max_steps=STEPS, log_every=1, eval_every=0, eval_batches=1, deterministic=True, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        single_lora = train("tiny-gpt", str(text), memory=MemorySettings(lora="r=4,alpha=8"), **kwargs)
        single = train("tiny-gpt", str(text), **kwargs)

    assert lora["strategy"] == "fsdp" and "each of 2 Block blocks" in lora["sharding"]
    assert lora["lora"]["r"] == 4 and lora["lora"]["trainable_parameters"] < lora["parameters"] / 2
    assert _losses(pd.read_csv(tmp_path / "lora" / "metrics.csv")) == pytest.approx(_losses(single_lora.history),
                                                                                    rel=1e-5)
    # The consolidated last.pt holds the adapters, as a one-process LoRA run's does: load_model wraps the base again.
    model = load_model(str(tmp_path / "lora" / "checkpoints" / "last.pt"))
    assert describe_lora(model)["r"] == 4
    assert all(p.any() for n, p in model.named_parameters() if "lora_B" in n)  # trained: peft starts B at zero
    with pytest.raises(ValueError, match="save_hf of a LoRA run under fsdp"):
        TrainConfig(strategy="fsdp", memory=MemorySettings(lora=4), save_hf=str(tmp_path / "hf"))
    assert compiled["strategy"] == "fsdp" and compiled["compiled"], compiled["compile_reason"]
    assert _losses(pd.read_csv(tmp_path / "compiled" / "metrics.csv")) == pytest.approx(_losses(single.history),
                                                                                        rel=1e-5)
