"""A registry of named entries: the precisions, the optimizers, the strategies (classes) and the tasks (instances)
each keep one, so adding one is `register_*` and every spelling of its name (`name`, `aliases`) finds it."""
from __future__ import annotations


class Registry:
    """Entries by name, each also found by its aliases (read stripped, in lower case). `kind`: what an entry is, a
    subclass of it (classes=True) or an instance of it; `extra`: spellings that name no entry but are accepted by
    `canonical` (precision's "auto"), listed first."""

    def __init__(self, what: str, kind: type, classes: bool = True, extra: tuple[str, ...] = ()):
        self.what, self.kind, self.classes, self.extra = what, kind, classes, extra
        self._entries: dict = {}

    def copy(self) -> Registry:
        """A registry holding the same entries (a test registers into its copy and leaves this one as it was)."""
        other = Registry(self.what, self.kind, self.classes, self.extra)
        other._entries = dict(self._entries)
        return other

    def spellings(self) -> dict[str, str]:
        table = {s: s for s in self.extra}
        for name, entry in self._entries.items():
            table.update({s.lower(): name for s in (name, *entry.aliases)})
        return table

    def is_entry(self, entry) -> bool:
        """Whether `entry` is of this registry's kind (registered or not)."""
        if self.classes:
            return isinstance(entry, type) and issubclass(entry, self.kind)
        return isinstance(entry, self.kind)

    def add(self, entry):
        """Register `entry`: its name and aliases find it from then on; one of another kind, unnamed, or whose
        spelling another entry has, is a one-line ValueError. Returns it (usable as a class decorator)."""
        form = "subclass" if self.classes else "instance"
        if not self.is_entry(entry) or not entry.name:
            raise ValueError(f"cannot register {entry!r}: not a named {self.kind.__name__} {form}")
        taken = self.spellings()
        clash = [s for s in (entry.name, *entry.aliases)
                 if s.lower() in taken and self._entries.get(taken[s.lower()], entry) is not entry]
        if clash:
            article = "an" if self.what[0] in "aeiou" else "a"
            raise ValueError(f"cannot register {entry!r}: {clash} already name {article} {self.what}")
        self._entries[entry.name] = entry
        return entry

    def canonical(self, requested) -> str:
        """The registered name of any spelling (read stripped, in lower case: "bf16-mixed" -> "bf16"), or of an entry
        of this kind (a class, or an instance of one: registered or not); an unknown spelling is a one-line
        ValueError listing the names."""
        if self.is_entry(requested) or (self.classes and isinstance(requested, self.kind)):
            return requested.name
        spellings = self.spellings()
        key = str(requested).strip().lower()
        if key not in spellings:
            choices = ", ".join((*self.extra, *self._entries))
            raise ValueError(f"unknown {self.what} {requested!r}; use one of: {choices}")
        return spellings[key]

    def __getitem__(self, requested):
        """The entry of any spelling of its name."""
        return self._entries[self.canonical(requested)]

    def get(self, name: str, default=None):
        """The entry registered under exactly `name` (a checkpoint's record), else `default`."""
        return self._entries.get(name, default)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entries(self) -> list:
        """The entries, in the order they were registered."""
        return list(self._entries.values())
