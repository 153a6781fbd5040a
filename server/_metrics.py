"""The server's Prometheus metrics, on ``prometheus-client``.

Each application gets its own ``CollectorRegistry`` (``new_registry``, under
the ``REGISTRY`` app key), never the process-global one, holding the service's
:class:`Metrics` and the process, GC and platform collectors. Every label
value comes from a fixed set (route templates, status codes, error names,
store operations), never from the request. The workers of ``--workers N``
share one set of figures (``shared_registry``: prometheus-client's
multiprocess mode), summed as README.md, Workers, says; the names are the same
in both modes. ``deploy/OPERATIONS.md`` lists every family, and a test holds
the two together.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

__all__ = ["Metrics", "new_registry", "shared_registry", "GcCounts", "GC_SYNC_S", "exposition", "CONTENT_TYPE"]

#: the text format every Prometheus (2.x and 3.x) scrapes as it is
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: seconds; store reads near the store take ~1 ms, across a bad link ~100 ms
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_P = "dataferry_server_"


def new_registry() -> CollectorRegistry:
    """A registry of its own, with the process, GC and platform collectors."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


@dataclass(frozen=True, slots=True)
class Metrics:
    """The service's metrics, registered on one application's registry."""

    requests: Counter
    in_flight: Gauge
    errors: Counter
    samples: Counter
    not_found: Counter
    bytes: Counter
    store_latency: Histogram
    store_errors: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> Metrics:
        r = registry
        return cls(
            requests=Counter(_P + "requests_total", "HTTP requests by route template, method and status.",
                             ("route", "method", "status"), registry=r),
            in_flight=Gauge(_P + "requests_in_flight", "HTTP requests being served now.", registry=r,
                            multiprocess_mode="livesum"),
            errors=Counter(_P + "errors_total", "Error responses and stream errors by error name.", ("error",),
                           registry=r),
            samples=Counter(_P + "samples_served_total", "Samples sent in batch fetch responses.", registry=r),
            not_found=Counter(_P + "samples_not_found_total", "Ids answered with a not-found record.", registry=r),
            bytes=Counter(_P + "bytes_served_total", "Response body bytes written by data endpoints.", registry=r),
            store_latency=Histogram(
                _P + "store_latency_seconds",
                "Store call latency by operation; fetch_first is a batch fetch's time to its first sample, "
                "fetch its time to the last.",
                ("op",), buckets=LATENCY_BUCKETS, registry=r,
            ),
            store_errors=Counter(_P + "store_errors_total", "Store failures by kind.", ("kind",), registry=r),
        )


def shared_registry(path: str) -> tuple[CollectorRegistry, Callable[[], None]]:
    """For a worker of ``serve --workers N``: switch this process's
    prometheus-client to multiprocess mode, its values in files under ``path``
    (the workers' shared folder), and return the registry ``/metrics`` serves
    (the sums over every worker, the process figures of the whole server, the
    platform) and the function that copies this worker's garbage-collection
    counts into the shared files (:class:`GcCounts`; the caller runs it every
    :data:`GC_SYNC_S` seconds). Call before any metric is made; once per process."""
    from prometheus_client import values
    from prometheus_client.multiprocess import MultiProcessCollector

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # read by prometheus-client's file-backed values
    values.ValueClass = values.MultiProcessValue()
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    registry.register(_ServerProcesses())
    PlatformCollector(registry=registry)
    return registry, GcCounts().sync


#: seconds between a worker's copies of its collection counts into the shared files
GC_SYNC_S = 1.0


class GcCounts:
    """``python_gc_*`` for a worker of ``serve --workers N``, the families
    ``GCCollector`` gives one process: the interpreter's own tallies
    (``gc.get_stats()``) since this object was made, copied into multiprocess
    counters by :meth:`sync`.

    :meth:`sync` is called from ordinary code (the worker's loop), never from a
    ``gc.callbacks`` hook. A collection can start anywhere, also while
    prometheus-client's multiprocess lock (one per process, not reentrant) is
    held by a metric being updated or made; a hook that updates a metric then
    waits on that lock in the thread that holds it, for good. That froze
    workers, and the connections the kernel gave their sockets were never
    answered."""

    _KEYS = ("collections", "collected", "uncollectable")

    def __init__(self) -> None:
        self._counters = (
            Counter("python_gc_collections", "Number of times this generation was collected", ("generation",),
                    registry=None),
            Counter("python_gc_objects_collected", "Objects collected during gc", ("generation",), registry=None),
            Counter("python_gc_objects_uncollectable", "Uncollectable objects found during GC", ("generation",),
                    registry=None),
        )
        self._seen = gc.get_stats()  # a forked worker starts with its parent's tallies, not its own
        for counter in self._counters:  # every series from the start, as GCCollector shows them
            for gen in range(len(self._seen)):
                counter.labels(str(gen))

    def sync(self) -> None:
        """Add what the collector did since the last call."""
        now = gc.get_stats()
        for gen, (was, got) in enumerate(zip(self._seen, now)):
            for key, counter in zip(self._KEYS, self._counters):
                if got[key] > was[key]:
                    counter.labels(str(gen)).inc(got[key] - was[key])
        self._seen = now


class _ServerProcesses:
    """The ``process_*`` figures of a whole ``serve --workers N``: this worker's
    parent and the parent's live children, summed (``process_max_fds`` and
    ``process_start_time_seconds``: the parent's)."""

    _SUMMED = {"process_cpu_seconds", "process_resident_memory_bytes", "process_virtual_memory_bytes",
               "process_open_fds"}

    def collect(self) -> Iterator[Metric]:
        parent = os.getppid()
        families: dict[str, Metric] = {}
        for pid in (parent, *_children(parent)):
            try:
                found = list(ProcessCollector(pid=lambda p=pid: p, registry=None).collect())
            except OSError:
                continue  # ended meanwhile
            for family in found:
                mine = families.get(family.name)
                if mine is None:
                    families[family.name] = family
                elif family.name in self._SUMMED and mine.samples and family.samples:
                    s = mine.samples[0]
                    mine.samples[0] = s._replace(value=s.value + family.samples[0].value)
        yield from families.values()


def _children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``; none elsewhere)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:  # kernels with CONFIG_PROC_CHILDREN
            return [int(x) for x in fh.read().split()]
    except OSError:
        pass
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    if int(fh.read().rsplit(b")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    return out


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in the text format (``CONTENT_TYPE``), without ``_created`` series."""
    return generate_latest(_WithoutCreated(registry))


class _WithoutCreated:
    """A view of a registry that leaves out the ``_created`` series.

    prometheus-client adds a ``<name>_created`` gauge (the series' start time)
    beside every counter and histogram; Prometheus does not use it from the
    text format, and it doubles the series. Its own switch
    (``disable_created_metrics``) is process-wide, and the app must not change
    what other code in the process exposes, so the app's exposition drops them.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():  # fresh objects on every collect
            family.samples = [s for s in family.samples if s.name != family.name + "_created"]
            yield family
