"""No function in the package is over 60 lines: a longer one does several jobs, and its steps want names."""
import ast
from pathlib import Path

import tier_utils

PACKAGE = Path(tier_utils.__file__).parent
LIMIT = 60
# build_parser is a flat table: one add_parser call per verb with its options, no logic between them; splitting
# it would only scatter the table.
ALLOWED = {("cli.py", "build_parser")}


def _lengths(path: Path):
    """(line, name, length) of every function and method in `path`, nested ones too. The length runs from the
    `def` line to the last line of the body: decorators are not counted."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.lineno, node.name, node.end_lineno - node.lineno + 1


def test_no_function_in_the_package_is_over_60_lines():
    long = [f"{path.relative_to(PACKAGE)}:{line} {name} ({length} lines)"
            for path in sorted(PACKAGE.rglob("*.py")) for line, name, length in _lengths(path)
            if length > LIMIT and (path.relative_to(PACKAGE).as_posix(), name) not in ALLOWED]
    assert not long, f"functions over {LIMIT} lines (split them into named steps): " + "; ".join(long)


def test_the_measure_sees_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))  # with its def line, one over the limit
    path = tmp_path / "long.py"
    path.write_text(f"@decorated\ndef long():\n{body}\n\n\ndef short():\n    pass\n")
    assert list(_lengths(path)) == [(2, "long", LIMIT + 1), (LIMIT + 5, "short", 2)]
