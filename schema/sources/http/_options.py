"""HttpOptions: how :class:`HttpSource` talks to the data service; the URL and TLS
context made from them (``base_url``, ``ssl_context``)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from yarl import URL

from ..._errors import ConfigError, check as _check

from .._tls import client_context
from ._buffers import ARENA

__all__ = ["HttpOptions", "base_url", "ssl_context"]


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """How :class:`HttpSource` talks to the data service."""

    #: keep-alive connections in the pool (requests in flight at once)
    connections: int = 128
    #: ids per batch request the engine should send (``preferred_request_size``).
    #: Each request in flight has its own connection, and one connection carries
    #: at most its TCP window per round trip: 32 x 110 KB = 3.5 MB stays under
    #: Linux's usual 6 MiB window (deploy/TRAINING.md, "TCP windows")
    request_size: int = 32
    #: seconds to open a TCP (and TLS) connection
    connect_timeout: float = 10.0
    #: seconds of silence allowed while reading a response
    read_timeout: float = 60.0
    #: seconds an idle pooled connection may be reused: below the server's 75 s
    #: (``keepalive_timeout``), so the client, not the server, closes idle
    #: connections (no reuse races), and below the idle timeout of the
    #: middleboxes seen dropping flows silently (a 30 s relay): a pause longer
    #: than this costs a new handshake per connection, never a dead one
    keepalive: float = 25.0
    #: seconds a request waits for its answer's first byte before it is sent
    #: again on a new connection (a middlebox may have dropped an idle flow
    #: without a word; a frozen server process behind a shared port accepts
    #: connections it never answers); the deadline is 4 x the slowest first
    #: byte of the last 64 answers when that is larger, so a service that
    #: queues (its ``queue_timeout`` is 2 s) or a long link is not cut short
    #: once seen, and it doubles at each of a request's tries (the fourth has
    #: none). A request's own size hardly moves its first byte: its body is 8
    #: bytes an id, and the server answers once the first sample is read.
    #: Taken for dead wrongly, a request costs a duplicate and a handshake (a
    #: service slower than this to its first answers: raise it); 1.5 s keeps a
    #: dead connection's stall under 2 s
    first_byte_timeout: float = 1.5
    #: ask the service for each sample's stored checksum and check the bytes against it as
    #: they arrive (in the cache, after the socket's copy); a mismatch is ``CorruptSample``.
    #: Off: records come without checksums and nothing is checked (a Loader opening a URL
    #: with ``ErrorPolicy(verify=False)`` turns it off)
    checksums: bool = True
    #: PEM bundle to verify the server's certificate with (default: system CAs)
    ca_file: str | None = None
    #: verify the server's certificate and host name (off only for testing)
    verify: bool = True
    #: read the bearer token from this file when ``open`` is given none: the
    #: server's token file (one per line, # comments); the first token is sent,
    #: and the file is read again when the service refuses it (a rotation)
    token_file: str | None = None
    #: bytes of received samples a response may hold, not yet taken by the
    #: engine, before its socket is paused (backpressure to the server). Judged
    #: once the loop has run what was ready (the engine, woken by the read,
    #: among it), before the next read: a consumer that keeps up is never paused,
    #: one that falls behind is, and may hold one read's worth more
    read_buffer: int = 1 << 20
    #: the largest record accepted (guards memory against a broken server)
    max_record_bytes: int = 1 << 30
    #: bytes of free receive arenas kept for reuse (see ``_buffers.py``). Free arenas
    #: were all in use at once before, so keeping them never raises the process's peak;
    #: the default is the default ``Prefetch.max_bytes``: below what a loader's arenas
    #: swing by, each arena given back is soon made again (a page fault per 4 KiB)
    spare_buffers: int = 512 << 20
    #: bytes of one receive arena: samples are read many at a time into arenas
    #: (``_buffers.py``); one sample kept after its batch keeps its arena from reuse
    arena: int = ARENA
    #: seconds ``derive_split`` waits for the service's derive job in all (its polls included)
    derive_timeout: float = 3600.0

    def __post_init__(self) -> None:
        _check(self.connections >= 1, f"connections must be >= 1, not {self.connections}")
        _check(self.request_size >= 1, f"request_size must be >= 1, not {self.request_size}")
        _check(min(self.connect_timeout, self.read_timeout, self.keepalive, self.derive_timeout,
                   self.first_byte_timeout) > 0,
               "timeouts must be > 0")
        _check(self.read_buffer >= 1 << 14, "read_buffer must be at least 16 KiB")
        _check(self.max_record_bytes >= 1 << 16, "max_record_bytes must be at least 64 KiB")
        _check(self.spare_buffers >= 0, f"spare_buffers must be >= 0, not {self.spare_buffers}")
        _check(self.arena >= 1 << 16, f"arena must be at least 64 KiB, not {self.arena}")


def base_url(url: str) -> str:
    try:
        u = URL(url)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"invalid data service URL {url!r}: {exc}") from exc
    _check(u.scheme in ("http", "https") and bool(u.host), f"data service URL {url!r} must be http(s)://host[:port]")
    _check(not u.query_string and not u.fragment, f"data service URL {url!r} must have no query or fragment")
    _check(u.user is None and u.password is None, f"data service URL {url!r}: pass the token with token=, not in the URL")
    return str(u.with_path(u.path.rstrip("/"))).rstrip("/")


def ssl_context(options: HttpOptions) -> ssl.SSLContext:
    return client_context(options.ca_file, verify=options.verify, what=f"cannot load CA file {options.ca_file!r}")
