"""``dataferry serve``: run the data service near the store.

``add_cli_arguments(parser)`` fills the subcommand's parser and ``cli(args)``
runs it (the CLI in ``schema/cli/`` loads this module by name); heavy imports
happen in ``cli`` only. The socket is bound before the app starts, so
``--port 0`` works: ``dataferry serve: listening on http(s)://HOST:PORT``
names the real port. The app runs under :class:`~._protocol.Runner` on uvloop;
SIGTERM or SIGINT stops accepting, gives in-flight responses ``--grace``
seconds and closes the store (a signal during start-up is held, never fatal).
``--workers N`` (default: the usable cores) runs N servers on the one port
under a supervising parent (``_workers.py``); ``--workers 1`` is one process.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

__all__ = ["add_cli_arguments", "cli", "main"]

_STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    from dataferry.schema import DEFAULT_STORE_URL

    parser.add_argument("--store", default=DEFAULT_STORE_URL, metavar="URL", help="store URL (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8470, help="port; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--token-file", metavar="F", help="require 'Authorization: Bearer <token>' on /v1 and /metrics; F holds one token per line, all accepted (rotations)")
    parser.add_argument("--open-metrics", action="store_true", help="serve /metrics without the token")
    parser.add_argument("--tls-cert", metavar="C", help="PEM certificate chain: serve HTTPS (needs --tls-key)")
    parser.add_argument("--tls-key", metavar="K", help="PEM private key of --tls-cert")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="worker processes sharing the port (default: the cores this process may use)")
    parser.add_argument("--worker-timeout", type=float, default=20.0, metavar="S",
                        help="with --workers N: a worker whose loop has not run for S seconds (frozen) is killed and "
                             "replaced; 0: never (default: %(default)s)")
    parser.add_argument("--max-ids", type=int, default=4096, help="ids per batch request (default: %(default)s)")
    parser.add_argument("--max-concurrent", type=int, default=256, help="requests served at once (default: %(default)s)")
    parser.add_argument("--store-timeout", type=float, default=30.0, metavar="S", help="seconds per store call (default: %(default)s)")
    parser.add_argument("--body-timeout", type=float, default=10.0, metavar="S",
                        help="seconds for a request body to arrive whole, else 408 and the connection is closed (default: %(default)s)")
    parser.add_argument("--hold-timeout", type=float, default=300.0, metavar="S",
                        help="seconds a request may hold one of --max-concurrent slots, response included (default: %(default)s)")
    parser.add_argument("--grace", type=float, default=10.0, metavar="S", help="seconds in-flight responses get on SIGTERM (default: %(default)s)")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--no-access-log", action="store_true", help="do not log each request")


def ssl_context(cert: str, key: str):
    """A server-side TLS context (TLS 1.2+) for ``cert``/``key``; ConfigError naming the file."""
    import ssl

    from dataferry.schema import ConfigError

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate {cert!r} with key {key!r}: {exc}") from exc
    return ctx


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket (IPv4 or IPv6 by ``host``), SO_REUSEADDR so a
    restart can take the same port at once; ``reuse_port``: SO_REUSEPORT too,
    for the workers of ``--workers N``."""
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(info[4])
        sock.listen(1024)
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def cli(args: argparse.Namespace) -> int:
    from dataferry.schema import ConfigError

    workers = args.workers
    if workers is None:
        from ._workers import default_workers

        workers = default_workers()
    # with several workers, each line names the process that wrote it
    name = "%(name)s[%(process)d]" if workers > 1 else "%(name)s"
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s {name}: %(message)s")
    try:
        return _serve(args, workers)
    except ConfigError as exc:
        print(f"dataferry serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"dataferry serve: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1


def _serve(args: argparse.Namespace, workers: int) -> int:
    from dataferry.schema import ConfigError, parse_store_url, read_token_file

    from ._options import ServerOptions

    if workers < 1:
        raise ConfigError(f"--workers must be >= 1, not {workers}")
    if args.worker_timeout < 0:
        raise ConfigError(f"--worker-timeout must be >= 0, not {args.worker_timeout:g}")
    parse_store_url(args.store)  # a bad URL fails here, before binding
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    tls = ssl_context(args.tls_cert, args.tls_key) if args.tls_cert else None
    options = ServerOptions(
        token=read_token_file(args.token_file) if args.token_file else None,
        metrics_auth=not args.open_metrics,
        max_ids=args.max_ids,
        max_body_bytes=max(1 << 20, 8 * args.max_ids),
        max_concurrent=args.max_concurrent,
        store_timeout=args.store_timeout,
        body_timeout=args.body_timeout,
        hold_timeout=args.hold_timeout,
        shutdown_grace=args.grace,
    )
    if workers == 1:
        socks = [bind(args.host, args.port)]
    else:
        from ._workers import bind_shared

        socks = bind_shared(args.host, args.port, workers, bind)
    host, port = socks[0].getsockname()[:2]
    scheme = "https" if tls else "http"
    shown = f"[{host}]" if ":" in host else host
    # from the announcement on, SIGTERM/SIGINT wait (blocked) until a loop handles them (``_run``); the
    # parent of --workers N takes them with sigtimedwait, and its workers inherit them blocked
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    print(f"dataferry serve: listening on {scheme}://{shown}:{port}", flush=True)
    access_log = None if args.no_access_log else logging.getLogger("aiohttp.access")
    if workers == 1:
        _serve_one(args.store, options, socks[0], tls, access_log)
        return 0

    from ._workers import supervise

    try:
        return supervise(workers, socks, lambda sock, metrics_dir, beat: _serve_worker(
            args.store, options, sock, tls, access_log, metrics_dir, beat), timeout=args.worker_timeout)
    finally:
        for s in socks:
            s.close()


def _serve_one(store: str, options, sock: socket.socket, tls, access_log: logging.Logger | None,
               metrics_dir: str | None = None, started: Callable[[], None] | None = None,
               beat: Callable[[], None] | None = None) -> None:
    """The app on ``sock`` in this process, on uvloop, until SIGTERM or SIGINT; ``beat`` (a worker's):
    called from its loop every ``BEAT_EVERY`` seconds."""
    import asyncio

    from dataferry.schema import new_event_loop

    from ._app import every, make_app

    keep_freed_memory()
    app = make_app(store, options, metrics_dir=metrics_dir)
    if beat is not None:  # the parent's watchdog: from the store's opening (the contexts before) to cleanup
        from ._workers import BEAT_EVERY

        app.cleanup_ctx.append(every(BEAT_EVERY, beat))
    loop = new_event_loop()  # uvloop when installed
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(_run(app, sock, tls, access_log, options.shutdown_grace, started))
    finally:
        _close_loop(loop)


#: glibc's malloc: freed memory a serving process keeps (per arena) instead of giving it back at once,
#: and the size from which an allocation gets its own mapping
_TRIM_THRESHOLD = 64 << 20
_MMAP_THRESHOLD = 32 << 20  # glibc's largest


def keep_freed_memory() -> None:
    """Have glibc's malloc keep freed memory for the next sample's bytes.

    Every served sample is a blob of ~100 KB allocated (by SQLite, then as
    Python bytes) and freed a moment later. By default glibc gives a freed
    run of pages back to the kernel as soon as ~128 KB-1 MiB lie free at an
    arena's top (``madvise``/``munmap``), and the next blob takes them back,
    one zeroed page at a time: ~30 page faults and a clear per sample, a
    fifth of the server's CPU under load. Holding up to ``_TRIM_THRESHOLD``
    per arena ends that; the cost is that much RSS kept after a burst. A
    no-op where the C library is not glibc."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL(None)
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    libc.mallopt(m_trim_threshold, _TRIM_THRESHOLD)
    libc.mallopt(m_mmap_threshold, _MMAP_THRESHOLD)


def _serve_worker(store: str, options, sock: socket.socket, tls, access_log: logging.Logger | None,
                  metrics_dir: str, beat: Callable[[], None]) -> int:
    """One worker of ``--workers N``: its exit status (``EXIT_NOT_STARTED`` if
    it failed before serving); ``beat`` is called from its loop while it serves."""
    from ._workers import EXIT_NOT_STARTED

    serving = False

    def started() -> None:
        nonlocal serving
        serving = True

    try:
        _serve_one(store, options, sock, tls, access_log, metrics_dir, started, beat)
    except Exception:  # noqa: BLE001 - the parent is told by the exit status; the cause is logged here
        logging.getLogger("dataferry.server").exception("worker %d %s", os.getpid(),
                                                        "failed" if serving else "could not start")
        return 1 if serving else EXIT_NOT_STARTED
    return 0


async def _run(app, sock: socket.socket, tls, access_log: logging.Logger | None, grace: float,
               started: Callable[[], None] | None = None) -> None:
    """Serve ``app`` on ``sock`` until SIGTERM or SIGINT; then stop accepting,
    give in-flight responses ``grace`` seconds, and run the app's cleanup."""
    import asyncio

    from aiohttp import web

    from ._protocol import Runner

    runner = Runner(app, access_log=access_log, shutdown_timeout=grace)
    await runner.setup()
    try:
        await web.SockSite(runner, sock, ssl_context=tls, backlog=1024).start()
        if started is not None:
            started()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in _STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)  # one that came while starting is handled now
        await stop.wait()
    finally:
        await runner.cleanup()


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    import asyncio

    try:
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        asyncio.set_event_loop(None)
        loop.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dataferry serve", description="Run the dataferry data service.")
    add_cli_arguments(parser)
    return cli(parser.parse_args(argv))
