"""The README's two set-up commands are the ones CI and users run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [c.strip() for c in re.findall(r"```bash\n(.*?)```", quick, re.S)]


def test_readme_has_exactly_two_commands():
    cmds = readme_commands()
    assert len(cmds) == 2, cmds
    assert all("\n" not in c for c in cmds)
    assert "dataferry demo" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci


def test_every_package_folder_has_a_readme_map():
    for folder in ("schema", "client", "server", "bench"):
        readme = ROOT / folder / "README.md"
        assert readme.exists(), readme
        names = readme.read_text()
        for py in (ROOT / folder).glob("*.py"):
            if py.name != "__init__.py":
                assert py.name in names, f"{folder}/README.md does not map {py.name}"
