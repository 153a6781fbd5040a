"""Check the latency proxy on loopback: round-trip time and bulk throughput.

    python -m dataferry.bench.proxy_check [--delays 0,20ms,50ms] [--size 1GB] [--loop uvloop]

Three processes, so the numbers are the proxy's and not the GIL's: an upstream
server (blocking sockets; it echoes, or counts what it is sent), the proxy
(``LatencyProxy`` on the chosen event loop), and this one, the client. For each
delay it prints the ping-pong round trip on a warm connection (it should be
2 × delay plus a little), the first round trip on a fresh connection (4 × delay:
the emulated handshake), the throughput of one bulk upload, and the proxy's
CPU time per GB relayed (steadier than throughput on a busy machine). The first row,
``direct``, skips the proxy: the loopback baseline of this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import resource
import socket
import statistics
import struct
import threading
import time

from dataferry.bench._latency_proxy import LatencyProxy, LinkOptions
from dataferry.schema._units import parse_duration, parse_rate

_ECHO, _SINK = b"E", b"S"


def _serve_client(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == _ECHO:
            while data := conn.recv(65536):
                conn.sendall(data)
        elif mode == _SINK:
            buf = memoryview(bytearray(1 << 20))
            total = 0
            while n := conn.recv_into(buf):
                total += n
            conn.sendall(struct.pack("!Q", total))


def _upstream(sock: socket.socket) -> None:
    with sock:
        while True:
            conn, _ = sock.accept()
            threading.Thread(target=_serve_client, args=(conn,), daemon=True).start()


def _proxy(upstream, link: LinkOptions, loop_kind: str, pipe) -> None:
    async def main() -> None:
        async with LatencyProxy(upstream, link) as proxy:
            pipe.send(proxy.address)
            await asyncio.get_running_loop().run_in_executor(None, pipe.recv)  # until told to stop
            usage = resource.getrusage(resource.RUSAGE_SELF)
            pipe.send(usage.ru_utime + usage.ru_stime)

    if loop_kind == "uvloop":
        import uvloop

        uvloop.run(main())
    else:
        asyncio.run(main())


def _ping(sock: socket.socket) -> float:
    start = time.perf_counter()
    sock.sendall(b"x")
    if sock.recv(1) != b"x":
        raise RuntimeError("echo server sent something else")
    return time.perf_counter() - start


def _measure(upstream, link: LinkOptions | None, loop_kind: str, size: int) -> dict:
    """Through a proxy with ``link``; ``None``: straight to the upstream."""
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.Process(target=_proxy, args=(upstream, link, loop_kind, child), daemon=True)
    if link is not None:
        proc.start()
    try:
        address = parent.recv() if link is not None else upstream
        with socket.create_connection(address) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(_ECHO)
            first = _ping(sock)
            rtts = [_ping(sock) for _ in range(20)]
        chunk = memoryview(bytes(1 << 20))
        with socket.create_connection(address) as sock:
            start = time.perf_counter()
            sock.sendall(_SINK)
            for _ in range(size // len(chunk)):
                sock.sendall(chunk)
            sock.shutdown(socket.SHUT_WR)
            (total,) = struct.unpack("!Q", sock.recv(8, socket.MSG_WAITALL))
            elapsed = time.perf_counter() - start
        cpu = 0.0
        if link is not None:
            parent.send("stop")
            cpu = parent.recv()
        return {
            "cpu_s_per_gb": cpu / (total / 1e9),
            "first_ms": first * 1e3,
            "rtt_ms": statistics.median(rtts) * 1e3,
            "rtt_max_ms": max(rtts) * 1e3,
            "mb_s": total / elapsed / 1e6,
            "seconds": elapsed,
        }
    finally:
        if link is not None:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="0,20ms,50ms", help="comma-separated one-way delays")
    parser.add_argument("--size", default="1GB", help="bytes per bulk upload, e.g. 1GB, 200MB")
    parser.add_argument("--rate", default=None, help="link rate, e.g. 1gbit (default: unlimited)")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    size = int(parse_rate(args.size))  # the same units: 1GB, 200MB, 512MiB
    rate = parse_rate(args.rate) if args.rate else None

    server = socket.create_server(("127.0.0.1", 0))
    upstream = server.getsockname()[:2]
    proc = multiprocessing.Process(target=_upstream, args=(server,), daemon=True)
    proc.start()
    server.close()
    try:
        print(f"loop {args.loop}, upload {size / 1e6:.0f} MB per delay")
        print(f"{'delay':>8} {'rtt':>9} {'rtt max':>9} {'fresh':>9} {'throughput':>12} {'proxy cpu':>12}")
        for text in ["direct", *args.delays.split(",")]:
            link = None if text == "direct" else LinkOptions(delay=parse_duration(text), rate=rate)
            r = _measure(upstream, link, args.loop, size)
            print(
                f"{text:>8} {r['rtt_ms']:7.1f}ms {r['rtt_max_ms']:7.1f}ms {r['first_ms']:7.1f}ms"
                f" {r['mb_s']:7.0f} MB/s {r['cpu_s_per_gb']:7.2f} s/GB",
                flush=True,
            )
    finally:
        proc.kill()
        proc.join()


if __name__ == "__main__":
    main()
