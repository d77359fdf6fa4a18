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
RANK = {"core": 0, "data": 1, "models": 2, "adapter": 3, "engine": 4,
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


def test_every_module_sits_in_a_known_layer():
    folders = {p.parent.name for p in MODULES if p.parent != PACKAGE}
    assert folders == set(RANK), folders ^ set(RANK)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_run_down_the_layers(path):
    own = path.parent.name if path.parent != PACKAGE else None
    rank = RANK[own] if own else TOP
    for line, target in _imports(path):
        folder = _folder(target)
        if target == "tier_utils" or folder == own:
            assert own is None or target != "tier_utils", f"{path.name}:{line} imports the package from below"
            continue
        there = RANK[folder] if folder else TOP
        assert there < rank, f"{path.relative_to(PACKAGE)}:{line} imports {target}, which is not below it"


def test_no_folder_is_named_like_a_public_function():
    """`tier_utils.train` is the function: a module or folder of that name would be hidden behind it."""
    names = {p.stem for p in MODULES} | {p.parent.name for p in MODULES}
    assert not names & set(tier_utils.__all__)
