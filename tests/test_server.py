"""The data service: the real app on loopback, over SQLite and Cassandra.

Every response checked here is also validated against ``server/openapi.yaml``.
Bad input (``test_server_input.py``) and fuzzing (``test_server_fuzz.py``)
live beside this file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import struct
import subprocess
import sys

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from dataferry.schema.sources.http._source import HttpOptions, HttpSource, TokenRefused
from dataferry.schema import DatasetNotFound, IdList, Sample, SampleNotFound, SplitNotFound, open_store
from dataferry.schema._errors import ConfigError, ProtocolMismatch, StoreTimeout, StoreUnavailable, TLSFailed
from dataferry.schema._wire import FRAMES_TYPE, IDLIST_TYPE, EndRecord, ErrorRecord, decode_idlist, encode_ids
from dataferry.server import ServerOptions, make_app
from dataferry.server._samples import Outbox
from server_kit import LABELS, BrokenStore, call, decode, make_samples, parse_metrics, run, seed, seed_url, self_signed, serve

BIN = {"Content-Type": "application/octet-stream"}


async def _fetch_raw(session, base, dataset, ids, **kw):
    return await call(session, "POST", f"{base}/v1/datasets/{dataset}/samples", "/v1/datasets/{name}/samples",
                      data=encode_ids(ids), headers={**BIN, **kw.pop("headers", {})}, **kw)


def test_openapi_document_is_valid_and_names_every_route():
    from openapi_spec_validator import validate

    from server_kit import spec_document

    doc = spec_document()
    validate(doc)
    app = make_app("sqlite:unused.db")
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()}
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops if m != "parameters"}
    assert routes == documented


# --- catalog ---------------------------------------------------------------------------------
def test_catalog_endpoints(store_url, dataset_name):
    samples = make_samples(30)

    async def go():
        async with await open_store(store_url) as store:
            await seed(store, dataset_name, samples, {"train": list(range(0, 30, 2))})
            async with serve(make_app(store)) as base, aiohttp.ClientSession() as s:
                status, _, body = await call(s, "GET", f"{base}/v1/datasets", "/v1/datasets")
                assert status == 200
                mine = [d for d in json.loads(body)["datasets"] if d["name"] == dataset_name]
                assert mine == [{"name": dataset_name, "num_samples": 30, "num_classes": 3,
                                 "label_names": list(LABELS), "created": "2024-05-01T00:00:00+00:00"}]

                status, _, body = await call(s, "GET", f"{base}/v1/datasets/{dataset_name}", "/v1/datasets/{name}")
                doc = json.loads(body)
                assert status == 200 and doc["label_names"] == list(LABELS) and doc["num_samples"] == 30
                assert sorted((x["name"], x["num_ids"]) for x in doc["splits"]) == [("all", 30), ("train", 15)]

                status, headers, body = await call(
                    s, "GET", f"{base}/v1/datasets/{dataset_name}/splits/train", "/v1/datasets/{name}/splits/{split}")
                assert status == 200 and headers["Content-Type"] == IDLIST_TYPE
                assert int(headers["Content-Length"]) == len(body) == 16 + 12 * 15
                train = [samples[k] for k in range(0, 30, 2)]
                assert decode_idlist(body) == IdList([x.id for x in train], [x.label for x in train])
                assert body[:16] == b"DFIL\x01\x00\x00\x00" + struct.pack("<Q", 15)

                status, _, body = await call(s, "GET", f"{base}/v1/datasets/nope{dataset_name}", "/v1/datasets/{name}")
                assert status == 404
                assert json.loads(body)["error"] == "dataset_not_found" and f"nope{dataset_name}" in json.loads(body)["detail"]
                status, _, body = await call(s, "GET", f"{base}/v1/datasets/{dataset_name}/splits/test",
                                             "/v1/datasets/{name}/splits/{split}")
                assert status == 404
                assert json.loads(body) | {"detail": ""} == {"error": "split_not_found", "detail": "",
                                                             "dataset": dataset_name, "split": "test"}

    run(go())


def test_big_split_streams_in_slices(tmp_path):
    n = 300_000  # 3.6 MB: several writes, several chunks in the store

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", make_samples(3))
            idl = IdList(np.arange(n, dtype=np.int64) * 3 - n, np.arange(n) % 1000)
            await store.put_split("d", "big", idl)
            async with serve(make_app(store)) as base, await HttpSource.open(base) as src:
                assert await src.read_split("d", "big") == idl

    run(go())


# --- batch fetch -------------------------------------------------------------------------------------
def test_batch_fetch_is_byte_exact_with_every_kind_of_target(store_url, dataset_name):
    samples = make_samples(24)
    unknown = [12345, -7]

    async def go():
        async with await open_store(store_url) as store:
            await seed(store, dataset_name, samples)
            async with serve(make_app(store)) as base, aiohttp.ClientSession() as s:
                ids = [x.id for x in samples] + unknown
                status, headers, body = await _fetch_raw(s, base, dataset_name, ids)
                assert status == 200 and headers["Content-Type"] == FRAMES_TYPE
                assert headers.get("Transfer-Encoding") == "chunked"
                recs = await decode(body, dataset_name)
                # JSON bodies are the same request
                status, _, body2 = await call(s, "POST", f"{base}/v1/datasets/{dataset_name}/samples",
                                              "/v1/datasets/{name}/samples", json={"ids": ids})
                return recs, await decode(body2, dataset_name), body

    recs, recs2, body = run(go())
    assert recs[-1] == EndRecord(len(samples) + len(unknown))
    got = {r.id: r for r in recs[:-1]}
    assert len(got) == len(recs) - 1  # each id exactly once
    for x in samples:
        assert got[x.id] == x  # data, label and target (None vs b"" vs bytes) byte-exact
        assert (got[x.id].target is None) == (x.target is None)
    assert {got[i] for i in unknown} == {SampleNotFound(dataset_name, i) for i in unknown}
    assert {r.id for r in recs2[:-1]} == set(got)
    # the header layout, pinned: magic, version, kind, flags, zero pad, id, label, lengths
    first = samples[0]
    head = struct.pack("<2sBBB3xqiII", b"DF", 1, 0, 0, first.id, first.label, 0, len(first.data))
    assert head + first.data in body


def test_records_come_in_completion_order():
    """A source that answers late for one id: the others are streamed first."""

    class Staggered:
        url = "memory:"

        async def get_dataset(self, name):
            return None

        async def fetch(self, dataset, ids):
            async def one(i):
                await asyncio.sleep(0.3 if i == 0 else 0.0)
                return Sample(i, 0, b"x" * 10)

            for fut in asyncio.as_completed([one(i) for i in ids]):
                yield await fut

    async def go():
        async with serve(make_app(Staggered())) as base, await HttpSource.open(base) as src:
            return [r.id async for r in src.fetch("d", [0, 1, 2, 3])]

    order = run(go())
    assert order[-1] == 0 and sorted(order) == [0, 1, 2, 3]


def test_http_source_reads_through_the_server(store_url, dataset_name):
    samples = make_samples(40)

    async def go():
        async with await open_store(store_url) as store:
            await seed(store, dataset_name, samples)
            async with serve(make_app(store)) as base:
                async with await HttpSource.open(base) as src:
                    got = [r async for r in src.fetch(dataset_name, [x.id for x in samples] + [99])]
                    infos = await src.list_datasets()
                    info = await src.get_dataset(dataset_name)
                    splits = await src.list_splits(dataset_name)
                    idl = await src.read_split(dataset_name, "all")
                    with pytest.raises(DatasetNotFound):
                        await src.get_dataset("nope")
                    with pytest.raises(DatasetNotFound):
                        await src.read_split("nope", "all")
                    with pytest.raises(SplitNotFound):
                        await src.read_split(dataset_name, "nope")
                    assert [r async for r in src.fetch(dataset_name, [])] == []
                return got, infos, info, splits, idl

    got, infos, info, splits, idl = run(go())
    assert len(got) == 41
    assert {r.id: r for r in got if isinstance(r, Sample)} == {x.id: x for x in samples}
    assert [r for r in got if isinstance(r, SampleNotFound)] == [SampleNotFound(dataset_name, 99)]
    assert info.label_names == LABELS and info.num_samples == 40 and info in infos
    assert [(s.name, s.num_ids) for s in splits] == [("all", 40)]
    assert sorted(idl.ids.tolist()) == sorted(x.id for x in samples)


def test_http_source_keeps_its_connections_alive(tmp_path):
    """Across a long link a new connection costs round trips: sequential requests share one."""
    samples = make_samples(20)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", samples)
            app = make_app(store)
            peers = []

            @web.middleware
            async def record_peer(request, handler):
                peers.append(request.transport.get_extra_info("peername"))
                return await handler(request)

            app.middlewares.append(record_peer)
            async with serve(app) as base, await HttpSource.open(base) as src:
                await src.read_split("d", "all")
                for _ in range(10):
                    assert len([r async for r in src.fetch("d", [x.id for x in samples] + [7])]) == 21
                await src.list_datasets()
            return peers

    peers = run(go())
    assert len(peers) == 12 and len(set(peers)) == 1


def test_store_failure_before_and_during_the_stream(tmp_path):
    samples = make_samples(20)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", samples)
            ids = [x.id for x in samples]
            async with aiohttp.ClientSession() as s:
                # before any sample: a plain 503 with a JSON body
                async with serve(make_app(BrokenStore(store, fail_after=0))) as base:
                    status, headers, body = await _fetch_raw(s, base, "d", ids)
                    assert status == 503 and headers["Retry-After"] == "1"
                    assert json.loads(body)["error"] == "store_unavailable"
                    async with await HttpSource.open(base) as src:
                        with pytest.raises(StoreUnavailable, match="connection to the store lost"):
                            [r async for r in src.fetch("d", ids)]
                # mid-stream: the samples so far, then an ERROR record
                async with serve(make_app(BrokenStore(store, fail_after=5))) as base:
                    status, _, body = await _fetch_raw(s, base, "d", ids)
                    recs = await decode(body, "d")
                    assert status == 200 and len(recs) == 6
                    assert recs[-1] == ErrorRecord("store_unavailable", "injected: connection to the store lost")
                    async with await HttpSource.open(base) as src:
                        got = []
                        with pytest.raises(StoreUnavailable, match="after 5 answers"):
                            async for r in src.fetch("d", ids):
                                got.append(r)
                        assert len(got) == 5
                # a store that stops answering: store_timeout
                opts = ServerOptions(store_timeout=0.2)
                async with serve(make_app(BrokenStore(store, hang_after=0), opts)) as base:
                    status, _, body = await _fetch_raw(s, base, "d", ids)
                    assert status == 503 and json.loads(body)["error"] == "store_timeout"
                async with serve(make_app(BrokenStore(store, hang_after=3), opts)) as base:
                    async with await HttpSource.open(base) as src:
                        with pytest.raises(StoreTimeout):
                            [r async for r in src.fetch("d", ids)]

    run(go())


def test_a_store_timeout_is_said_once_by_the_client_and_the_server_log(tmp_path, caplog):
    """A store timeout is a TimeoutError: the client's translation of transport
    errors must not wrap its own StoreTimeout again, and the server's log line
    names the store once."""
    samples = make_samples(20)

    def once(text: str, part: str) -> None:
        assert text.count(part) == 1, f"{part!r} said {text.count(part)} times in: {text}"

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", samples)
            ids = [x.id for x in samples]
            opts = ServerOptions(store_timeout=0.2)
            where = store.url
            for hang_after, catalog in ((3, None), (0, "hang")):
                broken = BrokenStore(store, hang_after=hang_after, catalog=catalog)
                async with serve(make_app(broken, opts)) as base:
                    async with await HttpSource.open(base) as src:
                        with pytest.raises(StoreTimeout) as got:
                            [r async for r in src.fetch("d", ids)]
                        text = str(got.value)
                        once(text, base)
                        once(text, "within 0.2 s")
                        if catalog:
                            with pytest.raises(StoreTimeout) as got:
                                await src.list_datasets()
                            once(str(got.value), base)
            logged = [r.getMessage() for r in caplog.records if "within 0.2 s" in r.getMessage()]
            assert logged
            for line in logged:
                once(line, where)

    with caplog.at_level("WARNING"):
        run(go())


def test_slow_client_pauses_the_store(tmp_path):
    """Backpressure: a client that does not read stops the store's iteration."""
    big = make_samples(120, size=256 << 10)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", big)
            broken = BrokenStore(store)
            opts = ServerOptions(buffer_bytes=1 << 20, write_chunk=256 << 10)
            async with serve(make_app(broken, opts)) as base:
                options = HttpOptions(read_buffer=1 << 16)
                async with await HttpSource.open(base, options=options) as src:
                    it = src.fetch("d", [x.id for x in big]).__aiter__()
                    first = await anext(it)
                    await asyncio.sleep(0.5)  # the client reads nothing meanwhile
                    stalled = broken.yielded
                    rest = [r async for r in it]
                    return first, rest, stalled

    first, rest, stalled = run(go())
    # socket buffers and the 1 MiB outbox hold a few MB, not the 30 MB asked for
    assert stalled < 80, stalled
    assert {first.id, *(r.id for r in rest)} == {x.id for x in big}


def test_a_client_slower_than_store_timeout_is_not_a_store_timeout(tmp_path):
    """store_timeout bounds the wait for the store, not for the client: a
    producer paused on a full outbox for many store_timeouts is not expired."""
    big = make_samples(60, size=256 << 10)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", big)
            opts = ServerOptions(buffer_bytes=1 << 20, write_chunk=256 << 10, store_timeout=0.1)
            async with serve(make_app(store, opts)) as base:
                async with await HttpSource.open(base, options=HttpOptions(read_buffer=1 << 16)) as src:
                    it = src.fetch("d", [x.id for x in big]).__aiter__()
                    first = await anext(it)
                    await asyncio.sleep(0.6)  # the client reads nothing for six store_timeouts
                    return [first, *[r async for r in it]]

    got = run(go())
    assert all(isinstance(r, Sample) for r in got)
    assert sorted(r.id for r in got) == sorted(x.id for x in big)


def test_outbox_coalesces_ready_records_and_bounds_bytes():
    async def go():
        box = Outbox(capacity=1000)
        for _ in range(50):
            await box.put((b"h" * 10, b"d" * 10))
        blocked = asyncio.ensure_future(box.put((b"x",)))
        await asyncio.sleep(0.01)
        assert not blocked.done()  # 1000 bytes waiting: the producer is paused
        parts = await box.take(1 << 20)
        assert len(parts) == 100  # everything ready leaves in one write
        await asyncio.sleep(0)
        assert blocked.done()
        box.close()
        assert await box.take(10) == [b"x"] and await box.take(10) is None

    run(go())


# --- auth -------------------------------------------------------------------------------------------
def test_token_rotation_accepts_every_token_in_the_file(tmp_path):
    from dataferry.server._options import read_token_file

    token_file = tmp_path / "tokens"
    token_file.write_text("# rotating: old, then new\nold-token\n\nnew-token\n")
    tokens = read_token_file(str(token_file))
    assert tokens == ("old-token", "new-token")
    options = ServerOptions(token=tokens)
    assert options.tokens == ("old-token", "new-token") and "token" not in repr(options).lower().replace("tokens", "")

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", make_samples(3))
            async with serve(make_app(store, options)) as base:
                for token in tokens:
                    async with await HttpSource.open(base, token=token) as src:
                        assert len(await src.read_split("d", "all")) == 3
                async with await HttpSource.open(base, token="older-token") as src:
                    with pytest.raises(TokenRefused):
                        await src.list_datasets()

    run(go())
    with pytest.raises(Exception, match="empty"):
        (tmp_path / "blank").write_text("# nothing\n\n")
        read_token_file(str(tmp_path / "blank"))


@pytest.mark.parametrize("token", ["ok-token", "", "two words", "t\u00f6ken", "tab\tin", "nul\x00", 5, b"bytes"])
def test_server_and_client_take_the_same_tokens(token):
    """One rule for a bearer token on both sides: what the server accepts, the
    client sends, and what one refuses the other does too (a ConfigError)."""

    async def client_takes() -> bool:
        try:
            src = await HttpSource.open("http://127.0.0.1:9", token=token)
        except ConfigError:
            return False
        await src.close()
        return True

    try:
        ServerOptions(token=token)
        server_takes = True
    except ConfigError:
        server_takes = False
    assert server_takes == run(client_takes())
    assert server_takes == (token == "ok-token")


def test_token_auth(tmp_path):
    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", make_samples(4))
            right = {"Authorization": "Bearer s3cret-token"}
            async with serve(make_app(store, ServerOptions(token="s3cret-token"))) as base, aiohttp.ClientSession() as s:
                for path in ("/healthz", "/readyz"):
                    assert (await call(s, "GET", base + path, path))[0] == 200
                for headers, error in [
                    ({}, "missing_token"),
                    ({"Authorization": "Bearer wrong"}, "invalid_token"),
                    ({"Authorization": "Bearer s3cret-tokenX"}, "invalid_token"),
                    ({"Authorization": "Basic czNjcmV0LXRva2Vu"}, "missing_token"),
                    ({"Authorization": "Bearer"}, "missing_token"),
                    ({"Authorization": "s3cret-token"}, "missing_token"),
                ]:
                    for path, template in [("/v1/datasets", "/v1/datasets"), ("/v1/datasets/d", "/v1/datasets/{name}"),
                                           ("/metrics", "/metrics")]:
                        status, h, body = await call(s, "GET", base + path, template, headers=headers)
                        assert status == 401, (headers, path)
                        assert h["WWW-Authenticate"].startswith('Bearer realm="dataferry"')
                        assert json.loads(body)["error"] == error
                    status, _, _ = await _fetch_raw(s, base, "d", [1], headers=headers)
                    assert status == 401
                status, _, body = await call(s, "GET", base + "/nowhere", headers={})
                assert status == 401  # unknown paths say nothing without the token
                assert (await call(s, "GET", base + "/v1/datasets", "/v1/datasets", headers=right))[0] == 200
                assert (await call(s, "GET", base + "/metrics", "/metrics", headers=right))[0] == 200
                assert (await _fetch_raw(s, base, "d", [1], headers=right))[0] == 200

                async with await HttpSource.open(base, token="s3cret-token") as src:
                    assert len(await src.read_split("d", "all")) == 4
                async with await HttpSource.open(base, token="wrong") as src:
                    with pytest.raises(TokenRefused, match="refused the token"):
                        await src.list_datasets()
                    with pytest.raises(TokenRefused):
                        [r async for r in src.fetch("d", [1])]
                async with await HttpSource.open(base) as src:
                    with pytest.raises(TokenRefused, match="requires a token"):
                        await src.read_split("d", "all")
                token_file = tmp_path / "token"
                token_file.write_text("s3cret-token\n")
                async with await HttpSource.open(base, options=HttpOptions(token_file=str(token_file))) as src:
                    assert "s3cret" not in repr(src)
                    assert len(await src.list_datasets()) == 1

            # metrics may be opened separately; without a token everything is open
            async with serve(make_app(store, ServerOptions(token="t", metrics_auth=False))) as base, aiohttp.ClientSession() as s:
                assert (await call(s, "GET", base + "/metrics", "/metrics"))[0] == 200
                assert (await call(s, "GET", base + "/v1/datasets", "/v1/datasets"))[0] == 401
            async with serve(make_app(store)) as base, aiohttp.ClientSession() as s:
                assert (await call(s, "GET", base + "/v1/datasets", "/v1/datasets"))[0] == 200

    run(go())


# --- TLS ----------------------------------------------------------------------------------------------
def test_tls_with_a_self_signed_certificate(tmp_path):
    from dataferry.server.cli import ssl_context

    cert, key = self_signed(tmp_path)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", make_samples(5))
            async with serve(make_app(store, ServerOptions(token="tok")), ssl_context=ssl_context(cert, key)) as base:
                assert base.startswith("https://localhost:")
                async with await HttpSource.open(base, token="tok", options=HttpOptions(ca_file=cert)) as src:
                    assert len([r async for r in src.fetch("d", (await src.read_split("d", "all")).ids)]) == 5
                async with await HttpSource.open(base, token="tok") as src:  # system CAs: not trusted
                    with pytest.raises(TLSFailed, match="certificate .* failed verification"):
                        await src.list_datasets()
                async with await HttpSource.open(base, token="tok", options=HttpOptions(verify=False)) as src:
                    assert len(await src.list_datasets()) == 1
                plain = base.replace("https://", "http://")
                async with await HttpSource.open(plain, token="tok") as src:
                    with pytest.raises(ProtocolMismatch, match="speaks TLS"):
                        await src.list_datasets()

    run(go())


# --- ops ----------------------------------------------------------------------------------------------
def _scrape(app: web.Application) -> tuple[str, str]:
    """(Content-Type, text) of one GET /metrics from ``app`` on loopback."""

    async def go():
        async with serve(app) as base, aiohttp.ClientSession() as s:
            status, headers, body = await call(s, "GET", base + "/metrics", "/metrics")
            assert status == 200
            return headers["Content-Type"], body.decode()

    return run(go())


def test_metrics_parse_as_prometheus_text_with_process_metrics(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    async def make():
        return await open_store(f"sqlite://{tmp_path / 's.db'}")

    store = run(make())
    try:
        ctype, text = _scrape(make_app(store))
    finally:
        run(store.close())
    # the text format Prometheus 2 and 3 both scrape without a fallback protocol
    assert ctype == "text/plain; version=0.0.4; charset=utf-8"
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    assert families["dataferry_server_requests"] == "counter"
    assert families["dataferry_server_store_latency_seconds"] == "histogram"
    # the process's own health beside the service's: memory, CPU, fds, GC, the interpreter
    for name in ("process_resident_memory_bytes", "process_cpu_seconds", "process_open_fds",
                 "python_gc_collections", "python_info"):
        assert name in families, f"/metrics has no {name}"
    assert not [line for line in text.splitlines() if "_created" in line]  # no series but the documented ones


def test_two_apps_in_one_process_count_apart(tmp_path):
    import prometheus_client

    samples = make_samples(4)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", samples)
            async with serve(make_app(store)) as one, serve(make_app(store)) as two, aiohttp.ClientSession() as s:
                await _fetch_raw(s, one, "d", [x.id for x in samples])
                await _fetch_raw(s, one, "d", [x.id for x in samples])
                await _fetch_raw(s, two, "d", [x.id for x in samples[:1]])
                return [(await call(s, "GET", base + "/metrics", "/metrics"))[2].decode() for base in (one, two)]

    served = [float(re.search(r"^dataferry_server_samples_served_total (\S+)$", t, re.M).group(1)) for t in run(go())]
    assert served == [8, 1]
    global_names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not [n for n in global_names if n.startswith("dataferry")], "the server registered on the global registry"


def test_readyz_and_metrics(tmp_path):
    samples = make_samples(10)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", samples)
            async with serve(make_app(store)) as base, aiohttp.ClientSession() as s:
                status, _, body = await call(s, "GET", base + "/healthz", "/healthz")
                assert status == 200 and json.loads(body) == {"status": "ok"}
                status, _, body = await call(s, "GET", base + "/readyz", "/readyz")
                assert status == 200 and json.loads(body) == {"status": "ready"}
                await _fetch_raw(s, base, "d", [x.id for x in samples] + [5])
                await call(s, "GET", base + "/v1/datasets/_bad", "/v1/datasets/{name}")
                await call(s, "GET", base + "/v1/datasets/d/splits/all", "/v1/datasets/{name}/splits/{split}")
                status, headers, body = await call(s, "GET", base + "/metrics", "/metrics")
            return status, headers, body.decode()

    status, headers, text = run(go())
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    metrics = parse_metrics(text)
    p = "dataferry_server_"
    assert metrics[p + "samples_served_total"] == 10
    assert metrics[p + "samples_not_found_total"] == 1
    assert metrics[p + "bytes_served_total"] >= sum(len(x.data) for x in samples)
    assert metrics[p + 'requests_total{method="POST",route="/v1/datasets/{name}/samples",status="200"}'] == 1
    assert metrics[p + 'requests_total{method="GET",route="/v1/datasets/{name}",status="400"}'] == 1
    assert metrics[p + 'errors_total{error="bad_dataset_name"}'] == 1
    assert metrics[p + "requests_in_flight"] == 1  # this very request
    assert metrics[p + 'store_latency_seconds_count{op="fetch"}'] == 1
    assert metrics[p + 'store_latency_seconds_bucket{le="+Inf",op="fetch"}'] == 1
    assert p + 'store_latency_seconds_count{op="fetch_first"}' in metrics


def test_readyz_is_503_when_the_store_is_down(tmp_path):
    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            async with aiohttp.ClientSession() as s:
                for mode in ("fail", "hang"):
                    opts = ServerOptions(ready_timeout=0.2, store_timeout=0.3)
                    async with serve(make_app(BrokenStore(store, catalog=mode), opts)) as base:
                        status, _, body = await call(s, "GET", base + "/readyz", "/readyz")
                        assert status == 503 and json.loads(body)["error"] == "not_ready"
                        assert (await call(s, "GET", base + "/healthz", "/healthz"))[0] == 200
                        status, _, body = await call(s, "GET", base + "/v1/datasets", "/v1/datasets")
                        error = {"fail": "store_unavailable", "hang": "store_timeout"}[mode]
                        assert status == 503 and json.loads(body)["error"] == error

    run(go())


def test_requests_beyond_the_limit_get_503_busy(tmp_path):
    samples = make_samples(4)

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", samples)
            opts = ServerOptions(max_concurrent=1, queue_timeout=0.1, store_timeout=0.5)
            async with serve(make_app(BrokenStore(store, hang_after=0), opts)) as base, aiohttp.ClientSession() as s:
                hung = asyncio.ensure_future(_fetch_raw(s, base, "d", [samples[0].id]))
                await asyncio.sleep(0.1)
                status, headers, body = await call(s, "GET", base + "/v1/datasets", "/v1/datasets")
                assert status == 503 and headers["Retry-After"] == "1" and json.loads(body)["error"] == "busy"
                assert (await call(s, "GET", base + "/healthz", "/healthz"))[0] == 200  # ops are not limited
                hung.cancel()
                await asyncio.gather(hung, return_exceptions=True)

    run(go())


def test_make_app_opens_and_closes_a_store_url(store_url, dataset_name):
    async def go():
        async with await open_store(store_url) as store:
            await seed(store, dataset_name, make_samples(3))
        app = make_app(store_url)
        async with serve(app) as base, await HttpSource.open(base) as src:
            assert (await src.get_dataset(dataset_name)).num_samples == 3
        from dataferry.server._keys import GATE

        with pytest.raises(Exception):
            await app[GATE].store.list_datasets()  # closed by the cleanup context

    run(go())


# --- the CLI ------------------------------------------------------------------------------------------
def test_cli_serves_and_finishes_in_flight_responses_on_sigterm(tmp_path):
    db = tmp_path / "s.db"
    samples = make_samples(40, size=512 << 10)  # 20 MB: still streaming when SIGTERM comes

    seed_url(f"sqlite://{db}", "d", samples)
    (tmp_path / "tok").write_text("tok\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "dataferry.server", "--store", f"sqlite://{db}", "--port", "0",
         "--token-file", str(tmp_path / "tok"), "--no-access-log", "--grace", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("dataferry serve: listening on http://127.0.0.1:"), line + proc.stderr.read()
        base = line.split()[-1]

        async def use():
            options = HttpOptions(read_buffer=1 << 16)
            async with await HttpSource.open(base, token="tok", options=options) as src:
                ids = (await src.read_split("d", "all")).ids
                it = src.fetch("d", ids).__aiter__()
                got = [await anext(it)]
                proc.send_signal(signal.SIGTERM)  # mid-stream: the response must still finish
                await asyncio.sleep(0.5)
                got += [r async for r in it]
                with pytest.raises(StoreUnavailable):  # and no new connections are taken
                    await src.list_datasets()
                return got

        got = run(use())
        assert sorted(r.id for r in got) == sorted(x.id for x in samples)
        assert proc.wait(10) == 0
        assert "tok" not in proc.stderr.read().replace("--token-file", "")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.parametrize("args,message", [
    (["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
    (["--token-file", "/nonexistent/tok"], "cannot read token file '/nonexistent/tok'"),
    (["--store", "ftp://x"], "unknown store URL scheme"),
    (["--tls-cert", "/nonexistent/c", "--tls-key", "/nonexistent/k"], "cannot load TLS certificate"),
])
def test_cli_rejects_bad_arguments(args, message):
    out = subprocess.run([sys.executable, "-m", "dataferry.server", "--port", "0", *args],
                         capture_output=True, text=True, timeout=30, env={**os.environ, "PYTHONWARNINGS": "error"})
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_load_bench_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "dataferry.bench.load_server", "--seconds", "1", "--clients", "2", "--images", "100",
         "--data", "random", "--cache-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONWARNINGS": "error"},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "errors      0" in out.stdout and "us per sample" in out.stdout and "server RSS" in out.stdout


class _HeldSplits(BrokenStore):
    """``read_split`` waits until ``release`` is set: the client can leave before the answer's head."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.release = asyncio.Event()
        self.asked = asyncio.Event()

    async def read_split(self, dataset, split):
        self.asked.set()
        await self.release.wait()
        return await self.inner.read_split(dataset, split)


def test_a_client_gone_before_the_id_lists_head_is_one_info_line_not_a_traceback(tmp_path, caplog):
    """The id list's head was written outside the route's ConnectionError guard: a client that left
    while the store was read (one that gave up on a frozen worker, say) reached the errors middleware,
    which logged a 500 with its traceback ("Cannot write to closing transport")."""

    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", make_samples(20))
            held = _HeldSplits(store)
            async with serve(make_app(held)) as base:
                host, port = base.removeprefix("http://").rsplit(":", 1)
                reader, writer = await asyncio.open_connection(host, int(port))
                writer.write(f"GET /v1/datasets/d/splits/all HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
                await writer.drain()
                await asyncio.wait_for(held.asked.wait(), 10)
                writer.close()  # gone before the head
                await asyncio.sleep(0.3)  # the server sees the connection end
                held.release.set()
                for _ in range(100):
                    if any("abandoned" in r.getMessage() or r.levelname == "ERROR" for r in caplog.records):
                        break
                    await asyncio.sleep(0.02)

    with caplog.at_level("INFO"):
        run(go())
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not errors, [(r.getMessage(), r.exc_info is not None) for r in errors]
    gone = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    assert len(gone) == 1 and gone[0].startswith("id list of 'd' split 'all' to 127.0.0.1 abandoned"), gone
