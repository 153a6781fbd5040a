"""Each module belongs to one side: the server never imports the client, nor the
client the server; what both need (the wire format) lives in dataferry.schema."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def imported_packages(path: Path, package: str) -> set[str]:
    """The dataferry subpackages a module imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from ..client import x / from .. import client
                base = f"dataferry.{package}".split(".")[: 3 - node.level]
                mod = ".".join(base + ([node.module] if node.module else []))
                names = [mod] if node.module else [f"{mod}.{alias.name}" for alias in node.names]
            else:
                names = [node.module or ""]
        else:
            continue
        found.update(".".join(n.split(".")[:2]) for n in names if n.startswith("dataferry."))
    return found


@pytest.mark.parametrize(("side", "other"), [("server", "client"), ("client", "server")])
def test_a_side_never_imports_the_other(side, other):
    offenders = [
        f"{side}/{py.name}"
        for py in sorted((ROOT / side).glob("*.py"))
        if f"dataferry.{other}" in imported_packages(py, side)
    ]
    assert not offenders, f"these import dataferry.{other}: {offenders}"


def test_relative_imports_are_resolved(tmp_path):
    # the check above must see through the relative spellings too
    mod = tmp_path / "m.py"
    mod.write_text("from ..client import _http\nfrom .. import client\nfrom . import _app\n")
    assert imported_packages(mod, "server") == {"dataferry.client", "dataferry.server"}


@pytest.mark.parametrize(("side", "other"), [("server", "client"), ("client", "server")])
def test_importing_a_side_loads_nothing_of_the_other(side, other):
    mods = {"server": "dataferry.server._app, dataferry.server.cli", "client": "dataferry.client, dataferry.schema.sources.http._source"}
    code = f"import sys, {mods[side]}; print([m for m in sys.modules if m.startswith('dataferry.{other}')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"importing dataferry.{side} loaded {out.strip()}"
