"""The house's size rules (issue 24): a module docstring says what the module is for and its
contract in at most 15 lines, and no runtime module runs over 600 lines.

Measurements, methods and history belong in ``bench/results/`` and the package READMEs
(``bench/README.md``'s "Methods", ``schema/README.md``'s "Errors"), not in docstrings.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
RUNTIME = ("schema", "client", "server")
MAX_DOCSTRING_LINES = 15
MAX_MODULE_LINES = 600


def modules(*packages: str) -> list[pathlib.Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_package_has_modules():
    for package in (*RUNTIME, "bench"):
        assert modules(package), package


def test_no_module_docstring_over_15_lines():
    long = {}
    for path in modules(*RUNTIME, "bench"):
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        if doc and len(doc.splitlines()) > MAX_DOCSTRING_LINES:
            long[str(path.relative_to(ROOT))] = len(doc.splitlines())
    assert long == {}


def test_no_runtime_module_over_600_lines():
    long = {}
    for path in modules(*RUNTIME):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MAX_MODULE_LINES:
            long[str(path.relative_to(ROOT))] = lines
    assert long == {}
