"""Live bottleneck attribution: per interval, what limited the pipeline.

Every interval (``Loader(log_interval=...)``, else 10 s) the loader takes a :class:`Stats`
snapshot, subtracts the previous one (:meth:`Stats.since`) and names the limit from that
interval's figures alone: ``consumer`` (the loop waited less than ``STALL``, 10%),
``decode`` (it waited more on the iterator's decode than on the loader), ``engine`` (the
engine's thread on CPU ``ENGINE_BUSY`` of the time), ``service`` (requests queue downstream:
mean latency ``QUEUEING`` times its floor with ``QUEUED`` requests' worth waiting, or requests
failed) or ``link`` (the window or byte budget full, latency at its floor). :class:`Attributor` keeps the recent
:class:`Interval` s. The rules, their evidence and why each needs two conditions:
client/README.md ("What limited it").
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from ._stats import Stats, _ms

__all__ = ["Interval", "Limit", "LIMITS", "Attributor", "attribute", "STALL", "QUEUEING", "QUEUED", "ENGINE_BUSY"]

Limit = Literal["consumer", "decode", "engine", "service", "link"]
LIMITS: tuple[Limit, ...] = ("consumer", "decode", "engine", "service", "link")

#: the training loop waiting less than this share of the interval: data is not the limit
STALL = 0.10
#: mean latency this many times its floor or more, with QUEUED requests' worth waiting: requests queue downstream
QUEUEING = 1.25
QUEUED = 1.5
#: the engine's thread on CPU this share of the interval or more: the client receives, checks and
#: assembles no faster, and answers wait in its sockets (which would otherwise read as a service's
#: queue). Answers come in bursts, so a thread busy three quarters of the time on average is already
#: the limit: on the GPU machine at 100 ms, ~76% (80 us an image at 9.5k/s), and three engine
#: processes doubled the rate (bench/results/gpu/README.md)
ENGINE_BUSY = 0.75
#: intervals over which the latency floor is the minimum
FLOOR_SPAN = 30


def attribute(s: Stats, floor: float | None) -> tuple[Limit, str]:
    """The limit of an interval's figures ``s`` (from :meth:`Stats.since`)
    and its evidence, one phrase; ``floor``: the latency floor."""
    if s.elapsed <= 0:
        return "consumer", "an empty interval"

    def share(x: float) -> float:
        return min(1.0, x / s.elapsed)

    stall = s.loop_wait_fraction
    if stall < STALL:
        return "consumer", f"the training loop waited {stall:.0%} of the time: data was ready when asked for"
    if s.decode_wait > s.wait:
        busy = ""
        if s.decode_threads and s.decode_busy:
            busy = f", {s.decode_threads} decode threads {share(s.decode_busy / s.decode_threads):.0%} busy"
        queue = f", decode queue {s.decode_queue}/{s.decode_depth}" if s.decode_depth else ""
        return "decode", (f"the loop waited {share(s.decode_wait):.0%} of the time on decode, "
                          f"{share(s.wait):.0%} on the loader{busy}{queue}")
    lat = s.mean_latency
    held = share(s.window_full + s.budget_full)
    what = "window" if s.window_full >= s.budget_full else f"byte budget ({s.budget / 2**20:,.0f} MiB)"
    ratio = lat / floor if lat is not None and floor else None
    waited = f"the loop waited {share(s.wait):.0%} of the time on the loader"
    if s.failures:
        return "service", f"{waited}; {s.failures} request(s) failed, {s.retries} sample(s) retried"
    busy = share(s.engine_cpu)
    if busy >= ENGINE_BUSY:
        return "engine", (f"{waited}; the engine's thread was on CPU {busy:.0%} of the time, latency "
                          f"{_ms(lat)} (floor {_ms(floor)}): the client's receive is the limit "
                          "(ProcessLoader(engines=N) spreads it over processes)")
    in_flight = s.latency_sum / s.elapsed  # mean requests in flight (Little's law)
    queued = 0.0 if ratio is None else max(0.0, in_flight * (1.0 - 1.0 / ratio))
    if ratio is not None and ratio >= QUEUEING and queued >= QUEUED:
        return "service", (f"{waited}; latency {_ms(lat)}, {ratio:.1f}x its floor {_ms(floor)}: "
                           f"~{queued:.0f} of {in_flight:.0f} requests in flight queued at the service")
    at_floor = "-" if ratio is None else f"{_ms(lat)} near its floor {_ms(floor)} (~{queued:.1f} requests queued)"
    return "link", f"{waited}; {what} full {held:.0%} of the time, latency {at_floor}"


@dataclass(frozen=True, slots=True)
class Interval:
    """One interval's figures and what limited it.

    ``start``: seconds from the consumer's first ``get()`` to the interval's
    start; ``stats``: its figures (rates over the interval, gauges at its
    end); ``limit`` and ``evidence``: see the module docstring.
    """

    start: float
    stats: Stats
    limit: Limit
    evidence: str
    floor: float | None = None

    @property
    def end(self) -> float:
        return self.start + self.stats.elapsed

    def __str__(self) -> str:
        s = self.stats
        return (
            f"limited by {self.limit} ({self.evidence}) | {s.samples_per_s:,.0f} samples/s "
            f"{s.bytes_per_s / 1e6:,.1f} MB/s, loop waited {s.loop_wait_fraction:.0%} | "
            f"window {s.window} inflight {s.inflight} latency {_ms(s.mean_latency)} (floor {_ms(self.floor)}) | "
            f"retries {s.retries} failures {s.failures} hedges {s.hedges} skipped {s.skipped}"
        )

    def as_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "limit": self.limit, "evidence": self.evidence,
                "floor": self.floor, **self.stats.as_dict()}


class Attributor:
    """Turns a loader's cumulative snapshots into :class:`Interval` s (one writer:
    the engine's loop); ``history`` keeps the last ``keep``, readable from any thread."""

    def __init__(self, keep: int = 360) -> None:
        self._keep = keep
        self._last: Stats | None = None
        self._mins: deque[float] = deque(maxlen=FLOOR_SPAN)
        #: the last intervals, oldest first (replaced, never mutated: safe to read from any thread)
        self.history: tuple[Interval, ...] = ()
        #: seconds attributed to each limit, over all intervals (the keys never change)
        self.seconds: dict[str, float] = dict.fromkeys(LIMITS, 0.0)

    def tick(self, now: Stats) -> Interval:
        """The interval since the previous ``tick`` (since the first ``get()``, the first time)."""
        last = self._last
        s = now if last is None else now.since(last)
        self._last = now
        if now.min_latency is not None:
            self._mins.append(now.min_latency)
        floor = min(self._mins) if self._mins else None
        limit, evidence = attribute(s, floor)
        iv = Interval(0.0 if last is None else last.elapsed, s, limit, evidence, floor)
        self.seconds[limit] += s.elapsed
        self.history = (*self.history[-(self._keep - 1):], iv) if self._keep > 1 else (iv,)
        return iv
