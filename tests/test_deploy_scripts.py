"""The helper scripts of the compose stacks, run for real with bash:
``cassandra-entrypoint.sh`` on both layouts of cassandra.yaml, and
``init-auth.sh`` against a stand-in for ``cqlsh`` (argv in, exit status out,
state in a JSON file: the seam the script uses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _deploy_kit import COMPOSE_DIR

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
