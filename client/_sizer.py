"""The request sizer: :class:`_RequestSizer` picks the ids per request (``Prefetch(tune=True)``
and no ``request_size``) for samples delivered per wall second at the least CPU, once per
loader: measured over a short round trip; over a long one, climbing unmeasured from the first
answers as the link holds larger requests, a size past what one TCP window usually carries
kept only once its answers were seen to come within one round trip. ``_tuner.Link`` feeds it
each request's answer and applies what it decides. The rules: client/README.md (Window).
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["_RequestSizer"]


class _RequestSizer:
    """Ids per request (``Prefetch(tune=True)`` and no ``request_size``) for one objective: samples
    delivered per second of wall time, at the least CPU.

    A request has a fixed cost ``o`` (a task, a POST and its headers, a response to open; the
    server's work per request) and a cost per sample ``c``. It starts small, so the first batch
    is spread over several requests in flight; over a short round trip, once the pipe is full,
    the samples answered per wall second and the CPU per sample are measured at that size ``n``
    and at ``2n``: this
    process's (every thread: the engine's, the consumer's, decoding) and, where the source tells
    it (``server``: ``HttpSource.server_work``, from the service's ``Dataferry-Work`` header), the
    server's per sample it answered meanwhile (other clients' requests too, where it has them).
    ``2n`` is kept unless it delivered ``SAVING`` fewer samples a second and cost no ``SAVING``
    less CPU (a tie goes to the larger request, which never costs the server more); where it
    delivered ``SAVING`` more at no ``SAVING`` less CPU, ``4n`` is measured against it the same
    way, and so on; where ``2n`` saved CPU,
    the size is the smallest power-of-two multiple of ``n`` past which a doubling would save less
    than ``SAVING`` (``c + o/n`` against ``c + o/2n``), within ``Link._size_cap``. Decided once
    per loader (a slow link may still cut it: ``Link._fit_size``).

    Over a long round trip ``Link._size_cap`` holds a request to what one TCP window usually
    carries (6 MiB), but a link may carry more in one round trip. Past that limit a size is kept
    only once its answers were seen to come within one: a window that does not hold an answer
    delivers its rest at least a round trip after its first bytes, so the least spread between
    a request's first and last sample over ``REQUESTS`` answers must be under ``WINDOW_SHARE`` of
    the round trip (where this process's own handling spreads answers that far, it errs towards
    the limit). The sizes are checked one doubling at a time; a size that spreads goes back to half.

    Over a long round trip (``link_fits``: ``Link.link_fits`` is not None) nothing is measured:
    the window holds a round trip's bytes whatever the size, so a larger request waits no longer
    and costs less (its fixed cost spread over more samples). From the first answers the size
    doubles, up to the most the budget allows (``wide``), as soon as ``Link.MIN_START`` requests
    of the new size fit ``Link.GAIN`` x the bandwidth-delay product measured so far (while the
    window's start-up is on, that grows; once it is over, a size that does not fit ends the
    climb). Where there is a long-link limit (a connection) every size climbed to is kept as
    above, once an answer came within the round trip (one is proof). A round trip that turns out
    short (``link_fits`` None later: first readings under load) ends the climb: that size is
    measured as over any short round trip.
    """

    SAVING = 0.05
    #: a measurement: PARTS parts of at least this many samples, requests and seconds each (the
    #: best part counts: interference from other processes only ever adds CPU and takes rate)
    SAMPLES, REQUESTS, SECONDS, PARTS = 1024, 8, 0.1, 3
    #: past the long-link limit, a size's answers must come within this share of the round trip
    WINDOW_SHARE = 0.5

    def __init__(self, size: int, cap: Callable[[], int], wide: Callable[[], int],
                 rtt: Callable[[], float | None], server: Callable[[], tuple[float, int]] | None = None,
                 link_fits: Callable[[], int | None] | None = None) -> None:
        self.size = size
        #: over a long round trip, the most ids of which MIN_START requests fit the link now; None:
        #: a short round trip or not known yet (``link_fits`` None: never climb unmeasured)
        self._fits = link_fits
        self._climbing, self._first = False, size
        self._again = False  # a size spread during the start-up: tried again once, after it
        self._began = False  # measuring or climbing: the choice between the two is made
        #: the server's CPU seconds and samples answered so far, as it tells them (None: it does not)
        self._server = server
        self._cap = cap  # the most ids per request now (Link._size_cap), asked when deciding
        self._wide, self._rtt = wide, rtt  # the most without the long-link limit; the link's round trip
        self._target = 0  # checking sizes one doubling at a time up to this (0: not checking)
        self._spread = float("inf")  # the least first-to-last spread of an answer at this size
        self.done = False
        self.settle = 32  # answers to let pass first (the start, or the old size's after a change)
        #: (this process's CPU s per sample, samples per s, the server's CPU s per sample or None)
        self._parts: list[tuple[float, float, float | None]] = []
        self._samples = self._requests = 0
        self._cpu0: float | None = None
        self._t0 = 0.0
        self._server0: tuple[float, int] | None = None
        self._before: tuple[float, float | None, float] | None = None  # (CPU here, at the server, rate) at n/2

    def answered(self, size: int, samples: int, window: float,
                 spread: float | None = None, *, filled: bool = True) -> tuple[int, str] | None:
        """A request of ``size`` ids came back with ``samples``, its last sample ``spread``
        seconds after its first, the window's start-up over (``filled``) or not: a new size and
        why, or None. Measured only once it is over (a growing window costs CPU of its own)."""
        if self.done or size != self.size:
            return None
        if self._climbing and self._fits() is None:  # the first readings were long (under load): it is short
            self._began = self._climbing = self._again = False
            self._fits, self._requests, self._spread, self.settle = None, 0, float("inf"), 32
            return size, f"the link's round trip is {(self._rtt() or 0.0) * 1e3:.1f} ms after all: measured instead"
        if not self._began:
            if self._fits is not None and self._fits() is not None:
                self._began, self._climbing, self.settle = True, True, 0  # nothing measured: nothing to let pass
            elif not filled:
                return None
        if self.settle > 0:
            self.settle -= 1
            return None
        whole = samples >= size  # a short request (an epoch's tail) says nothing of a window
        if whole and spread is not None and spread < self._spread:
            self._spread = spread
        if self._climbing:
            return self._climb(filled) if whole else None
        if self._target:
            return self._check() if whole else None
        if self._cpu0 is None:
            self._began = True
            self._cpu0, self._t0, self._server0 = time.process_time(), time.monotonic(), self._told()
            return None
        self._samples += samples
        self._requests += 1
        if self._samples < self.SAMPLES or self._requests < self.REQUESTS:
            return None
        t = time.monotonic()
        if t - self._t0 < self.SECONDS:
            return None
        now = time.process_time()
        server, server0 = self._told(), self._server0
        at_server = None  # the server's CPU per sample it answered over the part, where it tells it
        if server is not None and server0 is not None and server[1] > server0[1]:
            at_server = (server[0] - server0[0]) / (server[1] - server0[1])
        self._parts.append(((now - self._cpu0) / self._samples, self._samples / (t - self._t0), at_server))
        self._cpu0, self._t0, self._samples, self._requests, self._server0 = now, t, 0, 0, server
        if len(self._parts) < self.PARTS:
            return None
        here = min(c for c, _, _ in self._parts)
        rb = max(r for _, r, _ in self._parts)
        told = [s for _, _, s in self._parts if s is not None]
        there = min(told) if len(told) == len(self._parts) else None
        self._parts, self._cpu0 = [], None
        n = self.size
        upper = max(n, self._cap())
        wide = max(upper, self._wide())
        if self._before is None:  # measured at the first size: now at twice that
            self._before = (here, there, rb)
            cost = _cost(here, there)
            if n * 2 > wide:
                self.done = True
                return n, f"{n} ids per request: {rb:,.0f} samples/s at {cost}; the byte budget allows no more"
            return self._double(upper, window, f"{n} ids per request: {rb:,.0f} samples/s at {cost}")
        self.done = True
        (a_here, a_there, ra), small = self._before, n // 2  # at n/2 and at n
        a, b, both = a_here, here, False
        if a_there is not None and there is not None:  # the server's share counts where both were told
            a, b, both = a + a_there, b + there, True
        if n > upper:  # past the long-link limit: kept only if its answers came within a round trip
            if not self._holds():
                self.size = small
                return small, self._spread_out(n, small)
            upper = n
        seen = (f"{small} ids per request: {ra:,.0f} samples/s at {_cost(a_here, a_there if both else None)}; "
                f"{n}: {rb:,.0f} at {_cost(here, there if both else None)}")
        if rb < (1 - self.SAVING) * ra and b > (1 - self.SAVING) * a:
            self.size = small
            return small, f"{seen}: slower and no cheaper; back to {small}"
        if a - b <= self.SAVING * a:  # no cheaper
            if rb > (1 + self.SAVING) * ra and n * 2 <= wide:  # but faster: the objective says go on
                self.done, self._before = False, (here, there, rb)
                return self._double(upper, window, f"{seen}: faster at no less CPU")
            fewer = "" if both else ", and fewer requests for the server"
            return n, f"{seen}: as fast or faster{fewer}; {n} ids"
        # a = c + o / small, b = c + o / n: the per-request overhead o and the per-sample cost c
        overhead = (a - b) * n
        cost = max(b - (a - b), 1e-9)
        # the size past which doubling saves less than SAVING: o/(2m) < SAVING (c + o/m)
        best = overhead * (0.5 - self.SAVING) / (self.SAVING * cost)
        size = n
        while size < best and size * 2 <= wide:
            size *= 2
        model = f"{seen}: about {overhead * 1e6:.0f} us per request and {cost * 1e6:.1f} us per sample"
        if size > upper:  # past the long-link limit: one doubling at a time, each seen to come within a round trip
            ok = n
            while ok * 2 <= upper:
                ok *= 2
            self.done, self._target = False, size
            return self._resize(ok * 2, 0, f"{model}, so {size} ids: trying {ok * 2} first "
                                           "(past the long round trip's limit: kept if it comes within one)")
        self.size = size
        capped = "; the byte budget allows no more" if size * 2 > wide and size < best else ""
        return size, f"{model}, so {size} ids{capped}"

    def _top(self) -> int:
        """The largest power-of-two multiple of this size the byte budget allows (``wide``)."""
        top = self.size
        while top * 2 <= self._wide():
            top *= 2
        return top

    def _climb(self, filled: bool) -> tuple[int, str] | None:
        """A long round trip, after a whole answer: a size past the long-link limit, or any size
        climbed to where there is such a limit (a connection: its TCP window may hold less than
        the limit's 6 MiB, as a 4 MiB send buffer), is checked as ``_check`` does (back to half if
        it spreads); then the size doubles once ``MIN_START``
        requests of twice it fit the link (the climb is over once the window's start-up is over
        and they do not)."""
        n = self.size
        if self._again and not filled:
            return None
        checked = self._checks(n)

        def came() -> str:  # what the log says of this size (formatted only when a decision is logged)
            rtt = f"a {(self._rtt() or 0.0) * 1e3:.0f} ms round trip"
            if not checked:
                return rtt
            return f"{n} ids came within the round trip (first to last sample {self._spread * 1e3:.0f} ms, {rtt})"

        if checked:
            held = self._came()
            if held is None:
                return None
            if not held and not filled and not self._again:  # the start-up's bursts may be what spread it
                self._again = True
                return self._resize(n // 2, 0, f"{self._spread_out(n, n // 2)}, again once the window's start-up "
                                               "is over (its bursts keep this process busy)")
            if not held:
                self.done, self._climbing, self.size = True, False, n // 2
                return n // 2, self._spread_out(n, n // 2)
        if n * 2 > self._wide():
            self.done, self._climbing = True, False
            return n, f"{came()}: {n} ids, the most a request may carry (1/16 of max_bytes, at most 16 MiB)"
        if (self._fits() or 0) >= n * 2:
            if n == self._first:
                why = (f"{came()}: a larger request waits no longer (the window holds the round trip's bytes) and "
                       f"costs less, so up to {self._top()} ids, doubling as the link's bandwidth-delay product holds "
                       "several of the next")
            else:
                why = f"{came()}: the link holds several requests of {n * 2} ids"
            kept = " (kept if it comes within the round trip)" if self._checks(n * 2) else ""
            return self._resize(n * 2, 0, f"{why}: trying {n * 2}{kept}")
        if not filled:
            return None  # the window's start-up is on: the rate measured so far still grows
        self.done, self._climbing = True, False
        return n, f"{came()}: {n} ids; the link's bandwidth-delay product does not hold several of {n * 2}"

    def _checks(self, size: int) -> bool:
        """Climbing, whether ``size`` is kept only once an answer came within the round trip: past
        the long-link limit, or any size climbed to where there is one (a connection)."""
        return size > self._first and (size > self._cap() or self._cap() < self._wide())

    def _check(self) -> tuple[int, str] | None:
        """Checking a size past the long-link limit: keep it (and go on doubling towards the
        target) once an answer came within a round trip, back to half after ``REQUESTS`` did not."""
        held = self._came()
        if held is None:
            return None
        n = self.size
        if not held:
            self.done, self._target, self.size = True, 0, n // 2
            return n // 2, self._spread_out(n, n // 2)
        came = (f"{n} ids came within the round trip (first to last sample {self._spread * 1e3:.0f} ms, "
                f"round trip {(self._rtt() or 0.0) * 1e3:.0f} ms)")
        if n * 2 <= self._target:
            return self._resize(n * 2, 0, f"{came}: trying {n * 2}")
        self.done, self._target = True, 0
        return n, f"{came}: {n} ids"

    def _came(self) -> bool | None:
        """After a whole answer at a size being checked (``_check``, ``_checks``): True once the least spread
        holds (``_holds``: one answer within the round trip is enough, a window that does not hold
        the answer delivers none so), False after ``REQUESTS`` answers none of which did, else None."""
        self._requests += 1
        if self._holds():
            return True
        return False if self._requests >= self.REQUESTS else None

    def _told(self) -> tuple[float, int] | None:
        """The server's CPU seconds and samples answered so far, where the source tells them."""
        return self._server() if self._server is not None else None

    def _double(self, upper: int, window: float, seen: str) -> tuple[int, str]:
        """Measure at twice this size next (``upper``: the long-link limit now)."""
        n = self.size * 2
        beyond = "" if n <= upper else " (past the long round trip's limit: kept if it comes within one)"
        return self._resize(n, window, f"{seen}; trying {n}{beyond}")

    def _resize(self, size: int, window: float, why: str) -> tuple[int, str]:
        """Measure at ``size`` next: its rate after the requests of the old size in flight
        (``window``), its spread from its first answer (``window`` 0)."""
        self.size, self.settle = size, int(window) + 1 if window else 0
        self._requests, self._spread = 0, float("inf")
        return size, why

    def _holds(self) -> bool:
        """The least spread of an answer at this size is under ``WINDOW_SHARE`` of the round trip."""
        rtt = self._rtt()
        return rtt is not None and self._spread < self.WINDOW_SHARE * rtt

    def _spread_out(self, n: int, small: int) -> str:
        rtt = self._rtt()
        spread = "no answer measured" if self._spread == float("inf") else f"{self._spread * 1e3:.0f} ms"
        over = "an unknown round trip" if rtt is None else f"a {rtt * 1e3:.0f} ms round trip"
        return (f"the answers of {n} ids spread {spread} from first to last sample over {over}: more than "
                f"one TCP window a request; back to {small}")


def _cost(here: float, there: float | None) -> str:
    """CPU per sample as the log says it: this process's, and the server's where it told it."""
    if there is None:
        return f"{here * 1e6:.1f} us of CPU per sample"
    return f"{(here + there) * 1e6:.1f} us of CPU per sample ({here * 1e6:.1f} here, {there * 1e6:.1f} at the server)"
