"""Client CPU per sample on the HTTP path: what the training process pays to receive.

    python -m dataferry.bench.client_cpu [--images 1024] [--epochs 3] [--repeats 5]
                                         [--rtts 0] [--batch-size 256] [--data synthetic|random]
                                         [--pin] [--floor] [--unverified] [--no-memory] [--fetch-sizes 4,8,32,128]
                                         [--loader-sizes 32,128] [--perf] [--replay] [--lines IDS]

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass

from ._common import data_server, table

__all__ = ["main", "Run", "measure", "recv_floor", "perf_shares"]

SAMPLE_BYTES = 110_000
#: samples the floor receives at least (2.2 GB: enough CPU ticks for a steady user/system split)
FLOOR_SAMPLES = 20_000


@dataclass(frozen=True, slots=True)
class Run:
    samples: int  # delivered after the first batch
    cpu_s: float  # this process's CPU over the same span
    wall_s: float
    user_s: float = 0.0
    sys_s: float = 0.0
    requests: int = 0  # requests the engine sent over the same span (0: not counted)

    @property
    def us_per_sample(self) -> float:
        return self.cpu_s / max(self.samples, 1) * 1e6

    @property
    def user_us(self) -> float:
        return self.user_s / max(self.samples, 1) * 1e6

    @property
    def sys_us(self) -> float:
        return self.sys_s / max(self.samples, 1) * 1e6

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


def _usage() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime


def measure(source, dataset: str, epochs: int, batch_size: int, warmup: int = 1, request_size: int | None = None,
            profile: dict[str, float] | None = None, verify: bool = True) -> Run:
    """One Loader over ``source``: ``warmup`` epochs, then ``epochs`` measured
    (from the first batch after the warm-up to the last); ``request_size``
    fixes the ids per request (None: the tuner's). ``profile``: ``perf record``
    this process over the same span, and put each symbol's share of its CPU there. ``verify``
    False: ``ErrorPolicy(verify=False)`` (no checksums asked for, none checked)."""
    from dataferry.client import ErrorPolicy, Loader, Prefetch

    with Loader(source, dataset, batch_size=batch_size, prefetch=Prefetch(request_size=request_size),
                errors=ErrorPolicy(verify=verify)) as loader:
        samples = 0
        u0 = s0 = t0 = None
        r0 = 0
        for epoch in range(warmup + epochs):
            for batch in loader:
                if epoch < warmup:
                    continue
                if t0 is None:
                    perf = None if profile is None else _Perf()
                    (u0, s0), t0 = _usage(), time.perf_counter()
                    r0 = loader.stats().requests
                    continue
                samples += len(batch)
        (u1, s1), wall = _usage(), time.perf_counter() - t0
        requests = loader.stats().requests - r0
    if profile is not None and perf is not None:
        profile.update(perf.stop())
    return Run(samples, (u1 - u0) + (s1 - s0), wall, u1 - u0, s1 - s0, requests)


def count_lines(source, dataset: str, epochs: int, batch_size: int, request_size: int | None) -> tuple[int, list]:
    """A Loader over ``source`` for ``epochs`` epochs, its Python lines counted (``LineCounter``)
    from its start to its close: the samples the engine received (the look-ahead's included: what
    the lines were run for) and the lines per sample by function."""
    from dataferry.client import Loader, Prefetch

    from ._threadprof import LineCounter

    counter = LineCounter()
    counter.install()
    counter.on = True
    try:
        with Loader(source, dataset, batch_size=batch_size, prefetch=Prefetch(request_size=request_size)) as loader:
            n = 0
            for _ in range(epochs):
                for batch in loader:
                    n += len(batch)
            st = loader.stats()
    finally:
        counter.on = False
        counter.remove()
    received = round(n * st.received / max(st.bytes, 1))  # the samples taken, scaled by bytes received / taken
    return received, counter.per(received)


class _Perf:
    """``perf record`` of this process (every thread) from now to :meth:`stop`: each symbol's
    share of the samples (``"dso symbol"``: fraction)."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="dataferry-perf-")
        self._out = os.path.join(self._dir.name, "perf.data")
        self._proc = subprocess.Popen(["perf", "record", "-q", "-F", "999", "-p", str(os.getpid()), "-o", self._out],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # attached (samples before it are lost, not wrong)

    def stop(self) -> dict[str, float]:
        import signal

        self._proc.send_signal(signal.SIGINT)
        self._proc.wait(30)
        report = subprocess.run(["perf", "report", "-i", self._out, "--no-children", "--sort", "dso,sym", "--stdio",
                                 "-q"], capture_output=True, text=True, timeout=120).stdout
        self._dir.cleanup()
        return perf_shares(report)


def perf_shares(report: str) -> dict[str, float]:
    """``perf report --no-children --sort dso,sym --stdio -q``'s lines as ``{"library symbol": share}``."""
    shares: dict[str, float] = {}
    for line in report.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0].endswith("%") and parts[-2] in ("[k]", "[.]"):
            dso = parts[1].removesuffix(".so.1.0").split(".cpython")[0].strip("[]")
            key = f"{dso} {parts[-1]}"
            shares[key] = shares.get(key, 0.0) + float(parts[0][:-1]) / 100
    return shares


def _print_profile(profiles: list[dict[str, float]], runs: list[Run], top: int = 12) -> None:
    """The symbols' median share of each run's CPU, as us per sample; and by library."""
    us = statistics.median(r.us_per_sample for r in runs)
    keys = {k for p in profiles for k in p}
    if not keys:
        print("  perf recorded nothing (is it allowed here? /proc/sys/kernel/perf_event_paranoid)", flush=True)
        return
    med = {k: statistics.median(p.get(k, 0.0) for p in profiles) for k in keys}
    by_dso: dict[str, float] = {}
    for k, v in med.items():
        dso = k.split(" ")[0]
        by_dso[dso] = by_dso.get(dso, 0.0) + v
    print(f"  perf: median share of {len(profiles)} runs' samples, as us of the median {us:.1f} us/sample")
    for k, v in sorted(med.items(), key=lambda kv: -kv[1])[:top]:
        print(f"    {v * us:5.1f} us  {v * 100:4.1f}%  {k}")
    print("    by library: " + ", ".join(f"{d} {v * us:.1f}" for d, v in sorted(by_dso.items(), key=lambda kv: -kv[1])
                                        if v >= 0.01), flush=True)


def recv_floor(samples: int, *, sender_cpus: set[int] | None = None, chunk: int = 4 << 20, ring: int = 32,
               check: bool = False) -> Run:
    """This process receiving ``samples`` x 110 KB on loopback from another
    process, ``recv_into`` ``chunk`` bytes at a time into a ring of ``ring``
    buffers: the CPU of the receive alone. ``check``: each read's bytes also
    hashed (XXH3-64) right after it, in 110 KB pieces, as the decoder checks a
    sample: the least any client that verifies end to end pays."""
    from dataferry.schema import sample_checksum

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    total = samples * SAMPLE_BYTES
    pid = os.fork()
    if pid == 0:  # the sender
        try:
            if sender_cpus:
                os.sched_setaffinity(0, sender_cpus)
            with socket.create_connection(("127.0.0.1", port)) as s:
                block = memoryview(os.urandom(SAMPLE_BYTES * 32))
                left = total
                while left:
                    left -= s.send(block[: min(len(block), left)])
        finally:
            os._exit(0)
    listener.settimeout(30)
    conn, _ = listener.accept()
    listener.close()
    buffers = [memoryview(bytearray(chunk)) for _ in range(ring)]
    got = k = 0
    hash_ = sample_checksum if check else None
    (u0, s0), t0 = _usage(), time.perf_counter()
    with conn:
        while got < total:
            buf = buffers[k % ring]
            n = conn.recv_into(buf)
            if not n:
                break
            if hash_ is not None:  # a sample split across two reads is hashed in two pieces: the same bytes
                for i in range(0, n, SAMPLE_BYTES):
                    hash_(buf[i : min(i + SAMPLE_BYTES, n)])
            got += n
            k += 1
    (u1, s1), wall = _usage(), time.perf_counter() - t0
    os.waitpid(pid, 0)
    n = got // SAMPLE_BYTES
    return Run(n, (u1 - u0) + (s1 - s0), wall, u1 - u0, s1 - s0)


def fetch_alone(url: str, dataset: str, sizes: list[int], *, samples: int = 2048, concurrency: int = 4,
                repeats: int = 3) -> dict[int, list[float]]:
    """``HttpSource.fetch`` alone, no engine: ``concurrency`` tasks sending
    requests of ``n`` ids for each ``n`` of ``sizes``, ``samples`` in all per
    measurement; the loop thread's CPU (user + system) per sample, one figure
    per repeat."""
    import asyncio

    from dataferry.client import HttpSource
    from dataferry.schema._aio import new_event_loop

    async def one(src, n: int, ids: list[int]) -> float:
        got = 0

        async def worker(k: int) -> None:
            nonlocal got
            for i in range(0, samples // concurrency, n):
                async for _ in src.fetch(dataset, [ids[(k * 257 + i + j) % len(ids)] for j in range(n)]):
                    got += 1

        c0 = time.thread_time()
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return (time.thread_time() - c0) / max(got, 1) * 1e6

    async def go() -> dict[int, list[float]]:
        async with await HttpSource.open(url) as src:
            ids = (await src.read_split(dataset, "all")).ids.tolist()
            for n in sizes:
                await one(src, n, ids)  # warm: connections, arenas
            out: dict[int, list[float]] = {}
            for _ in range(repeats):
                for n in sizes:
                    out.setdefault(n, []).append(await one(src, n, ids))
            return out

    loop = new_event_loop()
    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


def fit_per_request(medians: dict[int, float]) -> tuple[float, float]:
    """Least squares of ``us_per_sample = a / n + b``: ``(a, b)``, CPU per request and per sample."""
    xs, ys = [1 / n for n in medians], list(medians.values())
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    a = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return a, my - a * mx


def _row(name: str, rtt: str, runs: list[Run]) -> list[str]:
    med = statistics.median
    return [name, rtt, f"{med(r.us_per_sample for r in runs):.1f}", f"{med(r.user_us for r in runs):.1f}",
            f"{med(r.sys_us for r in runs):.1f}", f"{med(r.samples_per_s for r in runs):,.0f}"]


def _ids_per_request(runs: list[Run]) -> str:
    """The median over the runs of samples delivered per request sent (the measured span)."""
    return f"{statistics.median(r.samples / r.requests for r in runs if r.requests):.0f}" if any(
        r.requests for r in runs) else "-"


class ReplaySource:
    """The HTTP path's client half with no socket and no server: each request's answer (the
    service's version 2 frames, encoded once per sample) written into ``HttpSource``'s decoder
    (``FrameDecoder``, checksums checked as they arrive) through its ``sink``/``sunk`` as the
    kernel's reads are, at most ``read`` bytes a read, into pooled arenas; each read's records
    handed on as a run (``fetch_runs``, as ``HttpSource``) or one at a time (``fetch``). What it
    adds to the engine alone (MemorySource) is the decoder, the arenas, and one copy of each
    sample into its arena, in user space, where the socket's is the kernel's (``--replay``)."""

    def __init__(self, memory, read: int = 256 << 10) -> None:
        from dataferry.schema import sample_checksum
        from dataferry.schema._wire import encode_end, encode_sample
        from dataferry.schema.sources.http._buffers import BufferPool

        self.memory = memory  # its catalog (the split, the dataset) is this source's
        self._records = {}
        for s in memory.samples.values():
            s = s if s.checksum is not None else type(s)(s.id, s.label, s.data, s.target, sample_checksum(s.data))
            self._records[s.id] = memoryview(b"".join(encode_sample(s, sums=True)))
        self._end, self._read, self._pool = encode_end, read, BufferPool()
        self._mean = sum(map(len, self._records.values())) / max(len(self._records), 1)  # the decoder's first hint

    def __getattr__(self, name):
        return getattr(self.memory, name)

    async def fetch(self, dataset: str, ids):
        async for run in self.fetch_runs(dataset, ids):
            for rec in run:
                yield rec

    async def fetch_runs(self, dataset: str, ids):
        import asyncio

        from dataferry.schema._wire import EndRecord, FrameDecoder

        dec = FrameDecoder(dataset, arena=self._pool.take, give_back=self._pool.give_back, expect=len(ids),
                           mean=self._mean, verify=True)
        body = [self._records[i] for i in ids] + [memoryview(self._end(len(ids)))]
        k, at = 0, 0  # the record being written, and how much of it is
        while k < len(body):
            view = dec.sink()  # a read: the kernel writes what it has, up to the room given
            room, w = min(len(view), self._read), 0
            while w < room and k < len(body):
                rec = body[k]
                n = min(room - w, len(rec) - at)
                view[w : w + n] = rec[at : at + n]
                w, at = w + n, at + n
                if at == len(rec):
                    k, at = k + 1, 0
            del view
            dec.sunk(w)
            run = dec.take()
            if run and type(run[-1]) is EndRecord:
                run.pop()
            if run:
                yield run
            await asyncio.sleep(0)  # the loop turns between reads, as between a socket's


def _replay(images: int, epochs: int, batch_size: int, repeats: int, size: int) -> list[Run]:
    from dataferry.client import MemorySource

    src = ReplaySource(MemorySource.synthetic("bench", images, size=size))
    return [measure(src, "bench", epochs, batch_size) for _ in range(repeats)]


def _memory_reference(images: int, epochs: int, batch_size: int, repeats: int) -> list[Run]:
    from dataferry.client import MemorySource

    src = MemorySource.synthetic("bench", images, size=SAMPLE_BYTES)
    return [measure(src, "bench", epochs, batch_size) for _ in range(repeats)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.client_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=1024, help="samples in the store (default 1024)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3)")
    p.add_argument("--repeats", type=int, default=5, help="runs per row; the median is printed (default 5)")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rtts", default="0", help="comma-separated RTTs in ms; above 0 through a latency proxy (default 0)")
    p.add_argument("--data", choices=("synthetic", "random"), default="synthetic",
                   help="synthetic JPEGs of ~110 KB (cached), or random bytes of the same sizes")
    p.add_argument("--no-memory", action="store_true", help="leave out the MemorySource reference row")
    p.add_argument("--lines", type=int, metavar="IDS", default=None,
                   help="count the Python lines dataferry runs per sample over HTTP at IDS ids a request "
                        "(0: the tuner's), by function, over --epochs epochs (a count, not a time: it is slow)")
    p.add_argument("--replay", action="store_true",
                   help="add the HTTP path's client half without a socket or a server: the answers' frames fed "
                        "to HttpSource's decoder from memory (ReplaySource), then the engine")
    p.add_argument("--replay-bytes", type=int, default=SAMPLE_BYTES, metavar="N",
                   help=f"--replay: bytes per sample (default {SAMPLE_BYTES:,})")
    p.add_argument("--floor", action="store_true", help="add the kernel's share: a bare loopback recv_into of the bytes, "
                   "and the same with each 110 KB hashed as the client checks it")
    p.add_argument("--unverified", action="store_true",
                   help="add an HTTP row per RTT with ErrorPolicy(verify=False): no checksums asked for or checked")
    p.add_argument("--pin", action="store_true", help="the server on CPU 0, this process on the others")
    p.add_argument("--loader-sizes", default="",
                   help="comma-separated request sizes: also the Loader over HTTP with Prefetch(request_size=n)")
    p.add_argument("--fetch-sizes", default="",
                   help="comma-separated request sizes: also HttpSource.fetch alone (no engine) at each, and the "
                        "CPU per request and per sample fitted to them")
    p.add_argument("--perf", action="store_true",
                   help="profile each HTTP run with `perf record` and print where its CPU went, by symbol")
    args = p.parse_args(argv)
    if args.perf and shutil.which("perf") is None:
        p.error("--perf needs the perf tool (linux-perf / linux-tools)")
    rtts = [float(x) for x in args.rtts.split(",") if x.strip()]

    from ._links import Condition, ProxyLink
    from .load_server import DATASET, prepare_store

    wrap: tuple[str, ...] = ()
    server_cpus = None
    if args.pin:
        cpus = sorted(os.sched_getaffinity(0))
        if len(cpus) < 2:
            p.error("--pin needs at least 2 CPUs")
        server_cpus = {cpus[0]}
        os.sched_setaffinity(0, set(cpus[1:]))  # threads made from now on (the Loader's) inherit it
        wrap = ("taskset", "-c", str(cpus[0]))
    store = prepare_store(args.images, args.data)
    if args.lines is not None:
        with data_server(store, wrap=wrap) as server:
            n, counted = count_lines(f"http://{server[0]}:{server[1]}", DATASET, args.epochs, args.batch_size,
                                     args.lines or None)
        print(f"Python lines per sample received over HTTP, {args.lines or 'tuned'} ids a request, {n} samples:")
        for name, per in counted:
            print(f"  {per:8.2f}  {name}")
        return 0
    rows = []
    if args.floor:
        n = max(args.images * args.epochs, FLOOR_SAMPLES)
        runs = [recv_floor(n, sender_cpus=server_cpus) for _ in range(args.repeats)]
        rows.append(_row("bare recv_into, 4 MiB (kernel floor)", "0", runs))
        print(f"floor: {rows[-1][2]} us per 110 KB (user {rows[-1][3]}, sys {rows[-1][4]})", flush=True)
        runs = [recv_floor(n, sender_cpus=server_cpus, check=True) for _ in range(args.repeats)]
        rows.append(_row("the same + XXH3-64 of each 110 KB (the check)", "0", runs))
        print(f"floor with the check: {rows[-1][2]} us per 110 KB (user {rows[-1][3]}, sys {rows[-1][4]})",
              flush=True)
    if not args.no_memory:
        rows.append(_row("MemorySource (engine alone)", "-",
                         _memory_reference(args.images, args.epochs, args.batch_size, args.repeats)))
        print(f"memory: {rows[-1][2]} us/sample, {rows[-1][5]} samples/s", flush=True)
    if args.replay:
        rows.append(_row(f"HTTP client half, replayed, {args.replay_bytes:,} B (no socket, no server)", "-",
                         _replay(args.images, args.epochs, args.batch_size, args.repeats, args.replay_bytes)))
        print(f"replay: {rows[-1][2]} us/sample (user {rows[-1][3]}), {rows[-1][5]} samples/s", flush=True)
    with data_server(store, wrap=wrap) as server:
        for rtt in rtts:
            with ProxyLink().emulate(Condition(rtt_ms=rtt)) as route:
                host, port = route(server) if rtt > 0 else server
                url = f"http://{host}:{port}"
                for verify in (True, False) if args.unverified else (True,):
                    profiles: list = [{} if args.perf and verify else None for _ in range(args.repeats)]
                    runs = [measure(url, DATASET, args.epochs, args.batch_size, profile=p, verify=verify)
                            for p in profiles]
                    unchecked = "" if verify else ", verify=False"
                    row = _row(f"HTTP, {'direct' if rtt == 0 else 'latency proxy'}{unchecked}", f"{rtt:g}", runs)
                    each = " ".join(f"{r.us_per_sample:.1f}" for r in runs)
                    print(f"http rtt {rtt:g} ms{unchecked}: {row[2]} us/sample (runs: {each}), user {row[3]}, "
                          f"sys {row[4]}, {row[5]} samples/s, {_ids_per_request(runs)} ids a request (tuned)",
                          flush=True)
                    rows.append(row)
                    if profiles[0] is not None:
                        _print_profile(profiles, runs)
        for n in [int(x) for x in args.loader_sizes.split(",") if x.strip()]:
            runs = [measure(f"http://{server[0]}:{server[1]}", DATASET, args.epochs, args.batch_size, request_size=n)
                    for _ in range(args.repeats)]
            rows.append(_row(f"HTTP, direct, Loader at {n} ids a request", "0", runs))
            print(f"loader at {n} ids: {rows[-1][2]} us/sample, user {rows[-1][3]}, sys {rows[-1][4]}", flush=True)
        sizes = [int(x) for x in args.fetch_sizes.split(",") if x.strip()]
        if sizes:
            got = fetch_alone(f"http://{server[0]}:{server[1]}", DATASET, sizes, repeats=args.repeats)
            medians = {n: statistics.median(v) for n, v in got.items()}
            for n, v in got.items():
                rows.append([f"HttpSource.fetch alone, {n} ids a request", "0", f"{medians[n]:.1f}", "-", "-", "-"])
            if len(sizes) > 1:
                per_request, per_sample = fit_per_request(medians)
                print(f"fetch alone: {per_request:.0f} us per request + {per_sample:.1f} us per sample "
                      f"(fitted to {len(sizes)} sizes)", flush=True)
    print()
    print(f"{args.images} samples of ~110 KB, {args.epochs} epochs per run, batch {args.batch_size}, "
          f"median of {args.repeats} runs; client CPU = this process only"
          + ("; server on CPU 0, client on the others" if args.pin else ""))
    print(table(["path", "RTT ms", "client CPU us/sample", "user", "sys", "samples/s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
