"""What a shell user types for --model-arg, and a built-in's argument of the wrong type, said plainly."""
import pytest

from tier_utils import ModelSpecError, load_model
from tier_utils.cli import build_parser, main
from tier_utils.options import model_kwargs


@pytest.mark.parametrize("typed,value", [
    ("true", True), ("TRUE", True), ("False", False), ("none", None), ("None", None), ("NONE", None),
    ("[1, true, null]", [1, True, None]), ("[2, 3]", [2, 3]), ('["a", "b"]', ["a", "b"]),
    ("256", 256), ("1e-3", 0.001), ("(1, 2)", (1, 2)), ("'x'", "x"), ("gelu", "gelu"), ("[unclosed", "[unclosed"),
])
def test_model_arg_values(typed, value):
    args = build_parser().parse_args(["info", "--model-arg", f"key={typed}"])
    assert model_kwargs(args) == {"key": value} and type(model_kwargs(args)["key"]) is type(value)


@pytest.mark.parametrize("kwargs,said", [
    ({"d_model": "abc"}, "tiny-gpt: d_model takes an int, got 'abc'"),
    ({"d_model": True}, "tiny-gpt: d_model takes an int, got True"),
    ({"dropout": "high"}, "tiny-gpt: dropout takes a number, got 'high'"),
])
def test_a_builtins_argument_of_the_wrong_type_names_the_type_it_takes(kwargs, said):
    with pytest.raises(ModelSpecError, match="^" + said):
        load_model("tiny-gpt", **kwargs)
    assert load_model("tiny-gpt", d_model=32, n_head=2, n_layer=1, dropout=0).blocks is not None  # right types build


def test_the_cli_says_it_in_one_line(capsys):
    assert main(["info", "--model-arg", "d_model=abc"]) == 2
    assert capsys.readouterr().err.startswith("error: tiny-gpt: d_model takes an int, got 'abc'")


@pytest.mark.parametrize("verb", ["train", "all", "search"])
def test_the_renamed_checkpointing_flag_still_works_with_a_one_line_notice(verb, capsys):
    """Issue 50: --activation-checkpointing became --checkpointing with no alias, and the error suggested
    --no-checkpointing. The old spelling keeps working for a release; a near miss names the new one."""
    out = ["--out", "x"] if verb != "search" else []
    parse = build_parser().parse_args
    assert parse([verb, *out, "--activation-checkpointing"]).checkpointing is True
    assert capsys.readouterr().err == ("warning: --activation-checkpointing is now --checkpointing; the old "
                                       "spelling goes in a later release\n")
    assert parse([verb, *out, "--no-activation-checkpointing"]).checkpointing is False
    assert "--no-activation-checkpointing is now --no-checkpointing" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([verb, *out, "--activation_checkpointing"])
    assert "; did you mean --checkpointing?" in capsys.readouterr().err
    assert "activation-checkpointing" not in build_parser()._subparsers._group_actions[0].choices[verb].format_help()
