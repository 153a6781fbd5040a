"""The compose stacks (``deploy/compose/*.yaml``) as ``docker compose config``
resolves them with ``.env.example``, cross-checked against the code: every
``dataferry`` command goes through the real CLI parser, every store URL through
``parse_store_url``, and the pieces that must agree (nodes and store URLs, DCs
and replication, the role auth-init creates and the one the servers log in as,
ports, secrets and the image's user, HAProxy's listeners) are compared with each
other rather than with literals. Plus ``yamllint``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from _deploy_kit import (
    COMPOSE_DIR,
    DOCKERFILE,
    ENV_EXAMPLE,
    HAPROXY_CFG,
    ONE_SHOTS,
    ROOT,
    SERVERS,
    STACKS,
    bind_mounts,
    cli_args,
    compose,
    compose_model,
    dataferry_services,
    dockerfile_uid,
    dockerfile_user,
    env_example,
    haproxy_sections,
    haproxy_setting,
    memory_bytes,
    seconds,
)

from dataferry.schema import CassandraOptions, parse_store_url


@pytest.fixture(params=sorted(STACKS))
def stack(request) -> str:
    return request.param


@pytest.fixture
def model(stack) -> dict:
    return compose_model(stack)


def test_the_stacks_are_all_the_compose_files_here():
    found = {p.name for p in COMPOSE_DIR.glob("*.yaml") if not p.name.startswith(".")}
    assert found == {s.file for s in STACKS.values()}


# --- interpolation: .env.example -----------------------------------------------------------------------------


def test_compose_resolves_the_stacks_without_warnings(stack):
    out = compose(stack, "config", "--quiet")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    # the check above can fail: without the env file compose warns of the unset variables
    bare = compose(stack, "config", "--quiet", env_file=os.devnull)
    assert bare.returncode == 0 and "CASSANDRA_PASSWORD" in bare.stderr and "variable is not set" in bare.stderr


def test_the_env_file_sets_every_variable_and_nothing_else():
    used = set()
    for stack in STACKS:
        out = compose(stack, "config", "--variables", "--format", "json")
        assert out.returncode == 0, out.stderr
        used |= set(json.loads(out.stdout))
        used |= {s["environment"] for s in compose_model(stack).get("secrets", {}).values() if "environment" in s}
    example = set(env_example())
    assert used == example, f"missing in .env.example: {used - example}; unused: {example - used}"


def test_compose_reads_the_env_file_as_written():
    """.env.example promises values taken literally, comments on their own lines:
    compose would strip quotes and a trailing `` #...``, and keep only the last of
    two lines setting one name."""
    lines = [line for line in ENV_EXAMPLE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    written = [tuple(line.split("=", 1)) for line in lines]
    assert all(len(pair) == 2 for pair in written), [line for line in lines if "=" not in line]
    names = [name for name, _ in written]
    assert len(set(names)) == len(names), f"set twice: {sorted(n for n in names if names.count(n) > 1)}"
    assert env_example() == dict(written)


def test_the_example_secrets_are_placeholders_the_code_accepts():
    from dataferry.server import ServerOptions

    env = env_example()
    for name in ("DATAFERRY_TOKEN", "CASSANDRA_PASSWORD", "CASSANDRA_ADMIN_PASSWORD"):
        assert "change-me" in env[name], f"{name} must be an obvious placeholder"
    ServerOptions(token=env["DATAFERRY_TOKEN"])  # a token the server takes
    assert env["CASSANDRA_ADMIN_PASSWORD"] not in (env["CASSANDRA_PASSWORD"], "cassandra")


# --- services: images, healthchecks, restarts, order -----------------------------------------------------------


def test_built_services_use_this_repository_and_other_images_are_pinned(stack, model):
    services = model["services"]
    built = dataferry_services(model)
    assert set(built) == {"schema-init", *SERVERS}  # the commands parsed below
    for name, svc in built.items():
        assert svc["build"]["context"] == str(ROOT), f"{name}: the build context is the repository root"
        assert (ROOT / svc["build"]["dockerfile"]).resolve() == DOCKERFILE
    assert len({svc["image"] for svc in built.values()}) == 1, "one image for the servers and the jobs"
    for name, svc in services.items():
        if name not in built:
            repo, _, tag = svc["image"].rpartition(":")
            assert repo and tag and tag != "latest", f"{name}: pin the image's tag"
    # cqlsh in auth-init is the cluster's own version
    assert {services[n]["image"] for n in STACKS[stack].nodes} == {services["auth-init"]["image"]}


def test_long_running_services_have_a_healthcheck_and_a_restart_policy(model):
    for name, svc in model["services"].items():
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
        assert seconds(hc["timeout"]) < seconds(hc["interval"]), name


def _needs(model: dict, name: str) -> set[str]:
    """Every service ``name`` waits for, directly or not."""
    seen, todo = set(), [name]
    while todo:
        for dep in model["services"][todo.pop()].get("depends_on", {}):
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_depends_on_waits_for_what_each_service_talks_to(stack, model):
    services = model["services"]
    nodes = STACKS[stack].nodes
    for name, svc in services.items():
        for target, spec in svc.get("depends_on", {}).items():
            want = "service_completed_successfully" if target in ONE_SHOTS else "service_healthy"
            assert spec["condition"] == want, f"{name} -> {target}: {spec}"
    done: list[str] = []
    while len(done) < len(services):
        ready = [n for n in services if n not in done and set(services[n].get("depends_on", {})) <= set(done)]
        assert ready, f"depends_on cycle among {set(services) - set(done)}"
        done += ready
    # nodes join one at a time: each waits for the one before it
    for before, node in zip(nodes, nodes[1:]):
        assert before in _needs(model, node), f"{node} may join while {before} is joining"
    # each job and server waits for every node its store URL or CQL_HOST names, and for what it needs first
    assert services["auth-init"]["environment"]["CQL_HOST"] in _needs(model, "auth-init")
    assert set(nodes) <= _needs(model, "auth-init")  # it sets system_auth's RF: all nodes up
    for name in ("schema-init", *SERVERS):
        hosts = parse_store_url(cli_args(services[name]["command"]).store).hosts
        assert set(hosts) <= _needs(model, name), f"{name} starts before {set(hosts) - _needs(model, name)}"
    assert "auth-init" in _needs(model, "schema-init")  # it logs in as the role auth-init creates
    for name in SERVERS:
        assert "schema-init" in _needs(model, name)  # the tables exist
    backends = {line.split()[1] for line in haproxy_sections()["backend dataferry"] if line.startswith("server ")}
    assert backends <= _needs(model, "lb")


def test_mounts_exist_and_each_node_has_its_own_volume(stack, model):
    declared = set(model.get("volumes") or {})
    used = []
    for name, svc in model["services"].items():
        for vol in svc.get("volumes", []):
            if vol["type"] == "bind":
                # compose would create a missing source as an empty directory
                assert Path(vol["source"]).is_file(), f"{name}: {vol['source']} missing"
                assert vol.get("read_only"), f"{name}: mount {vol['source']} read-only"
            else:
                assert vol["type"] == "volume" and vol["source"] in declared, f"{name}: {vol}"
                used.append(vol["source"])
        entrypoint = svc.get("entrypoint") or []
        scripts = [a for a in entrypoint if a.endswith(".sh")]
        assert set(scripts) <= set(bind_mounts(svc)), f"{name}: entrypoint script {scripts} is not mounted"
    assert sorted(used) == sorted(declared), "a volume is unused or shared"
    for name in STACKS[stack].nodes:
        data = [v for v in model["services"][name]["volumes"] if v["target"] == STACKS[stack].data_dir]
        assert len(data) == 1 and data[0]["type"] == "volume", f"{name}: its data on a named volume"


def test_resource_limits_everywhere_and_heaps_fit(stack, model):
    for name, svc in model["services"].items():
        limits = svc.get("deploy", {}).get("resources", {}).get("limits", {})
        assert float(limits.get("cpus", 0)) > 0, f"{name}: no cpu limit"
        assert int(limits.get("memory", 0)) >= 256 << 20, f"{name}: no memory limit"
    for name in STACKS[stack].nodes:
        svc = model["services"][name]
        limit = int(svc["deploy"]["resources"]["limits"]["memory"])
        if stack == "cassandra":
            heap = memory_bytes(svc["environment"]["MAX_HEAP_SIZE"])
            assert "HEAP_NEWSIZE" in svc["environment"]  # cassandra-env.sh wants the pair
            assert heap <= limit // 2, f"{name}: heap {heap} leaves no room for off-heap memory"
        else:
            cmd = svc["command"]
            assert memory_bytes(cmd[cmd.index("--memory") + 1]) < limit, f"{name}: --memory above the limit"


# --- the dataferry commands against the real CLI ---------------------------------------------------------------


def _node_dc(stack: str, svc: dict) -> str:
    """The DC a node announces: GossipingPropertyFileSnitch reads it from the
    image's env (cassandra) or the mounted cassandra-rackdc.properties (scylla)."""
    if stack == "cassandra":
        env = svc["environment"]
        assert env["CASSANDRA_ENDPOINT_SNITCH"] == "GossipingPropertyFileSnitch"
        return env["CASSANDRA_DC"]
    cmd = svc["command"]
    assert cmd[cmd.index("--endpoint-snitch") + 1] == "GossipingPropertyFileSnitch"
    props = bind_mounts(svc)["/etc/scylla/cassandra-rackdc.properties"].read_text().splitlines()
    return dict(line.split("=", 1) for line in props if line and not line.startswith("#"))["dc"]


def _seeds(stack: str, svc: dict) -> set[str]:
    if stack == "cassandra":
        return set(svc["environment"]["CASSANDRA_SEEDS"].split(","))
    return set(next(a.split("=", 1)[1] for a in svc["command"] if a.startswith("--seeds=")).split(","))


def test_server_commands_parse_and_agree_with_the_stack(stack, model):
    services, env = model["services"], env_example()
    commands = {name: services[name]["command"] for name in SERVERS}
    assert commands["server-1"] == commands["server-2"]
    args = cli_args(commands["server-1"])
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert str(args.port) in services["server-1"]["expose"]
    opts = parse_store_url(args.store)
    assert isinstance(opts, CassandraOptions)
    assert set(opts.hosts) == set(STACKS[stack].nodes)
    assert (opts.username, opts.password) == (env["CASSANDRA_USER"], env["CASSANDRA_PASSWORD"])
    assert opts.consistency == "LOCAL_QUORUM"
    assert {_node_dc(stack, services[n]) for n in opts.hosts} == {opts.local_dc}
    # the token file is the mounted secret, readable by the image's user alone
    (secret,) = services["server-1"]["secrets"]
    assert args.token_file == f"/run/secrets/{secret['target']}"
    assert model["secrets"][secret["source"]]["environment"] == "DATAFERRY_TOKEN"
    uid = dockerfile_uid()
    assert (secret["uid"], secret["gid"], int(secret["mode"], 8)) == (uid, uid, 0o400)
    assert dockerfile_user() == f"{uid}:{uid}"
    # SIGTERM grace fits inside compose's stop timeout
    assert seconds(services["server-1"]["stop_grace_period"]) > args.grace
    assert "ports" not in services["server-1"]  # reached through the load balancer only


def test_schema_init_command_parses_and_matches_the_cluster(stack, model):
    services = model["services"]
    args = cli_args(services["schema-init"]["command"])
    assert (args.command, args.action) == ("schema", "apply")
    opts = parse_store_url(args.store)
    server = parse_store_url(cli_args(services["server-1"]["command"]).store)
    assert set(opts.hosts) == set(STACKS[stack].nodes)
    assert (opts.keyspace, opts.username) == (server.keyspace, server.username)  # what the servers read
    replication = CassandraOptions(replication=args.replication).replication_map()
    assert replication["class"] == "NetworkTopologyStrategy"
    assert set(replication) == {"class", server.local_dc}, "replicas in the DC the servers read at LOCAL_QUORUM"
    rf = int(replication[server.local_dc])
    assert 3 <= rf <= len(STACKS[stack].nodes), "LOCAL_QUORUM survives a node down with RF >= 3"
    # auth-init creates the role schema-init logs in as, with system_auth at the same RF in the same DC
    auth = services["auth-init"]["environment"]
    assert (auth["CQL_USER"], auth["CQL_PASSWORD"]) == (opts.username, opts.password)
    assert (auth["CQL_DC"], int(auth["CQL_RF"])) == (server.local_dc, rf)
    assert auth["CQL_HOST"] in STACKS[stack].nodes
    assert bind_mounts(services["auth-init"])[services["auth-init"]["entrypoint"][-1]].name == "init-auth.sh"


def test_the_nodes_form_one_password_protected_dc(stack, model):
    services = model["services"]
    nodes = STACKS[stack].nodes
    for name in nodes:
        svc = services[name]
        assert svc["hostname"] == name  # the name the store URLs and seeds use
        assert _seeds(stack, svc) <= set(nodes) and nodes[0] in _seeds(stack, svc)
        if stack == "cassandra":  # the entrypoint wrapper turns authentication on (test_deploy_scripts.py)
            assert bind_mounts(svc)[svc["entrypoint"][-1]].name == "cassandra-entrypoint.sh"
            assert svc["command"], "an entrypoint override clears the image's CMD: give it again"
        else:
            cmd = svc["command"]
            assert cmd[cmd.index("--authenticator") + 1] == "PasswordAuthenticator"
            assert cmd[cmd.index("--authorizer") + 1] == "CassandraAuthorizer"
    assert len({_node_dc(stack, services[n]) for n in nodes}) == 1


def test_the_published_port_reaches_the_servers_through_haproxy(stack, model):
    services, env, cfg = model["services"], env_example(), haproxy_sections()
    lb = services["lb"]
    ports = {p["target"]: p for p in lb["ports"]}
    data_bind = haproxy_setting(cfg["frontend dataferry"], "bind").rsplit(":", 1)[1]
    monitor_bind = haproxy_setting(cfg["frontend monitor"], "bind").rsplit(":", 1)[1]
    assert set(ports) == {int(data_bind), int(monitor_bind)}
    assert ports[int(data_bind)]["published"] == env["DATAFERRY_PORT"]
    monitor = ports[int(monitor_bind)]
    assert monitor.get("host_ip") == "127.0.0.1", "HAProxy's stats stay on the host's loopback"
    assert monitor["published"] == env["HAPROXY_MONITOR_PORT"]
    assert bind_mounts(lb) == {"/usr/local/etc/haproxy/haproxy.cfg": HAPROXY_CFG}
    # the container's healthcheck asks HAProxy's monitor-uri on the monitor port
    url = lb["healthcheck"]["test"][-1]
    monitor_uri = haproxy_setting(cfg["frontend monitor"], "monitor-uri")
    assert url == f"http://127.0.0.1:{monitor_bind}{monitor_uri}"
    # the backend's servers are the replicas, on the port they listen on
    port = cli_args(services["server-1"]["command"]).port
    servers = [line.split() for line in cfg["backend dataferry"] if line.startswith("server ")]
    assert [(s[1], s[2]) for s in servers] == [(name, f"{services[name]['hostname']}:{port}") for name in SERVERS]


# --- yamllint ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stack_file", sorted(s.file for s in STACKS.values()))
def test_yamllint(stack_file):
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    config = YamlLintConfig(file=str(COMPOSE_DIR / ".yamllint.yaml"))
    problems = list(linter.run((COMPOSE_DIR / stack_file).read_text(), config))
    assert not problems, "\n".join(f"{stack_file}:{p.line}:{p.column}: {p.message}" for p in problems)
