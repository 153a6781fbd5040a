"""What the data service says of itself in a response's head, as ``HttpSource`` keeps it for
the client's tuner: :class:`ServiceTiming` takes the service's time out of a request's
(``Server-Timing: first;dur=MS``: the link's own round trip) and sums the CPU its workers
spent per sample answered (``Dataferry-Work: worker=NAME; cpu_us=N; samples=N``: the request
sizer's server cost). A header missing or not parsing is ignored: the tuner does without.
"""

from __future__ import annotations

from collections import deque

__all__ = ["ServiceTiming"]


class ServiceTiming:
    """``link_rtt``: a request's time to its response head less the service's own, the lowest
    of the last 64 (None: not told yet). ``server_work``: the service's CPU seconds and the
    samples it answered, summed over its workers between their answers to this source."""

    __slots__ = ("link_rtt", "server_work", "_rtts", "_workers")

    #: workers remembered (they come and go with restarts: the most recent are kept)
    WORKERS = 256

    def __init__(self) -> None:
        self.link_rtt: float | None = None
        self.server_work: tuple[float, int] = (0.0, 0)
        self._rtts: deque[float] = deque(maxlen=64)
        self._workers: dict[str, tuple[int, int]] = {}  # worker -> its last (cpu_us, samples)

    def timed(self, head_s: float, timing: str | None) -> None:
        """A response head came ``head_s`` after its request; ``timing``: its Server-Timing
        (``first;dur=MS``, the service's time to its first records)."""
        if not timing or not timing.startswith("first;dur="):
            return
        try:
            server = float(timing[10:]) / 1e3
        except ValueError:
            return
        self._rtts.append(max(0.0, head_s - server))
        self.link_rtt = min(self._rtts)

    def worked(self, work: str) -> None:
        """A response's ``Dataferry-Work`` (the worker's totals since it began): what it did
        since its last answer here goes into ``server_work``; a worker whose totals went back
        (restarted under the same name) starts again from these."""
        try:
            fields = dict(part.strip().split("=", 1) for part in work.split(";"))
            name, cpu, samples = fields["worker"], int(fields["cpu_us"]), int(fields["samples"])
        except (KeyError, ValueError):
            return
        last = self._workers.pop(name, None)
        self._workers[name] = (cpu, samples)  # the most recent last: the oldest go first
        if last is not None and cpu >= last[0] and samples >= last[1]:
            spent, answered = self.server_work
            self.server_work = (spent + (cpu - last[0]) / 1e6, answered + samples - last[1])
        elif len(self._workers) > self.WORKERS:
            del self._workers[next(iter(self._workers))]
