"""The tier-3 notebook runs through under each memory choice its parameter cell offers (issue 50, item 7), as a T4
user runs it (TIER_UTILS_GPU_PROFILE=T4): a QLoRA run's export is the merged, dequantised model, never an error
that stops Run All. The notebook runs in a kernel, small (2 steps, one search trial, a tiny model)."""
import os
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from test_notebooks import load

from tier_utils.core.device import GPU_PROFILE_ENV
from tier_utils.core.memory_settings import MEMORY_CHOICES

SMALL = {"MAX_STEPS": 2, "SEARCH_TRIALS": 1, "BATCH_SIZE": 4, "SEQ_LEN": 32,
         "MODEL_KWARGS": {"d_model": 32, "n_layer": 2, "n_head": 2, "max_len": 32}}
RAN = {"full": "full fine-tune, AdamW", "lora": "LoRA r=", "qlora": "QLoRA r=",
       "adamw8bit": "full fine-tune, AdamW8bit"}


def _with_parameters(nb, **values):
    """The notebook with `values` set after its parameters cell's own (as papermill injects them)."""
    cell = next(c for c in nb.cells if c.metadata.get("tags") == ["parameters"])
    cell.source += "\n" + "\n".join(f"{name} = {value!r}" for name, value in values.items())
    return nb


@pytest.mark.slow  # one kernel per choice, each a whole tier-3 run (about a minute on 2 busy cores)
@pytest.mark.parametrize("memory", list(MEMORY_CHOICES))
def test_tier3_notebook_runs_through_under_each_memory_choice_on_a_t4_profile(memory, tmp_path, monkeypatch):
    if memory in ("qlora", "adamw8bit"):
        pytest.importorskip("bitsandbytes")
    if memory != "full":
        pytest.importorskip("peft")
    monkeypatch.setenv(GPU_PROFILE_ENV, "T4")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sys.path))  # the kernel imports this tier_utils
    nb = _with_parameters(load("tier3_training.ipynb"), MEMORY=memory, **SMALL)
    nb.cells.append(nbformat.v4.new_code_cell('print(result.summary.memory["describe"])'))  # what training ran
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = {i: "".join(o.get("text", "") for o in c.outputs) for i, c in enumerate(nb.cells)
               if c.cell_type == "code"}
    exported = next(i for i, c in enumerate(nb.cells) if "print(exported.status)" in c.source)
    assert outputs[exported].strip() == "PASS", outputs[exported]  # the export reproduced eager
    assert outputs[len(nb.cells) - 1].startswith(RAN[memory]), outputs[len(nb.cells) - 1]
