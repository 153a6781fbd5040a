"""Shared by the benchmarks: a dataset in a store, timing, and tables."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from dataferry.schema._table import format_table

__all__ = ["Measurement", "measure_loader", "prepared_store", "table", "cpu_seconds", "announced", "data_server",
           "all_ids", "store_samples", "live_descendants", "stat_fields", "loader_epoch", "prefetch_of", "engine_count"]


@dataclass(frozen=True, slots=True)
class Measurement:
    samples: int  # after the first batch
    bytes: int
    seconds: float  # steady state: from the first batch to the last
    first_batch: float  # seconds from start to the first batch
    cpu: float  # client CPU seconds over the whole run, its child processes (DataLoader workers) included
    first_samples: int = 0  # samples in the first batch
    #: requests (or streams) in flight: the mean and peak over the run, as the loader reports them
    #: (:func:`measure_loader`); None where it reports none
    inflight: float | None = None
    inflight_peak: float | None = None
    per_request: float | None = None  # samples a request carries, on average

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def total_per_s(self) -> float:
        """What a user sees: every sample, the first batch's too, over the wall time from creating the loader
        (``make()``) to the last batch."""
        wall = self.first_batch + self.seconds
        return (self.samples + self.first_samples) / wall if wall > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    @property
    def cpu_per_1k(self) -> float:
        """CPU seconds per 1,000 samples delivered, the first batch's included (its CPU is in ``cpu``)."""
        return self.cpu / max(self.samples + self.first_samples, 1) * 1000


def cpu_seconds(*, exclude: frozenset[int] = frozenset()) -> float:
    """CPU seconds (user + system) of this process and its descendants so far,
    but for the live ones in ``exclude`` (and theirs: servers started before a
    measurement).

    ``os.times()`` counts this process and its *reaped* children; a child still
    running (a persistent DataLoader worker, with the ``curl`` it reaped
    counted in its own children's times) is read from ``/proc``. A process is
    counted once: alive in ``/proc``, or reaped in ``os.times()``.
    """
    live = sum(cpu for pid, cpu in _live_descendants().items() if pid not in exclude)
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + live


def live_descendants() -> frozenset[int]:
    """The pids of this process's live descendants."""
    return frozenset(_live_descendants())


def _live_descendants() -> dict[int, float]:
    """pid -> CPU seconds of each live descendant of this process, with the
    children it has reaped, not counting those of its own live descendants
    (Linux ``/proc``; none where there is none)."""
    children, cpu = _proc_table()
    return {pid: cpu[pid] for pid in _descendants(os.getpid(), children)}


def stat_fields(path: str) -> list[str] | None:
    """The fields of a ``/proc/.../stat`` file after the command name (the state,
    field 3, first; utime and stime at [11] and [12]), or None if it is gone."""
    try:
        with open(path) as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _proc_table() -> tuple[dict[int, list[int]], dict[int, float]]:
    """From ``/proc``: parent pid -> its children, and pid -> CPU seconds of the
    process and of the children it has reaped (utime + stime + cutime + cstime)."""
    children: dict[int, list[int]] = {}
    cpu: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return {}, {}
    for name in names:
        fields = stat_fields(f"/proc/{name}/stat")
        if fields is None:  # gone meanwhile
            continue
        # fields[0] is the state (field 3): ppid is field 4, utime..cstime fields 14-17
        children.setdefault(int(fields[1]), []).append(int(name))
        cpu[int(name)] = sum(int(f) for f in fields[11:15]) / tick
    return children, cpu


def _descendants(root: int, children: dict[int, list[int]]) -> list[int]:
    found, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, ())
    return found


def measure_loader(make: Callable[[], Iterator], *, seconds: float, max_samples: int) -> Measurement:
    """Iterate the batches of ``make()`` for about ``seconds`` (or ``max_samples``).

    Each batch is ``(n_samples, n_bytes)``. Throughput is counted from the first batch to the last, so it is
    the steady state; the time to first batch is reported on its own. ``max_samples`` counts the first batch's
    samples too. CPU covers the whole run, closing included, and every process the loader started. Where the
    iterator has ``in_flight() -> (mean, peak, samples per request)``, the measurement carries it (read before
    closing).
    """
    servers = live_descendants()  # started before the run: not the loader's
    c0 = cpu_seconds(exclude=servers)
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
            if last - first >= seconds or samples + first_samples >= max_samples:
                break
        probe = getattr(it, "in_flight", None)
        inflight = probe() if probe is not None else (None, None, None)
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()  # its CPU counts, its time does not: a worker may finish a batch first
        del it
        gc.collect()  # a DataLoader in a reference cycle shuts its persistent workers down here
    if first is None:
        first = last = time.perf_counter()
    return Measurement(samples, nbytes, last - first, first - t0, cpu_seconds(exclude=servers) - c0, first_samples,
                       *inflight)


def loader_epoch(url: str, dataset: str, batch_size: int, *,
                 at_first: Callable[[], Callable[[], dict] | None] | None = None) -> dict:
    """One epoch of a :class:`~dataferry.client.Loader` on ``url`` in this process, timed from creating it.

    ``at_first`` is called at the first batch and may return a callable whose dict, called at the end of
    the epoch, is merged into the result (what a bench counts over the epoch after the first batch). The
    result: ``first_batch_s``; ``total_per_s`` (every sample over the wall time from creating the Loader to
    its last batch: what a user sees) and ``samples_per_s`` (after the first batch); ``cpu_us_per_sample``
    (this process, every thread, from the first batch to the end, per sample) and ``setup_cpu_ms`` (before
    the first batch); and the engine's window over the whole run from ``Loader.stats()``: requests, ids
    per request, the mean requests in flight (the answered requests' summed latencies over the time:
    Little's law), their mean latency, the shares of the time the engine had requests to send but its
    window (``window_full_share``) or its byte budget (``budget_full_share``) was full, and the share the
    consumer waited for a batch (``wait_share``); and the requests retried, hedged and failed.
    """
    from dataferry.client import Loader

    c0, t0 = time.process_time(), time.perf_counter()
    samples, extra = 0, None
    with Loader(url, dataset, batch_size=batch_size) as loader:
        it = iter(loader)
        first = len(next(it))
        c1, t1 = time.process_time(), time.perf_counter()
        end = at_first() if at_first is not None else None
        for batch in it:
            samples += len(batch)
        c2, t2 = time.process_time(), time.perf_counter()
        extra = end() if end is not None else {}
        s = loader.stats()
    elapsed = max(s.elapsed, 1e-9)
    served = s.received / max(s.bytes, 1) * s.samples  # samples received, a sample's mean size from those taken
    return {
        "t0": t0, "t1": t1,  # perf_counter() at creating the Loader and at its first batch
        "first_batch_s": t1 - t0,
        "first_samples": first,
        "samples": first + samples,
        "total_per_s": (first + samples) / (t2 - t0),
        "samples_per_s": samples / (t2 - t1) if t2 > t1 else 0.0,
        "cpu_us_per_sample": (c2 - c1) / samples * 1e6 if samples else 0.0,
        "setup_cpu_ms": (c1 - c0) * 1e3,
        "served": served,
        "requests": s.requests,
        "ids_per_request": served / s.answers if s.answers else 0.0,
        "mean_inflight": s.latency_sum / elapsed,
        "latency_ms": (s.mean_latency or 0.0) * 1e3,
        "window_full_share": s.window_full / elapsed,
        "budget_full_share": s.budget_full / elapsed,
        "wait_share": s.wait_fraction,
        "retries": s.retries, "hedges": s.hedges, "failures": s.failures,
        **extra,
    }


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


def store_samples(store_url: str, dataset: str, ids: Sequence[int] | None = None,
                  chunk: int = 256) -> Iterator[tuple[int, bytes, int]]:
    """``(id, stored bytes, label)`` of ``ids`` (default: the ``all`` split), in that order, read ``chunk``
    at a time from one open store."""
    from dataferry.schema import Sample, open_store

    async def fetch(store, wanted: list[int]) -> dict[int, Sample]:
        got = {}
        async for result in store.fetch(dataset, wanted):
            if not isinstance(result, Sample):
                raise result
            got[result.id] = result
        return got

    order = list(ids) if ids is not None else all_ids(store_url, dataset)
    with asyncio.Runner() as runner:
        store = runner.run(open_store(store_url, create=False))
        try:
            for start in range(0, len(order), chunk):
                wanted = order[start:start + chunk]
                got = runner.run(fetch(store, wanted))
                for i in wanted:  # the given order, not completion order
                    yield i, got[i].data, got[i].label
        finally:
            runner.run(store.close())


@contextlib.contextmanager
def prepared_store(kind: str, images: int, dataset: str = "bench", store_url: str | None = None):
    """Yield ``(url, (host, port) or None, ingest report)`` of a store holding
    ``images`` synthetic JPEGs (the same bytes for every kind: the generator is
    seeded). ``kind="cassandra"`` starts a throwaway Cassandra 5.0 node unless
    ``store_url`` is given; ``"sqlite"`` uses a temp file. Ingest is
    idempotent, so a given store is filled once.
    """
    from dataferry.schema import IngestOptions, ingest, make_synthetic, open_store, parse_store_url

    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-bench-"))
        if store_url is None and kind == "cassandra":
            from ._devcassandra import DevCassandra

            server = stack.enter_context(DevCassandra(os.path.join(tmp, "cassandra")))
            store_url = server.url("bench")
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


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (the workers of ``serve --workers N``), from ``/proc``."""
    return [pid, *_descendants(pid, _proc_table()[0])]


def process_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by process ``pid``, its live
    descendants (a server's workers) and the children each has reaped (a
    worker that was replaced): Linux ``/proc``. OSError if ``pid`` is gone."""
    children, cpu = _proc_table()
    if pid not in cpu:
        raise ProcessLookupError(f"no process {pid}")
    return sum(cpu.get(p, 0.0) for p in [pid, *_descendants(pid, children)])


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


def data_server(store_url: str, *, host: str = "127.0.0.1", wrap: Sequence[str] = (), args: Sequence[str] = ()):
    """Run ``dataferry serve`` on ``store_url`` in its own process, listening on
    ``host``; yield ``(host, port)`` (a :class:`Listening`, with the ``pid``). ``wrap`` prefixes the command (e.g. ``ip
    netns exec NS``); ``args`` are more of its flags (``--workers 2``)."""
    import sys

    cmd = [*wrap, sys.executable, "-m", "dataferry.server", "--store", store_url, "--host", host, "--port", "0",
           "--no-access-log", "--log-level", "WARNING", "--max-concurrent", "1024", *args]
    return announced(cmd, "the data server")


def engine_count(engine: str) -> int | None:
    """A bench's engine setting: ``thread``: 0 (``Loader``, the engine in this process); ``process``: 1
    (``ProcessLoader``, one engine process); ``process:N``: N engine processes; None: not a setting."""
    kind, _, n = engine.partition(":")
    if kind == "thread" and not n:
        return 0
    if kind == "process" and (not n or (n.isdigit() and int(n) >= 1)):
        return int(n or 1)
    return None


def prefetch_of(setting: str):
    """``Prefetch`` from ``"default"`` or ``"max_bytes=2GiB,request_size=64,tune=false"``; ValueError naming a bad part."""
    from dataferry.client import Prefetch
    from dataferry.schema import DataferryError, parse_size

    if setting == "default":
        return Prefetch()
    kw = {}
    for part in setting.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key in ("max_bytes", "sample_bytes_hint"):
            kw[key] = parse_size(value)
        elif key in ("max_inflight", "initial_inflight", "request_size"):
            kw[key] = int(value) if value.strip().isdigit() else None
        elif key == "tune" and value.strip().lower() in ("true", "false"):
            kw[key] = value.strip().lower() == "true"
        else:
            raise ValueError(f"--prefetch: {part!r} is not a Prefetch setting (max_bytes, sample_bytes_hint, "
                             "max_inflight, initial_inflight, request_size, tune)")
    try:
        return Prefetch(**kw)
    except (DataferryError, TypeError) as exc:
        raise ValueError(f"--prefetch {setting!r}: {exc}") from None
