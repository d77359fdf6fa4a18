"""Every training and benchmark result says the share of the positions it computed that was padding, and what
padding each example to seq_len would have made it (issue 57): counted exactly on a hand-built dataset."""
import json

import pytest
import torch
from tiny import TINY_ARGS, tiny
from tiny import LengthExamples as Examples

from tier_utils import TinyEncoder
from tier_utils.benchmark.amp import amp_benchmark
from tier_utils.cli import main
from tier_utils.core.errors import TrainingOutOfMemory
from tier_utils.planning.planner import fit
from tier_utils.smoketest.suite import smoke
from tier_utils.training.loop import train

LENGTHS = [3, 5, 8, 9]  # one batch of 4: padded to 16 (the longest, 9, rounded up to a multiple of 8)


def test_train_states_the_padding_share_of_its_batches_and_at_seq_len():
    data = (Examples(LENGTHS), Examples(LENGTHS))
    result = train(tiny("tiny-encoder", seed=0), data, max_steps=2, batch_size=4, seq_len=32, eval_every=0,
                   eval_batches=1, progress=False, device="cpu")
    padding = result.summary.padding
    real = sum(LENGTHS) * 2  # two steps, each the four examples
    assert (padding["computed"], padding["real"], padding["at_length"]) == (2 * 4 * 16, real, 2 * 4 * 32)
    assert padding["share"] == pytest.approx(1 - real / 128)
    said = "padding 61 % of positions per batch (80 % at seq_len 32, every example padded to it)"
    assert padding["describe"] == said
    assert said in result.summary_line()
    assert dict(zip(result.table["metric"], result.table["value"]))["padding"] == said
    assert result.to_json()["summary"]["padding"]["share"] == pytest.approx(1 - real / 128)


def test_corpus_windows_have_no_padding_and_no_comparison():
    result = train(tiny(seed=0), None, max_steps=1, batch_size=2, seq_len=16, eval_every=0, eval_batches=1,
                   progress=False, device="cpu")
    assert result.summary.padding["describe"] == "padding 0 % of positions per batch"


@pytest.mark.slow  # a whole benchmark run (its memory, timing and accuracy steps)
def test_the_benchmark_states_the_padding_share_of_its_batches():
    result = amp_benchmark(tiny("tiny-encoder", seed=0), (Examples(LENGTHS * 4), Examples(LENGTHS)),
                           precisions=["fp32"], batch_size=4, seq_len=32, untimed_steps=1, timed_steps=1, repeats=1,
                           accuracy_steps=1, eval_batches=1, progress=False, device="cpu")
    padding = result.config.padding
    assert padding["computed"] > padding["real"] > 0 and 0 < padding["share"] < padding["share_at_length"]
    assert padding["describe"] in result.summary_line()
    assert result.to_json()["config"]["padding"]["describe"] == padding["describe"]


PLAN = dict(batch_size=4, seq_len=32, precisions=["fp32"], checkpointing=False, lora=0, validate="off",
            progress=False, device="cpu")


def test_fit_with_data_plans_at_the_longest_batch_the_data_makes():
    model = tiny("tiny-encoder", seed=0)
    asked = fit(model, **PLAN)
    planned = fit(model, data=(Examples(LENGTHS), Examples(LENGTHS)), **PLAN)
    assert (asked.seq_len, planned.seq_len) == (32, 16)  # the longest example, 9, padded to a multiple of 8
    said = "planned at T=16, the longest batch the data makes (the Datasets given, 4 examples: the longest 9 tokens"
    assert said in planned.summary_line() and said in planned.headline()
    assert planned.to_json()["from_data"]["length"] == 16 and asked.to_json()["from_data"] is None
    step = {r.name: r.step_bytes(4, 16) for r in planned.configs}
    assert step["fp32"] < {r.name: r.step_bytes(4, 32) for r in asked.configs}["fp32"]


def test_smoke_with_data_runs_its_memory_rows_at_the_datas_longest_batch():
    report = smoke(tiny("tiny-encoder", seed=0), data=(Examples(LENGTHS), Examples(LENGTHS)), checks=["memory"],
                   batch_sizes=[2], progress=False, device="cpu")
    assert report.seq_lens == [16] and {r["seq_len"] for r in report.memory} == {16}
    assert "memory and latency at T=16, the longest batch the data makes" in report.headline()


class OomEncoder(TinyEncoder):
    """Raises CUDA's out-of-memory error in its second training forward of a full batch (torch raises it on a CPU)."""

    def __init__(self, **sizes):
        super().__init__(**sizes)
        self.calls = 0

    def forward(self, input_ids=None, **kwargs):
        if torch.is_grad_enabled() and self.training and input_ids.shape[0] >= 4:
            self.calls += 1
            if self.calls == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(input_ids, **kwargs)


@pytest.mark.slow  # the answer's prediction probes every mode
def test_the_out_of_memory_answer_plans_at_the_longest_batch_the_data_makes(monkeypatch):
    monkeypatch.setenv("TIER_UTILS_FREE_MEMORY", str(2**30))
    torch.manual_seed(0)
    with pytest.raises(TrainingOutOfMemory) as caught:
        train(OomEncoder(d_model=32, n_layer=1, n_head=2, max_len=32), (Examples(LENGTHS * 2), Examples(LENGTHS)),
              max_steps=4, batch_size=4, seq_len=32, eval_every=0, eval_batches=1, precision="fp32", progress=False,
              device="cpu")
    line = str(caught.value)
    assert line.startswith("out of memory after 1 of 4 steps at B=4, T=32, fp32")
    assert "fits here (predicted at T=16, the longest batch the data makes (the Datasets given, 8 examples" in line


def test_fit_and_smoke_take_data_on_the_command_line(tmp_path, capsys):
    table = tmp_path / "sentences.csv"
    table.write_text("text,label\n" + "".join(f"{'word ' * n}end,{n % 2}\n" for n in (1, 3, 2, 1) * 3))
    common = ["--model", "tiny-encoder", *TINY_ARGS, "--device", "cpu", "--no-progress", "--data", str(table)]
    assert main(["fit", *common, "--seq-len", "32", "--precisions", "fp32", "--no-checkpointing", "--lora", "0",
                 "--validate", "off", "--json", str(tmp_path / "fit.json")]) == 0
    planned = json.loads((tmp_path / "fit.json").read_text())
    longest = planned["from_data"]["longest"]  # the byte tokenizer: one token per character
    assert planned["seq_len"] == -(-longest // 8) * 8 < 32  # its longest row, rounded up to a multiple of 8
    assert "the longest batch the data makes" in capsys.readouterr().out
    assert main(["smoke", *common, "--checks", "memory", "--batch-sizes", "2", "--json", str(tmp_path / "s.json")]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["seq_lens"] == [planned["seq_len"]]
