"""Every pair of memory flags through the CLI (issue 50): a pair that contradicts itself is one line, exit 2, nothing
written; every other pair gives the settings both flags said. Two spellings of one option are not a pair (argparse
takes the last, as for any option). The API's fields meet the same rule (MemorySettings declares it once)."""
import itertools
from dataclasses import replace

import pytest
from tiny import TINY_ARGS

from tier_utils import cli
from tier_utils.core.errors import MemorySettingError
from tier_utils.core.memory_settings import MemorySettings

# option -> its spellings in this table
FLAGS = {
    "--lora": {"lora": ["--lora", "r=4"], "lora-bits4": ["--lora", "r=4,bits=4"],
               "lora-bits16": ["--lora", "r=4,bits=16"], "lora-off": ["--lora", "off"]},
    "--qlora": {"qlora": ["--qlora"]},
    "--base-bits": {"bits4": ["--base-bits", "4"], "bits16": ["--base-bits", "16"]},
    "--base-dtype": {"dtype": ["--base-dtype", "fp16"]},
    "--optimizer": {"adamw8bit": ["--optimizer", "adamw8bit"]},
    "--checkpointing": {"checkpointing": ["--checkpointing"], "no-checkpointing": ["--no-checkpointing"]},
}
SPELLED = {name: args for spellings in FLAGS.values() for name, args in spellings.items()}
PAIRS = [(a, b) for (oa, sa), (ob, sb) in itertools.combinations(FLAGS.items(), 2) for a in sa for b in sb]

CONTRADICTION = "asks for a 4-bit NF4 base (QLoRA) and"
NEEDS_LORA = "give lora too"
# Every pair that is refused, and what its line says; any pair not here runs.
REFUSED = {
    ("lora-bits4", "bits16"): CONTRADICTION, ("lora-bits4", "dtype"): CONTRADICTION,
    ("lora-bits16", "qlora"): CONTRADICTION, ("lora-bits16", "bits4"): CONTRADICTION,
    ("qlora", "bits16"): CONTRADICTION, ("qlora", "dtype"): CONTRADICTION, ("bits4", "dtype"): CONTRADICTION,
    ("lora-off", "qlora"): "--lora off asks for no LoRA and --qlora for LoRA adapters",
    ("lora-off", "bits4"): NEEDS_LORA, ("lora-off", "dtype"): NEEDS_LORA,
    ("bits4", "adamw8bit"): NEEDS_LORA, ("bits4", "checkpointing"): NEEDS_LORA,
    ("bits4", "no-checkpointing"): NEEDS_LORA, ("bits16", "dtype"): NEEDS_LORA,
    ("dtype", "adamw8bit"): NEEDS_LORA, ("dtype", "checkpointing"): NEEDS_LORA,
    ("dtype", "no-checkpointing"): NEEDS_LORA,
}
QUANTIZED = {"lora-bits4", "qlora", "bits4"}
WITH_LORA = {"lora", "lora-bits4", "lora-bits16", "qlora"}


def test_the_table_names_only_pairs_it_walks():
    assert set(REFUSED) <= set(PAIRS) and len(PAIRS) == 47


class Built(Exception):
    """Raised by the stand-in train(): the settings reached it, built from the flags."""


@pytest.mark.parametrize("pair", PAIRS, ids="+".join)
def test_every_pair_of_memory_flags(pair, tmp_path, capsys, monkeypatch):
    pytest.importorskip("bitsandbytes")  # --optimizer adamw8bit's package, asked for as the settings are made
    out, summary = tmp_path / "run", tmp_path / "summary.json"

    def reached(model, data, config, **kwargs):
        raise Built(config.memory)

    monkeypatch.setattr(cli, "train", reached)  # a pair that runs stops here: its settings are the subject
    argv = ["train", *TINY_ARGS, "--max-steps", "1", "--device", "cpu", "--no-progress", "--out", str(out),
            "--json", str(summary), *SPELLED[pair[0]], *SPELLED[pair[1]]]
    if pair in REFUSED:
        code = cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and REFUSED[pair] in err, err
        assert err.startswith("error: ") and "Traceback" not in err
        assert not summary.exists() and not out.exists()
        return
    with pytest.raises(Built) as built:
        cli.main(argv)
    memory = built.value.args[0]
    assert memory.quantized == bool(QUANTIZED & set(pair))
    assert (memory.lora is not None) == bool(WITH_LORA & set(pair))
    assert memory.checkpointing == ("checkpointing" in pair) and (memory.optimizer == "adamw8bit") == (
        "adamw8bit" in pair)


@pytest.mark.parametrize("make", [
    lambda: MemorySettings(lora="r=8,bits=4", base_bits=16),
    lambda: MemorySettings(lora=8, base_bits=4, base_dtype="bf16"),
    lambda: MemorySettings.qlora(base_dtype="fp16"),
    lambda: MemorySettings.qlora("r=8,bits=16"),
    lambda: replace(MemorySettings.qlora(), base_dtype="fp32"),
], ids=["bits-vs-base_bits", "base_bits-vs-base_dtype", "qlora-vs-base_dtype", "qlora-vs-bits", "replace"])
def test_the_api_meets_the_same_rule(make):
    with pytest.raises(MemorySettingError, match=CONTRADICTION.replace("(", r"\(").replace(")", r"\)")) as info:
        make()
    assert "\n" not in str(info.value)
    assert MemorySettings.qlora("r=8,bits=4", base_bits=4) == MemorySettings(lora="r=8", base_bits=4)
