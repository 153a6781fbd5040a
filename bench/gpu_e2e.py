"""``gpu_check --e2e``: what a training job sees, from a data service across a WAN into GPU tensors.

    python -m dataferry.bench.gpu_check --e2e [--images 4096] [--rtts 0,100,200] [--epochs 3]
                                             [--batch 256] [--out DIR] [--allow-cpu]

A SQLite store of synthetic JPEGs, ``dataferry serve``, a latency proxy per RTT,
and ``Loader`` over HTTP → ``DaliIterator`` → tensors on ``cuda:N``. Prints per RTT
images/s total (the headline), first epoch and steady, time to first batch,
client and server CPU per image, and steady / DALI's decode ceiling.
Without a GPU, ``--allow-cpu`` labels every row "cpu (not GPU numbers)".

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

from ._common import data_server, engine_count, prefetch_of, process_cpu_s, table
from ._links import Condition, ProxyLink, default_proxy_processes
from ._threadprof import Sampler, cpu_by_thread, thread_cpu
from .decode import median_seconds, pipeline_epoch, read_files
from .gpu_check import MIN_PSNR, check_decoder

__all__ = ["E2EOptions", "RttResult", "run_e2e"]

DATASET = "gpu-e2e"
HEADER = ["rtt ms", "path", "device", "images/s total", "images/s first epoch", "images/s steady", "steady / ceiling",
          "first batch s", "client CPU us/image", "server CPU us/image served"]


@dataclass(frozen=True, slots=True)
class E2EOptions:
    images: int = 4096
    rtts_ms: tuple[float, ...] = (0.0, 100.0, 200.0)
    epochs: int = 3
    batch: int = 256
    runs: int = 3
    device_id: int = 0
    hw_decoder_load: float | None = None
    min_psnr: float = MIN_PSNR
    out: str | None = None
    iterators: tuple[str, ...] = ("dali", "torch")  # DaliIterator (GPU decode); TorchIterator (Pillow) for comparison
    jpeg2000_images: int = 0  # a second store of lossless JPEG 2000 (nvJPEG2000 on GPUs), DALI only; 0: none
    server_workers: int | None = None  # `dataferry serve --workers` (None: its default, the usable cores)
    profile_rtt: float | None = None  # one more DALI run at this RTT under the sampling profiler (not in the table)
    prefetch: tuple[str, ...] = ("default",)  # Prefetch settings ("max_bytes=2GiB,request_size=64"), alternated per RTT
    engines: tuple[str, ...] = ("thread",)  # thread: Loader; process: ProcessLoader; process:N: N engines; alternated
    #: latency-proxy --processes, one proxy each, alternated per RTT; () means (default_proxy_processes(),)
    proxy_processes: tuple[int, ...] = ()

    def proxies(self) -> tuple[int, ...]:
        return self.proxy_processes or (default_proxy_processes(),)

    def prefetches(self) -> list:
        """``(label, Prefetch)`` of each ``prefetch`` setting."""
        return [(p, prefetch_of(p)) for p in self.prefetch]

    def __post_init__(self) -> None:
        if self.images < 1 or self.batch < 1 or self.epochs < 1 or self.runs < 1:
            raise ValueError("--images, --batch, --epochs and --runs must be >= 1")
        if not self.iterators or set(self.iterators) - {"dali", "torch"}:
            raise ValueError(f"--iterators takes dali and/or torch, not {','.join(self.iterators)!r}")
        if self.jpeg2000_images < 0 or (self.server_workers is not None and self.server_workers < 1):
            raise ValueError("--jpeg2000-images must be >= 0 and --server-workers >= 1")
        self.prefetches()  # each setting parses
        if not self.engines or any(engine_count(e) is None for e in self.engines):
            raise ValueError(f"--engines takes thread, process and process:N, not {','.join(self.engines)!r}")
        if any(not isinstance(n, int) or n < 1 for n in self.proxy_processes):
            raise ValueError(f"--proxy-processes must be counts >= 1, not {self.proxy_processes!r}")
        if not self.rtts_ms or any(not (math.isfinite(r) and r >= 0) for r in self.rtts_ms):
            raise ValueError(f"--rtts must be round trips in ms >= 0, not {self.rtts_ms!r}")

    @classmethod
    def from_args(cls, args) -> E2EOptions:
        try:
            rtts = tuple(float(r) for r in args.rtts.split(",") if r.strip())
        except ValueError:
            raise ValueError(f"--rtts must be milliseconds separated by commas, e.g. 0,100,200, not {args.rtts!r}") \
                from None
        return cls(images=args.images or 4096, rtts_ms=rtts, epochs=args.epochs, batch=args.batch or 256,
                   runs=args.runs, device_id=args.device_id, hw_decoder_load=args.hw_decoder_load,
                   min_psnr=args.min_psnr, out=args.out,
                   iterators=tuple(i.strip() for i in args.iterators.split(",") if i.strip()),
                   jpeg2000_images=args.jpeg2000_images, server_workers=args.server_workers,
                   profile_rtt=args.profile_rtt, prefetch=tuple(args.prefetch or ("default",)),
                   engines=tuple(e.strip() for e in args.engines.split(",") if e.strip()),
                   proxy_processes=_counts(args.proxy_processes, "--proxy-processes"))


def _counts(text: str | None, flag: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        return tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise ValueError(f"{flag} must be counts separated by commas, e.g. 1,4, not {text!r}") from None


@dataclass(frozen=True, slots=True)
class RttResult:
    rtt_ms: float
    path: str  # "dali jpeg", "torch jpeg", "dali jpeg2000"
    device: str
    images: int  # delivered, all epochs
    epoch_images: tuple[int, ...]
    seconds_total: float  # from creating the Loader to the last batch
    seconds_first_epoch: float  # from creating the Loader to the first epoch's last batch
    first_batch_s: float
    client_cpu_s: float
    server_cpu_s: float
    proxy_cpu_s: float  # every latency-proxy process of the link, over the run
    proxy_processes: int
    ceiling: float  # images/s, DALI from memory
    loader: dict  # Loader.stats() at the last batch
    threads: tuple  # ((thread name, CPU s), ...): this process's busiest threads over the run

    @property
    def total(self) -> float:
        return self.images / self.seconds_total

    @property
    def first_epoch(self) -> float:
        return self.epoch_images[0] / self.seconds_first_epoch

    @property
    def steady(self) -> float | None:
        """Images/s over the epochs after the first (None with one epoch)."""
        rest = self.seconds_total - self.seconds_first_epoch
        return sum(self.epoch_images[1:]) / rest if len(self.epoch_images) > 1 and rest > 0 else None

    @property
    def served(self) -> float:
        """Images the server sent this loader (received bytes over the mean delivered sample)."""
        s = self.loader
        return s["received"] / max(s["bytes"], 1) * s["samples"]

    @property
    def steady_ratio(self) -> float | None:
        return None if self.steady is None else self.steady / self.ceiling

    def row(self) -> list[str]:
        steady, ratio = self.steady, self.steady_ratio
        return [f"{self.rtt_ms:g}", self.path, self.device, f"{self.total:,.0f}", f"{self.first_epoch:,.0f}",
                "-" if steady is None else f"{steady:,.0f}", "-" if ratio is None else f"{ratio:.2f}",
                f"{self.first_batch_s:.2f}", f"{self.client_cpu_s / self.images * 1e6:,.0f}",
                f"{self.server_cpu_s / max(self.served, 1) * 1e6:,.0f}"]

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(images_per_s_total=self.total, images_per_s_first_epoch=self.first_epoch,
                 images_per_s_steady=self.steady, steady_over_ceiling=self.steady_ratio,
                 client_cpu_us_per_image=self.client_cpu_s / self.images * 1e6,
                 images_served=self.served,
                 server_cpu_us_per_image_served=self.server_cpu_s / max(self.served, 1) * 1e6)
        return d


# --- the store and the processes ---------------------------------------------------------------------
def _make_store(tmp: str, images: int, format: str | None = None) -> tuple[str, list[bytes]]:
    """A SQLite store of ``images`` synthetic JPEGs (re-encoded as ``format`` if given); returns its URL and
    the stored bytes in id order (read back from the store when re-encoded, else the files sorted by path)."""
    from dataferry.client import Loader
    from dataferry.schema import IngestOptions, ingest, make_synthetic, open_store

    folder = os.path.join(tmp, f"images-{images}")
    if not os.path.isdir(folder):
        make_synthetic(folder, images, classes=10, seed=0)
    url = f"sqlite://{tmp}/gpu-e2e-{format or 'jpeg'}.db"

    async def fill():
        async with await open_store(url) as store:
            return await ingest(store, folder, DATASET, IngestOptions(format=format), progress=False)

    report = asyncio.run(fill())
    if report.ingested != images:
        raise RuntimeError(f"ingest into {url} took {report.ingested} of {images} images "
                           f"({len(report.rejected)} rejected)")
    if format is None:
        return url, read_files(folder)
    stored = {}
    with Loader(url, DATASET, batch_size=256) as loader:
        for b in loader:
            stored.update(zip(b.ids.tolist(), map(bytes, b.data)))
    return url, [stored[k] for k in sorted(stored)]


# --- the measurements ----------------------------------------------------------------------------
def decode_ceiling(blobs: list[bytes], device: str, device_id: int | None, options, batch: int, runs: int) -> float:
    """Images/s of DALI's graph (decode of the crop window, resize, flip, normalize: ``TrainTransform(224)``)
    from memory, no loader: the feed (crop windows drawn as the iterator draws them) is made beforehand."""
    import numpy as np

    from dataferry.client import Batch, TrainTransform
    from dataferry.client._dali import build_pipeline, feed_arrays
    from dataferry.client._imagebatch import prepare

    transform = TrainTransform(224)
    arrays = [np.frombuffer(b, np.uint8) for b in blobs]
    feeds = []
    for k in range(0, len(arrays), batch):
        data = arrays[k : k + batch]
        ids = np.arange(k, k + len(data), dtype=np.int64)
        b = Batch(ids, np.zeros(len(data), np.int32), data, None, 0, ids.copy(), sum(map(len, data)))
        feeds.append(feed_arrays(prepare(b, transform, "none", DATASET, 0), "none"))
    run = pipeline_epoch(lambda source: build_pipeline(source, transform, targets="none", batch_size=batch,
                                                       device=device, device_id=device_id, options=options),
                         feeds, _synchronizer(device, device_id))
    return len(arrays) / median_seconds(run, runs)


def _synchronizer(device: str, device_id: int | None):
    if device != "gpu":
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device_id)


def _iterator(kind: str, loader, options, device: str, device_id: int | None):
    """The iterator a training loop would use, and what it does to each batch's images (to the GPU)."""
    from dataferry.client import DaliIterator, TorchIterator, TrainTransform

    if kind == "dali":
        return DaliIterator(loader, TrainTransform(224), options=options), lambda images: images
    target = f"cuda:{device_id or 0}" if device == "gpu" else "cpu"
    return TorchIterator(loader, TrainTransform(224)), lambda images: images.to(target, non_blocking=True)


def measure_rtt(link_url: str, images: int, rtt_ms: float, label: str, device: str, device_id: int | None,
                options, opts: E2EOptions, server_pid: int, ceiling: float, *, kind: str = "dali",
                codec: str = "jpeg", prefetch=("default", None), engine: str = "thread",
                proxy: tuple[int, int] | None = None) -> RttResult:
    """``opts.epochs`` epochs of Loader (HTTP, through the proxy) → ``kind``'s iterator → tensors on ``device``;
    ``engine="process"`` (or ``"process:N"``): ProcessLoader with 1 (or N) engines, whose engine processes'
    CPU joins the client's; ``proxy``: the link's (pid, processes), whose CPU is reported apart."""
    from dataferry.client import Loader, ProcessLoader

    sync = _synchronizer(device, device_id)
    counts, ends = [], []
    first = None
    proxy_pid, proxies = proxy or (None, 0)
    p0 = 0.0 if proxy_pid is None else process_cpu_s(proxy_pid)
    c0, s0, th0 = time.process_time(), process_cpu_s(server_pid), thread_cpu()
    t0 = time.perf_counter()
    label_p, setting = prefetch
    engines = engine_count(engine)
    kw = ({} if setting is None else {"prefetch": setting}) | ({"engines": engines} if engines else {})
    with (ProcessLoader if engines else Loader)(link_url, DATASET, batch_size=opts.batch, **kw) as loader:
        it, to_device = _iterator(kind, loader, options, device, device_id)
        with it:
            for epoch in range(opts.epochs):
                seen = set()
                n = 0
                for b in it:
                    to_device(b.images)
                    if first is None:
                        sync()
                        first = time.perf_counter() - t0
                    n += len(b)
                    seen.update(b.ids.tolist())
                sync()
                ends.append(time.perf_counter())
                if n != images or len(seen) != images:
                    raise RuntimeError(f"at {rtt_ms:g} ms RTT, {kind} {codec}: epoch {epoch} delivered {n} images "
                                       f"({len(seen)} distinct) of {images}")
                counts.append(n)
            client_cpu, server_cpu = time.process_time() - c0, process_cpu_s(server_pid) - s0
            proxy_cpu = 0.0 if proxy_pid is None else process_cpu_s(proxy_pid) - p0
            if engines:  # the engine processes' CPU since their spawn (their imports included)
                client_cpu += sum(map(process_cpu_s, loader.engine_pids))
            threads = tuple(cpu_by_thread(th0, thread_cpu()))
        stats = loader.stats().as_dict()
    path = f"{kind} {codec}" + ("" if label_p == "default" else f" [{label_p}]") + \
        ("" if engine == "thread" else f" [{engine}]") + \
        ("" if len(opts.proxies()) < 2 else f" [proxy x{proxies}]")
    return RttResult(rtt_ms, path, label, sum(counts), tuple(counts), ends[-1] - t0, ends[0] - t0,
                     first, client_cpu, server_cpu, proxy_cpu, proxies, ceiling, stats, threads)


def _warm(url: str, images: int) -> None:
    """One epoch straight from the server (no proxy), not measured: its workers have started and the store's
    pages are in the page cache before the first row, as in a job's second hour."""
    from dataferry.client import Loader

    with Loader(url, DATASET, batch_size=256) as loader:
        n = sum(len(b) for b in loader)
    if n != images:
        raise RuntimeError(f"warm-up epoch from {url} delivered {n} of {images} images")


def _decoding(options, device: str, device_id: int | None) -> str:
    """The DALI threads and hardware-decoder share this run uses (the options', else the machine's defaults)."""
    torch = None
    if device == "gpu":
        import torch
    threads, load = options.decoding(device, device_id, torch)
    return f"{threads} thread(s)" + (f", hw_decoder_load {load:g}" if device == "gpu" else "")


def run_e2e(opts: E2EOptions, device: str, device_id: int | None, label: str, command: str = "") -> int:
    """Run it all; print the table (and write it under ``opts.out``). Exit status: 0, or 1 if the decoder disagrees."""
    from dataferry.client import DaliOptions

    from ._latency_proxy import LinkOptions

    if device == "cpu":
        label = "cpu (not GPU numbers)"
    kw = {} if opts.hw_decoder_load is None else {"hw_decoder_load": opts.hw_decoder_load}
    options = DaliOptions(device=device, device_id=device_id, **kw)
    lines = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    server_args = () if opts.server_workers is None else ("--workers", str(opts.server_workers))
    with tempfile.TemporaryDirectory(prefix="dataferry-gpu-e2e-") as tmp:
        t = time.perf_counter()
        store_url, blobs = _make_store(tmp, opts.images)
        mean_kb = statistics.fmean(map(len, blobs)) / 1e3
        say(f"{len(blobs)} synthetic JPEGs (mean {mean_kb:.0f} KB) ingested into {store_url} "
            f"in {time.perf_counter() - t:.1f} s; batch {opts.batch}, {opts.epochs} epoch(s) per RTT; "
            f"DALI on {label}: {_decoding(options, device, device_id)}; {os.cpu_count()} CPUs; "
            f"`dataferry serve {' '.join(server_args) or '(default workers)'}`; "
            f"`dataferry latency-proxy --processes {','.join(map(str, opts.proxies()))}`")
        agreed = check_decoder(blobs, device, device_id, opts.min_psnr)
        lines.append(f"decoder vs Pillow: {agreed.describe()}")
        ceiling = decode_ceiling(blobs, device, device_id, options, opts.batch, opts.runs)
        say(f"decode ceiling from memory ({label}; decode + TrainTransform(224), no loader, "
            f"median of {opts.runs}): {ceiling:,.0f} images/s")
        stores = [("jpeg", store_url, len(blobs), ceiling, opts.iterators)]
        if opts.jpeg2000_images:
            t = time.perf_counter()
            j2k_url, j2k = _make_store(tmp, opts.jpeg2000_images, "jpeg2000")
            j2k_ceiling = decode_ceiling(j2k, device, device_id, options, opts.batch, opts.runs)
            say(f"{len(j2k)} of the JPEGs as lossless JPEG 2000 (mean {statistics.fmean(map(len, j2k)) / 1e3:.0f} KB, "
                f"made in {time.perf_counter() - t:.1f} s); its decode ceiling from memory: {j2k_ceiling:,.0f} images/s")
            stores.append(("jpeg2000", j2k_url, len(j2k), j2k_ceiling, ("dali",)))
        results, profile = [], None

        def done(r: RttResult) -> None:  # each row as it ends: a run cut short still leaves what it measured
            results.append(r)
            steady = "-" if r.steady is None else f"{r.steady:,.0f}"
            print(f"    {r.path}: {r.total:,.0f} images/s total, {steady} steady, in {r.seconds_total:.1f} s", flush=True)
            if opts.out:
                _write(opts, command, lines, table(HEADER, [x.row() for x in results]), results, ceiling, agreed,
                       label, profile)

        for codec, url, n, ceil, kinds in stores:
            with data_server(url, args=server_args) as server:
                (host, port), pid = server, server.pid
                _warm(f"http://{host}:{port}", n)
                for rtt in opts.rtts_ms:
                    with contextlib.ExitStack() as links:
                        routes = []
                        for nproc in opts.proxies():  # one proxy (of nproc processes) each, alternated below
                            listening = links.enter_context(
                                ProxyLink(processes=nproc).emulate(Condition(rtt_ms=rtt)))((host, port))
                            routes.append((f"http://{listening[0]}:{listening[1]}", (listening.pid, nproc)))
                        link = LinkOptions(delay=rtt / 2000)
                        print(f"  {codec}, {rtt:g} ms RTT: {', '.join(u for u, _ in routes)} ({link.describe()}) -> "
                              f"http://{host}:{port} ...", flush=True)
                        for kind in kinds:
                            for prefetch in opts.prefetches():  # alternated, on the same server and link
                                for engine in opts.engines:
                                    for url_p, proxy in routes:
                                        done(measure_rtt(url_p, n, rtt, label, device, device_id, options, opts, pid,
                                                         ceil, kind=kind, codec=codec, prefetch=prefetch,
                                                         engine=engine, proxy=proxy))
                        if codec == "jpeg" and rtt == opts.profile_rtt:
                            with Sampler() as sampler:
                                profiled = measure_rtt(routes[0][0], n, rtt, label, device, device_id,
                                                       options, opts, pid, ceil, kind="dali", codec=codec)
                            profile = (f"# sampling profile: dali jpeg at {rtt:g} ms RTT, {profiled.total:,.0f} images/s "
                                       f"under the profiler\n\n" + sampler.report())
    say("images/s total: every image over the wall time from creating the Loader to the last batch "
        "(the headline); first epoch: from creating the Loader; steady: the epochs after the first; "
        "steady / ceiling: against the decode ceiling of the same images; "
        "client CPU: per image delivered; server CPU: per image served (the loader fetches ahead past the last epoch)")
    md = table(HEADER, [r.row() for r in results])
    print(md)
    for r in results:
        s = r.loader
        say(f"  {r.rtt_ms:g} ms, {r.path}: loader window {s['window']} requests, request latency "
            f"{(s['request_latency'] or 0) * 1e3:.0f} ms (min {(s['min_latency'] or 0) * 1e3:.0f}), "
            f"the iterator waited on the loader {s['wait_fraction']:.0%} of the time, "
            f"peak {s['peak_bytes'] / 2**20:.0f} MiB, the byte budget full {s['budget_full']:.1f} s and the window "
            f"full {s['window_full']:.1f} s of {s['elapsed']:.1f}, the engine's thread on CPU "
            f"{s['engine_cpu'] / max(s['elapsed'], 1e-9):.0%} (the busiest engine's), "
            f"retries {s['retries']}; received {r.served:,.0f} images "
            f"for {s['samples']:,} delivered (the rest: look-ahead past the last epoch); the latency proxy "
            f"({r.proxy_processes} process{'es' if r.proxy_processes > 1 else ''}) used "
            f"{r.proxy_cpu_s / r.seconds_total:.2f} cores (mean over the run), "
            f"{r.proxy_cpu_s / max(r.served, 1) * 1e6:,.0f} us/image")
        say("    client CPU us/image by thread: " + ", ".join(
            f"{name} {cpu / r.images * 1e6:,.0f}" for name, cpu in r.threads if cpu > 0))
    if profile:
        print(profile)
    if opts.out:
        _write(opts, command, lines, md, results, ceiling, agreed, label, profile)
    return 0 if agreed.ok else 1


def _finite(value):
    """JSON has no inf or nan: None instead (an identical decode's PSNR is inf)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _write(opts: E2EOptions, command: str, lines: list[str], md: str, results: list[RttResult], ceiling: float,
           agreed, label: str, profile: str | None) -> None:
    os.makedirs(opts.out, exist_ok=True)
    doc = {"command": command, "device": label,
           "options": asdict(opts), "decode_ceiling_images_per_s": ceiling,
           "psnr": {"min": agreed.min, "median": agreed.median, "threshold": agreed.threshold, "ok": agreed.ok,
                    "per_image": agreed.psnrs, "mean_abs_diff": agreed.mean_abs_diff},
           "rows": [r.as_dict() for r in results]}
    files = {"gpu_e2e.json": json.dumps(_finite(doc), indent=2, allow_nan=False) + "\n",
             "gpu_e2e.md": "\n\n".join(["# gpu_check --e2e", f"`{command}`", "\n".join(lines), md]) + "\n"}
    if profile:
        files["gpu_e2e_profile.txt"] = profile
    for name, text in files.items():
        path = os.path.join(opts.out, name)
        with open(path + ".tmp", "w") as fh:  # nothing half-written: replaced whole
            fh.write(text)
        os.replace(path + ".tmp", path)
    print(f"wrote {', '.join(os.path.join(opts.out, n) for n in files)}")
