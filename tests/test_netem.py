"""deploy/netem/: the scripts parse and lint, the netem probe answers for this
kernel, and (as root) a topology comes up, carries traffic at the shaped rate
or delay, and goes away without a trace, also after a failure."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

NETEM = Path(__file__).resolve().parent.parent / "deploy" / "netem"
SCRIPTS = sorted(NETEM.glob("*.sh"))
EXIT_NO_NETEM = 3

is_root = os.geteuid() == 0
has_iproute2 = bool(shutil.which("ip") and shutil.which("tc"))
needs_root = pytest.mark.skipif(not (is_root and has_iproute2), reason="needs root and iproute2 (ip, tc)")


def sh(*args, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def namespaces() -> set[str]:
    out = sh("ip", "netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.fixture
def prefix():
    """A topology name of this test's own; torn down whatever happens."""
    name = f"dft{os.getpid() % 100000}"
    yield name
    if is_root and has_iproute2:
        sh(NETEM / "down.sh", "--prefix", name)
        assert not {f"{name}-srv", f"{name}-cli"} & namespaces()


def test_every_script_parses():
    assert {p.name for p in SCRIPTS} >= {"common.sh", "check.sh", "up.sh", "shape.sh", "down.sh", "lab.sh"}
    for script in SCRIPTS:
        done = sh("bash", "-n", script)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_is_clean():
    done = sh("shellcheck", "-x", *SCRIPTS)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("script", ["check.sh", "up.sh", "shape.sh", "down.sh", "lab.sh"])
def test_help_and_usage_errors(script):
    done = sh(NETEM / script, "--help")
    assert done.returncode == 0 and "deploy/netem/" in done.stdout, done.stderr
    done = sh(NETEM / script, "--no-such-option")
    assert done.returncode == 2 and "netem: error:" in done.stderr


def test_bad_values_are_usage_errors():
    for args in (["--delay", "fast"], ["--loss", "lots"], ["--rate", "1gb"], ["--prefix", "bad name"]):
        done = sh(NETEM / "shape.sh", *args)
        if done.returncode == 4:  # not root: refused before the values are read
            pytest.skip("not root")
        assert done.returncode == 2 and "netem: error:" in done.stderr, (args, done.stderr)


@needs_root
def test_the_probe_answers_for_this_kernel(prefix):
    done = sh(NETEM / "check.sh")
    if done.returncode == 0:
        assert "netem: available" in done.stdout
        return
    # a kernel without sch_netem: a clear pointer to the userspace proxy, exit 3,
    # and up.sh asked for a delay refuses the same way and leaves nothing behind
    assert done.returncode == EXIT_NO_NETEM, done.stderr
    assert "no sch_netem" in done.stderr and "dataferry latency-proxy" in done.stderr
    done = sh(NETEM / "up.sh", "--prefix", prefix, "--delay", "10ms")
    assert done.returncode == EXIT_NO_NETEM and "dataferry latency-proxy" in done.stderr
    assert not {f"{prefix}-srv", f"{prefix}-cli"} & namespaces()


SENDER = """\
import socket, sys
srv = socket.create_server((sys.argv[1], 7777))
while True:
    conn, _ = srv.accept()
    with conn:
        if conn.recv(1) == b"t":
            conn.sendall(bytes(int(sys.argv[2])))
"""

RECEIVER = """\
import socket, sys, time
t0 = time.perf_counter()
conn = socket.create_connection(("{ip}", 7777), timeout=30)
connected = time.perf_counter()
n = 0
conn.sendall(b"t")
while chunk := conn.recv(1 << 20):
    n += len(chunk)
print(n, connected - t0, time.perf_counter() - connected)
"""


def lab(prefix: str, tmp_path: Path, *shape: str, nbytes: int) -> tuple[int, float, float]:
    """Send ``nbytes`` from the server namespace to the client namespace through lab.sh;
    return (bytes received, seconds to connect, seconds to transfer)."""
    (tmp_path / "sender.py").write_text(SENDER)
    (tmp_path / "receiver.py").write_text(RECEIVER.format(ip="10.77.0.1"))
    server = f"exec {sys.executable} {tmp_path / 'sender.py'} $SRV_IP {nbytes}"
    done = sh(NETEM / "lab.sh", "--prefix", prefix, *shape, "--server", server, "--ready", "7777",
              "--", sys.executable, tmp_path / "receiver.py", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "down: no namespaces" in done.stderr
    got, connect, transfer = done.stdout.split()
    return int(got), float(connect), float(transfer)


@needs_root
def test_lab_carries_traffic_at_the_tbf_rate_and_tears_down(prefix, tmp_path):
    # 40 mbit/s = 5 MB/s: 4 MB take about 0.8 s; unshaped a veth moves it in milliseconds
    got, _, seconds = lab(prefix, tmp_path, "--rate", "40mbit", nbytes=4_000_000)
    assert got == 4_000_000
    rate = got / seconds
    assert 2.5e6 < rate < 6.5e6, f"{rate / 1e6:.1f} MB/s through a 5 MB/s tbf"
    assert not {f"{prefix}-srv", f"{prefix}-cli"} & namespaces()
    assert not sh("pgrep", "-f", str(tmp_path / "sender.py")).stdout, "the server outlived the lab"


@needs_root
def test_lab_tears_down_after_a_failing_client(prefix):
    # the server is a sleep named after this lab (exec -a), so no other sleep on the machine matches
    server = f"{prefix}-server"
    done = sh(NETEM / "lab.sh", "--prefix", prefix, "--server", f"exec -a {server} sleep 300", "--", "false")
    assert done.returncode == 1
    assert not {f"{prefix}-srv", f"{prefix}-cli"} & namespaces()
    assert not sh("pgrep", "-fx", f"{server} 300").stdout


@needs_root
def test_up_refuses_an_existing_topology_and_down_is_idempotent(prefix):
    assert sh(NETEM / "up.sh", "--prefix", prefix).returncode == 0
    assert {f"{prefix}-srv", f"{prefix}-cli"} <= namespaces()
    again = sh(NETEM / "up.sh", "--prefix", prefix)
    assert again.returncode == 1 and "exists already" in again.stderr
    assert {f"{prefix}-srv", f"{prefix}-cli"} <= namespaces()  # the refusal removed nothing
    for _ in range(2):
        assert sh(NETEM / "down.sh", "--prefix", prefix).returncode == 0
        assert not {f"{prefix}-srv", f"{prefix}-cli"} & namespaces()


@needs_root
def test_netem_delay_sets_the_round_trip(prefix, tmp_path):
    if sh(NETEM / "check.sh").returncode == EXIT_NO_NETEM:
        pytest.skip("this kernel has no sch_netem (the probe test covers the refusal)")
    _, connect, _ = lab(prefix, tmp_path, "--delay", "20ms", "--loss", "0.1%", nbytes=1000)
    assert 0.035 < connect < 0.5, f"TCP connect took {connect * 1e3:.0f} ms at 40 ms RTT"
