"""The server's Prometheus metrics, on ``prometheus-client``.

Each application gets its own ``CollectorRegistry`` (``new_registry``, kept
under the ``REGISTRY`` app key), never the process-global one, so two apps in
one process count apart and embedding the app adds nothing to what the host
process exposes. Beside the service's metrics (:class:`Metrics`) the registry
holds the process (memory, CPU, file descriptors), GC and platform
collectors. ``deploy/OPERATIONS.md`` lists every family; a test scrapes the
real app and holds the two together.

Every label value comes from a fixed set (route templates, status codes, error
names, store operations), never from the request, so series stay few.
"""

from __future__ import annotations

from collections.abc import Iterator
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

__all__ = ["Metrics", "new_registry", "exposition", "CONTENT_TYPE"]

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
            in_flight=Gauge(_P + "requests_in_flight", "HTTP requests being served now.", registry=r),
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
