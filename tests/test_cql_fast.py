"""The hot read path (``schema/sources/cassandra/_hot.py``): its RESULT decoder at protocol v4, against
the driver's own decoder (byte-level, no server), and a store reading through it on a real server:
samples sent without ``execute_async``, and what the server refuses sent again the driver's way and
translated as before.
"""

from __future__ import annotations

import asyncio
import os
import struct
import uuid

import pytest

from dataferry.schema import Sample, SampleNotFound, StoreUnavailable, open_store, parse_store_url
from dataferry.schema.sources.cassandra._hot import _decoder, decode_rows, execute_message, readable
from test_cassandra_store import records

V = 4  # the protocol version spoken (schema/sources/cassandra/_driver_patches.py)
TYPES = ("int", "blob", "blob")
OPTION = {"int": 0x0009, "blob": 0x0003, "bigint": 0x0002, "varchar": 0x000D}


def _string(s: str) -> bytes:
    return struct.pack(">H", len(s)) + s.encode()


def rows_body(rows, types=TYPES, *, flags=0x0001, paging=b"", metadata_id=b"") -> bytes:
    """A RESULT body of kind Rows, written from the spec (section 4.2.5.2), not by the driver."""
    out = struct.pack(">iii", 2, flags, len(types))
    if flags & 0x0002:
        out += struct.pack(">i", len(paging)) + paging
    if flags & 0x0008:
        out += struct.pack(">H", len(metadata_id)) + metadata_id
    if not flags & 0x0004:
        if flags & 0x0001:
            out += _string("ks") + _string("samples")
        for k, name in enumerate(types):
            if not flags & 0x0001:
                out += _string("ks") + _string("samples")
            out += _string(f"c{k}") + struct.pack(">H", OPTION[name])
    out += struct.pack(">i", len(rows))
    for row in rows:
        for name, cell in zip(types, row):
            if cell is None:
                out += struct.pack(">i", -1)
            else:
                raw = {"int": lambda v: struct.pack(">i", v), "bigint": lambda v: struct.pack(">q", v),
                       "blob": bytes, "varchar": str.encode}[name](cell)
                out += struct.pack(">i", len(raw)) + raw
    return out


def driver_rows(version: int, body: bytes, types=TYPES, flags: int = 0):
    from cassandra.cqltypes import BytesType, Int32Type, LongType
    from cassandra.protocol import ProtocolHandler

    classes = {"int": Int32Type, "blob": BytesType, "bigint": LongType}
    meta = [("ks", "samples", f"c{k}", classes[t]) for k, t in enumerate(types)]
    msg = ProtocolHandler.decode_message(version, {}, 1, flags, 0x08, body, None, meta)
    return msg


SAMPLE_ROWS = [(3, os.urandom(1000), None), (-7, b"", b"\x00\x01"), (2**31 - 1, os.urandom(5), os.urandom(33))]


@pytest.mark.parametrize("flags", [0x0001, 0x0000, 0x0004])
def test_rows_decode_as_the_driver_decodes_them(flags):
    version = V
    for rows in (SAMPLE_ROWS, SAMPLE_ROWS[:1], []):
        body = rows_body(rows, flags=flags)
        ours = decode_rows(body, TYPES)
        assert ours == rows
        # in place: a view of the connection's read buffer, as the frame reader hands it
        window = bytearray(b"\xff" * 7 + body + b"\xee" * 5)
        viewed = decode_rows(memoryview(window)[7:7 + len(body)], TYPES)
        assert viewed == rows and all(type(c) in (int, bytes, type(None)) for r in viewed for c in r)
        assert ours == [tuple(r) for r in driver_rows(version, body).parsed_rows]
    body = rows_body([(5, -(2**63))], ("int", "bigint"), flags=flags)
    assert decode_rows(body, ("int", "bigint")) == [(5, -(2**63))]
    assert driver_rows(version, body, ("int", "bigint")).parsed_rows == [(5, -(2**63))]


@pytest.mark.parametrize("body, why", [
    (rows_body(SAMPLE_ROWS, flags=0x0001 | 0x0002, paging=b"page"), "more pages"),
    (rows_body(SAMPLE_ROWS, flags=0x0001 | 0x0008, metadata_id=b"id"), "metadata changed (a v5 flag)"),
    (rows_body([(1, "x", b"")], ("int", "varchar", "blob")), "a column of another type"),
    (rows_body([(1, b"")], ("int", "blob")), "another number of columns"),
    (struct.pack(">i", 1), "kind VOID"),
    (rows_body(SAMPLE_ROWS) + b"\x00", "bytes after the rows"),
])
def test_what_it_does_not_read_is_left_to_the_driver(body, why):
    assert decode_rows(body, TYPES) is None, why


def test_the_decoder_hands_the_rest_to_the_drivers():
    from cassandra.protocol import ErrorMessage, ProtocolHandler, ResultMessage

    version = V

    decode = _decoder(TYPES, ProtocolHandler.decode_message)
    body = rows_body(SAMPLE_ROWS)
    assert decode(version, {}, 1, 0, 0x08, body, None, None) == SAMPLE_ROWS
    assert decode.reads_views and decode(version, {}, 1, 0, 0x08, memoryview(body), None, None) == SAMPLE_ROWS
    # a warning is read by the driver: the rows arrive as its message
    warned = struct.pack(">H", 1) + _string("tombstones") + body
    msg = decode(version, {}, 1, 0x08, 0x08, warned, None, None)
    assert isinstance(msg, ResultMessage) and msg.warnings == ["tombstones"]
    # an error, and a body cut short (the driver says what is wrong, as before)
    err = decode(version, {}, 1, 0, 0x00, struct.pack(">i", 0x1000) + _string("no replicas")
                 + struct.pack(">Hii", 1, 2, 1), None, None)
    assert isinstance(err, ErrorMessage) and "no replicas" in str(err)
    viewed = decode(version, {}, 1, 0, 0x00, memoryview(struct.pack(">i", 0x1000) + _string("no replicas")
                                                         + struct.pack(">Hii", 1, 2, 1)), None, None)
    assert isinstance(viewed, ErrorMessage) and "no replicas" in str(viewed)  # the driver got bytes
    cut = body[: len(body) // 2]
    with pytest.raises(Exception) as driver:
        ProtocolHandler.decode_message(version, {}, 1, 0, 0x08, cut, None, None)
    with pytest.raises(type(driver.value)):
        decode(version, {}, 1, 0, 0x08, cut, None, None)


def test_readable_checks_the_statements_result_columns():
    from cassandra.cqltypes import BytesType, Int32Type, UTF8Type

    assert readable(TYPES, None)  # no result metadata with the statement: the rows name their columns
    assert readable(TYPES, [("k", "t", "label", Int32Type), ("k", "t", "data", BytesType),
                            ("k", "t", "target", BytesType)])
    assert not readable(TYPES, [("k", "t", "label", Int32Type), ("k", "t", "data", UTF8Type),
                                ("k", "t", "target", BytesType)])
    assert not readable(("int", "text"), None)


def test_the_execute_a_hot_read_sends():
    """The hot path's EXECUTE, encoded by the driver, read back from the v4 spec (section 4.1.5):
    the values, the consistency, and the flags of a prepared read as execute_async sends them
    (values, page size)."""
    from cassandra import ConsistencyLevel
    from cassandra.cqltypes import BytesType, Int32Type, LongType, UTF8Type
    from cassandra.protocol import ColumnMetadata, ProtocolHandler
    from cassandra.query import PreparedStatement

    version = V
    binds = [ColumnMetadata("ks", "samples", "dataset", UTF8Type), ColumnMetadata("ks", "samples", "id", LongType)]
    result = [ColumnMetadata("ks", "samples", name, t) for name, t in
              (("label", Int32Type), ("data", BytesType), ("target", BytesType))]
    ps = PreparedStatement(binds, b"qid-0123", [0, 1], "SELECT ...", "ks", version, result, None)
    bound = ps.bind(("cats", -42))
    msg = execute_message(ps, bound.values, ConsistencyLevel.QUORUM, 5000)
    frame = ProtocolHandler.encode_message(msg, 7, version, compressor=None, allow_beta_protocol_version=False)
    head = struct.Struct(">BBhBi")
    v, flags, stream, opcode, length = head.unpack_from(frame)
    body = frame[head.size:]
    assert (v, flags, stream, opcode, length) == (version, 0, 7, 0x0A, len(body))

    def short_bytes(pos):
        n = struct.unpack_from(">H", body, pos)[0]
        return body[pos + 2:pos + 2 + n], pos + 2 + n

    def values(pos):
        count = struct.unpack_from(">H", body, pos)[0]
        pos, out = pos + 2, []
        for _ in range(count):
            n = struct.unpack_from(">i", body, pos)[0]
            out.append(body[pos + 4:pos + 4 + n])
            pos += 4 + n
        return out, pos

    want = [b"cats", struct.pack(">q", -42)]
    query_id, pos = short_bytes(0)
    assert query_id == b"qid-0123"
    consistency = struct.unpack_from(">H", body, pos)[0]
    pos += 2
    query_flags, pos = body[pos], pos + 1
    # values and page size; no SKIP_METADATA (0x02): driver 3.x keeps skip_meta on the message, never on the
    # wire, so rows come with their column specs, which decode_rows checks against the types it reads
    assert consistency == ConsistencyLevel.QUORUM and query_flags == 0x01 | 0x04
    got, pos = values(pos)
    assert got == want and struct.unpack_from(">i", body, pos)[0] == 5000 and len(body) == pos + 4


# --- on a real server --------------------------------------------------------------------------
@pytest.mark.cassandra
def test_fetch_reads_without_execute_async_and_byte_exact(cassandra_url):
    ds = f"hot_{uuid.uuid4().hex[:8]}"
    recs = records(ds, 60)

    async def go():
        async with await open_store(cassandra_url) as store:
            await store.put_samples(ds, recs)
            calls, real = [], store._session.execute_async
            store._session.execute_async = lambda *a, **k: calls.append(a) or real(*a, **k)
            ids = [r.sample.id for r in recs] + [12345]
            got = [s async for s in store.fetch(ds, ids)]
            return got, calls, store._inflight

    got, calls, inflight = asyncio.run(go())
    want = {r.sample.id: r.sample for r in recs}
    samples = [g for g in got if isinstance(g, Sample)]
    assert sorted(s.id for s in samples) == sorted(want) and all(s == want[s.id] for s in samples)
    assert [(g.dataset, g.id) for g in got if isinstance(g, SampleNotFound)] == [(ds, 12345)]
    assert calls == [] and inflight == 0


@pytest.mark.cassandra
def test_an_error_answer_goes_again_the_drivers_way_and_is_translated(cassandra_server):
    """Replication 3 on one node: writes at ONE succeed, reads at QUORUM get the server's Unavailable
    (and by default, with 3 replicas, every request is at LOCAL_QUORUM: refused too).
    The hot path hands that read to execute_async (its retry policy decides), and the store says so."""
    from dataferry.schema._ddl import apply_schema

    host, port = cassandra_server
    ks = f"rf3_{uuid.uuid4().hex[:8]}"
    url = f"cassandra://{host}:{port}/{ks}?replication=SimpleStrategy:3"
    asyncio.run(apply_schema(parse_store_url(url)))
    recs = records("d", 4)

    async def go():
        async with await open_store(url) as store:
            assert store.consistency == "LOCAL_QUORUM"
            with pytest.raises(StoreUnavailable, match="Unavailable"):
                await store.put_samples("d", recs)
        async with await open_store(url + "&consistency=ONE") as store:
            await store.put_samples("d", recs)
        async with await open_store(url + "&consistency=QUORUM&concurrency=2") as store:
            calls, real = [], store._session.execute_async
            store._session.execute_async = lambda *a, **k: calls.append(a) or real(*a, **k)
            with pytest.raises(StoreUnavailable, match="fetch from dataset 'd'") as info:
                [s async for s in store.fetch("d", [r.sample.id for r in recs])]
            await asyncio.sleep(0.2)  # the other read's answer comes in too
            return info.value, len(calls), store._inflight

    err, calls, inflight = asyncio.run(go())
    assert "Unavailable" in str(err) or "unavailable" in str(err).lower()
    assert calls >= 1 and inflight == 0


@pytest.mark.cassandra
def test_a_read_the_driver_cannot_bind_fails_like_before_and_leaves_nothing_in_flight(cassandra_url):
    """An id outside bigint cannot be bound: the hot path leaves it to execute_async, which fails
    it as before (the error reaches the caller), and the store's count of requests in flight
    goes back to zero (close does not wait for it)."""
    ds = f"hot_{uuid.uuid4().hex[:8]}"

    async def go():
        async with await open_store(cassandra_url) as store:
            with pytest.raises(Exception) as info:
                [s async for s in store.fetch(ds, [2**70])]
            return info.value, store._inflight, store._idle.is_set()

    err, inflight, idle = asyncio.run(go())
    assert not isinstance(err, AssertionError) and (inflight, idle) == (0, True), err
