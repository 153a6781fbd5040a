"""The engine's window against the link, without sockets.

``python -m dataferry.bench.window [--latencies 0,100,200] [--images 65536] [--size 110000]
[--seconds 6] [--runs 3] [--rate MBIT] [--max-bytes N] [--request-size N] [--max-inflight N] [--no-tune]
[--step-ms MS]``
``python -m dataferry.bench.window --http-first-batch 100 [--runs 5] [--store-images 1024]``

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

from ._common import table

__all__ = ["WindowRun", "run_once", "main"]


@dataclasses.dataclass(frozen=True, slots=True)
class WindowRun:
    latency: float
    samples: int
    seconds: float
    steady_samples: int
    steady_seconds: float
    first_batch: float
    epoch0: float
    cpu: float
    window: int
    request_size: int
    trace: tuple[tuple[float, int], ...]  # (seconds since start, window)
    latency_mean: float = 0.0  # seconds a request took, answered whole, mean over the run
    window_full: float = 0.0  # seconds the engine had requests to send but its window was full
    budget_full: float = 0.0  # ... but its byte budget was full
    loop_wait: float = 0.0  # seconds the consuming loop waited for a batch

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_per_s(self) -> float:
        return self.steady_samples / self.steady_seconds if self.steady_seconds > 0 else 0.0

    @property
    def us_per_sample(self) -> float:
        return self.cpu / max(self.samples, 1) * 1e6


def make_source(images: int, size: int, latency: float, rate_mbit: float | None):
    """A maker of fresh sources: ``images`` samples of ``size`` random bytes, sharing at most
    1,024 distinct payloads (a large dataset without its memory), made once. Each run gets
    its own ``MemorySource``: a source's emulated link keeps the queue a run left on it
    (``rate``), which would hold back the next run's start."""
    import numpy as np

    from dataferry.client import MemorySource
    from dataferry.schema import Sample

    rate = rate_mbit * 1e6 / 8 if rate_mbit else None
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(min(images, 1024))]
    samples = [Sample(i, i % 10, blobs[i % len(blobs)]) for i in range(images)]
    return lambda: MemorySource("bench", samples, latency=latency, rate=rate)


def run_once(make, prefetch, *, seconds: float, batch_size: int = 256, max_samples: int | None = None,
             step: float = 0.0) -> WindowRun:
    """Iterate epochs of a fresh source from ``make`` (:func:`make_source`) through a Loader for about
    ``seconds``, sleeping ``step`` seconds after each batch (a training step)."""
    from dataferry.client import Hedge, Loader

    source = make()  # before the clock: the source's own set-up is not the loader's

    cpu0 = os.times()
    t0 = time.perf_counter()
    samples = steady = 0
    first_batch = epoch0 = steady_t0 = None
    trace: list[tuple[float, int]] = []
    next_trace = 0.05
    with Loader(source, "bench", batch_size=batch_size, prefetch=prefetch, hedge=Hedge(enabled=False)) as loader:
        done = False
        while not done:
            for batch in loader:
                now = time.perf_counter() - t0
                if first_batch is None:
                    first_batch = now
                samples += len(batch)
                if now >= seconds / 2:
                    if steady_t0 is None:
                        steady_t0 = now
                    else:
                        steady += len(batch)
                if now >= next_trace:
                    trace.append((now, loader.stats().window))
                    next_trace *= 2
                if now >= seconds or (max_samples is not None and samples >= max_samples):
                    done = True
                    break
                if step:
                    time.sleep(step)
            if epoch0 is None:
                epoch0 = time.perf_counter() - t0
        end = time.perf_counter() - t0
        stats = loader.stats()
        window = stats.window
        request_size = getattr(loader._link, "request_size", None) or loader.prefetch.request_size or 32
    cpu1 = os.times()
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return WindowRun(
        latency=getattr(source, "latency", 0.0), samples=samples, seconds=end,
        steady_samples=steady, steady_seconds=end - (steady_t0 or end),
        first_batch=first_batch or end, epoch0=epoch0 or end, cpu=cpu, window=window,
        request_size=int(request_size), trace=tuple(trace),
        latency_mean=stats.latency_sum / stats.answers if stats.answers else 0.0,
        window_full=stats.window_full, budget_full=stats.budget_full, loop_wait=stats.wait,
    )


def first_batch_http(rtt_ms: float, *, images: int, runs: int, batch_size: int) -> None:
    """Seconds from creating a Loader over HTTP across ``rtt_ms`` to its first batch."""
    from dataferry.client import Loader, Prefetch

    from ._common import data_server, prepared_store
    from ._links import Condition, ProxyLink

    with prepared_store("sqlite", images) as (store_url, _, _), data_server(store_url) as address, \
            ProxyLink().emulate(Condition(rtt_ms)) as route:
        host, port = route(address)
        url = f"http://{host}:{port}"
        got: dict[str, list[float]] = {"tuned": [], "fixed (tune=False)": []}
        for _ in range(runs):
            for key, prefetch in (("tuned", Prefetch()), ("fixed (tune=False)", Prefetch(tune=False))):
                t0 = time.perf_counter()
                with Loader(url, "bench", batch_size=batch_size, prefetch=prefetch) as loader:
                    next(iter(loader))
                    got[key].append(time.perf_counter() - t0)
    rtt = rtt_ms / 1e3
    print(f"first batch over HTTP at {rtt_ms:g} ms RTT (latency-proxy process), batch {batch_size}, "
          f"{images} JPEGs in SQLite, medians of {runs}:")
    print(table(["window", "first batch s", "RTTs", "min s", "max s"],
                [[k, f"{statistics.median(v):.3f}", f"{statistics.median(v) / rtt:.1f}" if rtt else "-",
                  f"{min(v):.3f}", f"{max(v):.3f}"] for k, v in got.items()]))


def median_run(runs: list[WindowRun]) -> WindowRun:
    """The run with the median whole-run rate (its trace is shown)."""
    return sorted(runs, key=lambda r: r.samples_per_s)[len(runs) // 2]


def prefetch_from(args):
    from dataferry.client import Prefetch

    kw = {}
    for name in ("max_bytes", "request_size", "max_inflight"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.no_tune:
        kw["tune"] = False
    return Prefetch(**kw)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.window", description=__doc__.split("\n\n")[0])
    p.add_argument("--latencies", default="0,100,200", help="ms per request, comma-separated")
    p.add_argument("--images", type=int, default=65536, help="samples per epoch (an epoch must outlast the window)")
    p.add_argument("--size", type=int, default=110_000, help="bytes per sample")
    p.add_argument("--seconds", type=float, default=6.0, help="per run")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--rate", type=float, default=None, help="the emulated link's Mbit/s (default unlimited)")
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--request-size", type=int, default=None)
    p.add_argument("--max-inflight", type=int, default=None)
    p.add_argument("--no-tune", action="store_true", help="Prefetch(tune=False): the fixed +1-per-answer window")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="the consumer sleeps this long after each batch, as a training step (default 0: none)")
    p.add_argument("--http-first-batch", type=float, default=None, metavar="RTT_MS",
                   help="measure the time to first batch over HTTP across this RTT instead")
    p.add_argument("--store-images", type=int, default=1024)
    args = p.parse_args(argv)
    if args.http_first_batch is not None:
        first_batch_http(args.http_first_batch, images=args.store_images, runs=args.runs, batch_size=args.batch_size)
        return 0
    prefetch = prefetch_from(args)
    latencies = [float(x) / 1e3 for x in args.latencies.split(",")]
    step = args.step_ms / 1e3
    consumer = (f", a training step of {args.step_ms:g} ms a batch (at most {args.batch_size / step:,.0f} samples/s)"
                if step else "")
    print(f"window: {args.images} samples of {args.size} B, batch {args.batch_size}, {args.runs} runs of "
          f"{args.seconds:g} s, rate {args.rate or 'unlimited'} Mbit/s{consumer}, {prefetch}")
    results: dict[float, list[WindowRun]] = {lat: [] for lat in latencies}
    makers = {lat: make_source(args.images, args.size, lat, args.rate) for lat in latencies}
    for _ in range(args.runs):  # interleaved, so drift on a shared machine hits every latency alike
        for lat in latencies:
            results[lat].append(run_once(makers[lat], prefetch, seconds=args.seconds, batch_size=args.batch_size,
                                         step=step))
    base = None
    steady_base = statistics.median(r.steady_per_s for r in results[latencies[0]]) or 1.0
    rows, traces = [], []
    for lat in latencies:
        runs = results[lat]
        rate = statistics.median(r.samples_per_s for r in runs)
        steady = statistics.median(r.steady_per_s for r in runs)
        base = base or rate
        med = median_run(runs)
        cap = prefetch.ceiling_bytes / (lat * args.size) if lat else float("inf")
        rows.append([
            f"{lat * 1e3:g} ms", f"{rate:,.0f}", f"{rate / base:.2f}",
            f"{steady:,.0f}", f"{steady / steady_base:.2f}", f"{max(0.0, 1 - rate / steady):.2f}" if steady else "-",
            f"{statistics.median(r.first_batch for r in runs):.3f}",
            f"{statistics.median(r.epoch0 for r in runs):.2f}",
            f"{statistics.median(r.us_per_sample for r in runs):.1f}",
            f"{statistics.median(r.cpu / r.seconds for r in runs):.2f}",
            f"{statistics.median(r.latency_mean for r in runs) * 1e3:.0f}",
            f"w {statistics.median(r.window_full / r.seconds for r in runs):.2f}, "
            f"b {statistics.median(r.budget_full / r.seconds for r in runs):.2f}",
            str(med.window), str(med.request_size), "-" if cap == float("inf") else f"{cap:,.0f}",
            f"{statistics.median(r.loop_wait / r.seconds for r in runs):.2f}",
        ])
        traces.append(f"{lat * 1e3:g} ms: " + " ".join(f"{t:.2f}s:{w}" for t, w in med.trace))
    print(table(["latency", "samples/s", "ratio", "steady/s", "steady ratio", "ramp", "first batch s", "epoch 0 s",
                 "us/sample", "CPU share", "req ms", "held", "window", "ids/req", "budget cap/s", "loop waited"],
                rows))
    print("window over time (median run):")
    print("\n".join(traces))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
