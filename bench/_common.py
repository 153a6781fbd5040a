"""Shared by the benchmarks: a dataset in a store, timing, and tables."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["Measurement", "measure_loader", "prepared_store", "median_of", "table", "cpu_seconds"]


@dataclass(frozen=True, slots=True)
class Measurement:
    samples: int
    bytes: int
    seconds: float  # steady state: from the first batch to the last
    first_batch: float  # seconds from start to the first batch
    cpu: float  # process CPU seconds over the whole run

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def cpu_per_1k(self) -> float:
        return self.cpu / max(self.samples, 1) * 1000


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure_loader(make: Callable[[], Iterator], *, seconds: float, max_samples: int) -> Measurement:
    """Iterate the batches of ``make()`` for about ``seconds`` (or ``max_samples``).

    Each batch is ``(n_samples, n_bytes)``. Throughput is counted after the first batch, so it is the steady
    state; the time to first batch is reported on its own.
    """
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    first = None
    samples = nbytes = 0
    it = make()
    try:
        for n, b in it:
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                samples += n
                nbytes += b
            if now - first >= seconds or samples >= max_samples:
                break
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    end = time.perf_counter()
    return Measurement(samples, nbytes, end - (first or end), (first or end) - t0, cpu_seconds() - c0)


def median_of(runs: list[Measurement]) -> Measurement:
    def med(f):
        return statistics.median(f(r) for r in runs)

    # the run whose throughput is the median, with median first-batch and CPU
    ordered = sorted(runs, key=lambda r: r.samples_per_s)
    mid = ordered[len(ordered) // 2]
    return Measurement(mid.samples, mid.bytes, mid.seconds, med(lambda r: r.first_batch), mid.cpu)


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "| " + " | ".join(c.rjust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), sep, *map(line, rows)])


@contextlib.contextmanager
def prepared_store(kind: str, images: int, dataset: str = "bench", store_url: str | None = None):
    """Yield ``(url, (host, port) or None, ingest report)`` of a store holding
    ``images`` synthetic JPEGs (the same bytes for every kind: the generator is
    seeded). ``kind="cassandra"`` starts a throwaway Cassandra 1.2 unless
    ``store_url`` is given; ``"sqlite"`` uses a temp file. Ingest is
    idempotent, so a given store is filled once.
    """
    from dataferry.schema import IngestOptions, ingest, make_synthetic, open_store, parse_store_url

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-bench-"))
        if store_url is None and kind == "cassandra":
            from dataferry.schema._devcassandra import DevCassandra

            server = stack.enter_context(DevCassandra(os.path.join(tmp, "cassandra")))
            store_url = server.url("bench", protocol_version=1)  # 1.2 speaks v1 only: skip negotiation
        elif store_url is None:
            store_url = f"sqlite://{tmp}/bench.db"
        opts = parse_store_url(store_url)
        if kind == "cassandra":
            from dataferry.schema._ddl import apply_schema

            asyncio.run(apply_schema(opts))
        folder = os.path.join(tmp, "images")
        make_synthetic(folder, images, classes=10, seed=0)

        async def fill():
            async with await open_store(store_url) as store:
                return await ingest(store, folder, dataset, IngestOptions(), progress=False)

        report = asyncio.run(fill())
        addr = (opts.hosts[0], opts.port) if kind == "cassandra" else None
        yield store_url, addr, report


@contextlib.contextmanager
def data_server(store_url: str):
    """Run ``dataferry serve`` on ``store_url`` in its own process; yield ``(host, port)``."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "dataferry.server", "--store", store_url, "--port", "0",
           "--no-access-log", "--log-level", "WARNING", "--max-concurrent", "1024"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"the data server did not start: {line.strip() or 'no output'}")
        host, port = line.rsplit("//", 1)[1].strip().rsplit(":", 1)
        yield host, int(port)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()
