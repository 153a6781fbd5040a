"""The HTTP data plane: HttpSource's own HTTP/1.1 client (schema/sources/http/_connection.py), the
incremental frame decoder (schema/_wire.py FrameDecoder) and the receive
buffers (schema/sources/http/_buffers.py), against the real app on loopback (plain and TLS)
and against hand-written answers that cut and frame the bytes every way
HTTP/1.1 allows.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dataferry.client import Loader, Prefetch
from dataferry.schema.sources.http._buffers import BufferPool, size_class
from dataferry.schema.sources.http._source import HttpOptions, HttpSource
from dataferry.schema import Sample, SampleNotFound, open_store
from dataferry.schema._errors import ProtocolMismatch, StoreError, StoreTimeout, StoreUnavailable
from dataferry.schema._wire import EndRecord, FrameDecoder, encode_end, encode_error, encode_not_found, encode_sample
from dataferry.server import ServerOptions, make_app
from server_kit import RawHttpServer, live_server, make_samples, run, seed, self_signed, serve


async def _drain(agen) -> list:
    return [r async for r in agen]


def _digest(data) -> bytes:
    return hashlib.sha256(data).digest()


# --- the real app on loopback -----------------------------------------------------------------------------
@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_large_samples_arrive_byte_exact_as_read_only_views(tmp_path, tls):
    """300 KB samples (read mostly straight into their buffers, through TLS
    too), with every kind of target, over several requests on kept-alive
    connections; a small write_chunk puts chunk boundaries inside payloads."""
    from dataferry.server.cli import ssl_context

    samples = make_samples(24, size=300_000)
    want = {s.id: s for s in samples}
    ctx, options = None, HttpOptions()
    if tls:
        cert, key = self_signed(tmp_path)
        ctx, options = ssl_context(cert, key), HttpOptions(ca_file=cert)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", samples)
            app = make_app(store, ServerOptions(write_chunk=70_001, buffer_bytes=1 << 20))
            async with serve(app, ssl_context=ctx) as base, await HttpSource.open(base, options=options) as src:
                got = []
                for k in range(0, 24, 8):
                    got += await _drain(src.fetch("d", [s.id for s in samples[k : k + 8]]))
                return got, src._buffers

    got, pool = run(go())
    assert sorted(r.id for r in got) == sorted(want)
    spans = []
    for r in got:
        w = want[r.id]
        assert isinstance(r.data, memoryview) and r.data.readonly
        assert _digest(r.data) == _digest(w.data) and r.label == w.label and r.target == w.target
        assert r.target is None or isinstance(r.target, bytes)
        assert len(r.data) == len(w.data)  # what the engine's byte budget counts is the sample's size
        start = np.frombuffer(r.data, np.uint8).ctypes.data
        spans.append((start, start + len(r.data)))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no two samples share a byte
    # samples are read many to an arena, arenas filled one after the other across the three responses:
    # what they hold is the samples' bytes plus at most one arena's room not yet used
    arenas = {id(r.data.obj): r.data.obj for r in got}
    received = sum(len(r.data) for r in got)
    assert len(arenas) < len(got) and sum(map(len, arenas.values())) <= received + pool.arena
    assert pool.made == len(arenas)  # every arena still held: none was reused


def test_arenas_left_with_room_are_reused_once_their_samples_are_dropped(tmp_path):
    """Each response leaves its last arena with room the next response cannot
    use (148 KB, records of 300 KB); once the samples are dropped those arenas
    are reused whole, not kept for their room while new ones are made (4 more
    per response). One arena more may be held a while by the connection's
    last read."""
    samples = make_samples(12, size=300_000)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", samples)
            async with serve(make_app(store)) as base, await HttpSource.open(
                base, options=HttpOptions(arena=1 << 20)
            ) as src:
                made = []
                for _ in range(4):
                    got = await _drain(src.fetch("d", [s.id for s in samples]))
                    assert len(got) == 12
                    del got
                    made.append(src._buffers.made)
                return made

    made = run(go())
    assert made[0] >= 4 and made[1] <= made[0] + 1 and made[2:] == [made[1]] * 2


def test_the_loader_reuses_buffers_and_never_one_still_held(tmp_path):
    """Over HTTP, epoch after epoch: buffers of batches the consumer dropped are
    reused; the bytes of batches it keeps (as numpy arrays and memoryview
    slices) never change; every sample comes exactly once per epoch."""
    samples = make_samples(96, size=40_000)
    digest = {s.id: _digest(s.data) for s in samples}
    kept = []

    async def make_app_():
        store = await open_store(f"sqlite://{tmp_path / 's.db'}")
        await seed(store, "d", samples)
        return make_app(store)

    sources = []

    async def source(base):
        sources.append(await HttpSource.open(base, options=HttpOptions(arena=1 << 18)))
        return sources[-1]

    with live_server(make_app_) as live:
        with Loader(lambda: source(live.base), "d", batch_size=16, prefetch=Prefetch(max_bytes=1 << 20)) as loader:
            # arenas of 6 samples: each kept batch holds a few, the rest are reused
            for epoch in range(4):
                seen = []
                for k, batch in enumerate(loader):
                    seen += batch.ids.tolist()
                    if k == 0:  # keep one batch per epoch: arrays, and a slice of the sample's view
                        kept.append((batch.ids.tolist(), batch.data, [memoryview(d)[5:] for d in batch.data]))
                assert sorted(seen) == sorted(digest)
            pool = sources[0]._buffers
    assert pool.reused > 0
    for ids, arrays, tails in kept:
        for i, a, t in zip(ids, arrays, tails):
            assert _digest(a) == digest[i] and bytes(t) == a.tobytes()[5:]


def test_buffer_pool_gives_back_only_what_nothing_refers_to():
    pool = BufferPool(arena=1 << 16)
    a1, at, stop = pool.take(1 << 16)  # a whole arena each
    assert (at, stop, len(a1)) == (0, 1 << 16, 1 << 16)
    a1[:1000] = b"a" * 1000
    as_array = np.frombuffer(memoryview(a1).toreadonly()[:1000], np.uint8)  # numpy keeps its own view
    a2, *_ = pool.take(1 << 16)
    a2[:1000] = b"b" * 1000
    tail = memoryview(a2).toreadonly()[:1000][10:]  # a slice outlives the sample's view
    a3, *_ = pool.take(1 << 16)
    del a1, a2, a3
    fresh = [pool.take(1 << 16)[0] for _ in range(6)]
    assert pool.reused == 1  # only the third arena was free
    for buf in fresh:
        buf[:] = b"z" * len(buf)
    assert as_array.tobytes() == b"a" * 1000 and bytes(tail) == b"b" * 990
    big, at, stop = pool.take(100_000, least=100_000)  # a record larger than an arena: an arena of its size
    assert (at, stop) == (0, 100_000) and len(big) == size_class(100_000) <= 100_000 * 17 / 16


def test_arenas_in_use_swinging_by_more_than_64_mib_are_reused_not_made_again():
    """A loader's arenas in use swing by more than 64 MiB within an epoch (the
    engine holds up to its 512 MiB budget): the free ones are kept and found
    again (every lent arena is looked at), not given back and made anew (a page
    fault per 4 KiB each)."""
    pool = BufferPool(arena=1 << 20)
    for _ in range(3):
        held = [pool.take(1 << 20)[0] for _ in range(100)]  # 100 MiB in use at once
        del held  # all released together, as batches are
    assert pool.made == 100 and pool.reused == 200


def test_a_response_expecting_more_than_an_arena_fills_arenas_of_the_usual_size():
    """A response of 128 ids x 110 KB (14 MB) asks for more room than an arena
    holds: it gets regions of at most an arena, filled one after the other,
    not an arena of its own size per response (a fresh allocation each time,
    its pages faulted in: on loopback 40+ us of system time per sample)."""
    pool = BufferPool(arena=1 << 20)
    records = [Sample(i, 0, os.urandom(100_000 + 1000 * (i % 7))) for i in range(40)]
    body = b"".join(b"".join(encode_sample(r)) for r in records) + encode_end(40)
    for _ in range(3):
        dec = FrameDecoder("d", arena=pool.take, give_back=pool.give_back, expect=40, mean=103_000)
        got = _read_as_a_socket(dec, body, 256 << 10)
        assert got == [*records, EndRecord(40)]
        assert {len(r.data.obj) for r in got[:-1]} == {1 << 20}
        del got
    assert pool.made <= 5  # the first response's arenas, reused by the next two


def test_arenas_are_shared_out_in_regions_and_filled_whole():
    pool = BufferPool(arena=1 << 20)
    buf, at, stop = pool.take(300_000)  # a response expecting 300 KB
    assert (at, stop) == (0, 300_000)
    other, at2, stop2 = pool.take(300_000)  # another, at the same time: the next region of the same arena
    assert other is buf and (at2, stop2) == (300_000, 600_000)
    pool.give_back(buf, 200_000, 300_000)  # the first wrote 200 KB; the second is still reading
    assert pool.take(300_000)[1:] == (600_000, 900_000)  # the arena's room after the second fits a third
    pool.give_back(buf, 550_000, 600_000)  # too little to hand on (under 64 KiB)
    assert pool.take(50_000)[1:] == (900_000, 950_000)
    assert pool.take(100_000)[1:] == (200_000, 300_000)  # the first's leftover
    # no room of 200 KB: rather than a new arena, the arena's last room whole
    assert pool.take(200_000, least=40_000) == (buf, 950_000, 1 << 20) and pool.made == 1
    assert pool.take(200_000, least=40_000)[1:] == (0, 200_000) and pool.made == 2  # none left of 40 KB


# --- hand-written answers -----------------------------------------------------------------------------------
class Scripted(RawHttpServer):
    """Answers request ``k`` (on any connection) with ``replies[k]``: a list of
    byte strings written with a pause between them (so the client reads them
    separately), or None to close at once. Counts connections."""

    def __init__(self, *replies: list[bytes] | None, close_after: bool = False) -> None:
        self.replies = list(replies)
        self.requests = 0
        self.connections = 0
        self.close_after = close_after

    async def handle(self, reader, writer) -> None:
        self.connections += 1
        while True:
            await self.read_request(reader)
            reply = self.replies[min(self.requests, len(self.replies) - 1)]
            self.requests += 1
            if reply is None:
                return
            for part in reply:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(0.01)
            if self.close_after:
                return


A = Sample(7, 1, bytes(range(256)) * 200, b"mask")  # 51 KB: large enough to be read into its buffer directly
B = Sample(-3, 2, b"small")
BODY = b"".join(encode_sample(A)) + encode_not_found(99) + b"".join(encode_sample(B)) + encode_end(3)
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/x-dataferry-frames\r\n"
FAILED_BODY = b"".join(encode_sample(B)) + encode_error("store_unavailable", "disk on fire")


def _chunked(body: bytes, cuts: list[int], ext: bytes = b"") -> list[bytes]:
    """``body`` as chunks cut at ``cuts``, the encoded stream split into parts at odd places."""
    edges = [0, *cuts, len(body)]
    stream = b"".join(b"%x%s\r\n%s\r\n" % (b - a, ext, body[a:b]) for a, b in zip(edges, edges[1:]))
    stream += b"0\r\nX-Trailer: 1\r\n\r\n"
    return [stream[:5], stream[5:40], stream[40:20000], stream[20000:20001], stream[20001:]]


@pytest.mark.parametrize("reply", ids=["chunked-odd-cuts", "chunk-extensions", "content-length", "until-close",
                                       "interim-100"], argvalues=[
    [HEAD + b"Transfer-Encoding: chunked\r\n\r\n", *_chunked(BODY, [3, 28, 29, 30_000, len(BODY) - 10])],
    [HEAD + b"Transfer-Encoding: chunked\r\n\r\n", *_chunked(BODY, [100], ext=b";name=value")],
    [HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY), BODY[:10], BODY[10:40_000], BODY[40_000:]],
    [HEAD.replace(b"1.1", b"1.0") + b"\r\n", BODY[:1000], BODY[1000:]],
    [b"HTTP/1.1 100 Continue\r\n\r\n" + HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY],
])
def test_every_framing_of_a_body_decodes_the_same(reply):
    async def go():
        async with Scripted(reply, close_after=True) as url, await HttpSource.open(url) as src:
            return await _drain(src.fetch("d", [7, 99, -3]))

    got = run(go())
    assert got == [A, SampleNotFound("d", 99), B]


def test_keep_alive_reuses_the_connection_and_retries_a_stale_one():
    """Three fetches ride one connection; when the server drops each
    connection after its answer, the next fetch goes through on a new one."""
    reply = [HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY]

    scripted = Scripted(reply)

    async def counted():
        async with scripted as url, await HttpSource.open(url) as src:
            for _ in range(3):
                assert len(await _drain(src.fetch("d", [7, 99, -3]))) == 3

    run(counted())
    assert scripted.connections == 1 and scripted.requests == 3

    closing = Scripted(reply, close_after=True)  # the server closes after each answer

    async def stale():
        async with closing as url, await HttpSource.open(url) as src:
            for _ in range(3):
                assert len(await _drain(src.fetch("d", [7, 99, -3]))) == 3
                await asyncio.sleep(0.05)  # the close arrives while the connection is idle

    run(stale())
    assert closing.connections == 3 and closing.requests == 3


@pytest.mark.parametrize("reply,error,match", ids=[
    "gzip", "bytes-after-end", "bad-chunk-size", "not-http", "ends-mid-record", "error-record",
], argvalues=[
    ([HEAD + b"Content-Encoding: gzip\r\nContent-Length: 4\r\n\r\nabcd"], StoreUnavailable, "gzip-encoded"),
    ([HEAD + b"Content-Length: %d\r\n\r\n" % (len(BODY) + 3) + BODY + b"xyz"], StoreError,
     "corrupt response.*bytes after the END record"),
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n"], StoreUnavailable, "malformed HTTP answer.*chunk size"),
    ([b"SSH-2.0-OpenSSH_9.6\r\n\r\n"], ProtocolMismatch, "not an HTTP server.*SSH-2.0"),  # permanent
    ([HEAD + b"Transfer-Encoding: chunked\r\n\r\n", *_chunked(BODY[:40_000], [])], StoreUnavailable,
     "lost connection.*after 0 answers.*ended in the middle"),
    ([HEAD + b"Content-Length: %d\r\n\r\n" % len(FAILED_BODY) + FAILED_BODY], StoreUnavailable,
     "failed after 1 answers: disk on fire"),
])
def test_broken_answers_fail_with_one_line_naming_the_service(reply, error, match):
    async def go():
        async with Scripted(reply) as url, await HttpSource.open(url) as src:
            with pytest.raises(error, match=match) as info:
                await _drain(src.fetch("d", [7, 99, -3]))
            assert url in str(info.value) and "\n" not in str(info.value)

    run(go())


def test_a_server_that_stalls_mid_body_is_a_timeout():
    class Stalling(RawHttpServer):
        async def handle(self, reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(24)
            writer.write(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:5000])
            await asyncio.sleep(5)

    async def go():
        async with Stalling() as url:
            async with await HttpSource.open(url, options=HttpOptions(read_timeout=0.3)) as src:
                with pytest.raises(StoreTimeout, match=f"{url}.*timed out"):
                    await _drain(src.fetch("d", [7, 99, -3]))

    run(go())


def test_the_frame_decoder_takes_bytes_fed_or_sunk_alike():
    rooms = []
    dec = FrameDecoder("d", arena=lambda n, least: (bytearray(70_000), 0, 70_000),
                       give_back=lambda b, at, stop: rooms.append((at, stop)))
    dec.feed(BODY[:30])
    view = dec.sink()  # the region's free room: the rest of the body may be written straight there
    assert view is not None and len(view) == 70_000 - 30 and dec.wanted() == 28 + 4 + len(A.data) - 30
    view[:100] = BODY[30:130]
    dec.sunk(100)
    assert not dec.records  # A is not complete yet
    dec.feed(BODY[130:])
    recs = dec.take()
    assert recs == [A, SampleNotFound("d", 99), B, EndRecord(3)] and dec.done and dec.sink() is None
    assert recs[0].data.obj is recs[2].data.obj  # both samples in one arena, without a copy of their own
    assert rooms == [(len(BODY), 70_000)]  # the room after END goes back for the next response
    assert (dec.count, dec.nbytes) == (3, len(BODY) - 28)
    with pytest.raises(Exception, match="after the END"):
        dec.feed(b"x")
    assert FrameDecoder("d").wanted() == 28


def test_a_record_that_does_not_fit_moves_to_a_new_region():
    """The decoder asks for the room the rest of the response should need
    (records expected x mean size seen); a record crossing its region's end
    moves, with the bytes read of it so far, to a new region; one larger than
    the arena gets an arena of its own."""
    pool = BufferPool(arena=1 << 18)
    big = Sample(5, 0, os.urandom(300_000))
    small = [Sample(i, 0, os.urandom(20_000 + 1000 * i)) for i in range(6)]
    records = [*small[:3], big, *small[3:]]
    body = b"".join(b"".join(encode_sample(r)) for r in records) + encode_end(7)
    asked = []

    def arena(n, least):
        asked.append(n)
        return pool.take(n, least)

    dec = FrameDecoder("d", arena=arena, give_back=pool.give_back, expect=7, mean=20_000)
    got = _read_as_a_socket(dec, body, 30_000)
    assert got == [*records, EndRecord(7)]
    assert asked[0] == int(7 * 20_000 * 17 / 16) + 28  # the guess from the hint
    assert asked[1] == 300_028  # big, which did not fit: a region of its own size, in an arena of its own
    assert got[3].data.obj is not got[0].data.obj and len(got[3].data.obj) == size_class(300_028)
    assert got[4].data.obj is got[0].data.obj  # then back to the first arena's room
    assert pool.made == 2


def _read_as_a_socket(dec, body: bytes, most: int) -> list:
    """``body`` written into ``dec.sink()`` reads of at most ``most`` bytes, as a
    socket gives them, to its end; the records decoded."""
    at = 0
    while not dec.done:
        view = dec.sink()
        k = min(len(view), most, len(body) - at)
        view[:k] = body[at : at + k]
        at += k
        dec.sunk(k)
    return dec.take()


# --- the benchmark runs ---------------------------------------------------------------------------------
def test_client_cpu_bench_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dataferry.bench.client_cpu", "--data", "random", "--images", "64", "--epochs", "1",
         "--repeats", "1", "--batch-size", "16", "--no-memory", "--fetch-sizes", "4,8", "--loader-sizes", "8",
         "--unverified"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "client CPU us/sample" in out.stdout and "HTTP, direct" in out.stdout
    assert "HTTP, direct, verify=False" in out.stdout and "verify=False: " in out.stdout
    assert "HttpSource.fetch alone, 8 ids a request" in out.stdout and "us per request +" in out.stdout
    assert "Loader at 8 ids a request" in out.stdout and "ids a request (tuned)" in out.stdout


def test_the_checked_floor_hashes_every_byte_received_in_sample_sized_pieces(monkeypatch):
    import dataferry.schema
    from dataferry.bench.client_cpu import SAMPLE_BYTES, recv_floor

    pieces = []
    monkeypatch.setattr(dataferry.schema, "sample_checksum", lambda view: pieces.append(len(view)) or 0)
    run = recv_floor(40, check=True)
    assert run.samples == 40 and sum(pieces) == 40 * SAMPLE_BYTES
    assert max(pieces) <= SAMPLE_BYTES and len(pieces) >= 40
    pieces.clear()
    assert recv_floor(40).samples == 40 and not pieces  # the bare floor hashes nothing


def test_client_cpu_replay_and_line_count_smoke(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    common = [sys.executable, "-m", "dataferry.bench.client_cpu", "--data", "random", "--images", "64", "--epochs", "2",
              "--repeats", "1", "--batch-size", "16", "--no-memory"]
    out = subprocess.run([*common, "--replay", "--replay-bytes", "3000", "--rtts", ""], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "HTTP client half, replayed, 3,000 B" in out.stdout and "replay: " in out.stdout
    out = subprocess.run([*common, "--lines", "8"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("Python lines per sample received"))
    total = float(lines[at + 1].split()[0])
    assert lines[at + 1].endswith(" all") and 20 < total < 2000
    assert any("_engine.py:Run._on_results" in line for line in lines[at + 2:])  # HttpSource's runs, taken so


def test_the_perf_profile_is_read_by_library_and_symbol():
    from dataferry.bench.client_cpu import perf_shares

    report = """
    26.32%  [kernel.kallsyms]                                  [k] _copy_to_iter
    17.07%  _xxhash.cpython-311-x86_64-linux-gnu.so            [.] XXH3_hashLong_64b_withSeed.constprop.0
    13.56%  libpython3.11.so.1.0                               [.] _PyEval_EvalFrameDefault
     0.20%  libpython3.11.so.1.0                               [.] 0x00000000001f2a3c
"""
    assert perf_shares(report) == {"kernel.kallsyms _copy_to_iter": 0.2632,
                                   "_xxhash XXH3_hashLong_64b_withSeed.constprop.0": 0.1707,
                                   "libpython3.11 _PyEval_EvalFrameDefault": 0.1356,
                                   "libpython3.11 0x00000000001f2a3c": 0.002}


@pytest.mark.skipif(shutil.which("perf") is None, reason="no perf on this machine")
def test_client_cpu_bench_profiles_with_perf(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dataferry.bench.client_cpu", "--data", "random", "--images", "256", "--epochs", "4",
         "--repeats", "1", "--no-memory", "--perf"],
        capture_output=True, text=True, timeout=180, env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    if "perf recorded nothing" in out.stdout:
        pytest.skip("perf recorded nothing here (perf_event_paranoid)")
    assert "by library: " in out.stdout and "us/sample" in out.stdout


def test_the_per_request_fit_recovers_a_known_split():
    from dataferry.bench.client_cpu import fit_per_request

    a, b = fit_per_request({n: 90 / n + 25 for n in (4, 8, 32, 128)})
    assert round(a, 6) == 90 and round(b, 6) == 25
