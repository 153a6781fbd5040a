"""What a served sample costs the server, as counts (never timings).

``dataferry serve`` reads SQLite through mmap (no read() copy into SQLite's
page cache), a loader opening the store directly does not (its RSS would hold
the mapped file); samples written while the server runs are served
byte-exact through the mapping; once warm, a served sample costs the server
process no page fault (glibc would otherwise give each freed blob's pages
back to the kernel and take them again, zeroed, for the next one).
"""

from __future__ import annotations

import asyncio
import http.client
import os
import socket
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from dataferry.bench._common import stat_fields
from dataferry.schema import open_store
from dataferry.schema._errors import ConfigError
from dataferry.schema._model import Sample
from dataferry.schema._url import parse_store_url
from dataferry.schema._wire import encode_ids
from server_kit import ServerProcess, decode, ended_after, make_samples, seed, seed_url

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")

OCTETS = {"Content-Type": "application/octet-stream"}


def fetch(server: ServerProcess, ids: list[int], dataset: str = "d") -> dict[int, Sample]:
    """One batch fetch on a new connection: the samples by id; asserts 200 and a complete response."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", f"/v1/datasets/{dataset}/samples", body=encode_ids(ids), headers=OCTETS)
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    assert resp.status == 200, body[:200]
    records = asyncio.run(decode(body, dataset))
    assert type(records[-1]).__name__ == "EndRecord", records[-1]
    return {r.id: r for r in records[:-1]}


def mapped(pid: int | str, path: str) -> bool:
    """Whether process ``pid`` has ``path`` mapped."""
    real = os.path.realpath(path)
    with open(f"/proc/{pid}/maps") as fh:
        return any(line.rstrip().endswith(real) for line in fh)


def minor_faults(pid: int) -> int:
    return int(stat_fields(f"/proc/{pid}/stat")[7])  # field 10: minflt


@pytest.fixture
def server():
    """``server(url, *args)``: ``dataferry serve --workers 1`` on a free port, killed after the test."""
    with ended_after(lambda url, *args: ServerProcess(url, 0, "--workers", "1", *args), ServerProcess.kill) as start:
        yield start


def test_the_server_reads_sqlite_through_mmap_and_a_direct_open_does_not(tmp_path, server):
    path = tmp_path / "s.db"
    samples = make_samples(12, size=5000)
    url = seed_url(f"sqlite://{path}", "d", samples)
    s = server(url)
    got = fetch(s, [x.id for x in samples])
    assert {i: bytes(r.data) for i, r in got.items()} == {x.id: x.data for x in samples}
    assert mapped(s.proc.pid, str(path)), "dataferry serve does not map the SQLite file"

    async def direct() -> None:
        async with await open_store(url, create=False) as store:
            async for r in store.fetch("d", [x.id for x in samples]):
                assert type(r) is Sample
            assert not mapped("self", str(path)), "a store opened directly maps the SQLite file"

    asyncio.run(direct())


def test_mmap_size_zero_in_the_url_turns_the_mapping_off(tmp_path, server):
    path = tmp_path / "s.db"
    samples = make_samples(6, size=5000)
    seed_url(f"sqlite://{path}", "d", samples)
    s = server(f"sqlite://{path}?mmap_size=0")
    assert len(fetch(s, [x.id for x in samples])) == 6
    assert not mapped(s.proc.pid, str(path))


#: run in a fresh interpreter: SQLite set to map every file by default (a build with
#: SQLITE_DEFAULT_MMAP_SIZE > 0), before its first connection; then the store at argv[1]
#: opened directly and with argv[2] (``?mmap_size=0``) maps nothing, nor does a writer
_MAPS_BY_DEFAULT = """
import asyncio, ctypes, os, sqlite3, sys, _sqlite3
lib = ctypes.CDLL(_sqlite3.__file__)  # its libsqlite3, whichever that is
assert lib.sqlite3_shutdown() == 0
assert lib.sqlite3_config(ctypes.c_int(22), ctypes.c_int64(1 << 30), ctypes.c_int64(1 << 31)) == 0  # MMAP_SIZE
from dataferry.schema import open_store
real = os.path.realpath(sys.argv[3])
def mapped():
    with open("/proc/self/maps") as fh:
        return any(line.rstrip().endswith(real) for line in fh)
plain = sqlite3.connect(sys.argv[3])
plain.execute("SELECT data FROM samples").fetchall()
assert mapped(), "sqlite3_config(SQLITE_CONFIG_MMAP_SIZE) did not take"
plain.close()
assert not mapped()
async def read(url):
    async with await open_store(url, create=False) as store:
        assert len([r async for r in store.fetch("d", [int(i) for i in sys.argv[4:]])]) == len(sys.argv) - 4
        return mapped()
async def write(url):  # the writer's connection too (ingest): the schema read at open, then a write
    import numpy as np
    from dataferry.schema import IdList
    async with await open_store(url) as store:
        await store.put_split("d", "extra", IdList(np.arange(3), np.zeros(3, dtype=np.int64)))
        return mapped()
print("mapped:", asyncio.run(read(sys.argv[1])), asyncio.run(read(sys.argv[2])), asyncio.run(write(sys.argv[1])))
"""


def test_an_unset_or_zero_mmap_size_maps_nothing_where_sqlite_maps_by_default(tmp_path):
    """``mmap_size`` unset on a direct open, or 0, is no mapping even where
    SQLite's build maps files by default, not "SQLite's default"; nor is
    the writer's connection (an ingest) mapped."""
    path = tmp_path / "s.db"
    samples = make_samples(6, size=5000)
    url = seed_url(f"sqlite://{path}", "d", samples)
    out = subprocess.run([sys.executable, "-c", _MAPS_BY_DEFAULT, url, f"{url}?mmap_size=0", str(path),
                          *(str(x.id) for x in samples)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["mapped:", "False", "False", "False"], out.stdout


def test_a_negative_mmap_size_is_refused_naming_it():
    with pytest.raises(ConfigError, match="mmap_size"):
        parse_store_url("sqlite:///tmp/x.db?mmap_size=-1")
    with pytest.raises(ConfigError, match="mmap_size"):
        parse_store_url("sqlite:///tmp/x.db?mmap_size=lots")
    assert parse_store_url("sqlite:///tmp/x.db?mmap_size=1048576").mmap_size == 1 << 20
    assert parse_store_url("sqlite:///tmp/x.db").mmap_size is None


def test_samples_written_while_serving_are_served_byte_exact(tmp_path, server):
    """The file grows past what the server mapped (SQLite maps it again) and
    rows change under the mapping (WAL): every answer is the store's bytes."""
    path = tmp_path / "s.db"
    first = make_samples(8, size=3000, seed=1)
    url = seed_url(f"sqlite://{path}", "d", first)
    s = server(url)
    assert {i: bytes(r.data) for i, r in fetch(s, [x.id for x in first]).items()} == {x.id: x.data for x in first}
    size0 = os.path.getsize(path)
    more = make_samples(40, size=200_000, seed=2)
    changed = [Sample(x.id, x.label, x.data[::-1] + b"new", x.target) for x in first]

    async def write() -> None:
        async with await open_store(url) as store:
            await seed(store, "d", more + changed)

    asyncio.run(write())
    assert os.path.getsize(path) + os.path.getsize(f"{path}-wal") > size0 + 40 * 200_000
    want = {x.id: (x.data, x.target) for x in more + changed}
    got = fetch(s, list(want))
    assert {i: (bytes(r.data), r.target) for i, r in got.items()} == want


def test_a_served_sample_costs_the_server_no_page_fault_once_warm(tmp_path, server):
    samples = make_samples(48, size=150_000, seed=3)
    url = seed_url(f"sqlite://{tmp_path / 's.db'}", "d", samples)
    s = server(url)
    ids = [x.id for x in samples]
    rng = np.random.default_rng(0)
    for _ in range(3):  # warm: the file mapped, the allocator at its working size
        assert len(fetch(s, rng.permutation(ids).tolist())) == 48
    before = minor_faults(s.proc.pid)
    rounds = 6
    for _ in range(rounds):
        assert len(fetch(s, rng.permutation(ids).tolist())) == 48
    per_sample = (minor_faults(s.proc.pid) - before) / (rounds * 48)
    # a 150-330 KB blob is 37-80 pages: freed memory given back and taken again faults on each
    assert per_sample < 2, f"{per_sample:.1f} minor page faults per served sample once warm"


@pytest.mark.parametrize("writes", ["writelines", "one write per part"])
def test_a_client_that_stops_reading_is_dropped_after_send_timeout(tmp_path, monkeypatch, writes):
    """The send timer is armed only when the kernel leaves bytes in the
    transport; a client that stops reading still leaves them there. Also with
    one ``write`` per part, the path taken on the CPython versions whose
    ``writelines`` never pauses the protocol (CVE-2024-12254)."""
    from dataferry.server import ServerOptions, _samples, make_app
    from server_kit import live_server, parse_metrics

    monkeypatch.setattr(_samples, "_WRITELINES_UNSAFE", writes != "writelines")
    samples = make_samples(30, size=400_000, seed=4)  # 12 MB: more than the sockets' buffers hold
    url = seed_url(f"sqlite://{tmp_path / 's.db'}", "d", samples)
    with live_server(lambda: make_app(url, ServerOptions(send_timeout=0.5))) as live:
        got = fetch(live, [x.id for x in samples])
        assert {i: bytes(s.data) for i, s in got.items()} == {x.id: bytes(x.data) for x in samples}
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        sock.connect(("127.0.0.1", live.port))
        body = encode_ids([x.id for x in samples])
        sock.sendall(b"POST /v1/datasets/d/samples HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        deadline = time.monotonic() + 15
        dropped = 0.0
        while time.monotonic() < deadline and not dropped:
            time.sleep(0.1)
            with urllib.request.urlopen(f"{live.base}/metrics", timeout=10) as resp:
                dropped = parse_metrics(resp.read().decode()).get(
                    'dataferry_server_errors_total{error="send_timeout"}', 0.0)
        received = 0
        sock.settimeout(10)
        try:
            while chunk := sock.recv(1 << 20):
                received += len(chunk)
        except ConnectionResetError:
            pass
        finally:
            sock.close()
    assert dropped == 1
    assert received < sum(len(x.data) for x in samples)  # the stream was cut, not finished
