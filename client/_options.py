"""Small frozen option objects for the loader; validated when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from dataferry.schema import check as _check

__all__ = ["PlanOptions", "Prefetch", "Retry", "Hedge", "ErrorPolicy"]


@dataclass(frozen=True, slots=True)
class PlanOptions:
    """How an epoch's order and this rank's shard are chosen.

    ``rank``/``world_size`` default (when None) to torch.distributed when it is
    initialized, else the ``RANK``/``WORLD_SIZE`` variables torchrun sets, else
    0 and 1. Explicit values always win.

    ``uneven``: when the sample count is not a multiple of ``world_size``,
    ``"pad"`` repeats the first samples of the epoch's permutation so every
    rank gets ``ceil(N / world_size)`` (some samples are seen twice per
    epoch, as torch's DistributedSampler does); ``"drop"`` drops the tail of
    the permutation so every rank gets ``floor(N / world_size)`` (a different
    few samples are left out each epoch).
    """

    seed: int = 0
    shuffle: bool = True
    rank: int | None = None
    world_size: int | None = None
    uneven: Literal["pad", "drop"] = "pad"

    def __post_init__(self) -> None:
        _check(self.uneven in ("pad", "drop"), f"uneven must be 'pad' or 'drop', not {self.uneven!r}")
        if self.world_size is not None:
            _check(self.world_size >= 1, f"world_size must be >= 1, not {self.world_size}")
        if self.rank is not None:
            _check(self.rank >= 0, f"rank must be >= 0, not {self.rank}")
            if self.world_size is not None:
                _check(self.rank < self.world_size, f"rank {self.rank} out of range for world_size {self.world_size}")


@dataclass(frozen=True, slots=True)
class Prefetch:
    """The window of requests in flight, the request size and the memory budget.

    With ``tune`` (the default) the engine sizes both from the link it
    measures, and logs each decision to the ``dataferry.client`` logger:

    * the window: requests in flight cover ``2 x`` the bandwidth-delay
      product, learned as BBR does (the highest delivery rate of recent round
      trips x the lowest recent request latency). It starts with enough
      requests to fill the first batch in one round trip, grows 2.89x per
      round trip (BBR's start-up gain) while the delivery rate keeps up, then
      drains the queue the start-up left at a bottleneck (BBR's drain), and
      shrinks when answers queue at the bottleneck (latency above the lowest
      by more than a few requests' worth, as TCP Vegas does, judged (tuned)
      by the lowest latency of this round trip and the last, so a tail of
      late answers is no queue) or a request fails;
    * the request size: small at first (the first batch spread over several
      requests, for a short time to first batch), then doubled while a
      doubling cuts the engine's measured CPU per sample by more than 5%
      (the per-request overhead against the per-sample cost).

    Every knob overrides: ``request_size`` fixes the ids per request,
    ``max_inflight`` caps the window (None: bounded by the link, the byte
    budget and 4096 requests), ``initial_inflight`` sets its start.
    ``tune=False`` gives the fixed scheme: ``initial_inflight`` (2) requests,
    one more per answer up to ``max_inflight`` (64), of the source's
    ``preferred_request_size`` (else 32) ids.
    ``max_bytes``, the byte budget, caps bytes in flight (estimated from the
    sizes seen) plus bytes ready but not yet taken by the consumer. None (the
    default) lets it follow the link: it starts at ``START_BYTES`` (512 MiB)
    and grows by half, at most once a round trip, while the training loop
    waits on the loader with the budget holding requests back (a fast consumer
    over a long round trip needs rate x RTT in flight), up to ``CEILING_BYTES``
    (2 GiB); it never shrinks. A number fixes it: memory is then bounded by it.
    """

    #: where a budget that follows the link (``max_bytes=None``) starts, and the most it grows to
    START_BYTES: ClassVar[int] = 512 << 20
    CEILING_BYTES: ClassVar[int] = 2 << 30

    max_inflight: int | None = None
    initial_inflight: int | None = None
    max_bytes: int | None = None
    request_size: int | None = None
    #: assumed bytes per sample until the first answers arrive
    sample_bytes_hint: int = 128 << 10
    tune: bool = True

    def __post_init__(self) -> None:
        _check(self.max_inflight is None or self.max_inflight >= 1, "max_inflight must be >= 1 (or None: no cap)")
        _check(self.initial_inflight is None or 1 <= self.initial_inflight <= self.inflight_cap,
               "initial_inflight must be in [1, max_inflight]")
        _check(self.max_bytes is None or self.max_bytes >= 1 << 16,
               "max_bytes must be at least 64 KiB (or None: it follows the link)")
        _check(self.request_size is None or self.request_size >= 1, "request_size must be >= 1")
        _check(self.sample_bytes_hint >= 1, "sample_bytes_hint must be >= 1")

    @property
    def start_bytes(self) -> int:
        """The byte budget at the start: ``max_bytes``, else ``START_BYTES``."""
        return self.START_BYTES if self.max_bytes is None else self.max_bytes

    @property
    def ceiling_bytes(self) -> int:
        """The most the byte budget may be: ``max_bytes``, else ``CEILING_BYTES``. Memory is bounded by it."""
        return self.CEILING_BYTES if self.max_bytes is None else self.max_bytes

    @property
    def inflight_cap(self) -> int:
        """The most requests ever in flight: ``max_inflight``, else 4096 tuned or 64 fixed."""
        if self.max_inflight is not None:
            return self.max_inflight
        return 4096 if self.tune else 64


@dataclass(frozen=True, slots=True)
class Retry:
    """Timeouts, retries and the circuit breaker: how a store outage is ridden out.

    The retry budget is a time, not a count: a sample that fails (refused,
    reset, timed out) is tried again, with exponential backoff and jitter,
    until it has been failing for ``deadline`` seconds; only then does
    :class:`ErrorPolicy` decide. The default rides out a server restart, a
    Cassandra node restart or a rolling upgrade unnoticed. ``attempts``, when
    set, also caps the tries per sample.

    Before try k (k >= 2) of a sample the engine waits
    ``min(backoff * 2**(k-2), max_backoff)`` scaled by a random factor in
    ``[1 - jitter, 1]``. Once ``breaker_after`` requests in a row have failed
    with no answer in between, the breaker opens: the engine stops flooding the
    store and sends one request at a time (a probe), spaced by the same
    backoff, until one is answered. ``timeout`` bounds one request.
    Catalog reads (the split's id list) are retried the same way.
    The deadline covers transient failures only: a
    :class:`~dataferry.schema.PermanentStoreError` (a certificate that fails
    verification, a refused token, the wrong scheme, a peer that is not HTTP)
    is raised at once.
    """

    deadline: float = 300.0
    timeout: float = 30.0
    backoff: float = 0.05
    max_backoff: float = 2.0
    jitter: float = 0.5
    attempts: int | None = None
    breaker_after: int = 3

    def __post_init__(self) -> None:
        _check(self.deadline >= 0, "deadline must be >= 0 seconds")
        _check(self.attempts is None or self.attempts >= 1, "attempts must be >= 1 (or None: no cap)")
        _check(self.timeout > 0, "timeout must be > 0")
        _check(0 <= self.backoff <= self.max_backoff, "need 0 <= backoff <= max_backoff")
        _check(0 <= self.jitter <= 1, "jitter must be in [0, 1]")
        _check(self.breaker_after >= 1, "breaker_after must be >= 1")

    def delay(self, attempt: int, rand: float) -> float:
        """Backoff before ``attempt`` (2 = first retry); ``rand`` in [0, 1)."""
        base = min(self.backoff * (2 ** min(max(0, attempt - 2), 62)), self.max_backoff)
        return base * (1 - self.jitter * rand)

    def gives_up(self, attempts: int, failing_for: float) -> bool:
        """Whether a sample tried ``attempts`` times, failing for ``failing_for`` s, is done for."""
        return failing_for >= self.deadline or (self.attempts is not None and attempts >= self.attempts)


@dataclass(frozen=True, slots=True)
class Hedge:
    """Duplicate a straggling request; the first answer per sample wins.

    A request outstanding longer than ``max(min_delay, factor * p95)`` of
    recent request latencies is sent again (the ids not yet answered), once.
    At most ``max_fraction`` of the window may be hedges.
    """

    enabled: bool = True
    factor: float = 2.0
    min_delay: float = 0.05
    max_fraction: float = 0.25
    #: latencies remembered for the quantile
    history: int = 256

    def __post_init__(self) -> None:
        _check(self.factor >= 1, "hedge factor must be >= 1")
        _check(self.min_delay >= 0, "hedge min_delay must be >= 0")
        _check(0 < self.max_fraction <= 1, "hedge max_fraction must be in (0, 1]")
        _check(self.history >= 8, "hedge history must be >= 8")


@dataclass(frozen=True, slots=True)
class ErrorPolicy:
    """What happens to a sample that fails for good (unknown id, retries spent, bytes
    that do not match their stored checksum, or that fail to decode in an iterator).

    ``"raise"``: iteration raises, naming the sample id. ``"skip"``: the sample
    is left out and counted; more than ``max_skipped`` skips in one epoch
    raises. ``verify``: check every sample that has a stored checksum against
    its bytes where they arrive (a mismatch is ``CorruptSample``, never
    delivered); samples stored without one are delivered unchecked.
    """

    on_error: Literal["raise", "skip"] = "raise"
    max_skipped: int = 0
    verify: bool = True

    def __post_init__(self) -> None:
        _check(self.on_error in ("raise", "skip"), f"on_error must be 'raise' or 'skip', not {self.on_error!r}")
        _check(self.max_skipped >= 0, "max_skipped must be >= 0")
