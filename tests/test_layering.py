"""Each module is owned by one side and nothing is imported backwards.

``schema`` is the shared data layer: it imports no other dataferry package.
``server`` and ``client`` import ``schema`` and themselves, never each other.
``bench`` (lab tools) may import anything; nothing imports ``bench``. The CLI
dispatcher names other packages' subcommands as strings (``schema._cli._MODULES``),
which is not an import.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ALLOWED = {
    "schema": {"schema"},
    "server": {"schema", "server"},
    "client": {"schema", "client"},
}


def _dataferry_imports(path: pathlib.Path, package: str) -> list[tuple[int, str]]:
    """(line, top-level dataferry package) of every import in ``path``, lazy ones inside functions included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                names = [f"dataferry.{package}"]
            elif node.level >= 2:
                names = [f"dataferry.{node.module or ''}"]
            else:
                names = [node.module or ""]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "dataferry" and len(parts) > 1 and parts[1]:
                found.append((node.lineno, parts[1]))
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_no_package_imports_backwards(package):
    wrong = [
        f"{package}/{path.name}:{line} imports dataferry.{target}"
        for path in sorted((ROOT / package).glob("*.py"))
        for line, target in _dataferry_imports(path, package)
        if target not in ALLOWED[package]
    ]
    assert wrong == []


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from dataferry.bench.demo import x\n    from ..client import y\n    from . import z\n")
    assert _dataferry_imports(src, "schema") == [(2, "bench"), (3, "client"), (4, "schema")]
