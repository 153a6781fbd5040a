"""HttpSource: the Loader through a real server that dies mid-epoch, and the
client's error translation against dead, silent, lying and cut-off servers.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import threading
import time
from collections import Counter

import pytest

from dataferry.client import Hedge, Loader, Prefetch, Retry
from dataferry.schema.sources.http._source import HttpOptions, HttpSource, RequestRejected, TokenRefused
from dataferry.schema import Sample, open_store, sample_checksum
from dataferry.schema._errors import ConfigError, SampleNotFound, StoreError, StoreTimeout, StoreUnavailable
from dataferry.schema._wire import encode_end, encode_not_found, encode_sample
from dataferry.server import ServerOptions, make_app
from server_kit import RawHttpServer, ServerProcess, make_samples, run, seed, seed_url, serve


# --- a real server in a subprocess, killed and restarted ---------------------------------------------
def test_loader_finishes_the_epoch_across_a_server_kill_and_restart(tmp_path):
    samples = make_samples(3000, size=1500)
    db = f"sqlite://{tmp_path / 's.db'}"

    seed_url(db, "d", samples)
    digest = {s.id: hashlib.sha256(s.data).digest() for s in samples}
    servers = [ServerProcess(db)]
    events: list[str] = []

    def bounce():
        servers[0].kill()
        events.append("killed")
        time.sleep(0.5)
        servers.append(ServerProcess(db, servers[0].port))
        events.append("restarted")

    seen: Counter = Counter()
    t0 = time.monotonic()
    try:
        loader = Loader(
            servers[0].url, "d", batch_size=32,
            prefetch=Prefetch(max_inflight=8, max_bytes=256 << 10),
            retry=Retry(attempts=20, backoff=0.05, max_backoff=0.5, timeout=5),
            hedge=Hedge(enabled=False),
        )
        with loader:
            bouncer = None
            for k, batch in enumerate(loader):
                for i, data in zip(batch.ids.tolist(), batch.data):
                    seen[i] += 1
                    assert hashlib.sha256(data.tobytes()).digest() == digest[i]
                if k == 10:
                    bouncer = threading.Thread(target=bounce)
                    bouncer.start()
                time.sleep(0.004)
            bouncer.join()
            stats = loader.stats()
    finally:
        for s in servers:
            s.kill()
    assert events == ["killed", "restarted"]
    assert seen == Counter({s.id: 1 for s in samples})  # every sample exactly once
    assert stats.retries > 0 or stats.failures > 0  # the kill was felt mid-epoch
    assert time.monotonic() - t0 < 60


# --- error translation ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_dead_server_is_store_unavailable_naming_the_url():
    url = f"http://127.0.0.1:{_free_port()}"

    async def go():
        async with await HttpSource.open(url) as src:
            for call in (src.list_datasets(), src.read_split("d", "all"), _drain(src.fetch("d", [1, 2]))):
                with pytest.raises(StoreUnavailable, match=f"cannot connect to {url}"):
                    await call

    run(go())


async def _drain(agen) -> list:
    return [r async for r in agen]


class RawServer(RawHttpServer):
    """Answers every request with ``reply`` bytes (then closes), or with
    nothing at all when ``reply`` is None."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply

    async def handle(self, reader, writer) -> None:
        await reader.readuntil(b"\r\n\r\n")
        if self.reply is None:
            await asyncio.sleep(30)
        else:
            writer.write(self.reply)
            await writer.drain()


def _http(status: str, ctype: str, body: bytes, *, chunked: bool = False) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nConnection: close\r\n"
    if chunked:
        return (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + f"{len(body):x}\r\n".encode() + body + b"\r\n"
    return (head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def test_a_silent_server_is_a_timeout():
    async def go():
        async with RawServer(None) as url:
            async with await HttpSource.open(url, options=HttpOptions(read_timeout=0.3)) as src:
                with pytest.raises(StoreTimeout, match=url):
                    await _drain(src.fetch("d", [1]))
                with pytest.raises(StoreTimeout):
                    await src.list_datasets()

    run(go())


def test_a_cut_stream_yields_what_arrived_then_fails():
    a, b = Sample(1, 0, b"a" * 100, b""), Sample(2, 1, b"b" * 100)
    body = b"".join(encode_sample(a)) + b"".join(encode_sample(b))[:60]  # the second record is cut

    async def go():
        async with RawServer(_http("200 OK", "application/x-dataferry-frames", body, chunked=True)) as url:
            async with await HttpSource.open(url) as src:
                got = []
                with pytest.raises(StoreUnavailable, match=f"lost connection to {url}.*after 1 answers"):
                    async for r in src.fetch("d", [1, 2]):
                        got.append(r)
                return got

    assert run(go()) == [a]


def test_fetch_runs_hands_on_each_reads_records_as_one_list_the_same_as_fetch():
    data = {i: bytes([i]) * (1000 + 37 * i) for i in range(1, 121)}
    samples = [Sample(i, i % 3, d, b"t" if i % 5 == 0 else None, sample_checksum(d)) for i, d in data.items()]
    body = b"".join(b"".join(encode_sample(x, sums=True)) for x in samples) + encode_not_found(999)
    body += encode_end(len(samples) + 1)
    ids = [x.id for x in samples] + [999]

    async def go():
        async with RawServer(_http("200 OK", "application/x-dataferry-frames", body)) as url:
            async with await HttpSource.open(url) as src:
                runs = [run async for run in src.fetch_runs("d", ids)]
        async with RawServer(_http("200 OK", "application/x-dataferry-frames", body)) as url:
            async with await HttpSource.open(url) as src:
                one_by_one = await _drain(src.fetch("d", ids))
        return runs, one_by_one

    runs, one_by_one = run(go())
    assert runs and all(type(r) is list and r for r in runs)
    flat = [x for r in runs for x in r]
    assert flat == one_by_one == [*samples, SampleNotFound("d", 999)]
    assert all(x.checksum is None for x in flat[:-1])  # checked on arrival


def test_fetch_runs_on_a_cut_stream_yields_what_arrived_then_fails():
    a, b = Sample(1, 0, b"a" * 100, b""), Sample(2, 1, b"b" * 100)
    body = b"".join(encode_sample(a)) + b"".join(encode_sample(b))[:60]

    async def go():
        async with RawServer(_http("200 OK", "application/x-dataferry-frames", body, chunked=True)) as url:
            async with await HttpSource.open(url) as src:
                got = []
                with pytest.raises(StoreUnavailable, match="after 1 answers"):
                    async for r in src.fetch_runs("d", [1, 2]):
                        got.append(r)
                return got

    assert run(go()) == [[a]]


@pytest.mark.parametrize("reply,error,match", ids=[
    "html", "bad-magic", "early-end", "502", "503", "401", "413", "other-json-404", "html-401",
], argvalues=[
    (_http("200 OK", "text/html", b"<html>proxy login</html>"), RequestRejected,
     r"expected 200 application/x-dataferry-frames or a JSON error, got HTTP 200 OK \(text/html\) from POST"),
    (_http("200 OK", "application/x-dataferry-frames", b"XX" + b"\0" * 40), StoreError, "corrupt response"),
    (_http("200 OK", "application/x-dataferry-frames", encode_end(0)), StoreError, "ended after 0 answers"),
    (_http("502 Bad Gateway", "text/plain", b"upstream down"), StoreError, "HTTP 502"),
    (_http("503 Service Unavailable", "application/json", b'{"error": "busy", "detail": "too many"}'),
     StoreUnavailable, "too many"),
    (_http("401 Unauthorized", "application/json", b'{"error": "missing_token", "detail": "x"}'), TokenRefused,
     "requires a token"),
    (_http("413 Payload Too Large", "application/json", b'{"error": "body_too_large", "detail": "big"}'),
     RequestRejected, r"\(413 body_too_large\): big"),
    (_http("404 Not Found", "application/json", b'{"message": "no route"}'), RequestRejected,
     r"not a dataferry data service .*got HTTP 404 Not Found \(application/json\) from POST .*/samples$"),
    (_http("401 Unauthorized", "text/html", b"<html>\n<h1>login</h1>\n</html>"), TokenRefused,
     r"requires a token and none was given \(.*\): HTTP 401 \(text/html\)$"),
])
def test_bad_replies_are_translated(reply, error, match):
    async def go():
        async with RawServer(reply) as url:
            async with await HttpSource.open(url) as src:
                with pytest.raises(error, match=match):
                    await _drain(src.fetch("d", [1]))

    run(go())


def test_rejections_and_auth_from_the_real_server(tmp_path):
    async def go():
        async with await open_store(f"sqlite://{tmp_path / 's.db'}") as store:
            await seed(store, "d", make_samples(3))
            async with serve(make_app(store, ServerOptions(token="tok", max_ids=4))) as base:
                async with await HttpSource.open(base, token="tok") as src:
                    with pytest.raises(RequestRejected, match="duplicate_ids") as info:
                        await _drain(src.fetch("d", [5, 5]))
                    assert info.value.status == 400 and "appears more than once" in info.value.detail
                    with pytest.raises(RequestRejected, match="too_many_ids"):
                        await _drain(src.fetch("d", [1, 2, 3, 4, 5]))
                    with pytest.raises(RequestRejected, match="bad_dataset_name"):
                        await src.get_dataset("../etc")
                async with await HttpSource.open(base, token="nope") as src:
                    with pytest.raises(TokenRefused, match=f"the data service at {base} refused the token"):
                        await src.read_split("d", "all")

    run(go())


# --- options and lifetime -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("url", ["ftp://h/", "http://", "localhost:8470", "http://u:p@h:1", "http://h:1/?q=1", "http://h/#x"])
def test_bad_urls_are_config_errors(url):
    with pytest.raises(ConfigError):
        run(HttpSource.open(url))


@pytest.mark.parametrize("kw", [{"connections": 0}, {"request_size": 0}, {"read_timeout": 0}, {"read_buffer": 10}])
def test_bad_options_are_config_errors(kw):
    with pytest.raises(ConfigError):
        HttpOptions(**kw)


def test_token_file_and_lifetime(tmp_path):
    (tmp_path / "empty").write_text("\n")

    async def go():
        with pytest.raises(ConfigError, match="empty"):
            await HttpSource.open("http://127.0.0.1:1", options=HttpOptions(token_file=str(tmp_path / "empty")))
        with pytest.raises(ConfigError, match="token"):
            await HttpSource.open("http://127.0.0.1:1", token="two words")
        src = await HttpSource.open("https://127.0.0.1:1/prefix/", token="secret",
                                    options=HttpOptions(request_size=128))
        assert src.url == "https://127.0.0.1:1/prefix" and src.preferred_request_size == 128
        assert "secret" not in repr(src)
        await src.close()
        await src.close()
        with pytest.raises(StoreUnavailable, match="closed"):
            await src.list_datasets()

    run(go())


# --- the token file: one reader for the server and the client ----------------------------------------------
def test_a_rotation_token_file_works_for_the_server_and_the_client(tmp_path):
    """The server's two-line rotation file, given to both: the server (its CLI)
    accepts both tokens, the client sends the first."""
    db = f"sqlite://{tmp_path / 's.db'}"

    seed_url(db, "d", make_samples(3))
    tokens = tmp_path / "tokens"
    tokens.write_text("# rotating: old, then new\r\nold-token\r\n\nnew-token\n")
    server = ServerProcess(db, 0, "--token-file", str(tokens))

    async def go():
        async with await HttpSource.open(server.url, options=HttpOptions(token_file=str(tokens))) as src:
            assert len(await src.read_split("d", "all")) == 3  # the first token
        async with await HttpSource.open(server.url, token="new-token") as src:
            assert len(await src.read_split("d", "all")) == 3  # the second token
        async with await HttpSource.open(server.url, token="other-token") as src:
            with pytest.raises(TokenRefused):
                await src.list_datasets()

    try:
        run(go())
        with Loader(lambda: HttpSource.open(server.url, options=HttpOptions(token_file=str(tokens))), "d") as loader:
            assert sum(len(b.ids) for b in loader) == 3
    finally:
        server.kill()


@pytest.mark.parametrize("text, match", [
    ("\n# only a comment\n\n", "is empty"),
    ("good-token\nBearer secret-token\n", "line 2: a token is printable ASCII without spaces"),
    ("t\u00f6ken-secret\n", "line 1: a token is printable ASCII without spaces"),
])
def test_a_bad_token_file_is_one_line_naming_the_file_never_the_token(tmp_path, text, match):
    from dataferry.schema._tokens import read_token_file
    from dataferry.server._options import read_token_file as server_reader

    assert server_reader is read_token_file  # one reader for both sides
    path = tmp_path / "tokens"
    path.write_text(text, encoding="utf-8")
    for attempt in (lambda: read_token_file(str(path)),
                    lambda: run(HttpSource.open("http://127.0.0.1:1", options=HttpOptions(token_file=str(path))))):
        with pytest.raises(ConfigError, match=match) as info:
            attempt()
        msg = str(info.value)
        assert str(path) in msg and "\n" not in msg and "secret" not in msg and "good" not in msg
