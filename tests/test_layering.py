"""The house has floors, and a package crosses into another only through its public face.

Floors, lowest first:

0. ``schema``: the contract both sides share (model, errors, seam, wire, ingest and the storage
   advisor, which measures decoding through a seam the CLI fills with the client's), and every
   source behind the one URL dispatcher (``schema/sources/``: the stores, the data service's
   client, the in-memory source);
1. ``server`` and ``client``: the two sides; neither imports the other;
2. the top: the ``dataferry`` CLI (``schema/cli/``, ``dataferry.schema.cli``) and ``bench``
   (the demo, benchmarks, lab tools).

Two rules, over every import: static, lazy inside a function, relative, and a
module named in a string (``import_module("dataferry.x")``, the CLI's table of
subcommands):

- nothing imports from a higher floor, nor from the other package of its own floor;
- a runtime package (schema, server, client) imports no other package's private
  module (``dataferry.schema._errors``): it uses the public face
  (``dataferry.schema``; the sources': ``dataferry.schema.sources``). ``bench``
  measures internals and is exempt; nothing imports it.

A logger's name (``getLogger("dataferry.client")``) is not an import. And things of one
kind live together: every runtime ``SampleSource`` is in ``schema/sources/``.
"""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLOOR = {"schema": 0, "server": 1, "client": 1, "cli": 2, "bench": 2}
#: packages allowed to reach into another's private modules
LAB = {"bench"}
_NAME = re.compile(r"dataferry(\.\w+)+")


def package_of(module: str) -> str | None:
    """The package a dotted ``dataferry.*`` module belongs to (``dataferry.schema.cli.x`` -> ``cli``)."""
    parts = module.split(".")
    if parts[0] != "dataferry" or len(parts) < 2:
        return None
    if parts[1] == "schema" and len(parts) > 2 and parts[2] == "cli":
        return "cli"
    return parts[1]


def is_private(module: str) -> bool:
    """Whether ``module`` names a private module (a ``_name`` part below its package)."""
    parts = module.split(".")
    below = parts[3:] if package_of(module) == "cli" else parts[2:]
    return any(p.startswith("_") and not p.startswith("__") for p in below)


def module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["dataferry", *parts])


def imports(path: pathlib.Path, me: str | None = None) -> list[tuple[int, str]]:
    """(line, dotted module) of every dataferry import in ``path`` (the module ``me``):
    static, lazy, relative (resolved), and module names written as strings."""
    me = me or module_name(path)
    package = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
    found = []
    tree = ast.parse(path.read_text(), str(path))
    # a logger's name is no import (the data service client, in schema/sources/, logs as dataferry.client)
    loggers = {id(arg) for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "attr", getattr(node.func, "id", None)) == "getLogger" for arg in node.args}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                base_name = ".".join(base + ([node.module] if node.module else []))
                # ``from . import x``: x may be a module
                found += [(node.lineno, f"{base_name}.{a.name}" if not node.module else base_name) for a in node.names]
            else:
                found.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in loggers:
            text = node.value.split(":")[0]
            if _NAME.fullmatch(text):
                found.append((node.lineno, text))
    return [(line, name) for line, name in found if name.startswith("dataferry.")]


def _files():
    for package in ("schema", "server", "client", "bench"):
        for path in sorted((ROOT / package).rglob("*.py")):
            own = package_of(module_name(path))
            yield path, own


def test_no_import_runs_down_a_floor_or_across_to_the_other_side():
    wrong = []
    for path, own in _files():
        for line, name in imports(path):
            target = package_of(name)
            if target is None or target == own or target not in FLOOR:
                continue
            if FLOOR[target] > FLOOR[own] or (FLOOR[target] == FLOOR[own] and FLOOR[own] < 2):
                wrong.append(f"{path.relative_to(ROOT)}:{line} ({own}) imports {name} ({target})")
    assert wrong == []


def test_no_package_imports_another_packages_private_module():
    wrong = []
    for path, own in _files():
        if own in LAB:
            continue
        for line, name in imports(path):
            target = package_of(name)
            if target is not None and target != own and is_private(name):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert wrong == []


def test_the_checker_sees_lazy_relative_and_named_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import importlib\n"
        "def f():\n    from dataferry.bench.demo import x\n    from ..client import y\n    from . import z\n"
        "    importlib.import_module('dataferry.server._cli')\n"
        "    from ._errors import E\n"
        "log = logging.getLogger('dataferry.client')\n"
    )
    assert imports(src, "dataferry.schema.m") == [
        (3, "dataferry.bench.demo"), (4, "dataferry.client"), (5, "dataferry.schema.z"),
        (7, "dataferry.schema._errors"), (6, "dataferry.server._cli"),
    ]
    assert [package_of(n) for n in ("dataferry.schema._x", "dataferry.schema.cli._y", "dataferry.client")] == [
        "schema", "cli", "client"]
    assert is_private("dataferry.schema._errors") and not is_private("dataferry.schema")
    assert is_private("dataferry.schema.cli._common") and not is_private("dataferry.server.__main__")
    assert not is_private("dataferry.schema.sources") and is_private("dataferry.schema.sources.http._source")
    assert package_of("dataferry.schema.sources.cassandra._store") == "schema"



def test_every_sample_source_lives_in_schema_sources():
    """Things of one kind live together: a runtime class with the seam's method (``fetch``) is
    in ``schema/sources/``, behind its one URL dispatcher; ``schema/_store.py`` holds the
    protocol itself. (``bench`` and ``tests`` keep their lab and fake sources.)"""
    home, seam = ROOT / "schema" / "sources", ROOT / "schema" / "_store.py"
    stray = []
    for path, own in _files():
        if own in LAB or path == seam or path.is_relative_to(home):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name == "fetch" for f in node.body):
                stray.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert stray == []
