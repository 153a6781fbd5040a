"""Where a request that gets no answer is held: the diagnostics for the GPU runs' 30 s stalls
(bench/results/gpu/README.md, 2026-11-27). The latency proxy logs each connection whose request
has had no byte back for ``stall_log`` seconds, saying whether the request is still waiting for
the upstream connection, held in the proxy, or sent upstream; the client's pool logs an exchange
given up after ``STALL_LOG`` seconds with where it stood and its local port, the same port the
proxy's line names, so the two logs can be matched.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import re

import pytest

from dataferry.bench._latency_proxy import LatencyProxy, LinkOptions
from dataferry.schema.sources.http import _pool
from dataferry.schema.sources.http._connection import collector, read_body
from dataferry.schema.sources.http._pool import Pool

_NO_UVLOOP = importlib.util.find_spec("uvloop") is None
LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(_NO_UVLOOP, reason="uvloop not installed"))]
REQUEST = b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n"
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
PROXY_LOG = "dataferry.bench._latency_proxy"


def run(coro, loop: str):
    async def bounded():
        return await asyncio.wait_for(coro, 30)

    if loop == "uvloop":
        import uvloop

        return uvloop.run(bounded())
    return asyncio.run(bounded())


async def logged(caplog, pattern: str) -> re.Match:
    """Wait (at most 10 s) until a log line matches ``pattern``."""
    for _ in range(1000):
        for record in caplog.records:
            found = re.search(pattern, record.getMessage())
            if found:
                return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"no log line matches {pattern!r}; got {[r.getMessage() for r in caplog.records]}")


@pytest.mark.parametrize("loop", LOOPS)
def test_the_proxy_logs_a_request_with_no_answer_and_when_the_answer_begins(loop, caplog):
    release = None

    async def hold_then_answer(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        await release.wait()
        writer.write(ANSWER)
        await writer.drain()
        await reader.read()  # until the client closes
        writer.close()

    async def main():
        nonlocal release
        release = asyncio.Event()
        server = await asyncio.start_server(hold_then_answer, "127.0.0.1", 0)
        try:
            async with LatencyProxy(server.sockets[0].getsockname()[:2], LinkOptions(delay=0.01),
                                    stall_log=0.2) as proxy:
                reader, writer = await asyncio.open_connection(*proxy.address)
                port = writer.get_extra_info("sockname")[1]
                writer.write(REQUEST)
                line = await logged(caplog, r"connection from 127\.0\.0\.1:(\d+) via .*: no answer .* the request "
                                            r"went upstream .* no byte came back \(unsent in our upstream socket: 0 B\)")
                assert int(line.group(1)) == port
                release.set()
                assert (await reader.readuntil(b"ok")).startswith(b"HTTP/1.1 200")
                await logged(caplog, rf"127\.0\.0\.1:{port} via .*: the answer began")
                writer.close()
        finally:
            server.close()

    with caplog.at_level(logging.INFO, logger=PROXY_LOG):
        run(main(), loop)
    stalls = [r for r in caplog.records if "no answer" in r.getMessage()]
    assert len(stalls) == 1, "one line per stalled request, not one per check"


@pytest.mark.parametrize("loop", LOOPS)
def test_a_request_given_up_is_logged_by_the_pool_with_the_port_the_proxy_names(loop, caplog, monkeypatch):
    monkeypatch.setattr(_pool, "STALL_LOG", 0.2)

    async def never_answer(reader, writer):
        await reader.read()  # reads the request, answers nothing, until the client goes
        writer.close()

    async def main():
        server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
        try:
            async with LatencyProxy(server.sockets[0].getsockname()[:2], LinkOptions(delay=0.01),
                                    stall_log=0.2) as proxy:
                pool = Pool(*proxy.address, ssl_context=None, connections=2, connect_timeout=5.0,
                            read_timeout=60.0, keepalive=25.0)
                try:
                    with pytest.raises(TimeoutError):
                        async with asyncio.timeout(0.6):
                            async with pool.exchange(REQUEST, "text/plain", collector()) as conn:
                                await read_body(conn)
                finally:
                    pool.close()
                return await logged(caplog, r"connection from 127\.0\.0\.1:(\d+) via .*: no answer")
        finally:
            server.close()

    with caplog.at_level(logging.INFO):
        proxy_line = run(main(), loop)
    client = [r.getMessage() for r in caplog.records if r.name == "dataferry.client"]
    assert len(client) == 1, client
    found = re.search(r"given up after [\d.]+ s: sent [\d.]+ s before on a new connection: local port (\d+), "
                      r"no byte of the answer \(1 of 2 connections in use\)", client[0])
    assert found, client[0]
    assert found.group(1) == proxy_line.group(1)


def test_a_request_waiting_for_a_connection_says_so(caplog, monkeypatch):
    monkeypatch.setattr(_pool, "STALL_LOG", 0.1)

    async def main():
        pool = Pool("127.0.0.1", 9, ssl_context=None, connections=1, connect_timeout=5.0, read_timeout=60.0,
                    keepalive=25.0)
        await pool._slots.acquire()  # the one connection is busy
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                async with pool.exchange(REQUEST, "text/plain", collector()):
                    pass

    with caplog.at_level(logging.WARNING, logger="dataferry.client"):
        run(main(), "asyncio")
    assert "waiting for one of the pool's connections (0 of 1 connections in use)" in caplog.text


def test_stall_log_must_be_positive():
    with pytest.raises(Exception, match="stall_log"):
        LatencyProxy(("127.0.0.1", 1), stall_log=0)
