"""The run objects are built complete: no method but __init__ (or a dataclass's __post_init__) sets an attribute on
them, and every attribute they read is one they define (a field, an attribute set in __init__, a method or a
property), so no setup order is hidden in them and no mixin reads state it never defines. Add a run class to RUNS."""
import ast
import importlib
import inspect
import textwrap

import pytest

RUNS = [
    ("tier_utils.training.loop", "_Run"),
    ("tier_utils.training.checkpointing", "RunCheckpoints"),  # once a mixin reading 16 attributes it never defined
    ("tier_utils.benchmark.amp", "BenchmarkRun"),  # each step returns a frozen record (benchmark/record.py)
]
BUILDERS = {"__init__", "__post_init__"}


def _class_node(module: str, name: str) -> ast.ClassDef:
    cls = getattr(importlib.import_module(module), name)
    return ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]


def _self_attributes(node: ast.AST, store: bool) -> list[tuple[int, str]]:
    """`self.x` stored (assigned, augmented, deleted, or through setattr(self, ...)) or loaded under `node`."""
    found = []
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self":
            if isinstance(n.ctx, (ast.Store, ast.Del)) == store:
                found.append((n.lineno, n.attr))
        elif store and isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr" \
                and n.args and isinstance(n.args[0], ast.Name) and n.args[0].id == "self":
            found.append((n.lineno, "setattr(self, ...)"))
    return found


def attributes_set_after_init(cls: ast.ClassDef) -> list[str]:
    return [f"{method.name}:{line} sets self.{attr}" for method in cls.body
            if isinstance(method, ast.FunctionDef) and method.name not in BUILDERS
            for line, attr in _self_attributes(method, store=True)]


def attributes_read_undefined(cls: ast.ClassDef) -> list[str]:
    defined = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    defined |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    defined |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {attr for method in cls.body if isinstance(method, ast.FunctionDef) and method.name in BUILDERS
                for _, attr in _self_attributes(method, store=True)}
    return [f"line {line} reads self.{attr}" for line, attr in _self_attributes(cls, store=False)
            if attr not in defined]


@pytest.mark.parametrize("module, name", RUNS)
def test_a_run_object_is_built_complete(module, name):
    cls = _class_node(module, name)
    assert not [b for b in cls.bases if not (isinstance(b, ast.Name) and b.id == "object")], \
        f"{name} inherits state (a mixin's attributes are set and read where this test can't see)"
    assert not attributes_set_after_init(cls), attributes_set_after_init(cls)
    assert not attributes_read_undefined(cls), attributes_read_undefined(cls)


def test_the_check_sees_a_step_that_sets_a_field_and_a_mixin_read():
    cls = ast.parse(textwrap.dedent("""
        class Run:
            size: int = 0

            def __init__(self):
                self.a = 1

            def step(self):
                self.a += 1
                self.b, self.size = 2, 3
                return self.a + self.size + self.elsewhere + self.step()
    """)).body[0]
    assert attributes_set_after_init(cls) == ["step:9 sets self.a", "step:10 sets self.b", "step:10 sets self.size"]
    assert attributes_read_undefined(cls) == ["line 11 reads self.elsewhere"]
