"""LoRA over a new head and through each task's peft model (issue 50, item 5): a base folder loaded as a classifier
starts its head at random, and LoRA and QLoRA train that head in full beside the adapters (peft's modules_to_save),
save it in the checkpoint and the merged model, count it in fit's and the pre-flight's bytes, and say so. A
transformers model is wrapped as its task's peft model (a T5 as SEQ_2_SEQ_LM), and its checkpoint reloads as one."""
import warnings
from dataclasses import replace

import pytest
import torch

from tier_utils import load_model, train
from tier_utils.cli import main
from tier_utils.core.memory_settings import DecidedMemory, MemorySettings
from tier_utils.core.precision import resolve_precision
from tier_utils.engine.lora import LoraSettings, apply_lora, lora_static_bytes, trained_in_full
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.models.loading import ModelSource, record_source, source_of
from tier_utils.planning.memory_rows import mode_static_bytes
from tier_utils.planning.planner import static_bytes
from tier_utils.tasks import CLASSIFICATION, task_named
from tier_utils.training.host_memory import weights_of

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

BERT = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64)
AS_CLASSIFIER = {"task": "classification", "num_labels": 4}  # the bundled corpus' four topics
LORA = MemorySettings(lora=LoraSettings(r=4, alpha=8))
RUN = dict(max_steps=3, batch_size=4, seq_len=32, eval_every=0, eval_batches=1, progress=False, device="cpu",
           precision="fp32", lr=1e-2, seed=0)
IDS = torch.randint(5, 250, (2, 16), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def bert_base(tmp_path_factory):
    """A BertModel folder (no classifier head), as a base checkpoint is saved."""
    folder = tmp_path_factory.mktemp("bert-base")
    torch.manual_seed(0)
    transformers.BertModel(transformers.BertConfig(**BERT)).save_pretrained(folder)
    return folder


def _classifier(folder):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new head's and the byte tokenizer's warnings, tested below
        return load_model(str(folder), **AS_CLASSIFIER)


def test_the_loader_records_the_new_head_and_warns_naming_it(bert_base):
    with pytest.warns(UserWarning, match=r"classifier\.bias, classifier\.weight: .*new head starts at random"):
        model = load_model(str(bert_base), **AS_CLASSIFIER)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert source_of(model).new_modules == ("classifier",)


def test_a_new_module_is_trained_in_full_whatever_the_task_type():
    """What the loader started new is trained whole, also where peft's task type would not add it (a module outside
    a transformers model: peft's plain PeftModel)."""
    from tier_utils import TinyGPT

    model = TinyGPT(vocab_size=64, d_model=32, n_layer=1, n_head=2, max_len=16)
    record_source(model, ModelSource(None, new_modules=("head",)))
    assert trained_in_full(model, task_named("causal-lm")) == ("head",)
    wrapped = apply_lora(model, LoraSettings(r=2, alpha=4), task_named("causal-lm"))
    assert type(wrapped).__name__ == "PeftModel"  # not a transformers model: no task type
    trained = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert any(".head." in n for n in trained) and any("lora_" in n for n in trained)


def test_lora_bytes_count_the_trained_head_as_the_wrapped_model_holds_it(bert_base):
    model = _classifier(bert_base)
    fp32_base = DecidedMemory(LORA, torch.float32, "test")
    predicted = lora_static_bytes(model, fp32_base, task=CLASSIFICATION)
    wrapped = apply_lora(model, LORA.lora, CLASSIFICATION)
    assert predicted == static_bytes(wrapped)
    sizes = [p.numel() for p in wrapped.base_model.model.classifier.original_module.parameters()]
    head = sum(sizes)
    bare = _classifier(bert_base)
    record_source(bare, replace(source_of(bare), new_modules=()))  # as if its head were not new, outside a task:
    # adapters only
    without = lora_static_bytes(bare, fp32_base)
    assert {k: predicted[k] - without[k] for k in predicted} == {  # the head's fp32 copy, gradient, AdamW's moments
        "weights_bytes": 4 * head, "grads_bytes": 4 * head,
        "optimizer_state_bytes": fp32_base.optimizer.state_bytes(sizes)}


def test_the_host_memory_preflight_counts_the_head_of_the_task_it_builds(bert_base):
    """The meta-device build of a folder knows its task, and counts the classifier LoRA will train in full."""
    weights = weights_of(str(bert_base), AS_CLASSIFIER)
    assert weights.task is CLASSIFICATION
    memory = DecidedMemory(LORA, torch.float32, "test")
    fp32 = resolve_precision("fp32", "cpu", warn=False)
    with_head = mode_static_bytes(weights.module, fp32, memory, task=weights.task)
    head = [32 * 4, 4]  # the classifier's weight and bias: an fp32 copy, its gradient, the optimizer's state
    assert with_head - mode_static_bytes(weights.module, fp32, memory) == 8 * sum(head) + \
        memory.optimizer.state_bytes(head)


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    """A LlamaModel folder (no head), in bf16: its classifier's head is `score`, a Linear without bias."""
    folder = tmp_path_factory.mktemp("llama-base")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0)
    transformers.LlamaModel(config).to(torch.bfloat16).save_pretrained(folder)
    return folder


QLORA = MemorySettings.qlora(LoraSettings(r=4, alpha=8))


# bert-qlora: transformers keeps out of 4-bit only the module of the last parameter key (`classifier.bias`), so
# BERT's classifier weight was quantised and its training a traceback; Llama's `score` has no bias (a regression).
@pytest.mark.parametrize("base, head, memory", [
    ("bert_base", "classifier", LORA), ("llama_base", "score", LORA), ("bert_base", "classifier", QLORA),
    ("llama_base", "score", QLORA)], ids=["bert-lora", "llama-lora", "bert-qlora", "llama-qlora"])
def test_lora_and_qlora_train_the_new_head_and_the_checkpoint_keeps_it(request, tmp_path, monkeypatch, base, head,
                                                                        memory):
    # A CPU with native bf16: the run holds a bf16-stored base in bf16, as the checkpoint reloads it, so the logits
    # compare like with like (a CPU without it holds the base in fp32)
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")
    if memory.quantized:
        pytest.importorskip("bitsandbytes")
    folder = request.getfixturevalue(base)
    run = train(str(folder), None, model_kwargs=AS_CLASSIFIER, memory=memory, checkpoint_dir=tmp_path, **RUN)
    info = run.summary.lora
    assert info["trained_in_full"] == [head] and info["task_type"] == "SEQ_CLS"
    assert f"{head} trained in full" in info["detail"]
    wrapper = getattr(run.model.base_model.model, head)
    trained, start = wrapper.modules_to_save["default"].weight, wrapper.original_module.weight  # copy starts equal
    assert trained.requires_grad and trained.dtype == torch.float32 and not start.requires_grad
    assert not torch.equal(trained.detach(), start.detach().float())  # trained, not left at its random start
    # Its base (the adapters off, scored against the fine-tune in the base's dtype) had the head at its random start.
    said = run.summary.versus_base["base"]
    assert said.startswith("QLoRA's 4-bit base" if memory.quantized else "LoRA's base") and "head was untrained" in said
    saved = load_checkpoint(tmp_path / "last.pt")
    assert f"base_model.model.{head}.weight" in saved["model"]
    assert saved["source"]["lora"]["task_type"] == "SEQ_CLS"
    if not memory.quantized:  # a 4-bit run's adapters reload over the full-precision base: not the same logits
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = load_model(str(tmp_path / "last.pt")).eval()
        assert type(again).__name__ == "PeftModelForSequenceClassification"
        with torch.no_grad():
            torch.testing.assert_close(again(input_ids=IDS).logits, run.model.eval()(input_ids=IDS).logits)


@pytest.mark.slow  # a CLI run, saved merged and loaded back in plain transformers
def test_merge_writes_the_trained_head_into_the_plain_classifier(bert_base, tmp_path):
    merged = tmp_path / "merged"
    results = []
    with pytest.MonkeyPatch.context() as patch:
        import tier_utils.cli as cli

        patch.setattr(cli, "train", lambda *a, **k: results.append(train(*a, **k)) or results[-1])
        assert main(["train", "--model", str(bert_base), "--model-arg", "task=classification", "--model-arg",
                     "num_labels=4", "--out", str(tmp_path / "run"), "--max-steps", "3", "--lr", "1e-2",
                     "--batch-size", "4", "--seq-len", "32", "--eval-every", "0", "--eval-batches", "1",
                     "--precision", "fp32", "--device", "cpu", "--lora", "r=4,alpha=8", "--save-hf", str(merged),
                     "--merge", "--no-progress"]) == 0
    with torch.no_grad():
        expected = results[0].model.eval()(input_ids=IDS).logits
        plain = transformers.AutoModelForSequenceClassification.from_pretrained(merged).eval()
        assert not any("lora" in n for n, _ in plain.named_parameters())
        torch.testing.assert_close(plain(input_ids=IDS).logits, expected, rtol=1e-5, atol=1e-5)


def test_lora_on_a_tiny_t5_is_a_seq2seq_peft_model_that_trains_and_reloads(tmp_path):
    folder = tmp_path / "t5"
    torch.manual_seed(0)
    load_model("hf:T5ForConditionalGeneration", vocab_size=320, d_model=32, d_ff=64, num_layers=1, num_heads=2,
               d_kv=16, decoder_start_token_id=0, pad_token_id=0).save_pretrained(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer in the folder: byte ids
        run = train(str(folder), None, memory=LORA, checkpoint_dir=tmp_path / "ck", **RUN)
        again = load_model(str(tmp_path / "ck" / "last.pt")).eval()
    assert run.summary.lora["task_type"] == "SEQ_2_SEQ_LM"
    assert type(run.model).__name__ == type(again).__name__ == "PeftModelForSeq2SeqLM"
    decoder = torch.randint(5, 250, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=IDS, decoder_input_ids=decoder).logits,
                                   run.model.eval()(input_ids=IDS, decoder_input_ids=decoder).logits)
