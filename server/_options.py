"""ServerOptions: the data service's limits and its token, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field

# read_token_file re-exported: one reader for both sides
from dataferry.schema import check as _check, read_token_file, valid_token

__all__ = ["ServerOptions", "read_token_file"]


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """How the server guards itself. Every field has a safe default.

    Requests beyond ``max_concurrent`` (on ``/v1/...``) wait in line up to
    ``queue_timeout`` seconds for a slot, then get 503 with ``Retry-After``.
    ``store_timeout`` bounds each catalog call and, during a batch fetch, the
    wait for the store's next sample. ``send_timeout`` bounds one write to a
    client that stopped reading; the connection is then dropped.

    A request's body must arrive whole within ``body_timeout`` seconds, and it
    is read before the request takes a slot: a client that stalls mid-upload
    gets 408 and its connection is closed, and never holds a slot. A request
    holds its slot (queue wait excluded, the whole response included) for at
    most ``hold_timeout`` seconds; then it is ended: 503 ``hold_timeout`` if
    nothing was sent yet, else its connection is dropped mid-stream.
    """

    #: bearer token required on /v1/... (and /metrics when metrics_auth); None: no
    #: auth. Several tokens (a tuple) are all accepted: that is how a rotation
    #: goes without a failed request (old + new, then new alone).
    token: str | tuple[str, ...] | None = field(default=None, repr=False)
    #: whether /metrics needs the token too (healthz and readyz never do)
    metrics_auth: bool = True
    #: ids per batch fetch request
    max_ids: int = 4096
    #: request body bytes (aiohttp's client_max_size)
    max_body_bytes: int = 1 << 20
    #: /v1/... requests being served at once
    max_concurrent: int = 256
    queue_timeout: float = 2.0
    #: seconds for a request's whole body to arrive (before it takes a slot)
    body_timeout: float = 10.0
    #: seconds a /v1/... request may hold its slot, the whole response included
    hold_timeout: float = 300.0
    store_timeout: float = 30.0
    #: the catalog call behind /readyz
    ready_timeout: float = 2.0
    send_timeout: float = 60.0
    #: frames are coalesced into writes of up to this many bytes
    write_chunk: int = 1 << 20
    #: per request: encoded frames waiting for the client before the store is paused
    buffer_bytes: int = 4 << 20
    #: seconds a dataset seen to exist is trusted without asking the store again
    catalog_ttl: float = 10.0
    #: seconds in-flight responses get to finish on SIGTERM
    shutdown_grace: float = 10.0

    @property
    def tokens(self) -> tuple[str, ...]:
        """Every accepted token (empty: no auth)."""
        if self.token is None:
            return ()
        return (self.token,) if isinstance(self.token, str) else self.token

    def __post_init__(self) -> None:
        if self.token is not None:
            tokens = tuple(self.token) if isinstance(self.token, (tuple, list)) else (self.token,)
            _check(bool(tokens), "token must not be an empty list")
            for t in tokens:
                _check(valid_token(t), "token must be non-empty printable ASCII without spaces")
            object.__setattr__(self, "token", tokens[0] if len(tokens) == 1 else tokens)
        _check(self.max_ids >= 1, f"max_ids must be >= 1, not {self.max_ids}")
        _check(self.max_body_bytes >= 8 * self.max_ids, "max_body_bytes must hold max_ids binary ids (8 bytes each)")
        _check(self.max_concurrent >= 1, f"max_concurrent must be >= 1, not {self.max_concurrent}")
        for name in ("queue_timeout", "body_timeout", "hold_timeout", "store_timeout", "ready_timeout", "send_timeout",
                     "shutdown_grace"):
            _check(getattr(self, name) > 0, f"{name} must be > 0")
        _check(self.catalog_ttl >= 0, "catalog_ttl must be >= 0")
        _check(self.write_chunk >= 1 << 12, "write_chunk must be at least 4 KiB")
        _check(self.buffer_bytes >= self.write_chunk, "buffer_bytes must be >= write_chunk")
