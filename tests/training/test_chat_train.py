"""Training on chat data (issue 58): a resume keeps the base's answers and refuses another reading, a saved folder
answers the same in plain transformers (with a --chat-template written into it), LoRA and QLoRA run on chat data,
and `all` gives the three-tier report with the samples table."""
import warnings

import pytest
import torch
from tiny import without_template

from tier_utils import train
from tier_utils.cli import main
from tier_utils.core.errors import CheckpointError
from tier_utils.data.chat_demo import END_OF_TURN, TEMPLATE, chat_demo

transformers = pytest.importorskip("transformers")
RUN = dict(batch_size=8, seq_len=64, lr=1e-2, warmup_steps=2, device="cpu", precision="fp32", progress=False)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return chat_demo(tmp_path_factory.mktemp("chat"), n=120)


def quiet_train(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the demo's truncation count, said on purpose
        return train(*args, **kwargs)


def test_a_resume_keeps_the_base_answers_and_refuses_another_reading(demo, tmp_path):
    ck, run = str(tmp_path / "ck"), dict(max_steps=6, eval_every=3, checkpoint_every=2, **RUN)

    def interrupt(step, metrics):
        raise KeyboardInterrupt  # at the first evaluation (step 3): last.pt is step 2's

    first = quiet_train(str(demo.model), str(demo.data), checkpoint_dir=ck, on_eval=interrupt, **run)
    assert first.interrupted
    saved = torch.load(tmp_path / "ck" / "last.pt", weights_only=False)
    base = saved["base_answers"]
    assert saved["step"] == 2 and len(base) == 12 and all(isinstance(b, str) for b in base)
    resumed = quiet_train(str(demo.model), str(demo.data), checkpoint_dir=ck, resume=True, **run)
    assert resumed.summary.resumed_from_step == 2
    assert [s["base"] for s in resumed.summary.generation["samples"]] == base
    with pytest.raises(CheckpointError, match="loss_on='answer' \\(this run: 'all'\\)"):
        quiet_train(str(demo.model), str(demo.data), max_steps=6, checkpoint_dir=ck, resume=True, loss_on="all",
                    **RUN)


def test_the_saved_folder_answers_the_same_in_plain_transformers_with_its_chat_template(demo, tmp_path, capsys):
    bare = without_template(demo.model, tmp_path / "bare")
    out = tmp_path / "hf"
    result = quiet_train(str(bare), str(demo.data), max_steps=6, eval_every=6, save_hf=str(out),
                         chat_template=str(TEMPLATE), **{**RUN, "progress": True})
    s = result.summary
    assert s.chat["format"] == "messages" and s.chat["end_of_turn"] == [END_OF_TURN]
    assert 0.1 < s.chat["scored_share"] < 0.5 and "of the tokens" in s.data and str(TEMPLATE) in s.data
    shown = capsys.readouterr().out  # example 0 at the run's start, its answers marked, the newline after them not
    assert "example 0 as the model reads it" in shown and f"{END_OF_TURN}]]\n" in shown
    samples = result.more_tables()["samples"]
    assert list(samples.columns) == ["prompt", "reference", "base", "generated"] and len(samples) == 12
    assert samples["prompt"][0].endswith("?") and (samples["base"] != samples["generated"]).any()
    assert "[[" in result.more_tables()["chat_example"]["example"][0]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert tokenizer.chat_template == TEMPLATE.read_text()  # --chat-template written into the folder
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    eos = model.generation_config.eos_token_id
    assert end in ([eos] if isinstance(eos, int) else eos)
    for sample in result.summary.generation["samples"][:4]:
        text = tokenizer.apply_chat_template([{"role": "user", "content": sample["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        out_ids = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
        answer = out_ids[:out_ids.index(end)] if end in out_ids else out_ids
        if sample["reference"] and "\n" not in sample["prompt"]:  # a one-turn question: the same prompt
            assert tokenizer.decode(answer, skip_special_tokens=True) == sample["generated"]


@pytest.mark.slow
def test_lora_trains_on_chat_data_and_its_merged_folder_loads_in_transformers(demo, tmp_path):
    out = tmp_path / "merged"
    result = quiet_train(str(demo.model), str(demo.data), max_steps=4, eval_every=4, memory="lora",
                         save_hf=str(out), merge=True, **RUN)
    assert result.summary.lora and result.summary.generation["n"] == 12
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"


@pytest.mark.slow
def test_qlora_trains_on_chat_data(demo):
    pytest.importorskip("bitsandbytes")
    result = quiet_train(str(demo.model), str(demo.data), max_steps=4, eval_every=4, memory="qlora",
                         **{**RUN, "precision": "bf16"})
    assert result.summary.quantized and result.summary.generation["n"] == 12


@pytest.mark.slow
def test_all_on_chat_data_gives_the_three_tier_report_with_the_samples_table(demo, tmp_path, capsys):
    out = tmp_path / "report"
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # every line shown: the job itself says each once
        code = main(["all", "--model", str(demo.model), "--data", str(demo.data), "--fast", "--device", "cpu",
                     "--no-progress", "--out", str(out)])
    err = capsys.readouterr().err
    assert code in (0, 1), err
    # every tier reads the data; the conversations cut to fit FAST's 32 tokens are said once
    assert err.count("conversations lost turns from the front to fit") == 1, err
    page = (out / "index.html").read_text()
    assert "train_samples" in page and "base" in page and "reference" in page
    assert (out / "train_samples.csv").exists() and (out / "train_chat_example.csv").exists()


@pytest.mark.slow  # two torchrun ranks
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_answer_the_held_out_prompts_as_one_process_does(demo, tmp_path, strategy):
    """Under DDP every rank writes the answers from its own copy; under FSDP the ranks generate in step (each
    forward needs every shard). The base's answers and each evaluation's are written either way, the same on every
    rank, and scored as one process scores them."""
    import json

    from torchrun import ok, torchrun

    args = ["train", "--model", str(demo.model), "--data", str(demo.data), "--batch-size", "4", "--seq-len", "64",
            "--lr", "1e-2", "--max-steps", "4", "--eval-every", "4", "--precision", "fp32", "--device", "cpu",
            "--no-progress"]
    ok(torchrun(["-m", "tier_utils", *args, "--strategy", strategy, "--out", str(tmp_path / "two"), "--json",
                 str(tmp_path / "two.json")]))
    two = json.loads((tmp_path / "two.json").read_text())
    one = quiet_train(str(demo.model), str(demo.data), max_steps=4, eval_every=4, **{**RUN, "batch_size": 8})
    samples = two["generation"]["samples"]
    assert len(samples) == len(one.summary.generation["samples"]) == 12
    assert all(isinstance(s["base"], str) and isinstance(s["generated"], str) for s in samples)
    # The base answers come from the same start in both: equal. (The fine-tunes' answers may differ by a step's
    # summation order, so only that they are there.)
    assert [s["base"] for s in samples] == [s["base"] for s in one.summary.generation["samples"]]
    after = two["versus_base"]["pairing"]["after"]["metrics"]  # the fine-tune against its base, per answer too
    assert len(after["chrf"]) == len(after["exact_match"]) == 12
