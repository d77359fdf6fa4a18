"""The folders show the layers, and imports only run down them."""
import ast
from pathlib import Path

import pytest

import tier_utils

PACKAGE = Path(tier_utils.__file__).parent
# Lowest first. A module may import from its own folder and from folders of a lower rank only; the tiers of one
# rank know nothing of each other. The modules at the top of the package are the surfaces (cli, widgets, report,
# presets, the demo recipe) and may import anything.
# training sits above planning (5.5): its out-of-memory answer is the planner's prediction.
RANK = {"core": 0, "data": 1, "tasks": 1.5, "models": 2, "adapter": 3, "engine": 4,
        "smoketest": 5, "analysis": 5, "training": 5.5, "planning": 5, "exporting": 5, "benchmark": 6, "tuning": 6}
TOP = 7


def _folder(module: str) -> str | None:
    """The layer folder of `tier_utils.x.y` (x), or None for a module at the top of the package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every tier_utils module `path` imports, at any depth (inside functions and TYPE_CHECKING blocks too)."""
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    package = list(rel.parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            targets = [module] if node.module else [f"{module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, t) for t in targets if t == "tier_utils" or t.startswith("tier_utils.")]
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def _layer(path: Path) -> str | None:
    """The layer folder `path` sits in, however deep (benchmark/x/y.py: benchmark); None at the top."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def test_every_module_sits_in_a_known_layer():
    folders = {_layer(p) for p in MODULES} - {None}
    assert folders == set(RANK), folders ^ set(RANK)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_down_the_layers(path):
    own = _layer(path)
    rank = RANK[own] if own else TOP
    for line, target in _imports(path):
        folder = _folder(target)
        if target == "tier_utils" or folder == own:
            assert own is None or target != "tier_utils", f"{path.name}:{line} imports the package from below"
            continue
        there = RANK[folder] if folder else TOP
        assert there < rank, f"{path.relative_to(PACKAGE)}:{line} imports {target}, which is not below it"


def test_the_report_page_sits_low():
    """report.py asks results what every Result says, and what the main job adds (its consistency rows) is handed in
    as a table: it imports nothing above core/."""
    above = [t for _, t in _imports(PACKAGE / "report.py") if _folder(t) != "core"]
    assert not above, above


def test_no_folder_is_named_like_a_public_function():
    """`tier_utils.train` is the function: a module or folder of that name would be hidden behind it."""
    names = {p.stem for p in MODULES} | {p.parent.name for p in MODULES}
    assert not names & set(tier_utils.__all__)


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


NAMES = {_module_name(p): p for p in MODULES}


def _imported_modules(path: Path) -> set[str]:
    """The package's modules `path` imports by name, at any depth: `from .x import y` is module x, or x.y
    where y is a module. A package's __init__ that Python runs on the way in is not an edge of its own."""
    package = _module_name(path).split(".")[:None if path.name == "__init__.py" else -1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in NAMES else module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in NAMES} - {_module_name(path)}


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm): each is an import circle."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_inside_the_package():
    """Imports inside functions count too: deferring one hides the circle from Python's import order, not from a
    reader: the two modules still need each other, and neither can be understood or moved alone. The package's
    own __init__ (the public API, importing every tier) is left out: a module reaching the API through it is an
    upward import, which test_imports_run_down_the_layers already forbids."""
    graph = {name: _imported_modules(path) - {"tier_utils"} for name, path in NAMES.items() if name != "tier_utils"}
    assert import_circles(graph) == []


def test_the_circle_check_finds_a_circle():
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


LAYOUT = PACKAGE.parent / "docs" / "layout.md"


def _table_rows(marker: str) -> list[str]:
    """The first cell (a `path`, backticks dropped) of each row between `<!-- marker -->` and `<!-- /marker -->`."""
    text = LAYOUT.read_text()
    body = text.split(f"<!-- {marker}:", 1)[1].split(f"<!-- /{marker} -->", 1)[0]
    return [line.split("|")[1].strip().strip("`") for line in body.splitlines()
            if line.startswith("| `")]


def test_the_layout_page_has_a_row_for_every_module_and_no_other():
    rows = _table_rows("modules")
    modules = sorted(str(p.relative_to(PACKAGE)) for p in MODULES if p.name != "__init__.py")
    assert len(rows) == len(set(rows)), "a module has two rows in docs/layout.md"
    missing, stale = sorted(set(modules) - set(rows)), sorted(set(rows) - set(modules))
    assert not missing and not stale, f"docs/layout.md's module table: add {missing}, remove {stale}"
