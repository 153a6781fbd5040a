"""Shared by the benchmarks: a dataset in a store, timing, and tables."""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from dataferry.schema._table import format_table

__all__ = ["Measurement", "measure_loader", "prepared_store", "median_of", "table", "cpu_seconds", "announced",
           "data_server", "all_ids"]


@dataclass(frozen=True, slots=True)
class Measurement:
    samples: int  # after the first batch
    bytes: int
    seconds: float  # steady state: from the first batch to the last
    first_batch: float  # seconds from start to the first batch
    cpu: float  # client CPU seconds over the whole run, reaped child processes (DataLoader workers) included
    first_samples: int = 0  # samples in the first batch

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def cpu_per_1k(self) -> float:
        """CPU seconds per 1,000 samples delivered, the first batch's included (its CPU is in ``cpu``)."""
        return self.cpu / max(self.samples + self.first_samples, 1) * 1000


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure_loader(make: Callable[[], Iterator], *, seconds: float, max_samples: int) -> Measurement:
    """Iterate the batches of ``make()`` for about ``seconds`` (or ``max_samples``).

    Each batch is ``(n_samples, n_bytes)``. Throughput is counted from the first batch to the last, so it is
    the steady state; the time to first batch is reported on its own. CPU covers the whole run, closing included.
    """
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    first = last = None
    samples = nbytes = first_samples = 0
    it = make()
    try:
        for n, b in it:
            last = time.perf_counter()
            if first is None:
                first = last
                first_samples = n
            else:
                samples += n
                nbytes += b
            if last - first >= seconds or samples >= max_samples:
                break
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # its CPU counts (workers are reaped here), its time does not: a worker may finish a batch first
    if first is None:
        first = last = time.perf_counter()
    return Measurement(samples, nbytes, last - first, first - t0, cpu_seconds() - c0, first_samples)


def median_of(runs: list[Measurement]) -> Measurement:
    def med(f):
        return statistics.median(f(r) for r in runs)

    # the run whose throughput is the median, with median first-batch and CPU
    ordered = sorted(runs, key=lambda r: r.samples_per_s)
    mid = ordered[len(ordered) // 2]
    return Measurement(mid.samples, mid.bytes, mid.seconds, med(lambda r: r.first_batch), mid.cpu, mid.first_samples)


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table (the one formatter, shared with the CLI)."""
    return format_table(header, rows, markdown=True)


def all_ids(store_url: str, dataset: str = "bench") -> list[int]:
    """The ids of ``dataset``'s ``all`` split, in stored order."""
    from dataferry.schema import ALL_SPLIT, open_store

    async def go():
        async with await open_store(store_url, create=False) as store:
            return (await store.read_split(dataset, ALL_SPLIT)).ids.tolist()

    return asyncio.run(go())


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
            from ._devcassandra import DevCassandra

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


class Listening(tuple):
    """``(host, port)`` of a server process that :func:`announced` started, with its ``pid``."""

    pid: int

    def __new__(cls, host: str, port: int, pid: int) -> Listening:
        self = super().__new__(cls, (host, port))
        self.pid = pid
        return self

    def __reduce__(self):  # it travels to the bench's measuring processes
        return (Listening, (*self, self.pid))


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process ``pid`` has used so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    # fields[0] is the state (field 3): utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def announced(cmd: Sequence[str], what: str, *, stderr=None):
    """Run ``cmd``, a server that prints its address on its first line of stdout
    (``listening on HOST:PORT``, or a URL); yield its :class:`Listening`
    ``(host, port)``, which also carries the ``pid``; stop it on exit (SIGTERM,
    SIGKILL after 15 s). ``what`` names it in errors; ``stderr`` is passed to
    :class:`subprocess.Popen`."""
    import re
    import subprocess

    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, stderr=stderr, text=True)
    try:
        line = proc.stdout.readline()
        found = re.search(r"(?:https?://|listening on )\[?([\w.:-]+?)\]?:(\d+)", line)
        if found is None:
            proc.kill()
            raise RuntimeError(f"{what} did not start ({' '.join(cmd)}): {line.strip() or 'no output'}")
        yield Listening(found.group(1), int(found.group(2)), proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def data_server(store_url: str, *, host: str = "127.0.0.1", wrap: Sequence[str] = ()):
    """Run ``dataferry serve`` on ``store_url`` in its own process, listening on
    ``host``; yield ``(host, port)`` (a :class:`Listening`, with the ``pid``). ``wrap`` prefixes the command (e.g. ``ip
    netns exec NS``)."""
    import sys

    cmd = [*wrap, sys.executable, "-m", "dataferry.server", "--store", store_url, "--host", host, "--port", "0",
           "--no-access-log", "--log-level", "WARNING", "--max-concurrent", "1024"]
    return announced(cmd, "the data server")
