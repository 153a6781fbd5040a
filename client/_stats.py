"""Loader statistics: live counters on the engine, frozen snapshots for users."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

__all__ = ["Counters", "Taken", "Stats", "snapshot"]


class Counters:
    """The engine's counters: written only on the engine's event loop, read anywhere."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.bytes = 0
        self.requests = 0
        self.inflight = 0
        self.window = 0
        self.rtt: float | None = None
        self.retries = 0
        self.failures = 0
        self.hedges = 0
        self.duplicates = 0
        self.peak_bytes = 0


class Taken:
    """The consumer's counters: written only by the thread that takes batches."""

    def __init__(self) -> None:
        self.samples = 0
        self.batches = 0
        self.skipped = 0
        self.stall = 0.0  # seconds the consumer waited for a batch


def snapshot(c: Counters, taken: Taken, ready_bytes: int) -> Stats:
    """Both sides' counters as one frozen :class:`Stats`."""
    elapsed = max(time.monotonic() - c.started, 1e-9)
    return Stats(
        elapsed=elapsed,
        samples=taken.samples,
        batches=taken.batches,
        bytes=c.bytes,
        samples_per_s=taken.samples / elapsed,
        bytes_per_s=c.bytes / elapsed,
        requests=c.requests,
        inflight=c.inflight,
        window=c.window,
        rtt=c.rtt,
        retries=c.retries,
        failures=c.failures,
        hedges=c.hedges,
        duplicates=c.duplicates,
        skipped=taken.skipped,
        ready_bytes=ready_bytes,
        peak_bytes=c.peak_bytes,
        stall=taken.stall,
        stall_fraction=min(1.0, taken.stall / elapsed),
    )


@dataclass(frozen=True, slots=True)
class Stats:
    """A snapshot of a loader's counters since it was created."""

    elapsed: float
    samples: int
    batches: int
    bytes: int
    samples_per_s: float
    bytes_per_s: float
    requests: int
    inflight: int
    window: int
    #: smoothed request latency (seconds), None before the first answer
    rtt: float | None
    retries: int
    failures: int
    hedges: int
    duplicates: int
    skipped: int
    #: bytes received and not yet taken by the consumer
    ready_bytes: int
    #: high-water mark of bytes in flight (reserved) plus ready
    peak_bytes: int
    #: seconds the consumer waited for data, and that as a fraction of elapsed
    stall: float
    stall_fraction: float

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self) -> str:
        rtt = "-" if self.rtt is None else f"{self.rtt * 1e3:.1f}ms"
        return (
            f"{self.samples} samples {self.samples_per_s:,.0f}/s {self.bytes_per_s / 1e6:,.1f} MB/s | "
            f"window {self.window} inflight {self.inflight} rtt {rtt} | stall {self.stall_fraction:.1%} | "
            f"retries {self.retries} failures {self.failures} hedges {self.hedges} skipped {self.skipped} | "
            f"peak {self.peak_bytes / 2**20:,.1f} MiB"
        )
