"""train() with batches grouped by length and examples packed (issue 57): what the summary says, validation's order,
and an exact resume (the order and the packing drawn again from the seed)."""
from __future__ import annotations

import warnings

import pandas as pd
import pytest
import torch

from tier_utils.core.errors import CheckpointError
from tier_utils.models.checkpoint import load_checkpoint
from tier_utils.training.loop import train
from tier_utils.training.parts import scored_in_length_order

DETERMINISTIC = ["kind", "step", "epoch", "train_loss", "val_loss", "grad_norm", "lr"]


def llama(seed: int = 0):
    """A tiny transformers Llama over byte ids: a model that can keep packed examples apart."""
    import transformers as tf

    torch.manual_seed(seed)
    config = tf.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return tf.LlamaForCausalLM(config)


def table(path, n=48):
    words = "the cat sat on a mat while dogs ran past quickly".split()
    texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(1 + (i * 7) % 13)) for i in range(n)]
    pd.DataFrame({"text": texts}).to_csv(path, index=False)
    return str(path)


RUN = dict(batch_size=4, seq_len=64, precision="fp32", device="cpu", progress=False, eval_every=3, eval_batches=1,
           deterministic=True, group_by_length=True, packing=True, max_steps=6, checkpoint_every=2, log_every=1)


def test_grouped_packed_training_says_so_counts_real_tokens_and_resumes_exactly(tmp_path):
    data = table(tmp_path / "t.csv")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        whole = train(llama(), data, checkpoint_dir=tmp_path / "whole", **RUN)
    assert not [w for w in said if "packing" in str(w.message)]  # a model that packs: no fallback line
    order = whole.summary.order
    assert "batches grouped by length" in order and "examples packed into" in order
    rows = int(order.split("packed into ")[1].split()[0])
    assert rows < 30 and whole.summary.steps == 6 > rows // 4  # 44 texts in fewer rows; past one epoch

    def interrupt(step, metrics):
        if step == 3:
            raise KeyboardInterrupt  # last.pt is step 2's: the resume re-enters the first epoch mid-way

    part = train(llama(), data, checkpoint_dir=tmp_path / "part", on_eval=interrupt, **RUN)
    assert part.interrupted and load_checkpoint(tmp_path / "part" / "last.pt")["step"] == 2
    resumed = train(llama(), data, checkpoint_dir=tmp_path / "part", resume=True, **RUN)
    pd.testing.assert_frame_equal(resumed.history[DETERMINISTIC].reset_index(drop=True),
                                  whole.history[DETERMINISTIC].reset_index(drop=True), check_exact=True)
    a, b = load_checkpoint(tmp_path / "whole" / "last.pt"), load_checkpoint(tmp_path / "part" / "last.pt")
    assert all(torch.equal(a["model"][k], v) for k, v in b["model"].items())


def test_validation_scores_the_same_rows_put_in_length_order():
    class Val(torch.utils.data.Dataset):
        lengths = [3, 9, 1, 7, 5, 2, 8, 4, 6]

        def __len__(self):
            return len(self.lengths)

        def __getitem__(self, i):
            return {"input_ids": torch.zeros(self.lengths[i], dtype=torch.long)}

    order = scored_in_length_order(Val(), eval_batches=2, batch_size=3)
    assert order[:6] == [1, 3, 4, 0, 5, 2] and order[6:] == [6, 7, 8]  # rows 6-8 stay unscored, as without it
    assert scored_in_length_order(Val(), None, 3) == sorted(range(9), key=lambda i: -Val.lengths[i])


@pytest.mark.parametrize("changed", [dict(group_by_length=False), dict(packing=False)])
def test_resume_refuses_a_change_of_grouping_or_packing(tmp_path, changed):
    data = table(tmp_path / "t.csv")
    run = dict(RUN, max_steps=2, eval_every="never")
    train(llama(), data, checkpoint_dir=tmp_path / "c", **run)
    with pytest.raises(CheckpointError, match=f"{next(iter(changed))}=True \\(this run: False\\)"):
        train(llama(), data, checkpoint_dir=tmp_path / "c", resume=True, **{**run, **changed})



_RECORD_ROWS = """
import json
from tier_utils.engine.step import TrainStep
real_step = TrainStep.__call__

def recording_step(self, micro):
    rows = [row[mask.bool()].tolist() for b in micro for row, mask in zip(b["input_ids"], b["attention_mask"])]
    with open(os.environ["SEEN"] + "." + os.environ.get("RANK", "0"), "a") as f:
        f.write(json.dumps(rows) + "\\n")
    return real_step(self, micro)

TrainStep.__call__ = recording_step
"""


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_ranks_grouped_and_packed_take_the_global_batches_one_process_takes(tmp_path, strategy):
    """Packing before sharding, global batches formed before they are dealt: under torchrun each step's rows over
    both ranks are the rows of one process's step with twice the batch, and both ranks run every step."""
    import json

    from torchrun import ok, torchrun, worker_script

    folder, data = tmp_path / "llama", table(tmp_path / "t.csv", n=96)
    llama().save_pretrained(folder)
    args = ["--precision", "fp32", "--device", "cpu", "--seq-len", "64", "--max-steps", "6", "--eval-every",
            "never", "--group-by-length", "--packing", "--no-progress", "--data", data]
    worker = tmp_path / "worker.py"
    worker.write_text(worker_script(preamble=_RECORD_ROWS))
    ok(torchrun([str(worker), "train", "--model", str(folder), "--batch-size", "2", "--out", str(tmp_path / "two"),
                 "--strategy", strategy, *args], env_extra={"SEEN": str(tmp_path / "ranks")}))
    ok(torchrun([str(worker), "train", "--model", str(folder), "--batch-size", "4", "--out", str(tmp_path / "one"),
                 *args], ranks=1, env_extra={"SEEN": str(tmp_path / "one")}))
    steps = [[json.loads(line) for line in (tmp_path / f"{name}").read_text().splitlines()]
             for name in ("ranks.0", "ranks.1", "one.0")]
    assert len(steps[0]) == len(steps[1]) == len(steps[2]) == 6
    for r0, r1, one in zip(*steps):
        assert sorted(r0 + r1) == sorted(one)
    # The loss is the mean over both ranks' scored tokens (each rank's share weighted by the count summed across
    # them): one process's, step by step. (An untrained model scores every token near log(vocab), so a mean of the
    # ranks' means would agree here too: tests/engine/test_step_weights.py tells those apart.)
    two, one = (pd.read_csv(tmp_path / name / "metrics.csv").query("kind == 'step'")["train_loss"].tolist()
                for name in ("two", "one"))
    assert len(two) == 6 and two == pytest.approx(one, abs=1e-5)


def test_per_example_scores_stay_with_their_examples_when_validation_is_put_in_length_order(tmp_path):
    """Grouping reads the scored validation rows longest first: the fine-tune's per-example scores (versus its base,
    and compare's) must still name the example each came from."""
    import json

    from tier_utils.adapter.adapter import adapt
    from tier_utils.tasks import CAUSAL_LM
    from tier_utils.training.versus_base import SCORES_FILE

    run = dict(RUN, max_steps=2, eval_every=0, eval_batches=None, checkpoint_every=None)
    result = train(llama(), table(tmp_path / "t.csv", n=60), checkpoint_dir=tmp_path / "c", **run)
    tuned = json.loads((tmp_path / "c" / SCORES_FILE).read_text())["tuned"]
    adapter = adapt(result.model.eval())
    val = adapter.datasets(table(tmp_path / "t.csv", n=60), 64, packing=True).val
    assert len({len(val[i]["input_ids"]) for i in range(len(val))}) > 1  # lengths differ: the order changed
    with torch.no_grad():
        for i, loss in zip(tuned["index"], tuned["metrics"]["loss"]):
            row = val[i]
            alone = CAUSAL_LM.loss(adapter.logits(row["input_ids"][None]), row["labels"][None])
            assert loss == pytest.approx(alone.item(), rel=1e-4), i
