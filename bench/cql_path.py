"""The CQL path alone: a Loader reading ``cassandra://`` straight from the store.

``python -m dataferry.bench.cql_path [--images 2048] [--rtts 0,100] [--repeats 3] [--batch-size 256]
[--paths hot,driver] [--also concurrency=1024] [--proxy-window none]``
``python -m dataferry.bench.cql_path --read-path [--frames 2000] [--repeats 3]``

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

from ._common import announced, loader_epoch, prepared_store, table
from ._threadprof import thread_cpu

DATASET = "bench"


def _count_messages():
    """Hook the driver's send path: ``(sent, unhook)``; ``sent`` gets ``(time, kind)`` per message
    sent, kind "read" for a sample read (an EXECUTE binding a dataset and a bigint id)."""
    from cassandra.connection import Connection
    from cassandra.protocol import ExecuteMessage

    sent: list[tuple[float, str]] = []
    original = Connection.send_msg

    def send_msg(self, msg, *args, **kwargs):
        kind = type(msg).__name__
        if isinstance(msg, ExecuteMessage) and len(msg.query_params or ()) == 2 and len(msg.query_params[1]) == 8:
            kind = "read"
        sent.append((time.perf_counter(), kind))
        return original(self, msg, *args, **kwargs)

    Connection.send_msg = send_msg
    return sent, lambda: setattr(Connection, "send_msg", original)


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of each live thread of this process, by thread name (Linux: /proc/self/task)."""
    out: dict[str, float] = {}
    for name, cpu in thread_cpu(unnamed="other").values():
        out[name] = out.get(name, 0.0) + cpu
    return out


def measure(url: str, batch_size: int, path: str = "hot") -> dict:
    """One run in this process: a Loader on ``url``, one epoch (see the module docs); ``path``
    "driver" sends the sample reads through ``execute_async``, not the hot path."""
    import dataferry.client  # noqa: F401 - imported before the clock starts, as a training script would

    if path == "driver":
        from dataferry.schema.sources.cassandra import _store as _cassandra

        _cassandra._HOT = {}  # no statement is read on the hot path in this process

    i0 = time.perf_counter()
    sent, unhook = _count_messages()  # imports the driver (the Loader would, on creating it)
    import cassandra.cluster  # noqa: F401 - the rest of what opening a store imports

    def at_first():
        unhook()  # counted up to the first batch; the epoch's CPU is the Loader's alone
        threads0 = _thread_cpu()
        return lambda: {"threads": {k: v - threads0.get(k, 0.0) for k, v in _thread_cpu().items()}}

    r = loader_epoch(url, DATASET, batch_size, at_first=at_first)
    t0, t1, threads, samples = r.pop("t0"), r.pop("t1"), r.pop("threads"), r["samples"] - r["first_samples"]
    reads = [t for t, kind in sent if kind == "read"]
    before = [kind for t, kind in sent if t < (reads[0] if reads else t1)]

    def at(kind: str) -> float:
        return next((t - t0 for t, k in sent if k == kind), float("nan"))

    return {
        **r,
        "import_s": t0 - i0,  # the driver's import
        # when the first message of each kind was sent, from creating the Loader (see the RTT breakdown)
        "at_startup_s": at("StartupMessage"), "at_register_s": at("RegisterMessage"),
        "at_prepare_s": at("PrepareMessage"), "at_execute_s": at("ExecuteMessage"),
        "at_read_s": at("read"),
        "setup_requests": len(before),
        "connections": sum(1 for t, kind in sent if kind == "StartupMessage" and t < t1),
        # the driver's IO thread (libev's is "event_loop") and the engine's loop, per sample
        "io_us_per_sample": threads.get("event_loop", 0.0) / samples * 1e6 if samples else 0.0,
        "engine_us_per_sample": threads.get("dataferry-engine", 0.0) / samples * 1e6 if samples else 0.0,
    }


def _run_child(url: str, batch_size: int, path: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "dataferry.bench.cql_path", "--child", url, "--batch-size", str(batch_size),
         "--paths", path],
        capture_output=True, text=True, check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"measuring run failed (exit {out.returncode}): {out.stderr.strip()[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _proxy(stack: contextlib.ExitStack, address: tuple[str, int], rtt: float, window: str | None) -> tuple[str, int]:
    """The address of a latency-proxy process in front of ``address`` at ``rtt`` ms: the bench's link
    (``_links.ProxyLink``), or with its TCP window named (``--window``: bytes, or "none")."""
    if window is None:
        from ._links import Condition, ProxyLink

        return stack.enter_context(ProxyLink().emulate(Condition(rtt_ms=rtt)))(address)
    cmd = [sys.executable, "-m", "dataferry.schema.cli", "latency-proxy", "--listen", "127.0.0.1:0",
           "--upstream", f"{address[0]}:{address[1]}", "--delay", f"{rtt / 2:g}ms", "--window", window]
    return stack.enter_context(announced(cmd, "the latency proxy"))


def run(images: int, rtts: list[float], repeats: int, batch_size: int, paths: Sequence[str] = ("hot",),
        options: Sequence[str] = (), window: str | None = None) -> tuple[list[list[str]], list[list[str]], list[list[str]]]:
    """``(rows, phases, windows)``: the table's rows, when each step of the set-up began, and the engine's
    window over the run (medians). Each of ``options`` (store URL options, ``concurrency=1024``) adds a
    run of every link and path with them, interleaved, in rows named with them; ``window`` is the
    proxies' TCP window (None: the link's default, the kernel's ``tcp_rmem`` maximum)."""
    from ._loaders import with_options

    results: dict[str, list[dict]] = {}
    with prepared_store("cassandra", images, DATASET) as (url, address, report), contextlib.ExitStack() as stack:
        print(f"cql_path: {report.num_samples} images of {report.bytes_out / max(report.num_samples, 1) / 1e3:.0f} KB "
              f"mean in Cassandra 5.0 at {address[0]}:{address[1]}", file=sys.stderr, flush=True)
        routes = {"direct": address}
        for rtt in rtts:
            routes[f"proxy {rtt:g} ms"] = _proxy(stack, address, rtt, window)
        targets = {}  # row name -> (url, path)
        for (where, route), path, extra in itertools.product(routes.items(), paths, ("", *options)):
            name = ", ".join(x for x in (where, "driver path" if path == "driver" else "", extra) if x)
            targets[name] = (with_options(url, *route, **dict(_pairs(extra))), path)
        for repeat in range(repeats):
            for name, (target, path) in targets.items():
                r = _run_child(target, batch_size, path)
                results.setdefault(name, []).append(r)
                print(f"  {name:<26} run {repeat + 1}: first batch {r['first_batch_s']:.3f} s, "
                      f"{r['setup_requests']} set-up requests, {r['connections']} connections, "
                      f"{r['total_per_s']:,.0f} samples/s from creating the Loader "
                      f"({r['samples_per_s']:,.0f}/s after the first batch), {r['cpu_us_per_sample']:.1f} us CPU/sample",
                      file=sys.stderr, flush=True)
    rows, phases, windows = [], [], []
    for name, runs in results.items():
        def med(key):
            return statistics.median(r[key] for r in runs)

        phases.append([name, f"{med('import_s') * 1e3:.0f}", *(
            f"{med(key) * 1e3:.0f}" for key in ("at_startup_s", "at_register_s", "at_prepare_s", "at_execute_s",
                                                 "at_read_s", "first_batch_s"))])

        rtt = float(name.split()[1]) if name.startswith("proxy") else 0.0  # "proxy 100 ms[, driver path][, opts]"
        # the same path and options at 0 ms through the proxy, run for run (the repeats are interleaved)
        base = results.get(name.replace(f"proxy {rtt:g} ms", "proxy 0 ms", 1)) if rtt else None
        ratio = statistics.median(r["total_per_s"] / b["total_per_s"] for r, b in zip(runs, base)) if base else None
        rows.append([
            name, f"{med('first_batch_s'):.3f}", f"{med('first_batch_s') * 1e3 / rtt:.1f}" if rtt else "-",
            f"{med('setup_requests'):.0f}", f"{med('connections'):.0f}", f"{med('total_per_s'):,.0f}",
            "-" if ratio is None else f"{ratio:.2f}", f"{med('samples_per_s'):,.0f}",
            f"{med('cpu_us_per_sample'):.1f}", f"{med('io_us_per_sample'):.0f}", f"{med('engine_us_per_sample'):.0f}",
            f"{med('setup_cpu_ms'):.0f}",
        ])
        windows.append([name, f"{med('requests'):.0f}", f"{med('ids_per_request'):.1f}", f"{med('mean_inflight'):.1f}",
                        f"{med('latency_ms'):.0f}", *(f"{med(k):.2f}" for k in (
                            "window_full_share", "budget_full_share", "wait_share"))])
    return rows, phases, windows


def _pairs(options: str) -> list[tuple[str, str]]:
    """``"a=1&b=2"`` -> ``[("a", "1"), ("b", "2")]``."""
    return [tuple(kv.split("=", 1)) for kv in options.split("&") if kv]


def _read_path_once(conn, handle_read, frames: int, buffer: int | None = None, size: int = 110_000) -> float:
    """CPU seconds of this thread per frame for ``handle_read`` on ``conn`` (see the module docs)."""
    import os
    import select
    import socket
    import struct
    import threading

    header = struct.Struct(">BBhBi")
    frame = header.pack(0x80 | conn.protocol_version, 0, 5, 0x08, size) + os.urandom(size)
    blob = frame * 100
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    if buffer is not None:  # as a long link's socket buffers grow (Linux autotunes them up to tcp_rmem's max)
        for sock in (ours, theirs):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer)
    got = [0]
    conn.process_msg = lambda header, body: got.__setitem__(0, got[0] + 1)
    original, conn._socket = conn._socket, ours
    writer = threading.Thread(target=lambda: [theirs.sendall(blob) for _ in range(frames // 100)])
    try:
        writer.start()
        c0 = time.thread_time()
        while got[0] < frames // 100 * 100:
            select.select([ours], [], [], 1.0)
            handle_read(conn, None, 0)
        return (time.thread_time() - c0) / got[0]
    finally:
        writer.join()
        conn._socket = original
        del conn.process_msg
        ours.close()
        theirs.close()


def read_path(frames: int, repeats: int) -> list[list[str]]:
    import tempfile

    from cassandra.io.libevreactor import LibevConnection

    from dataferry.schema import parse_store_url
    from dataferry.schema.sources.cassandra import _connect

    from ._devcassandra import DevCassandra

    with tempfile.TemporaryDirectory(prefix="dataferry-bench-") as tmp, DevCassandra(tmp) as server:
        cluster, session, _ = _connect.open_cluster(parse_store_url(server.url("bench")))
        try:
            conn = next(c for c in list(cluster.connection_class.opened)
                        if not (c.is_control_connection or c.is_closed))
            readers = {
                "the driver's (LibevConnection.handle_read)": LibevConnection.handle_read,
                "dataferry's (_hot._frame_reader)": type(conn).handle_read,
            }
            rows = []
            for buffer in (None, 4 << 20):
                for name, handle_read in readers.items():
                    if buffer and handle_read is LibevConnection.handle_read:
                        rows.append([name, "4 MiB", "seconds: a backlog's frames copied n^2/2 times", "-"])
                        continue
                    t = statistics.median(_read_path_once(conn, handle_read, frames, buffer) for _ in range(repeats))
                    rows.append([name, "4 MiB" if buffer else "default", f"{t * 1e6:.1f}", f"{0.11 / t / 1e3:.2f}"])
        finally:
            _connect.shutdown(cluster)
        del session
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.cql_path", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--rtts", default="0,100", help="RTTs in ms through the latency proxy, comma-separated")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--paths", default="hot",
                   help="sample reads on the store's hot path and/or through the driver's execute_async: hot,driver")
    p.add_argument("--also", action="append", default=[], metavar="OPTIONS",
                   help="store URL options (e.g. concurrency=1024); every link is also run with them, interleaved")
    p.add_argument("--proxy-window", metavar="BYTES",
                   help="the latency proxies' TCP window per connection and direction, e.g. 128MB or none "
                        "(default: the kernel's tcp_rmem maximum)")
    p.add_argument("--read-path", action="store_true", help="measure one connection's read side alone")
    p.add_argument("--frames", type=int, default=2000, help="110 KB frames per --read-path run")
    p.add_argument("--child", metavar="URL", help=argparse.SUPPRESS)  # one measuring run, JSON on stdout
    args = p.parse_args(argv)
    if args.read_path:
        rows = read_path(args.frames, args.repeats)
        print(f"median of {args.repeats} runs; {args.frames} frames of 110 KB, protocol v4, libev")
        print(table(["reader", "socket buffers", "CPU us per frame", "GB/s of one core"], rows))
        return 0
    if args.child:
        print(json.dumps(measure(args.child, args.batch_size, args.paths)))
        return 0
    rtts = [float(x) for x in args.rtts.split(",") if x.strip()]
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    if not paths or set(paths) - {"hot", "driver"}:
        p.error(f"--paths: {args.paths!r}: name hot, driver or both")
    for extra in args.also:
        if not _pairs(extra) or any(len(kv) != 2 or not kv[0] for kv in _pairs(extra)):
            p.error(f"--also: {extra!r}: store URL options, key=value&key=value")
    rows, phases, windows = run(args.images, rtts, args.repeats, args.batch_size, paths, args.also,
                                args.proxy_window)
    print(f"median of {args.repeats} runs; {args.images} images, batch {args.batch_size}; the proxies' TCP window "
          f"{args.proxy_window or 'the default (tcp_rmem max)'}")
    print(table(["link", "first batch s", "first batch / RTT", "set-up requests", "connections",
                 "samples/s from creating the Loader", "of proxy 0 ms", "samples/s after the first batch",
                 "CPU us/sample",
                 "of which driver IO thread", "engine thread", "set-up CPU ms"], rows))
    print("\nms from creating the Loader to the first message of each step (the driver's import is before it)")
    print(table(["link", "driver import ms", "STARTUPs", "REGISTER (control)", "PREPAREs", "split read",
                 "first sample read", "first batch"], phases))
    print("\nthe engine's window over the run, from creating the Loader (Loader.stats(): shares of the time)")
    print(table(["link", "requests", "ids per request", "mean in flight", "request latency ms", "window full",
                 "byte budget full", "consumer waited"], windows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
