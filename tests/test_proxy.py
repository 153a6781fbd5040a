"""The latency proxy on real loopback sockets: timing, integrity, flow control,
end of stream, and its small parsers.

Timing assertions keep lower bounds tight (a link must never be faster than
asked) and upper bounds loose (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

from proc_kit import alive, children, wait_gone

from dataferry.bench._latency_proxy import DEFAULT_MAX_BUFFER, LatencyProxy, LinkOptions, ProxyThread
from dataferry.bench.latency_proxy_cli import _parse_address, add_cli_arguments, cli, serve_proxy
from dataferry.schema._units import parse_duration, parse_rate
from dataferry.schema import ConfigError

_NO_UVLOOP = importlib.util.find_spec("uvloop") is None
#: the proxy must behave the same on both event loops
LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(_NO_UVLOOP, reason="uvloop not installed"))]


def run(coro, loop: str = "asyncio", timeout: float = 20.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    if loop == "uvloop":
        import uvloop

        return uvloop.run(bounded())
    return asyncio.run(bounded())


# -- upstream servers ---------------------------------------------------------


@contextlib.asynccontextmanager
async def upstream(handler):
    """An asyncio server on loopback; yields its address."""
    handlers: set[asyncio.Task] = set()

    async def tracked(reader, writer):
        handlers.add(asyncio.current_task())
        try:
            await handler(reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()
            handlers.discard(asyncio.current_task())

    server = await asyncio.start_server(tracked, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[:2]
    finally:
        server.close()
        for task in list(handlers):
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)
        await server.wait_closed()


async def echo(reader, writer):
    while data := await reader.read(1 << 16):
        writer.write(data)
        await writer.drain()


@contextlib.contextmanager
def threaded_echo():
    """A blocking echo server in threads, for sync callers; yields its address."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    stop = threading.Event()
    conns: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def serve(conn):
        with conn:
            try:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)
            except OSError:
                pass

    def accept():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            conns.append(conn)
            thread = threading.Thread(target=serve, args=(conn,), daemon=True)
            threads.append(thread)
            thread.start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield server.getsockname()[:2]
    finally:
        stop.set()
        acceptor.join()
        server.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join()


async def ping(reader, writer, payload: bytes = b"x") -> float:
    start = time.monotonic()
    writer.write(payload)
    await writer.drain()
    assert await reader.readexactly(len(payload)) == payload
    return time.monotonic() - start


async def close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


# -- timing -------------------------------------------------------------------


def test_round_trip_grows_by_twice_the_delay_for_a_sync_caller():
    with threaded_echo() as up, ProxyThread(up, LinkOptions(delay=0.05)) as proxy:
        with socket.create_connection(proxy.address) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rtts = []
            for _ in range(6):
                start = time.monotonic()
                sock.sendall(b"ping")
                got = b""
                while len(got) < 4:
                    got += sock.recv(4 - len(got))
                rtts.append(time.monotonic() - start)
    print(f"RTT at 50 ms one way: first {rtts[0] * 1e3:.1f} ms, then " + ", ".join(f"{r * 1e3:.1f}" for r in rtts[1:]))
    assert rtts[0] >= 0.200  # a fresh connection also pays the handshake
    warm = sorted(rtts[1:])
    assert warm[0] >= 0.100
    assert warm[len(warm) // 2] < 0.130


@pytest.mark.parametrize("loop", LOOPS)
def test_fresh_connection_pays_the_handshake_round_trip(loop):
    async def main():
        async with upstream(echo) as up:
            for handshake, low, high in ((True, 0.120, 0.200), (False, 0.060, 0.110)):
                async with LatencyProxy(up, LinkOptions(delay=0.03, handshake=handshake)) as proxy:
                    start = time.monotonic()
                    reader, writer = await asyncio.open_connection(*proxy.address)
                    await ping(reader, writer)
                    first = time.monotonic() - start
                    second = await ping(reader, writer)
                    await close_writer(writer)
                assert low <= first < high, (handshake, first)
                assert 0.060 <= second < 0.110

    run(main(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_pipe_not_stop_and_wait(loop):
    """200 back-to-back messages arrive about one delay after they were sent."""
    delay = 0.05

    async def main():
        arrived: list[float] = []
        done = asyncio.Event()

        async def sink(reader, writer):
            total = 0
            while data := await reader.read(1 << 16):
                total += len(data)
                arrived.append(time.monotonic())
                if total >= 200 * 100:
                    done.set()

        async with upstream(sink) as up, LatencyProxy(up, LinkOptions(delay=delay, handshake=False)) as proxy:
            reader, writer = await asyncio.open_connection(*proxy.address)
            start = time.monotonic()
            for _ in range(200):
                writer.write(b"m" * 100)
                await writer.drain()
            await done.wait()
            elapsed = time.monotonic() - start
            await close_writer(writer)
        print(f"200 messages through a 50 ms link: {elapsed * 1e3:.0f} ms, {len(arrived)} reads at the sink")
        assert delay <= arrived[0] - start
        assert elapsed < 1.0

    run(main(), loop)


def test_messages_spread_in_time_each_take_one_delay():
    """Sent 10 ms apart, each message arrives one delay after it was sent:
    reading goes on while earlier bytes are in flight."""
    delay = 0.05

    async def main():
        arrivals: dict[int, float] = {}

        async def sink(reader, writer):
            while data := await reader.readexactly(4):
                arrivals[struct.unpack("!I", data)[0]] = time.monotonic()

        async with upstream(sink) as up, LatencyProxy(up, LinkOptions(delay=delay, handshake=False)) as proxy:
            reader, writer = await asyncio.open_connection(*proxy.address)
            sent = {}
            for i in range(20):
                sent[i] = time.monotonic()
                writer.write(struct.pack("!I", i))
                await writer.drain()
                await asyncio.sleep(0.01)
            await asyncio.sleep(delay + 0.05)
            await close_writer(writer)
        lags = [arrivals[i] - sent[i] for i in range(20)]
        assert min(lags) >= delay
        assert sorted(lags)[10] < delay + 0.02

    run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_connections_do_not_wait_for_each_other(loop):
    async def main():
        async with upstream(echo) as up, LatencyProxy(up, LinkOptions(delay=0.02, handshake=False)) as proxy:
            conns = [await asyncio.open_connection(*proxy.address) for _ in range(20)]
            start = time.monotonic()
            rtts = await asyncio.gather(*(ping(r, w) for r, w in conns))
            elapsed = time.monotonic() - start
            for _, writer in conns:
                await close_writer(writer)
            assert proxy.stats.connections == 20
        assert min(rtts) >= 0.040
        assert elapsed < 20 * 0.040, elapsed  # 20 round trips one after another take at least that

    run(main(), loop)


# -- integrity and throughput -------------------------------------------------


@pytest.mark.parametrize("loop", LOOPS)
def test_jitter_never_reorders_bytes(loop):
    payload = random.Random(7).randbytes(20 << 20)

    async def main():
        async with upstream(echo) as up, LatencyProxy(up, LinkOptions(delay=0.005, jitter=0.004)) as proxy:
            reader, writer = await asyncio.open_connection(*proxy.address)

            async def send():
                rng = random.Random(8)
                view = memoryview(payload)
                pos = 0
                while pos < len(view):
                    step = rng.choice((1, 100, 1500, 65536, 300_000))
                    writer.write(view[pos : pos + step])
                    pos += step
                    await writer.drain()
                writer.write_eof()

            sender = asyncio.create_task(send())
            received = await reader.read(-1)
            await sender
            await close_writer(writer)
        assert len(received) == len(payload)
        assert received == payload

    run(main(), loop)


async def _upload(proxy_address, total: int) -> float:
    """Send ``total`` bytes, wait for the sink's byte count; return seconds."""
    chunk = bytes(1 << 20)
    reader, writer = await asyncio.open_connection(*proxy_address)
    start = time.monotonic()
    for _ in range(total // len(chunk)):
        writer.write(chunk)
        await writer.drain()
    writer.write_eof()
    (count,) = struct.unpack("!Q", await reader.readexactly(8))
    elapsed = time.monotonic() - start
    await close_writer(writer)
    assert count == total
    return elapsed


async def count_sink(reader, writer):
    total = 0
    while data := await reader.read(1 << 20):
        total += len(data)
    writer.write(struct.pack("!Q", total))
    await writer.drain()


@pytest.mark.parametrize("delay", [0.0, 0.02])
def test_bulk_throughput_is_not_stop_and_wait(delay):
    total = 200 << 20

    async def main():
        async with upstream(count_sink) as up, LatencyProxy(up, LinkOptions(delay=delay)) as proxy:
            elapsed = await _upload(proxy.address, total)
            stats = proxy.stats
        return elapsed, stats

    elapsed, stats = run(main())
    print(f"delay {delay * 1e3:.0f} ms: {total / elapsed / 1e6:.0f} MB/s (client, proxy and sink on one loop)")
    assert stats.bytes_up == total and stats.bytes_down == 8
    assert total / elapsed > 50e6


def test_rate_limits_bandwidth():
    total = 10 << 20

    async def main():
        async with upstream(count_sink) as up, LatencyProxy(up, LinkOptions(rate=20e6)) as proxy:
            return await _upload(proxy.address, total)

    elapsed = run(main())
    print(f"10 MiB at 20 MB/s: {elapsed:.2f} s")
    assert elapsed >= total / 20e6 * 0.95
    assert elapsed < 3.0


# -- flow control and end of stream -------------------------------------------


def test_backpressure_bounds_what_the_proxy_holds():
    cap = 1 << 20

    async def main():
        go = asyncio.Event()

        async def lazy_sink(reader, writer):
            await go.wait()
            await count_sink(reader, writer)

        async with upstream(lazy_sink) as up, LatencyProxy(up, LinkOptions(delay=0.01, max_buffer=cap)) as proxy:
            reader, writer = await asyncio.open_connection(*proxy.address)
            chunk = bytes(1 << 20)
            sent = 0
            with pytest.raises(asyncio.TimeoutError):
                while sent < 256 << 20:
                    writer.write(chunk)
                    sent += len(chunk)
                    await asyncio.wait_for(writer.drain(), 0.5)
            stalled = proxy.stats
            go.set()
            await writer.drain()
            writer.write_eof()
            (count,) = struct.unpack("!Q", await reader.readexactly(8))
            await close_writer(writer)
        return sent, stalled, count, proxy.stats

    sent, stalled, count, final = run(main())
    print(f"stalled after {sent >> 20} MiB sent; proxy held {stalled.buffered >> 10} KiB, peak {final.peak_buffered >> 10} KiB")
    assert sent < 128 << 20  # the sender was stopped, not buffered without end
    assert 0 < stalled.buffered <= cap
    assert final.peak_buffered <= cap
    assert count == sent and final.buffered == 0


@pytest.mark.parametrize("max_buffer", [1000, 64_000])
def test_a_cap_smaller_than_a_read_still_flows(max_buffer):
    payload = random.Random(max_buffer).randbytes(200_000)

    async def main():
        link = LinkOptions(delay=0.001, max_buffer=max_buffer)
        async with upstream(echo) as up, LatencyProxy(up, link) as proxy:
            reader, writer = await asyncio.open_connection(*proxy.address)
            writer.write(payload)
            writer.write_eof()
            received = await reader.read(-1)
            await close_writer(writer)
            assert proxy.stats.peak_buffered <= max_buffer
        assert received == payload

    run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_half_close_travels_both_ways(loop):
    delay = 0.02

    async def main():
        seen: dict[str, object] = {}

        async def server(reader, writer):
            writer.write(b"hello")
            writer.write_eof()  # the server is done talking first
            seen["request"] = await reader.read(-1)
            seen["eof_at"] = time.monotonic()

        async with upstream(server) as up, LatencyProxy(up, LinkOptions(delay=delay)) as proxy:
            reader, writer = await asyncio.open_connection(*proxy.address)
            assert await reader.read(-1) == b"hello"  # the server's EOF arrived
            writer.write(b"still talking")  # our half is still open
            await writer.drain()
            eof_sent = time.monotonic()
            writer.write_eof()
            await asyncio.sleep(0)
            while "eof_at" not in seen:
                await asyncio.sleep(0.005)
            await close_writer(writer)
            await asyncio.sleep(0.01)
            assert proxy.stats.active == 0
        assert seen["request"] == b"still talking"
        assert seen["eof_at"] - eof_sent >= delay

    run(main(), loop)


def _rst(sock_writer: asyncio.StreamWriter) -> None:
    sock = sock_writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock_writer.transport.abort()


@pytest.mark.parametrize("loop", LOOPS)
def test_a_reset_reaches_the_other_side_after_the_delay(loop):
    delay = 0.03

    async def main():
        outcome = asyncio.get_running_loop().create_future()

        async def server(reader, writer):
            try:
                data = await reader.read(-1)
            except ConnectionResetError:
                outcome.set_result(("reset", time.monotonic()))
            else:
                outcome.set_result((data, time.monotonic()))

        async with upstream(server) as up, LatencyProxy(up, LinkOptions(delay=delay, handshake=False)) as proxy:
            _, writer = await asyncio.open_connection(*proxy.address)
            writer.write(b"partial")
            await writer.drain()
            await asyncio.sleep(0.01)
            reset_at = time.monotonic()
            _rst(writer)
            kind, at = await outcome
            await asyncio.sleep(0.01)
            assert proxy.stats.active == 0 and proxy.stats.buffered == 0
        assert kind == "reset"
        assert at - reset_at >= delay

    run(main(), loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_refused_upstream_closes_the_client_and_the_proxy_keeps_serving(loop, caplog):
    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        address = sock.getsockname()[:2]
        try:
            async with LatencyProxy(address, LinkOptions(delay=0.01)) as proxy:
                reader, writer = await asyncio.open_connection(*proxy.address)
                start = time.monotonic()
                try:
                    assert await reader.read(10) == b""
                except ConnectionResetError:
                    pass
                assert time.monotonic() - start < 1.0
                await close_writer(writer)
                assert proxy.stats.refused == 1

                sock.listen()
                server = await asyncio.start_server(echo, sock=sock)
                try:
                    reader, writer = await asyncio.open_connection(*proxy.address)
                    assert await ping(reader, writer, b"again") >= 0.02
                    await close_writer(writer)
                finally:
                    server.close()
                    await server.wait_closed()
                assert proxy.stats.connections == 2 and proxy.stats.refused == 1
        finally:
            sock.close()
        return address

    with caplog.at_level(logging.WARNING, logger="dataferry.bench._latency_proxy"):
        host, port = run(main(), loop)
    assert f"cannot reach upstream {host}:{port}" in caplog.text


def test_close_resets_open_connections_twice_safely_and_leaves_no_tasks():
    async def main():
        with threaded_echo() as up:  # not asyncio: every task left would be the proxy's
            proxy = await LatencyProxy(up, LinkOptions(delay=0.05)).start()
            reader, writer = await asyncio.open_connection(*proxy.address)
            writer.write(b"x" * 100_000)  # in flight when the proxy closes
            await writer.drain()
            await asyncio.sleep(0.01)
            assert proxy.stats.active == 1 and proxy.stats.buffered > 0
            await proxy.close()
            await proxy.close()
            others = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
            assert all(t.get_coro().__name__ == "bounded" for t in others)  # run()'s own
            assert proxy.stats.active == 0 and proxy.stats.buffered == 0
            with contextlib.suppress(ConnectionResetError):
                assert await reader.read(-1) == b""
            await close_writer(writer)
            with pytest.raises(OSError):
                await asyncio.open_connection(*proxy.address)

    run(main())


def test_proxy_thread_close_is_idempotent_and_stops_its_thread():
    def proxy_threads():
        return [t for t in threading.enumerate() if t.name == "dataferry-latency-proxy"]

    with threaded_echo() as up:
        proxy = ProxyThread(up, LinkOptions(delay=0.001)).start()
        assert len(proxy_threads()) == 1
        with socket.create_connection(proxy.address) as sock:
            sock.sendall(b"abc")
            assert sock.recv(3) == b"abc"
        proxy.close()
        proxy.close()
        assert proxy_threads() == []
        with pytest.raises(RuntimeError):
            proxy.start()


def test_proxy_thread_reports_a_port_in_use():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        with pytest.raises(OSError, match="cannot listen on 127.0.0.1"):
            ProxyThread(("127.0.0.1", 9), LinkOptions(), listen=busy.getsockname()[:2]).start()


# -- options, parsers, CLI ------------------------------------------------------


@pytest.mark.parametrize(
    "text, seconds",
    [("50ms", 0.05), ("0.05", 0.05), ("1s", 1.0), ("200us", 200e-6), ("200µs", 200e-6), ("0", 0.0),
     (" 1.5 s ", 1.5), ("2e-3", 0.002), ("10MS", 0.01), (0.25, 0.25)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "ms", "-5ms", "5 minutes", "5m", "1h", "nan", "inf", "1e999", "5ms5", float("nan"), -1])
def test_parse_duration_refuses(text):
    with pytest.raises(ConfigError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    "text, rate",
    [("1gbit", 125e6), ("100mbit", 12.5e6), ("500kbit", 62.5e3), ("1Gbit", 125e6), ("10MB", 10e6),
     ("10MB/s", 10e6), ("1MiB", 1 << 20), ("2.5GB", 2.5e9), ("125000000", 125e6), ("8bit", 1.0), (1e6, 1e6)],
)
def test_parse_rate(text, rate):
    assert parse_rate(text) == pytest.approx(rate)


@pytest.mark.parametrize("text", ["", "fast", "100Mbps", "100mb", "10Gb", "0", "0mbit", "-1MB", "1e999", "MB"])
def test_parse_rate_refuses(text):
    with pytest.raises(ConfigError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize(
    "text, address",
    [("127.0.0.1:9042", ("127.0.0.1", 9042)), ("db.example:80", ("db.example", 80)), ("[::1]:9000", ("::1", 9000)),
     (":8080", ("127.0.0.1", 8080)), ("8080", ("127.0.0.1", 8080)), ("0.0.0.0:0", ("0.0.0.0", 0))],
)
def test_parse_address(text, address):
    assert _parse_address(text, "--listen", allow_port_zero=True) == address


@pytest.mark.parametrize("text", ["", "host", "host:", "::1:9000", "[::1]9000", "h:99999", "h:-1"])
def test_parse_address_refuses(text):
    with pytest.raises(ConfigError, match="--listen"):
        _parse_address(text, "--listen", allow_port_zero=True)


def test_upstream_port_zero_is_refused():
    with pytest.raises(ConfigError, match="port out of range"):
        _parse_address("127.0.0.1:0", "--upstream", allow_port_zero=False)


def test_link_options_validate_and_size_the_buffer():
    for bad in (dict(delay=-0.001), dict(jitter=float("inf")), dict(rate=0), dict(rate=-5.0), dict(max_buffer=0)):
        with pytest.raises(ConfigError):
            LinkOptions(**bad)
    assert LinkOptions().transparent and not LinkOptions(jitter=0.001).transparent
    assert LinkOptions(delay=0.05).buffer_cap == DEFAULT_MAX_BUFFER
    assert LinkOptions(delay=0.05, rate=125e6).buffer_cap == int(2 * 125e6 * 0.05)
    assert LinkOptions(rate=125e6).buffer_cap >= 4 * LinkOptions(rate=125e6).read_size
    assert LinkOptions(delay=0.05, max_buffer=1000).buffer_cap == 1000
    assert LinkOptions(max_buffer=1000).read_size == 1000
    assert LinkOptions(delay=0.05, jitter=0.005, rate=125e6, window=None).describe() == "delay 50ms, jitter 5ms, rate 125 MB/s"


def _cli_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dataferry latency-proxy")
    add_cli_arguments(parser)
    return parser.parse_args(argv)


def test_cli_arguments_and_bad_values():
    args = _cli_args("--upstream", "127.0.0.1:9042", "--delay", "50ms", "--jitter", "5ms", "--rate", "1gbit")
    assert (args.listen, args.upstream, args.delay, args.jitter, args.rate, args.no_handshake) == (
        "127.0.0.1:0", "127.0.0.1:9042", "50ms", "5ms", "1gbit", False)
    with pytest.raises(ConfigError, match="bad duration 'fifty'"):
        cli(_cli_args("--upstream", "127.0.0.1:9042", "--delay", "fifty"))
    with pytest.raises(ConfigError, match="--upstream"):
        cli(_cli_args("--upstream", "127.0.0.1", "--delay", "5ms"))
    with pytest.raises(ConfigError, match="rate"):
        cli(_cli_args("--upstream", "127.0.0.1:9042", "--rate", "100Mbps"))
    with pytest.raises(ConfigError, match="--processes must be at least 1, not 0"):
        cli(_cli_args("--upstream", "127.0.0.1:9042", "--processes", "0"))
    with pytest.raises(ConfigError, match="--rate with --processes > 1"):
        cli(_cli_args("--upstream", "127.0.0.1:9042", "--rate", "1gbit", "--processes", "2"))


def test_cli_reports_a_port_in_use():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{port}"):
            cli(_cli_args("--listen", f"127.0.0.1:{port}", "--upstream", "127.0.0.1:9"))


def test_serve_proxy_prints_its_address_and_serves_until_cancelled(capsys):
    async def main():
        async with upstream(echo) as up:
            task = asyncio.create_task(serve_proxy(("127.0.0.1", 0), up, LinkOptions(delay=0.01)))
            line = ""
            while "listening on" not in line:
                await asyncio.sleep(0.01)
                line += capsys.readouterr().out
            assert f"-> upstream {up[0]}:{up[1]} (delay 10ms, rate unlimited, window" in line
            host, port = line.split("listening on ")[1].split()[0].rsplit(":", 1)
            reader, writer = await asyncio.open_connection(host, int(port))
            assert await ping(reader, writer) >= 0.02
            await close_writer(writer)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    run(main())


_CLI_MAIN = """
import argparse, sys
from dataferry.bench.latency_proxy_cli import add_cli_arguments, cli
parser = argparse.ArgumentParser()
add_cli_arguments(parser)
sys.exit(cli(parser.parse_args(sys.argv[1:])))
"""


def test_cli_serves_until_sigterm_then_exits_cleanly():
    with threaded_echo() as up:
        proc = subprocess.Popen(
            [sys.executable, "-c", _CLI_MAIN, "--upstream", f"{up[0]}:{up[1]}", "--delay", "10ms"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            line = proc.stdout.readline()
            assert "latency proxy listening on 127.0.0.1:" in line, line + proc.stderr.read()
            port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
            with socket.create_connection(("127.0.0.1", port)) as sock:
                start = time.monotonic()
                sock.sendall(b"hi")
                assert sock.recv(2) == b"hi"
                assert time.monotonic() - start >= 0.02
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(10) == 0
                with contextlib.suppress(ConnectionResetError):
                    assert sock.recv(10) == b""  # the proxy closed (reset) our connection
        finally:
            if proc.poll() is None:
                proc.kill()
            out, err = proc.communicate()
        assert "Traceback" not in err


# -- several relay processes (--processes N) ----------------------------------------


def _accepted(pid: int, port: int) -> int:
    """Established TCP connections to local ``port`` (IPv4) that process ``pid`` holds."""
    with open("/proc/net/tcp") as fh:
        inodes = {f.split()[9] for f in list(fh)[1:]
                  if f.split()[1].endswith(f":{port:04X}") and f.split()[3] == "01"}
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            held.add(os.readlink(f"/proc/{pid}/fd/{fd}").removeprefix("socket:[").removesuffix("]"))
    return len(inodes & held)


@contextlib.contextmanager
def _proxy_processes(upstream, n: int, *extra: str):
    """``latency-proxy --processes n`` in front of ``upstream``: yields (Popen, port, relay pids)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CLI_MAIN, "--upstream", f"{upstream[0]}:{upstream[1]}", "--processes", str(n), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"in {n} processes" in line, line + proc.stderr.read()
        port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
        relays = children(proc.pid)
        assert len(relays) == n - 1
        yield proc, port, relays
    finally:
        for pid in [proc.pid, *(children(proc.pid) if proc.poll() is None else ())]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def test_several_relay_processes_share_the_port_each_delays_and_all_stop_on_sigterm():
    with threaded_echo() as up, _proxy_processes(up, 3, "--delay", "10ms") as (proc, port, relays):
        conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        try:
            for sock in conns:  # each connection is relayed with the delay, whichever process took it
                start = time.monotonic()
                sock.sendall(b"hi")
                assert sock.recv(2) == b"hi"
                assert time.monotonic() - start >= 0.02
            took = {pid: _accepted(pid, port) for pid in (proc.pid, *relays)}
            assert all(took.values()) and sum(took.values()) == len(conns), took  # the kernel spread them
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(10) == 0
            wait_gone(relays, 5)
        finally:
            for sock in conns:
                sock.close()
        assert "Traceback" not in proc.stderr.read()


def test_a_relay_process_that_dies_stops_the_proxy_and_its_relays_die_with_the_first():
    with threaded_echo() as up:
        with _proxy_processes(up, 3) as (proc, port, relays):
            os.kill(relays[0], signal.SIGKILL)
            assert proc.wait(10) == 1
            err = proc.stderr.read()
            assert f"latency proxy process {relays[0]} exited (killed by SIGKILL); stopping the rest" in err, err
            assert not alive(relays[1])
        with _proxy_processes(up, 2) as (proc, port, relays):  # the first killed: the relay goes with it
            proc.kill()
            proc.wait(10)
            wait_gone(relays, 5)


# -- the TCP window -------------------------------------------------------------


async def _download(proxy_address, total: int) -> float:
    """Ask the upstream for ``total`` bytes; seconds from the request to the last byte."""
    reader, writer = await asyncio.open_connection(*proxy_address)
    await asyncio.sleep(0.3)  # the handshake's round trip is paid before timing starts
    start = time.monotonic()
    writer.write(struct.pack("!Q", total))
    await writer.drain()
    got = 0
    while got < total:
        data = await reader.read(1 << 20)
        assert data, f"stream ended after {got} of {total} bytes"
        got += len(data)
    elapsed = time.monotonic() - start
    await close_writer(writer)
    return elapsed


async def bulk_source(reader, writer):
    (total,) = struct.unpack("!Q", await reader.readexactly(8))
    chunk = bytes(1 << 20)
    while total > 0:
        writer.write(chunk[: min(total, len(chunk))])
        total -= min(total, len(chunk))
        await writer.drain()
    writer.close()


@pytest.mark.parametrize("window", [None, 2 << 20], ids=["kernel-default", "2MiB"])
def test_one_connection_carries_at_most_window_per_round_trip(window):
    """Issue 12: through the proxy at 100 ms RTT, one long response moves no
    more than window / RTT, as over a real long path; with a small window the
    proxy itself is not what limits it."""
    link = LinkOptions(delay=0.05) if window is None else LinkOptions(delay=0.05, window=window)
    w = link.window
    total = 4 * w

    async def main():
        async with upstream(bulk_source) as up, LatencyProxy(up, link) as proxy:
            return await _download(proxy.address, total)

    elapsed = run(main())
    ceiling = w / 0.1
    print(f"window {w >> 20} MiB at 100 ms: {total / elapsed / 1e6:.1f} MB/s (ceiling {ceiling / 1e6:.1f} MB/s)")
    assert total / elapsed <= 1.1 * ceiling
    if window is not None:
        assert total / elapsed >= 0.5 * ceiling


def test_window_option_and_flag():
    with pytest.raises(ConfigError, match="window"):
        LinkOptions(window=0)
    with open("/proc/sys/net/ipv4/tcp_rmem") as f:
        assert LinkOptions().window == int(f.read().split()[2])
    assert "window 2 MiB" in LinkOptions(delay=0.01, window=2 << 20).describe()
