"""Client CPU per sample on the HTTP path: what the training process pays to receive.

    python -m dataferry.bench.client_cpu [--images 1024] [--epochs 3] [--repeats 5]
                                         [--rtts 0] [--batch-size 256] [--data synthetic|random]

A real ``dataferry serve`` (its own process, :func:`~._common.data_server`)
over a SQLite store of ``--images`` samples of about 110 KB (synthetic JPEGs,
made once and cached in the temp folder; ``--data random`` for random bytes
of the same sizes, instant). For each RTT of ``--rtts`` (0: loopback direct;
otherwise through one ``dataferry latency-proxy`` process, its own CPU not
counted), ``--repeats`` runs of a :class:`~dataferry.client.Loader` reading
``--epochs`` epochs in completion order, the consumer doing nothing with the
batches. Each run is measured from its first batch to its last (the start-up
and the id list are left out): the CPU of this process only (every thread of
it: the engine's loop and the consumer; the server and the proxy are other
processes) divided by the samples delivered, and samples/s. Printed: the
median of the repeats, with the engine alone over a
:class:`~dataferry.client.MemorySource` of the same sizes as the reference
(what is left when the network side costs nothing).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from ._common import data_server, table

__all__ = ["main", "Run", "measure"]


@dataclass(frozen=True, slots=True)
class Run:
    samples: int  # delivered after the first batch
    cpu_s: float  # this process's CPU over the same span
    wall_s: float

    @property
    def us_per_sample(self) -> float:
        return self.cpu_s / max(self.samples, 1) * 1e6

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else 0.0


def measure(source, dataset: str, epochs: int, batch_size: int, warmup: int = 1) -> Run:
    """One Loader over ``source``: ``warmup`` epochs, then ``epochs`` measured
    (from the first batch after the warm-up to the last)."""
    from dataferry.client import Loader

    with Loader(source, dataset, batch_size=batch_size) as loader:
        samples = 0
        c0 = t0 = None
        for epoch in range(warmup + epochs):
            for batch in loader:
                if epoch < warmup:
                    continue
                if c0 is None:
                    c0, t0 = time.process_time(), time.perf_counter()
                    continue
                samples += len(batch)
        cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    return Run(samples, cpu, wall)


def _median(runs: list[Run]) -> tuple[float, float]:
    return statistics.median(r.us_per_sample for r in runs), statistics.median(r.samples_per_s for r in runs)


def _memory_reference(images: int, epochs: int, batch_size: int, repeats: int) -> list[Run]:
    from dataferry.client import MemorySource

    src = MemorySource.synthetic("bench", images, size=110_000)
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
    args = p.parse_args(argv)
    rtts = [float(x) for x in args.rtts.split(",") if x.strip()]

    from ._links import Condition, ProxyLink
    from .load_server import DATASET, prepare_store

    store = prepare_store(args.images, args.data)
    rows = []
    if not args.no_memory:
        us, rate = _median(_memory_reference(args.images, args.epochs, args.batch_size, args.repeats))
        rows.append(["MemorySource (engine alone)", "-", f"{us:.1f}", f"{rate:,.0f}"])
        print(f"memory: {us:.1f} us/sample, {rate:,.0f} samples/s", flush=True)
    with data_server(store) as server:
        for rtt in rtts:
            with ProxyLink().emulate(Condition(rtt_ms=rtt)) as route:
                host, port = route(server) if rtt > 0 else server
                url = f"http://{host}:{port}"
                runs = [measure(url, DATASET, args.epochs, args.batch_size) for _ in range(args.repeats)]
            us, rate = _median(runs)
            each = " ".join(f"{r.us_per_sample:.1f}" for r in runs)
            print(f"http rtt {rtt:g} ms: {us:.1f} us/sample (runs: {each}), {rate:,.0f} samples/s", flush=True)
            rows.append([f"HTTP, {'direct' if rtt == 0 else 'latency proxy'}", f"{rtt:g}", f"{us:.1f}", f"{rate:,.0f}"])
    print()
    print(f"{args.images} samples of ~110 KB, {args.epochs} epochs per run, batch {args.batch_size}, "
          f"median of {args.repeats} runs; client CPU = this process only")
    print(table(["path", "RTT ms", "client CPU us/sample", "samples/s"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
