"""Loader statistics: live counters on the engine, frozen snapshots for users."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

__all__ = ["Counters", "Taken", "Stats", "snapshot", "MAX_IDS"]

#: sample ids kept per kind of damage in ``Stats`` (the counts go on)
MAX_IDS = 1000


class Counters:
    """The engine's counters: written only on the engine's event loop, read anywhere."""

    def __init__(self) -> None:
        self.received = 0  # bytes of sample data received
        self.requests = 0
        self.inflight = 0
        self.window = 0
        self.request_latency: float | None = None  # smoothed
        self.min_latency: float | None = None  # over recent full-size requests: the RTT estimate
        self.retries = 0
        self.failures = 0
        self.hedges = 0
        self.duplicates = 0
        self.peak_bytes = 0
        # for the attribution (``_attribution.py``): seconds the dispatcher had
        # something to send but was held back by the window (requests in
        # flight) or by the byte budget; and the answered requests' latencies
        self.window_full = 0.0
        self.budget_full = 0.0
        self.answers = 0
        self.latency_sum = 0.0


class Taken:
    """The consumer's counters: written only by the thread that takes batches.
    The clock starts at the first ``get()``, as SPDL's queue stats do."""

    def __init__(self) -> None:
        self.first: float | None = None  # time.monotonic() of the first get()
        self.samples = 0
        self.batches = 0
        self.bytes = 0
        self.skipped = 0
        self.wait = 0.0  # seconds the consumer waited for a batch (its waits that ended)
        self.waiting_since: float | None = None  # time.monotonic() when its wait now under way began
        # written by an iterator (TorchIterator, DaliIterator) in the same thread:
        self.decode_wait = 0.0  # seconds the training loop waited on decode, not on the loader
        self.decode_busy = 0.0  # decode threads' busy seconds, summed (TorchIterator; DALI does not say)
        self.decode_threads = 0  # gauge; 0: no iterator
        self.decode_queue = 0  # gauge: batches in the iterator's decode queue
        self.decode_depth = 0  # gauge: its capacity
        # samples whose bytes did not match their stored checksum (left out: ErrorPolicy skip)
        self.corrupt = 0
        self.corrupt_ids: list[int] = []  # the first MAX_IDS of them
        # samples an iterator could not decode (left out: ErrorPolicy skip)
        self.undecodable = 0
        self.undecodable_ids: list[int] = []  # the first MAX_IDS of them


def _ms(v: float | None) -> str:
    """Seconds as whole milliseconds for a log line; ``-`` for None."""
    return "-" if v is None else f"{v * 1e3:.0f}ms"


def snapshot(c: Counters, taken: Taken, ready_bytes: int) -> Stats:
    """Both sides' counters as one frozen :class:`Stats`."""
    now = time.monotonic()
    elapsed = 0.0 if taken.first is None else now - taken.first
    since = taken.waiting_since
    wait = taken.wait + (max(0.0, now - since) if since is not None else 0.0)  # a wait under way counts so far
    return Stats(
        elapsed=elapsed,
        samples=taken.samples,
        batches=taken.batches,
        bytes=taken.bytes,
        wait=wait,
        skipped=taken.skipped,
        received=c.received,
        requests=c.requests,
        inflight=c.inflight,
        window=c.window,
        request_latency=c.request_latency,
        min_latency=c.min_latency,
        retries=c.retries,
        failures=c.failures,
        hedges=c.hedges,
        duplicates=c.duplicates,
        ready_bytes=ready_bytes,
        peak_bytes=c.peak_bytes,
        window_full=c.window_full,
        budget_full=c.budget_full,
        answers=c.answers,
        latency_sum=c.latency_sum,
        decode_wait=taken.decode_wait,
        decode_busy=taken.decode_busy,
        decode_threads=taken.decode_threads,
        decode_queue=taken.decode_queue,
        decode_depth=taken.decode_depth,
        corrupt=taken.corrupt,
        corrupt_ids=tuple(taken.corrupt_ids),
        undecodable=taken.undecodable,
        undecodable_ids=tuple(taken.undecodable_ids),
    )


@dataclass(frozen=True, slots=True)
class Stats:
    """A loader's figures, counted from the consumer's first ``get()``.

    Rates are what the training loop saw: samples and bytes handed to it over
    the time since its first request for data. ``wait`` is the time it spent
    blocked in ``get()``. ``request_latency`` is the smoothed time a request
    takes (it grows with the window and with queueing at the server);
    ``min_latency``, the lowest recent one, estimates the link's round trip.
    With an iterator (``TorchIterator``, ``DaliIterator``) ``wait`` is its
    feeder's wait on the loader and ``decode_wait`` the training loop's wait
    on decode; ``loop_wait`` is their sum, the training loop's wait for data.
    ``b.since(a)`` gives the figures of the interval between two snapshots.
    """

    elapsed: float
    samples: int
    batches: int
    #: bytes of sample data handed to the consumer
    bytes: int
    #: seconds the consumer waited in get()
    wait: float
    skipped: int
    #: bytes of sample data received (taken or not; duplicates not counted)
    received: int
    requests: int
    inflight: int
    window: int
    request_latency: float | None
    min_latency: float | None
    retries: int
    failures: int
    hedges: int
    duplicates: int
    #: bytes received and not yet taken by the consumer
    ready_bytes: int
    #: high-water mark of bytes in flight (reserved) plus ready
    peak_bytes: int
    #: seconds the engine had requests to send but its window was full
    window_full: float = 0.0
    #: seconds the engine had requests to send but its byte budget was full
    budget_full: float = 0.0
    #: requests answered whole, and the sum of their latencies
    answers: int = 0
    latency_sum: float = 0.0
    #: seconds the training loop waited on the iterator's decode (not on the loader)
    decode_wait: float = 0.0
    #: busy seconds of the decode threads, summed (TorchIterator; 0 for DALI, which does not say)
    decode_busy: float = 0.0
    #: the iterator's decode threads, batches in its decode queue and its capacity (gauges; 0: no iterator)
    decode_threads: int = 0
    decode_queue: int = 0
    decode_depth: int = 0
    #: samples left out because their bytes did not match the checksum stored with them
    #: (``ErrorPolicy(on_error="skip")``; counted in ``skipped`` too), and the first 1,000 ids
    corrupt: int = 0
    corrupt_ids: tuple[int, ...] = ()
    #: samples an iterator left out because they failed to decode, and the first 1,000 ids
    undecodable: int = 0
    undecodable_ids: tuple[int, ...] = ()

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bytes / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def wait_fraction(self) -> float:
        """The share of the time the consumer waited in the loader's ``get()``."""
        return min(1.0, self.wait / self.elapsed) if self.elapsed > 0 else 0.0

    @property
    def loop_wait(self) -> float:
        """Seconds the training loop waited for data: on the loader, and on decode."""
        return self.wait + self.decode_wait

    @property
    def loop_wait_fraction(self) -> float:
        """The share of the time the training loop waited for data."""
        return min(1.0, self.loop_wait / self.elapsed) if self.elapsed > 0 else 0.0

    @property
    def mean_latency(self) -> float | None:
        """The mean latency of the requests answered (over an interval, with :meth:`since`)."""
        return self.latency_sum / self.answers if self.answers else None

    def since(self, earlier: Stats) -> Stats:
        """The figures of the interval from ``earlier`` to this snapshot
        (counts and times as differences; gauges as of now)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("elapsed", "samples", "batches", "bytes", "wait", "skipped", "received", "requests",
                     "retries", "failures", "hedges", "duplicates", "window_full", "budget_full", "answers", "latency_sum",
                     "decode_wait", "decode_busy", "corrupt", "undecodable"):
            d[name] = getattr(self, name) - getattr(earlier, name)
        return Stats(**d)

    def as_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(samples_per_s=self.samples_per_s, bytes_per_s=self.bytes_per_s, wait_fraction=self.wait_fraction,
                 loop_wait_fraction=self.loop_wait_fraction, mean_latency=self.mean_latency)
        return d

    def __str__(self) -> str:
        return (
            f"{self.samples} samples in {self.elapsed:.1f}s: {self.samples_per_s:,.0f}/s "
            f"{self.bytes_per_s / 1e6:,.1f} MB/s, waited {self.wait_fraction:.0%} | "
            f"window {self.window} inflight {self.inflight} latency {_ms(self.request_latency)} "
            f"(min {_ms(self.min_latency)}) | retries {self.retries} failures {self.failures} "
            f"hedges {self.hedges} skipped {self.skipped} | peak {self.peak_bytes / 2**20:,.1f} MiB"
        )
