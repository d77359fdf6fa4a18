"""The settings machinery reads a config's real types. This module has no `from __future__ import annotations`
on purpose: its annotations are classes, not strings, and the checks must hold all the same."""
from dataclasses import dataclass

import pytest

from tier_utils.core.settings import check_fields, setting


@dataclass
class PlainConfig:
    steps: int = setting(2, "steps", low=1)
    kind: str = setting("a", "a kind", choices=("a", "b"))
    limit: int | None = setting(None, "a limit", low=1)
    rate: float = setting(0.5, "a rate", above=0, high=1)

    def __post_init__(self):
        check_fields(self)


@pytest.mark.parametrize("bad,said", [
    ({"steps": 0}, "steps must be a whole number >= 1, got 0"),
    ({"steps": 1.5}, "steps must be a whole number >= 1, got 1.5"),
    ({"steps": True}, "steps must be a whole number >= 1, got True"),
    ({"kind": "c"}, "kind must be one of a, b, got 'c'"),
    ({"limit": 0}, "limit must be a whole number >= 1, got 0"),
    ({"rate": float("nan")}, "rate must be a number > 0 and <= 1, got nan"),
])
def test_a_config_without_the_future_import_is_checked(bad, said):
    assert not isinstance(PlainConfig.__dataclass_fields__["steps"].type, str)  # real classes, no strings
    with pytest.raises(ValueError) as caught:
        PlainConfig(**bad)
    assert str(caught.value) == said


def test_its_good_values_pass():
    assert PlainConfig(steps=3, kind="b", limit=None, rate=1).limit is None
    assert PlainConfig(limit=4, rate=0.25).limit == 4
