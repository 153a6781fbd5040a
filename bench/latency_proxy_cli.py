"""``dataferry latency-proxy``: run a :class:`LatencyProxy` from the command line.

``schema/_cli.py`` imports this module only when ``latency-proxy`` is the
subcommand asked for: ``add_cli_arguments(parser)`` declares the arguments,
``cli(args)`` parses the addresses, durations and rate, then serves until
SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from dataferry.schema import ConfigError

from dataferry.schema._aio import new_event_loop
from dataferry.schema._units import parse_duration, parse_rate, parse_size

from ._latency_proxy import Address, LatencyProxy, LinkOptions, format_address

__all__ = ["serve_proxy", "add_cli_arguments", "cli"]


async def serve_proxy(listen: Address, upstream: Address, link: LinkOptions, *, stall_log: float | None = None) -> None:
    """Run a proxy until cancelled, SIGINT or SIGTERM.

    Prints ``latency proxy listening on HOST:PORT -> upstream HOST:PORT (...)``
    once it is bound, so a caller that asked for port 0 can read the port.
    """
    async with LatencyProxy(upstream, link, listen, stall_log=stall_log) as proxy:
        host, port = proxy.address
        print(
            f"latency proxy listening on {format_address((host, port))} -> upstream "
            f"{format_address(proxy.upstream)} ({link.describe()})",
            flush=True,
        )
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
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
    stall_log = parse_duration(args.stall_log) or None
    if stall_log is not None and not logging.getLogger().handlers:  # the stall lines go to stderr, with our pid
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s latency-proxy[%(process)d]: %(message)s")
    loop = new_event_loop()
    try:
        loop.run_until_complete(serve_proxy(listen, upstream, link, stall_log=stall_log))
    except OSError as exc:
        raise ConfigError(str(exc)) from exc
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    return 0


def _parse_window(text: str) -> int | None:
    """``--window``: a size (``6MB``, ``512KiB``, plain bytes) or ``none``."""
    if text.strip().lower() in ("none", "unlimited"):
        return None
    return parse_size(text, "--window")
