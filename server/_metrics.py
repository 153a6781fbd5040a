"""Prometheus metrics, hand-written: counters, gauges and histograms with labels,
rendered in the text exposition format (version 0.0.4). No dependency.

Every label value comes from a fixed set (route templates, status codes, error
names, store operations), never from the request, so series stay few.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence

__all__ = ["Metrics", "Counter", "Gauge", "Histogram", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: seconds; store reads near the store take ~1 ms, across a bad link ~100 ms
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


class Counter:
    kind = "counter"

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.labelnames = name, help, tuple(labels)
        self._values: dict[tuple[str, ...], float] = {}

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        return tuple(str(labels[n]) for n in self.labelnames)

    def inc(self, amount: float = 1, **labels: object) -> None:
        key = self._key(labels)
        self._values[key] = self._values.get(key, 0) + amount

    def value(self, **labels: object) -> float:
        return self._values.get(self._key(labels), 0)

    def samples(self) -> Iterator[str]:
        if not self._values and not self.labelnames:
            yield f"{self.name} 0"
        for key, v in sorted(self._values.items()):
            yield f"{self.name}{_labels(self.labelnames, key)} {_num(v)}"


class Gauge(Counter):
    kind = "gauge"

    def dec(self, amount: float = 1, **labels: object) -> None:
        self.inc(-amount, **labels)


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help: str, labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.labelnames = name, help, tuple(labels)
        self.buckets = tuple(sorted(buckets))
        self._series: dict[tuple[str, ...], list] = {}  # key -> [counts per bucket, sum, count]

    def observe(self, value: float, **labels: object) -> None:
        key = tuple(str(labels[n]) for n in self.labelnames)
        s = self._series.get(key)
        if s is None:
            s = self._series[key] = [[0] * len(self.buckets), 0.0, 0]
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.buckets):
            s[0][i] += 1
        s[1] += value
        s[2] += 1

    def count(self, **labels: object) -> int:
        s = self._series.get(tuple(str(labels[n]) for n in self.labelnames))
        return s[2] if s else 0

    def samples(self) -> Iterator[str]:
        for key, (counts, total, n) in sorted(self._series.items()):
            cum = 0
            for le, c in zip(self.buckets, counts):
                cum += c
                bucket = _labels(self.labelnames, key, 'le="%s"' % _num(le))
                yield f"{self.name}_bucket{bucket} {cum}"
            bucket = _labels(self.labelnames, key, 'le="+Inf"')
            yield f"{self.name}_bucket{bucket} {n}"
            yield f"{self.name}_sum{_labels(self.labelnames, key)} {_num(total)}"
            yield f"{self.name}_count{_labels(self.labelnames, key)} {n}"


class Metrics:
    """The server's metrics, one instance per application."""

    def __init__(self) -> None:
        p = "dataferry_server_"
        self.requests = Counter(p + "requests_total", "HTTP requests by route template, method and status.",
                                ("route", "method", "status"))
        self.in_flight = Gauge(p + "requests_in_flight", "HTTP requests being served now.")
        self.errors = Counter(p + "errors_total", "Error responses and stream errors by error name.", ("error",))
        self.samples = Counter(p + "samples_served_total", "Samples sent in batch fetch responses.")
        self.not_found = Counter(p + "samples_not_found_total", "Ids answered with a not-found record.")
        self.bytes = Counter(p + "bytes_served_total", "Response body bytes written by data endpoints.")
        self.store_latency = Histogram(
            p + "store_latency_seconds",
            "Store call latency by operation; fetch_first is a batch fetch's time to its first sample, "
            "fetch its time to the last.",
            ("op",),
        )
        self.store_errors = Counter(p + "store_errors_total", "Store failures by kind.", ("kind",))

    def all(self):
        return (self.requests, self.in_flight, self.errors, self.samples, self.not_found, self.bytes,
                self.store_latency, self.store_errors)

    def render(self) -> str:
        lines: list[str] = []
        for m in self.all():
            lines.append(f"# HELP {m.name} {m.help}")
            lines.append(f"# TYPE {m.name} {m.kind}")
            lines.extend(m.samples())
        return "\n".join(lines) + "\n"
