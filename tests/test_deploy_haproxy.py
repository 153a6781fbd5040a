"""HAProxy in front of the replicas (``deploy/compose/haproxy.cfg``): its limits
and timeouts against the server's and the client's own, ``haproxy -c``, and the
real config in front of two real servers on loopback, streaming an epoch and
failing over when one dies. (The health-check request itself is sent to the
real server in test_deploy_healthchecks.py.)
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from dataferry.bench._devcassandra import _free_ports
from _deploy_kit import HAPROXY_CFG, SERVERS, cli_args, compose_model, haproxy_sections, haproxy_setting, seconds


def _haproxy() -> str | None:
    return shutil.which("haproxy") or next((p for p in ("/usr/sbin/haproxy",) if os.access(p, os.X_OK)), None)


needs_haproxy = pytest.mark.skipif(_haproxy() is None, reason="haproxy is not installed (apt-get install haproxy)")


def test_haproxy_checks_both_replicas_within_the_servers_limits():
    from dataferry.client import HttpOptions
    from dataferry.server import ServerOptions

    cfg = haproxy_sections()
    backend = cfg["backend dataferry"]
    assert "option httpchk" in backend
    default_server = haproxy_setting(backend, "default-server").split()
    assert "check" in default_server
    # queue at the balancer, not at the replica: one slot per request a replica serves at once
    server = cli_args(compose_model("cassandra")["services"]["server-1"]["command"])
    assert int(default_server[default_server.index("maxconn") + 1]) == server.max_concurrent
    # streaming: no request buffering; inactivity timeouts above the server's own
    assert not [line for lines in cfg.values() for line in lines if "http-buffer-request" in line]
    timeout = {line.split()[1]: seconds(line.split()[2]) for line in cfg["defaults"] if line.startswith("timeout ")}
    server_defaults = ServerOptions()
    assert timeout["server"] > max(server_defaults.store_timeout, server_defaults.send_timeout)
    assert timeout["client"] > server_defaults.send_timeout
    assert timeout["queue"] >= server_defaults.queue_timeout
    assert timeout["http-keep-alive"] > HttpOptions().keepalive  # the client closes idle connections first


@needs_haproxy
def test_haproxy_accepts_the_config():
    out = subprocess.run([_haproxy(), "-c", "-f", str(HAPROXY_CFG)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stdout + out.stderr
    # the only warnings allowed: the replicas' names resolve inside compose only
    warnings = [line for line in (out.stdout + out.stderr).splitlines() if "WARNING" in line]
    assert all("could not resolve address 'server-" in w for w in warnings), warnings


# --- the real config in front of two real servers ------------------------------------------------------------


def _loopback_config(ports: dict[str, int]) -> str:
    """haproxy.cfg with the replicas, listeners and check interval moved to loopback test values."""
    text = HAPROXY_CFG.read_text()
    swaps = [
        ("    bind :8470\n", f"    bind 127.0.0.1:{ports['lb']}\n"),
        ("    bind :8404\n", f"    bind 127.0.0.1:{ports['monitor']}\n"),
        ("server server-1 server-1:8470", f"server server-1 127.0.0.1:{ports['server-1']}"),
        ("server server-2 server-2:8470", f"server server-2 127.0.0.1:{ports['server-2']}"),
        (" inter 2s fall 3 rise 2 ", " inter 100ms fall 3 rise 1 "),
        (" resolvers docker init-addr last,libc,none", ""),
        ("    maxconn 20000\n", "    maxconn 1000\n"),  # 2 fds a connection: within a test's ulimit
        # a check's own timeout is ``inter`` unless set: 100 ms, two of which a replica on a busy
        # 2-core machine may miss (once in a full run, server-1 served nothing of an epoch). With
        # 2 s and fall 2, server-2 was marked down once at load 7 (a full run beside a 16-worker
        # stress test): 5 s and fall 3; a killed replica refuses its checks at once, so the
        # failover below is as quick
        ("    timeout queue 30s\n", "    timeout queue 30s\n    timeout check 5s\n"),
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




@needs_haproxy
def test_haproxy_streams_from_both_replicas_and_fails_over(tmp_path):
    from server_kit import make_samples, seed_url

    from dataferry.client import Hedge, HttpSource, Loader, Prefetch, Retry

    samples = make_samples(400, size=3000)
    db = f"sqlite://{tmp_path / 's.db'}"

    seed_url(db, "d", samples)
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
                        prefetch=Prefetch(max_inflight=8, initial_inflight=8, request_size=16, tune=False),  # 8 connections all along: haproxy balances connections (a tuned window shrinks to the tiny loopback BDP)
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
        if not all(v > 0 for v in served.values()):
            head, *rows = _get(f"{monitor}/stats;csv")[1].splitlines()
            cols = [head.lstrip("# ").split(",").index(c) for c in ("svname", "status", "chkfail", "chkdown", "lbtot")]
            stats = [" ".join(r.split(",")[i] for i in cols) for r in rows if r.startswith("dataferry,")]
            pytest.fail(f"a replica served nothing: {served}; haproxy: {stats}; log: {log.read_text()[-1500:]}")
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
