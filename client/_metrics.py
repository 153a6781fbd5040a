"""The training process's loader figures as Prometheus metrics (opt in).

::

    metrics = ClientMetrics()                  # a registry of its own (never the global one)
    metrics.watch(loader, "train")             # any number of loaders, label loader="train"
    metrics.serve(9481)                        # GET http://host:9481/metrics

or ``ClientMetrics(registry=yours)`` to mount them on a registry you already
expose. Nothing is counted twice: a custom collector reads each loader's
:meth:`Loader.stats` and its last :class:`Interval` at scrape time. The
families are listed in ``deploy/OPERATIONS.md`` (next to the server's); a
test scrapes them over HTTP and holds the two together.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from dataferry.schema import ConfigError

from ._attribution import LIMITS

__all__ = ["ClientMetrics", "serve_metrics"]

_P = "dataferry_client_"

#: (name, help, Stats field): cumulative counts since the consumer's first get()
_COUNTERS = (
    ("samples", "Samples handed to the training loop.", "samples"),
    ("batches", "Batches handed to the training loop.", "batches"),
    ("bytes", "Bytes of sample data handed to the training loop.", "bytes"),
    ("received_bytes", "Bytes of sample data received from the source.", "received"),
    ("wait_seconds", "Seconds the consumer waited in the loader's get() (an iterator's feeder, with one).", "wait"),
    ("decode_wait_seconds", "Seconds the training loop waited on an iterator's decode.", "decode_wait"),
    ("decode_busy_seconds", "Busy seconds of TorchIterator's decode threads, summed.", "decode_busy"),
    ("requests", "Requests sent to the source.", "requests"),
    ("retries", "Samples sent again after a failed request.", "retries"),
    ("failures", "Failed requests.", "failures"),
    ("hedges", "Hedged (duplicate) requests sent.", "hedges"),
    ("skipped", "Samples skipped by the error policy.", "skipped"),
    ("window_full_seconds", "Seconds the engine had requests to send but its window was full.", "window_full"),
    ("budget_full_seconds", "Seconds the engine had requests to send but its byte budget was full.", "budget_full"),
)

#: (name, help, Stats field): gauges as of now
_GAUGES = (
    ("window", "Requests the engine's window allows in flight.", "window"),
    ("requests_in_flight", "Requests in flight now.", "inflight"),
    ("ready_bytes", "Bytes received and not yet taken by the training loop.", "ready_bytes"),
    ("request_latency_seconds", "Smoothed request latency.", "request_latency"),
    ("min_latency_seconds", "Lowest recent request latency: the round-trip estimate.", "min_latency"),
    ("decode_queue", "Batches in the iterator's decode queue.", "decode_queue"),
    ("decode_threads", "The iterator's decode threads.", "decode_threads"),
)


class ClientMetrics:
    """Loaders' figures as Prometheus metrics, on ``registry`` (default: a new
    one of its own); :meth:`serve` exposes it over HTTP."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self._loaders: dict[str, weakref.ref] = {}
        self._lock = threading.Lock()
        self._server = None
        #: the port :meth:`serve` listens on (None: not served)
        self.port: int | None = None
        self.registry.register(_Collector(self))

    def watch(self, loader, name: str | None = None) -> ClientMetrics:
        """Export ``loader`` with the label ``loader=name`` (default: its
        dataset and split, ``"imagenet/train"``); a collected loader drops out."""
        name = name or f"{loader.dataset}/{loader.split}"
        with self._lock:
            old = self._loaders.get(name)
            if old is not None and old() is not None and old() is not loader:
                raise ConfigError(f"a loader named {name!r} is already exported: pass another name=")
            self._loaders[name] = weakref.ref(loader)
        return self

    def loaders(self) -> list[tuple[str, object]]:
        with self._lock:
            pairs = [(n, r()) for n, r in self._loaders.items()]
            for n, loader in pairs:
                if loader is None:
                    del self._loaders[n]
        return [(n, loader) for n, loader in pairs if loader is not None and not loader._closed]

    def serve(self, port: int = 0, addr: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``addr:port`` (0: a free port) in a daemon
        thread; the port it listens on. Loopback by default: pass
        ``addr="0.0.0.0"`` for a scraper on another host."""
        if self._server is not None:
            raise ConfigError("these metrics are already served")
        try:
            self._server, _thread = start_http_server(port, addr, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"cannot serve client metrics on {addr}:{port}: {exc}") from exc
        self.port = self._server.server_address[1]
        return self.port

    def close(self) -> None:
        """Stop serving (idempotent); the registry stays."""
        server, self._server = self._server, None
        self.port = None
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> ClientMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def serve_metrics(loader, port: int = 0, addr: str = "127.0.0.1", *, name: str | None = None) -> ClientMetrics:
    """One loader's metrics served on ``addr:port``: ``serve_metrics(loader, 9481)``.
    The returned :class:`ClientMetrics` has the bound port as ``.port``."""
    metrics = ClientMetrics().watch(loader, name)
    metrics.serve(port, addr)
    return metrics


class _Collector:
    """Reads the watched loaders at scrape time (prometheus-client's custom collector)."""

    def __init__(self, metrics: ClientMetrics) -> None:
        self._metrics = metrics  # a mounted registry keeps exporting after the ClientMetrics is dropped

    def collect(self) -> Iterator[Metric]:
        loaders = self._metrics.loaders()
        snaps = [(name, loader.stats(), loader.intervals(), loader._attributor.seconds) for name, loader in loaders]
        for name, help_, field in _COUNTERS:
            fam = CounterMetricFamily(_P + name, help_, labels=("loader",))
            for label, s, _, _ in snaps:
                fam.add_metric((label,), float(getattr(s, field)))
            yield fam
        for name, help_, field in _GAUGES:
            fam = GaugeMetricFamily(_P + name, help_, labels=("loader",))
            for label, s, _, _ in snaps:
                value = getattr(s, field)
                if value is not None:
                    fam.add_metric((label,), float(value))
            yield fam
        limited = CounterMetricFamily(_P + "limited_seconds", "Seconds of the intervals attributed to each limit.",
                                      labels=("loader", "limit"))
        limit = GaugeMetricFamily(_P + "limit", "What limited the last interval: 1 for its limit, 0 for the others.",
                                  labels=("loader", "limit"))
        rate = GaugeMetricFamily(_P + "interval_samples_per_second", "Samples/s handed out in the last interval.",
                                 labels=("loader",))
        stall = GaugeMetricFamily(_P + "interval_loop_wait_ratio",
                                  "Share of the last interval the training loop waited for data.", labels=("loader",))
        for label, _, intervals, seconds in snaps:
            for lim in LIMITS:
                limited.add_metric((label, lim), seconds.get(lim, 0.0))
            if intervals:
                last = intervals[-1]
                for lim in LIMITS:
                    limit.add_metric((label, lim), 1.0 if last.limit == lim else 0.0)
                rate.add_metric((label,), last.stats.samples_per_s)
                stall.add_metric((label,), last.stats.loop_wait_fraction)
        yield from (limited, limit, rate, stall)
