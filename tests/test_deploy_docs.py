"""The guides in ``deploy/``: the README maps every file, OPERATIONS.md names
the server's real metrics, and the Python snippets of TRAINING.md and
OPERATIONS.md import real names and pass options the client accepts.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from _deploy_kit import DEPLOY, ROOT


def test_deploy_readme_maps_every_file():
    readme = (DEPLOY / "README.md").read_text()
    tracked = subprocess.run(["git", "ls-files", "--others", "--cached", "--exclude-standard", "deploy"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    mine = {f for f in tracked if not f.startswith("deploy/netem/") and f != "deploy/README.md"}
    for f in sorted(mine):
        assert f.removeprefix("deploy/") in readme, f"deploy/README.md does not mention {f}"
    for doc in ("TRAINING.md", "OPERATIONS.md"):
        assert f"]({doc})" in readme


def test_operations_lists_every_server_metric(tmp_path):
    """Every metric family the real app exposes at /metrics is in OPERATIONS.md,
    and every metric OPERATIONS.md names is exposed."""
    import asyncio

    import aiohttp
    from server_kit import call, serve

    from dataferry.schema import open_store
    from dataferry.server import make_app

    async def scrape() -> str:
        async with await open_store(f"sqlite://{tmp_path / 'm.db'}") as store:
            async with serve(make_app(store)) as base, aiohttp.ClientSession() as s:
                return (await call(s, "GET", base + "/metrics", "/metrics"))[2].decode()

    text = asyncio.run(scrape())
    names = re.findall(r"^# TYPE (\S+) \S+$", text, re.M)
    assert "dataferry_server_requests_total" in names and "process_resident_memory_bytes" in names
    text_doc = (DEPLOY / "OPERATIONS.md").read_text()
    missing = [n for n in names if f"`{n}`" not in text_doc]
    assert not missing, f"OPERATIONS.md does not list {missing}"
    documented = set(re.findall(r"`((?:dataferry_server|process|python)_[a-z_]+)`", text_doc))
    histogram_parts = {f"{n}{suffix}" for n in names for suffix in ("_bucket", "_sum", "_count")}
    assert documented <= set(names) | histogram_parts, f"not real metrics: {documented - set(names) - histogram_parts}"


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.parametrize("doc", ["TRAINING.md", "OPERATIONS.md"])
def test_doc_snippets_use_real_names_and_options(doc):
    import dataclasses

    import dataferry.client as client

    options = {name: {f.name for f in dataclasses.fields(getattr(client, name))}
               for name in ("PlanOptions", "Prefetch", "Retry", "Hedge", "ErrorPolicy", "HttpOptions")}
    for block in _python_blocks(DEPLOY / doc):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "dataferry.client":
                for alias in node.names:
                    assert alias.name in client.__all__, f"{doc}: dataferry.client has no {alias.name}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in options:
                for kw in node.keywords:
                    assert kw.arg in options[node.func.id], f"{doc}: {node.func.id} has no option {kw.arg}"
                    if isinstance(kw.value, ast.Constant):  # and the value is accepted
                        getattr(client, node.func.id)(**{kw.arg: kw.value.value})
