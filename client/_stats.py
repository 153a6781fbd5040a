"""Loader statistics, each figure defined once, in :class:`Stats`.

A field of ``Stats`` says who writes it live (``side``: the engine's loop or the
consumer's thread) and whether an interval takes its difference (``count``) or its
latest value (``gauge``). :class:`Counters` (the engine's) and :class:`Taken` (the
consumer's) are made from those fields, :func:`snapshot` merges them into a frozen
``Stats`` and :meth:`Stats.since` gives an interval's figures.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, fields, make_dataclass

__all__ = ["Counters", "Taken", "Stats", "EngineCpu", "snapshot", "MAX_IDS"]

#: sample ids kept per kind of damage in ``Stats`` (the counts go on)
MAX_IDS = 1000

ENGINE, CONSUMER, SNAPSHOT = "engine", "consumer", "snapshot"


def _figure(side: str, default: object = 0, *, gauge: bool = False):
    """A field of :class:`Stats`: written live by ``side`` (ENGINE, CONSUMER, or SNAPSHOT: worked
    out when the snapshot is taken); a ``gauge`` is read as of now over an interval, a count as a
    difference."""
    return field(default=default, metadata={"side": side, "gauge": gauge})


def _ms(v: float | None) -> str:
    """Seconds as whole milliseconds for a log line; ``-`` for None."""
    return "-" if v is None else f"{v * 1e3:.0f}ms"


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

    #: seconds since the consumer's first get()
    elapsed: float = _figure(SNAPSHOT, 0.0)
    samples: int = _figure(CONSUMER)
    batches: int = _figure(CONSUMER)
    #: bytes of sample data handed to the consumer
    bytes: int = _figure(CONSUMER)
    #: seconds the consumer waited in get()
    wait: float = _figure(CONSUMER, 0.0)
    skipped: int = _figure(CONSUMER)
    #: bytes of sample data received (taken or not; duplicates not counted)
    received: int = _figure(ENGINE)
    requests: int = _figure(ENGINE)
    #: requests in flight, and the window's size
    inflight: int = _figure(ENGINE, gauge=True)
    window: int = _figure(ENGINE, gauge=True)
    #: a request's smoothed latency, and the lowest over recent full-size requests (the RTT estimate)
    request_latency: float | None = _figure(ENGINE, None, gauge=True)
    min_latency: float | None = _figure(ENGINE, None, gauge=True)
    retries: int = _figure(ENGINE)
    failures: int = _figure(ENGINE)
    hedges: int = _figure(ENGINE)
    duplicates: int = _figure(ENGINE)
    #: bytes received and not yet taken by the consumer
    ready_bytes: int = _figure(SNAPSHOT, gauge=True)
    #: high-water mark of bytes in flight (reserved) plus ready
    peak_bytes: int = _figure(ENGINE, gauge=True)
    #: the byte budget now: ``Prefetch.max_bytes``, or where a budget that follows the link has grown to
    budget: int = _figure(ENGINE, gauge=True)
    #: seconds the engine's thread was on CPU since the first get() (several engine processes:
    #: the busiest one's), its receive, checks and assembly: near ``elapsed``, the client is the limit
    engine_cpu: float = _figure(ENGINE, 0.0)
    #: seconds the engine had requests to send but its window was full
    window_full: float = _figure(ENGINE, 0.0)
    #: seconds the engine had requests to send but its byte budget was full
    budget_full: float = _figure(ENGINE, 0.0)
    #: requests answered whole, and the sum of their latencies
    answers: int = _figure(ENGINE)
    latency_sum: float = _figure(ENGINE, 0.0)
    #: seconds the training loop waited on the iterator's decode (not on the loader)
    decode_wait: float = _figure(CONSUMER, 0.0)
    #: busy seconds of the decode threads, summed (TorchIterator; 0 for DALI, which does not say)
    decode_busy: float = _figure(CONSUMER, 0.0)
    #: the iterator's decode threads, batches in its decode queue and its capacity (gauges; 0: no iterator)
    decode_threads: int = _figure(CONSUMER, gauge=True)
    decode_queue: int = _figure(CONSUMER, gauge=True)
    decode_depth: int = _figure(CONSUMER, gauge=True)
    #: samples left out because their bytes did not match the checksum stored with them
    #: (``ErrorPolicy(on_error="skip")``; counted in ``skipped`` too), and the first 1,000 ids
    corrupt: int = _figure(CONSUMER)
    corrupt_ids: tuple[int, ...] = _figure(CONSUMER, (), gauge=True)
    #: samples an iterator left out because they failed to decode, and the first 1,000 ids
    undecodable: int = _figure(CONSUMER)
    undecodable_ids: tuple[int, ...] = _figure(CONSUMER, (), gauge=True)

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
        return Stats(**{name: getattr(self, name) if gauge else getattr(self, name) - getattr(earlier, name)
                        for name, gauge in _KINDS})

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


#: (name, gauge) of every figure, in order; the names each side writes live
_KINDS = tuple((f.name, f.metadata["gauge"]) for f in fields(Stats))
_ENGINE = tuple(f.name for f in fields(Stats) if f.metadata["side"] == ENGINE)
_CONSUMER = tuple(f.name for f in fields(Stats) if f.metadata["side"] == CONSUMER)


def _live(name: str, side: str, doc: str, extra: list[tuple] = ()) -> type:
    """A mutable class with ``side``'s fields of :class:`Stats` (a list for a tuple of ids)."""
    specs = [(f.name, f.type, field(default_factory=list) if f.default == () else field(default=f.default))
             for f in fields(Stats) if f.metadata["side"] == side]
    cls = make_dataclass(name, specs + list(extra), slots=True, eq=False, repr=False)
    cls.__doc__, cls.__module__ = doc, __name__
    return cls


Counters = _live("Counters", ENGINE, "The engine's figures (``Stats``' ENGINE fields): written only on the "
                 "engine's event loop, read anywhere.")
Taken = _live(
    "Taken", CONSUMER,
    "The consumer's figures (``Stats``' CONSUMER fields): written only by the thread that takes batches "
    "(the decode ones through ``Loader.record_decode``). The clock starts at the first ``get()``, as "
    "SPDL's queue stats do: ``first`` (time.monotonic()), and ``waiting_since``, when a wait now under "
    "way began.",
    [("first", "float | None", field(default=None)), ("waiting_since", "float | None", field(default=None))],
)


class EngineCpu:
    """CPU seconds of the engine's thread since :meth:`start`, read from any thread (Linux's
    per-thread CPU clock); None where there is none, or the engine runs elsewhere (``thread``
    None: the figure comes in its counters, from the engine processes)."""

    def __init__(self, thread: threading.Thread | None) -> None:
        try:
            self._clock: int | None = None if thread is None else time.pthread_getcpuclockid(thread.ident)
        except (AttributeError, OSError, TypeError):
            self._clock = None
        self._start: float | None = None

    def _now(self) -> float:
        try:
            return time.clock_gettime(self._clock)
        except OSError:  # the thread has ended
            return self._start or 0.0

    def start(self) -> None:
        if self._start is None and self._clock is not None:
            self._start = self._now()

    def seconds(self) -> float | None:
        return None if self._start is None else self._now() - self._start


def snapshot(c: Counters, taken: Taken, ready_bytes: int, engine_cpu: float | None = None) -> Stats:
    """Both sides' figures as one frozen :class:`Stats`; ``engine_cpu``: the engine thread's CPU
    (None: the counters' own, as an engine process sends them)."""
    now = time.monotonic()
    d = {name: getattr(c, name) for name in _ENGINE}
    if engine_cpu is not None:
        d["engine_cpu"] = engine_cpu
    d.update((name, tuple(v) if isinstance(v, list) else v) for name in _CONSUMER for v in (getattr(taken, name),))
    since = taken.waiting_since
    if since is not None:
        d["wait"] += max(0.0, now - since)  # a wait under way counts so far
    d.update(elapsed=0.0 if taken.first is None else now - taken.first, ready_bytes=ready_bytes)
    return Stats(**d)
