"""`all --qlora` (issue 50, item 8): the AMP benchmark takes a 4-bit model (its shared start is the adapters; a whole
state dict of a 4-bit base does not load back), its fp16 rows run over a bf16 base (a 4-bit layer's output follows
autocast as a linear layer's does), and every summary line names the memory setting that ran."""
import warnings

import pytest
import torch

from tier_utils import amp_benchmark, load_model, train
from tier_utils.core.memory_settings import MemorySettings
from tier_utils.engine.lora import LoraSettings

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

QLORA = MemorySettings.qlora(LoraSettings(r=4, alpha=8))
QLORA_WORDS = "QLoRA r=4 over a 4-bit NF4 base"
SMALL = dict(batch_size=4, seq_len=32, device="cpu", progress=False)


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-bf16")
    torch.manual_seed(0)
    load_model("hf:LlamaForCausalLM", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64
               ).to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.mark.slow  # a benchmark run over five precisions (30 s on 2 busy cores)
def test_the_benchmark_runs_every_precision_over_a_4bit_model_and_names_qlora(llama_bf16):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no tokenizer in the folder: byte ids
        # force: fp16 runs on a CPU without native fp16 too (this test is about the 4-bit base, not the CPU)
        result = amp_benchmark(str(llama_bf16), memory=QLORA, untimed_steps=1, timed_steps=1, repeats=1,
                               accuracy_steps=2, eval_batches=1, force=True, **SMALL)
    ran = [r.precision for r in result.records if r.ran]
    assert {"fp32", "bf16", "fp16"} <= set(ran), ran  # fp16 autocast over the bf16 base included
    assert f"the precision rows train {QLORA_WORDS}" in result.summary_line()
    from tier_utils.mainjob import _measured

    class Plan:  # fit's plan, as far as the main job hands it the benchmark's speedups
        def with_measured_speedups(self, speedups, source):
            return source

    # fit's "fastest here" then says its speedups were measured on QLoRA rows, not on a full fine-tune
    assert _measured(Plan(), {"amp_benchmark": result}).endswith(f", training {QLORA_WORDS}, fp32 adapters, AdamW")


def test_a_4bit_layer_follows_fp16_autocast_over_a_bf16_base(llama_bf16, monkeypatch):
    """bitsandbytes returns its input's dtype: bf16 activations met fp16 autocast's cat in the rotary embedding
    ("Unexpected floating ScalarType in at::autocast::prioritize") before the layer's output followed autocast."""
    monkeypatch.setenv("TIER_UTILS_CPU_FLAGS", "avx512_bf16")  # a CPU with native bf16 keeps the base bf16
    from tier_utils.core.device import device_facts
    from tier_utils.core.memory_settings import resolve_memory
    from tier_utils.core.precision import resolve_precision
    from tier_utils.engine.quantization import apply_memory

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = load_model(str(llama_bf16))
    fp32, fp16 = (resolve_precision(name, "cpu", warn=False) for name in ("fp32", "fp16"))
    held = resolve_memory(QLORA, fp32, device_facts(torch.device("cpu")), torch.bfloat16, model)
    assert held.base_dtype == torch.bfloat16  # the benchmark decides the base once, for every row
    model = fp16.convert_module(apply_memory(model, held), held)
    with fp16.autocast():
        logits = model(input_ids=torch.randint(0, 256, (2, 8))).logits
    assert logits.dtype == torch.float16 and torch.isfinite(logits).all()


def test_the_train_line_names_the_memory_setting_that_ran(llama_bf16):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = {name: train(str(llama_bf16), None, memory=memory, max_steps=1, eval_every=0, eval_batches=1,
                            precision="bf16", **SMALL) for name, memory in (("qlora", QLORA), ("full", None))}
    line = runs["qlora"].summary_line()
    assert f"bf16 ({QLORA_WORDS}, fp32 adapters, AdamW)" in line and "master weights" not in line
    assert "bf16 (weights stored bf16 → fp32 master weights, bf16 autocast; full fine-tune, AdamW)" in \
        runs["full"].summary_line()
