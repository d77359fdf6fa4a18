"""The task as an object: a task defined here runs through smoke, train and the benchmark like the built-in ones."""
import pytest
import torch
from tiny import TINY

import tier_utils
from tier_utils import TinyGPT
from tier_utils.core.errors import AdapterError
from tier_utils.tasks import CausalLM, register_task, task_named


class CountingLM(CausalLM):
    """A causal LM whose loss counts its calls: proof that every tier scores through the task it was handed."""

    name = "counting-lm"
    aliases = ()
    calls = 0

    def loss(self, logits, labels):
        CountingLM.calls += 1
        return super().loss(logits, labels)


register_task(CountingLM())


class CountingGPT(TinyGPT):
    task = "counting-lm"


def test_a_task_defined_here_runs_through_smoke_train_and_bench():
    model = CountingGPT(**TINY)
    before = CountingLM.calls
    report = tier_utils.smoke(model, checks=["shapes", "gradients"], device="cpu", progress=False)
    assert report.model["task"] == "counting-lm" and report.passed
    after_smoke = CountingLM.calls
    assert after_smoke > before
    trained = tier_utils.train(model, "synthetic", max_steps=2, batch_size=2, seq_len=16, eval_batches=1,
                               progress=False, device="cpu")
    assert trained.summary.task == "counting-lm" and CountingLM.calls > after_smoke
    bench = tier_utils.amp_benchmark(model, "synthetic", precisions=("fp32",), batch_size=2, seq_len=16, repeats=1,
                                     timed_steps=1, accuracy_steps=1, eval_batches=1, progress=False, device="cpu")
    assert bench.config.task == "counting-lm"


def test_unknown_task_is_one_line_naming_the_known_ones():
    with pytest.raises(AdapterError, match="unknown task 'translation'; use one of: causal-lm, classification, "):
        tier_utils.adapt(TinyGPT(**TINY), task="translation")
    assert task_named("Causal-LM") is task_named("causal_lm")


def test_a_task_name_cannot_be_taken_twice():
    with pytest.raises(ValueError, match="already name a task"):
        register_task(type("Other", (CausalLM,), {"name": "other-lm", "aliases": ("causal-lm",)})())


def test_a_module_attribute_named_task_that_is_no_task_is_left_alone():
    model = TinyGPT(**TINY)
    model.task = "summarise the docs"  # the model's own business
    assert tier_utils.adapt(model).task.name == "causal-lm"


def test_build_datasets_takes_a_task_object_or_its_name():
    by_name = tier_utils.build_datasets("synthetic", "classification", seq_len=8, num_classes=3)
    by_object = tier_utils.build_datasets("synthetic", task_named("classification"), seq_len=8, num_classes=3)
    assert torch.equal(by_name.train[0]["input_ids"], by_object.train[0]["input_ids"])
    assert by_name.train[0]["labels"].dim() == 0
