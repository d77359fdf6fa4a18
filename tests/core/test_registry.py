"""The one registry shape the precisions, optimizers, strategies and tasks share."""
import pytest

from tier_utils.core.registry import Registry


class Thing:
    name = ""
    aliases: tuple = ()


class Alpha(Thing):
    name, aliases = "alpha", ("A", "first")


def test_every_spelling_finds_the_entry_and_a_copy_keeps_the_original_as_it_was():
    things = Registry("thing", Thing, extra=("auto",))
    things.add(Alpha)
    copy = things.copy()
    copy.add(type("Beta", (Thing,), {"name": "beta"}))
    assert things[" a "] is Alpha and things.canonical(Alpha) == things.canonical(Alpha()) == "alpha"
    assert things.canonical("AUTO") == "auto" and things.names() == ("alpha",) and copy.names() == ("alpha", "beta")
    with pytest.raises(ValueError, match="unknown thing 'beta'; use one of: auto, alpha$"):
        things.canonical("beta")


def test_a_taken_spelling_or_another_kind_is_refused_and_the_same_entry_again_is_not():
    items = Registry("item", Thing)
    assert items.add(Alpha) is Alpha and items.add(Alpha) is Alpha
    with pytest.raises(ValueError, match=r"\['first'\] already name an item"):
        items.add(type("Other", (Thing,), {"name": "other", "aliases": ("first",)}))
    with pytest.raises(ValueError, match="not a named Thing subclass"):
        items.add(Thing)
    with pytest.raises(ValueError, match="not a named Thing instance"):
        Registry("item", Thing, classes=False).add(Alpha)
