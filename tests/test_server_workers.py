"""``dataferry serve --workers N``: the real command, its real processes.

Workers share the port and all serve; /metrics from any worker sums them
all; SIGTERM lets in-flight responses finish and the server exits 0 leaving
no process behind; a worker that dies is restarted (a crash loop, or a worker
that cannot start, stops the server with status 1); a parent killed with
SIGKILL takes its workers with it.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataferry.schema._wire import HEADER, encode_ids
from proc_kit import alive, children, wait_gone
from server_kit import ended_after, make_samples, parse_metrics, seed_url

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc"), reason="forks; reads /proc")


class Served:
    """``python -m dataferry.server --workers N`` with its log in a file."""

    def __init__(self, store_url: str, log: Path, *args: str) -> None:
        self.log = log
        with log.open("w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dataferry.server", "--store", store_url, "--port", "0", "--open-metrics",
                 "--log-level", "INFO", *args],
                stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, "PYTHONWARNINGS": "error", "TMPDIR": str(log.parent)},  # the metrics folder
            )
        line = self.proc.stdout.readline()
        found = re.search(r"listening on http://([\d.]+):(\d+)", line)
        assert found, line + log.read_text()
        self.host, self.port = found.group(1), int(found.group(2))
        self.seen: set[int] = set()  # every worker pid ever seen, for the orphan check

    def workers(self, count: int, timeout: float = 20.0) -> list[int]:
        """The worker pids, once there are ``count`` of them serving."""
        deadline = time.monotonic() + timeout
        while True:
            pids = [p for p in children(self.proc.pid) if alive(p)]
            self.seen.update(pids)
            if len(pids) == count and all(self.serving(p) for p in pids):
                return pids
            assert time.monotonic() < deadline, f"workers {pids}, log:\n{self.log.read_text()}"
            time.sleep(0.05)

    def serving(self, pid: int) -> bool:
        return f"[{pid}]: opened store" in self.log.read_text()

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
        """One request on a new connection: ``(status, body)``."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def metrics(self) -> dict[str, float]:
        status, body = self.request("GET", "/metrics")
        assert status == 200
        return parse_metrics(body.decode())

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        finally:
            self.proc.stdout.close()

    def kill_all(self) -> None:
        """Teardown: nothing of this server survives the test."""
        for pid in {*self.seen, *children(self.proc.pid)}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if not self.proc.stdout.closed:
            self.proc.stdout.close()


def listening(host: str, port: int) -> bool:
    """Whether anything accepts connections on ``host:port``."""
    try:
        sock = socket.create_connection((host, port), timeout=5)
    except ConnectionRefusedError:
        return False
    with sock:
        # with no listener, loopback can connect a socket to itself (its source port the same)
        return sock.getsockname() != sock.getpeername()


OCTETS = {"Content-Type": "application/octet-stream"}


@pytest.fixture
def store_url(tmp_path):
    return seed_url(f"sqlite://{tmp_path / 's.db'}", "d", make_samples(40, size=3000))


@pytest.fixture
def served(store_url, tmp_path):
    logs = (tmp_path / f"server-{k}.log" for k in itertools.count())
    with ended_after(lambda *args: Served(store_url, next(logs), *args), Served.kill_all) as start:
        yield start


def test_workers_share_the_port_and_metrics_sum_across_them(served, store_url):
    s = served("--workers", "2")
    pids = s.workers(2)
    ids = [x.id for x in make_samples(40, size=3000)]
    for k in range(24):  # a new connection each: the kernel spreads them over the workers' sockets
        status, body = s.request("POST", "/v1/datasets/d/samples", encode_ids(ids[k % 4 :: 4]), OCTETS)
        assert status == 200 and body[-HEADER.size + 3] == 3  # ends with an END record
    log = s.log.read_text()
    served_by = {int(p) for p in re.findall(r"aiohttp\.access\[(\d+)\]: .* \"POST /v1/datasets/d/samples", log)}
    assert served_by == set(pids), (served_by, pids)  # both workers served, and only they
    assert s.proc.pid not in served_by  # the parent accepts nothing

    scrapes = [s.metrics() for _ in range(8)]  # new connections: both workers answer some
    for m in scrapes:
        assert m["dataferry_server_samples_served_total"] == 24 * 10
        assert m['dataferry_server_requests_total{method="POST",route="/v1/datasets/{name}/samples",status="200"}'] == 24
        assert m["dataferry_server_requests_in_flight"] == 1  # the scrape itself, in whichever worker
        assert m["process_open_fds"] > 0 and m["process_resident_memory_bytes"] > 0
        assert any(k.startswith("python_gc_collections_total") for k in m)
    # the process figures cover the whole server: more than the parent alone
    parent_rss = int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{s.proc.pid}/status").read_text()).group(1)) * 1024
    assert scrapes[0]["process_resident_memory_bytes"] > 2 * parent_rss * 0.9
    status, body = s.request("GET", "/healthz")
    assert status == 200 and json.loads(body) == {"status": "ok"}
    assert s.stop() == 0


def test_sigterm_lets_in_flight_responses_finish_then_exits_0_leaving_no_process(served, tmp_path):
    big = make_samples(24, size=1 << 20, seed=3)
    url = seed_url(f"sqlite://{tmp_path / 'big.db'}", "big", big)
    s = Served(url, tmp_path / "big.log", "--workers", "2", "--grace", "20")
    try:
        pids = s.workers(2)
        sock = socket.create_connection((s.host, s.port))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        body = encode_ids([x.id for x in big])
        sock.sendall(b"POST /v1/datasets/big/samples HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        first = sock.recv(1 << 16)
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        time.sleep(0.3)  # the response is in flight, the worker waits on this client's socket
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert s.proc.poll() is None  # still draining
        assert not listening(s.host, s.port)  # no longer accepting
        got = bytearray(first)
        while chunk := sock.recv(1 << 20):
            got += chunk
            if got.endswith(b"\r\n0\r\n\r\n"):
                break
        sock.close()
        assert s.proc.wait(30) == 0, s.log.read_text()
        s.proc.stdout.close()
        samples = _records(bytes(got))
        assert sorted(samples) == sorted(x.id for x in big)  # every sample, then END
        wait_gone([s.proc.pid, *pids])
        assert not list(Path(tmp_path).glob("dataferry-metrics-*"))
    finally:
        s.kill_all()


def _records(raw: bytes) -> list[int]:
    """The SAMPLE ids of a chunked batch response; asserts it ends with END."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    body = bytearray()
    while True:
        line, _, rest = rest.partition(b"\r\n")
        n = int(line, 16)
        if n == 0:
            break
        body += rest[:n]
        rest = rest[n + 2 :]
    ids, pos = [], 0
    while True:
        _, _, kind, _, id_, _, tlen, dlen = HEADER.unpack_from(body, pos)
        pos += HEADER.size + tlen + dlen
        if kind == 3:
            assert pos == len(body)
            return ids
        assert kind == 0
        ids.append(id_)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_sigterm_as_soon_as_the_port_is_announced_stops_the_server_with_status_0(served, workers):
    """The signal comes while the workers are still starting (importing, opening
    the store), before their loops handle it: it waits for them, it does not
    kill them (which the parent took for a failed stop: exit status 1)."""
    s = served("--workers", workers)
    s.proc.send_signal(signal.SIGTERM)
    assert s.stop() == 0, s.log.read_text()
    assert "killed by" not in s.log.read_text()


def test_a_killed_worker_is_restarted_and_its_counts_kept(served):
    s = served("--workers", "2")
    pids = s.workers(2)
    ids = [x.id for x in make_samples(40, size=3000)]
    for _ in range(6):
        assert s.request("POST", "/v1/datasets/d/samples", encode_ids(ids[:5]), OCTETS)[0] == 200
    before = s.metrics()["dataferry_server_samples_served_total"]
    assert before == 30
    os.kill(pids[0], signal.SIGKILL)
    wait_gone([pids[0]])  # else the dying worker may still be counted as one of the two
    now = s.workers(2)
    assert pids[0] not in now and pids[1] in now
    assert f"worker {pids[0]} was killed by SIGKILL; starting another" in s.log.read_text()
    for _ in range(12):  # every new connection is served, the replaced worker's socket included
        assert s.request("POST", "/v1/datasets/d/samples", encode_ids(ids[:5]), OCTETS)[0] == 200
    assert s.metrics()["dataferry_server_samples_served_total"] == 30 + 60  # the dead worker's 30 kept
    assert s.stop() == 0


def test_a_frozen_worker_is_killed_and_replaced_and_the_connections_queued_on_its_socket_are_answered(served):
    """A worker whose loop stops (a deadlock; here SIGSTOP) keeps its socket in the kernel's
    SO_REUSEPORT group, which goes on giving it new connections; nothing answered them. The parent
    reads each worker's heartbeat and kills one silent for --worker-timeout, so it is replaced on the
    same socket, and the replacement answers what queued there meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    s = served("--workers", "2", "--worker-timeout", "2")
    pids = s.workers(2)
    ids = [x.id for x in make_samples(40, size=3000)]
    os.kill(pids[0], signal.SIGSTOP)
    start = time.monotonic()
    with ThreadPoolExecutor(12) as pool:  # new connections: about half reach the frozen worker's socket
        statuses = list(pool.map(lambda _: s.request("POST", "/v1/datasets/d/samples", encode_ids(ids[:5]), OCTETS)[0],
                                 range(12)))
    took = time.monotonic() - start
    assert statuses == [200] * 12
    assert took < 15, took  # the timeout (2 s), a look (1 s), a new worker's start
    wait_gone([pids[0]])
    now = s.workers(2)
    assert pids[0] not in now and pids[1] in now
    log = s.log.read_text()
    assert f"worker {pids[0]} has not run its loop for" in log and "(frozen); killing it" in log
    assert f"worker {pids[0]} was killed by SIGKILL; starting another" in log
    assert s.stop() == 0


def test_a_sigterm_with_a_frozen_worker_ends_the_server_instead_of_waiting_for_good(served):
    """A frozen worker never handles the SIGTERM the parent passes on; the parent, waiting for every
    worker to end, waited for good. The watchdog goes on while stopping: the worker is killed, and the
    server exits 1 (a worker did not stop cleanly)."""
    s = served("--workers", "2", "--worker-timeout", "2")
    pids = s.workers(2)
    os.kill(pids[0], signal.SIGSTOP)
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(20) == 1
    log = s.log.read_text()
    assert f"worker {pids[0]} has not run its loop for" in log
    assert f"worker {pids[0]} was killed by SIGKILL while stopping" in log, log
    wait_gone(pids)


def test_worker_timeout_must_not_be_negative(store_url, tmp_path):
    run = subprocess.run([sys.executable, "-m", "dataferry.server", "--store", store_url, "--port", "0",
                          "--workers", "2", "--worker-timeout", "-1"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr.strip() == "dataferry serve: --worker-timeout must be >= 0, not -1"


def test_a_crash_loop_stops_the_server_with_status_1(served):
    s = served("--workers", "2")
    for _ in range(6):  # MAX_RESTARTS deaths are restarted; one more within the window stops the server
        os.kill(s.workers(2)[0], signal.SIGKILL)
        time.sleep(0.05)
    assert s.proc.wait(30) == 1
    assert "worker deaths within 60 s; stopping the server" in s.log.read_text()
    wait_gone(s.seen)


def test_a_worker_that_cannot_start_stops_the_server_with_status_1(tmp_path):
    s = Served(f"sqlite://{tmp_path / 'missing.db'}", tmp_path / "log", "--workers", "2")
    try:
        assert s.proc.wait(30) == 1
        s.seen.update(children(s.proc.pid))
        log = s.log.read_text()
        assert "could not start; stopping the server" in log and "does not exist" in log
        wait_gone(s.seen)
    finally:
        s.kill_all()


def test_a_parent_killed_with_sigkill_takes_its_workers_with_it(served):
    s = served("--workers", "2")
    pids = s.workers(2)
    s.proc.kill()
    s.proc.wait()
    wait_gone(pids)  # no orphan keeps the port (the kernel may take a moment to drop the last listener)
    deadline = time.monotonic() + 5
    while listening(s.host, s.port):
        assert time.monotonic() < deadline, f"something still listens on port {s.port}"
        time.sleep(0.1)


def test_workers_must_be_at_least_one():
    out = subprocess.run([sys.executable, "-m", "dataferry.server", "--port", "0", "--workers", "0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--workers must be >= 1, not 0" in out.stderr


def test_a_port_in_use_fails_as_with_one_worker(served):
    s = served("--workers", "2")
    s.workers(2)
    out = subprocess.run([sys.executable, "-m", "dataferry.server", "--port", str(s.port), "--workers", "2",
                          "--store", "sqlite:///nonexistent/x.db"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "cannot listen on" in out.stderr, out.stderr
    assert s.stop() == 0



_GC_IN_THE_LOCK = """
import gc, sys
from prometheus_client import CollectorRegistry
from dataferry.server._metrics import Metrics, exposition, shared_registry
registry, sync_gc = shared_registry(sys.argv[1])
gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation: inside prometheus-client's lock too
m = Metrics.register(CollectorRegistry())
for i in range(2000):
    m.requests.labels(f"/r{i % 200}", "GET", "200").inc()  # a new label set: a new value made under the lock
    m.store_latency.labels("fetch").observe(0.001)
    m.in_flight.inc()
    m.in_flight.dec()
sync_gc()
gc.set_threshold(700, 10, 10)
print(exposition(registry).decode())
"""


def test_a_garbage_collection_inside_a_worker_s_metric_update_does_not_freeze_the_worker(tmp_path):
    """A worker counted collections from a ``gc.callbacks`` hook that took prometheus-client's
    multiprocess lock: a collection that started while the lock was held (a metric being updated or
    made) blocked the worker's only thread on that lock for good, and the connections the kernel gave
    its socket were never answered (seen on a 16-core machine: 3 of 16 workers frozen in a minute)."""
    run = subprocess.run([sys.executable, "-c", _GC_IN_THE_LOCK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    m = parse_metrics(run.stdout)
    assert m['dataferry_server_requests_total{method="GET",route="/r7",status="200"}'] == 10
    assert m['python_gc_collections_total{generation="0"}'] > 1000  # the collections are still counted
