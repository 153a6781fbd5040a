"""``dataferry latency-proxy``: run a :class:`LatencyProxy` from the command line.

``schema/_cli.py`` imports this module only when ``latency-proxy`` is the
subcommand asked for: ``add_cli_arguments(parser)`` declares the arguments,
``cli(args)`` parses the addresses, durations and rate, then serves until
SIGINT or SIGTERM. ``--processes N`` relays in N processes (forked before any
event loop exists), each accepting on its own ``SO_REUSEPORT`` socket bound to
the one address, so one Python process's CPU does not cap a fast link; a
process that dies stops the rest, and they die with the first.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
import time

from dataferry.schema import ConfigError

from dataferry.schema._aio import new_event_loop
from dataferry.schema._units import parse_duration, parse_rate, parse_size
from dataferry.server._workers import _die_with, bind_shared
from dataferry.server.cli import bind

from ._latency_proxy import Address, LatencyProxy, LinkOptions, format_address

__all__ = ["serve_proxy", "add_cli_arguments", "cli"]


async def serve_proxy(listen: Address, upstream: Address, link: LinkOptions, *, stall_log: float | None = None,
                      sock: socket.socket | None = None, children: tuple[int, ...] = (), announce: bool = True) -> int:
    """Run a proxy until cancelled, SIGINT or SIGTERM; 0, or 1 when one of ``children`` exits first.

    Prints ``latency proxy listening on HOST:PORT -> upstream HOST:PORT (...)``
    once it is bound, so a caller that asked for port 0 can read the port
    (``announce=False``: silent, as the other processes of ``--processes N`` are).
    ``sock``: accept on this listening socket instead of ``listen``; ``children``:
    the other proxy processes, watched every half second.
    """
    async with LatencyProxy(upstream, link, listen, stall_log=stall_log, sock=sock) as proxy:
        host, port = proxy.address
        if announce:
            processes = f" in {len(children) + 1} processes" if children else ""
            print(
                f"latency proxy listening on {format_address((host, port))} -> upstream "
                f"{format_address(proxy.upstream)} ({link.describe()}){processes}",
                flush=True,
            )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        lost: list[str] = []

        def watch() -> None:
            for pid in children:
                gone, status = os.waitpid(pid, os.WNOHANG)
                if gone:
                    lost.append(f"latency proxy process {pid} exited ({_exit_status(status)}); stopping the rest")
                    stop.set()
                    return
            loop.call_later(0.5, watch)

        if children:
            watch()
        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
                installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass  # not the main thread, or no signals on this platform
        try:
            await stop.wait()
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)
        for line in lost:
            print(line, file=sys.stderr, flush=True)
        return 1 if lost else 0


def _exit_status(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"status {os.waitstatus_to_exitcode(status)}"


def _run(coro) -> int:
    loop = new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _fork_relays(socks: list[socket.socket], upstream: Address, link: LinkOptions,
                 stall_log: float | None) -> tuple[int, ...]:
    """Fork a proxy process for each of ``socks`` but the first (kept by this one); their pids."""
    parent, pids = os.getpid(), []
    for mine in socks[1:]:
        pid = os.fork()
        if pid == 0:  # a relay: serve on its socket until SIGTERM or the parent's end
            code = 1
            try:
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C stops the parent, which stops us
                _die_with(parent)
                for s in socks:
                    if s is not mine:
                        s.close()
                code = _run(serve_proxy(mine.getsockname()[:2], upstream, link, stall_log=stall_log, sock=mine,
                                        announce=False))
            except BaseException:  # noqa: BLE001 - reported, and the parent sees the exit
                logging.getLogger(__name__).exception("latency proxy process %d failed", os.getpid())
            finally:
                os._exit(code)
        pids.append(pid)
    return tuple(pids)


def _stop(pids: tuple[int, ...]) -> None:
    """SIGTERM each relay still running, then reap it (SIGKILL after 10 s)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for pid in pids:
        for _ in range(100):
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def _parse_address(text: str, what: str, *, allow_port_zero: bool) -> Address:
    """``HOST:PORT``, ``[IPV6]:PORT``, ``:PORT`` or ``PORT`` (host 127.0.0.1)."""
    text = text.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        valid = bool(sep) and ":" in host
    elif ":" in text:
        host, _, port = text.rpartition(":")
        valid = ":" not in host  # a bare IPv6 address needs its brackets
    else:
        host, port, valid = "", text, True
    if not (valid and port.isdigit()):
        raise ConfigError(f"bad {what} address {text!r}: expected HOST:PORT, [IPV6]:PORT or PORT")
    number = int(port)
    if not (0 if allow_port_zero else 1) <= number <= 65535:
        raise ConfigError(f"bad {what} address {text!r}: port out of range")
    return (host or "127.0.0.1", number)


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``dataferry latency-proxy``."""
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT",
                        help="address to listen on (default: 127.0.0.1 on a free port, printed at start)")
    parser.add_argument("--upstream", required=True, metavar="HOST:PORT", help="the server to forward to")
    parser.add_argument("--delay", default="0", metavar="DURATION",
                        help="one-way delay, e.g. 50ms (RTT grows by twice this)")
    parser.add_argument("--jitter", default="0", metavar="DURATION",
                        help="vary each chunk's delay within +/- this; order is kept")
    parser.add_argument("--rate", default=None, metavar="RATE",
                        help="bandwidth per direction, e.g. 1gbit, 100mbit or 50MB (default: unlimited)")
    parser.add_argument("--window", default=None, metavar="BYTES",
                        help="TCP window: bytes in flight per direction of a connection, e.g. 6MB "
                             "(default: the kernel's net.ipv4.tcp_rmem maximum; 'none': unlimited)")
    parser.add_argument("--no-handshake", action="store_true",
                        help="do not charge a fresh connection the TCP handshake's round trip")
    parser.add_argument("--processes", type=int, default=1, metavar="N",
                        help="relay in N processes sharing the listening port (SO_REUSEPORT), for links faster "
                             "than one Python process can copy; not with --rate (default: %(default)s)")
    parser.add_argument("--stall-log", default="10s", metavar="DURATION",
                        help="log (stderr) each connection whose request has had no byte back for this long, "
                             "and where the request is; 0: off (default: %(default)s)")


def cli(args: argparse.Namespace) -> int:
    """The body of ``dataferry latency-proxy``: serve until SIGINT or SIGTERM.

    Bad values, and an address it cannot listen on, raise :class:`ConfigError`
    (the ``dataferry`` command prints it and exits with status 2).
    """
    listen = _parse_address(args.listen, "--listen", allow_port_zero=True)
    upstream = _parse_address(args.upstream, "--upstream", allow_port_zero=False)
    link = LinkOptions(
        delay=parse_duration(args.delay),
        jitter=parse_duration(args.jitter),
        rate=None if args.rate is None else parse_rate(args.rate),
        handshake=not args.no_handshake,
        **({} if args.window is None else {"window": _parse_window(args.window)}),
    )
    processes = args.processes
    if processes < 1:
        raise ConfigError(f"--processes must be at least 1, not {processes}")
    if processes > 1 and link.rate is not None:
        raise ConfigError("--rate with --processes > 1: each process would shape only its own connections; "
                          "use one process for a rate")
    stall_log = parse_duration(args.stall_log) or None
    if stall_log is not None and not logging.getLogger().handlers:  # the stall lines go to stderr, with our pid
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s latency-proxy[%(process)d]: %(message)s")
    if processes == 1:
        try:
            return _run(serve_proxy(listen, upstream, link, stall_log=stall_log))
        except OSError as exc:
            raise ConfigError(str(exc)) from exc
    try:  # one SO_REUSEPORT socket each, as `dataferry serve --workers N` binds its workers'
        socks = bind_shared(*listen, processes, bind)
    except OSError as exc:
        raise ConfigError(f"latency proxy cannot listen on {listen[0]}:{listen[1]}: {exc.strerror or exc}") from exc
    children = _fork_relays(socks, upstream, link, stall_log)
    try:
        for s in socks[1:]:
            s.close()
        return _run(serve_proxy(socks[0].getsockname()[:2], upstream, link, stall_log=stall_log, sock=socks[0],
                                children=children))
    finally:
        _stop(children)


def _parse_window(text: str) -> int | None:
    """``--window``: a size (``6MB``, ``512KiB``, plain bytes) or ``none``."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    return parse_size(text, "--window")
