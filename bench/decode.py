"""Decode throughput on this machine: DALI on the CPU against Pillow.

``python -m dataferry.bench.decode [--images 64] [--runs 5] [--threads N]``

The same synthetic ImageNet-like JPEGs (about 110 KB, 400-640 px on the long
side) go through:

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from ._common import table

__all__ = ["main", "run_decode_bench"]


def _jpegs(n: int) -> list[bytes]:
    from dataferry.schema import make_synthetic

    with tempfile.TemporaryDirectory(prefix="dataferry-decode-") as tmp:
        make_synthetic(tmp, n, classes=10, seed=0)
        return read_files(tmp)


def read_files(folder: str) -> list[bytes]:
    """The bytes of every file under ``folder``, sorted by path."""
    out = []
    for p in sorted(os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs):
        with open(p, "rb") as fh:
            out.append(fh.read())
    return out


def median_seconds(fn, runs: int) -> float:
    """The median time of ``runs`` calls of ``fn``, after one warm-up call (builds, allocations, JIT)."""
    fn()
    secs = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t0)
    return statistics.median(secs)


def _median_rate(fn, runs: int, images: int, nbytes: int) -> tuple[float, float]:
    s = median_seconds(fn, runs)
    return images / s, nbytes / s / 1e6


def _pillow(blobs: list[bytes], threads: int, passes: int):
    from dataferry.client._transforms import decode_rgb

    work = blobs * passes
    if threads == 1:
        return lambda: [decode_rgb(b) for b in work]
    pool = ThreadPoolExecutor(threads)
    return lambda: list(pool.map(decode_rgb, work, chunksize=4))


def _dali_decode(blobs: list[bytes], threads: int, passes: int, batch: int):
    from dataferry.client import DaliOptions

    return decode_epoch(blobs, passes, batch, "cpu", None, DaliOptions(device="cpu", num_threads=threads))


def decode_epoch(blobs: list[bytes], passes: int, batch: int, device: str, device_id: int | None, options):
    """:func:`pipeline_epoch` of DALI's decoder alone (no transform) over ``blobs`` ``passes`` times, in
    batches of ``batch``."""
    import numpy as np

    from dataferry.client._dali import build_pipeline

    arrays = [np.frombuffer(b, np.uint8) for b in blobs] * passes
    feeds = [(arrays[i : i + batch],) for i in range(0, len(arrays), batch)]
    return pipeline_epoch(lambda source: build_pipeline(source, None, targets="none", batch_size=batch, device=device,
                                                        device_id=device_id, options=options), feeds)


def pipeline_epoch(build, feeds: list, after=None):
    """A function that runs one epoch of ``feeds`` (the external source's output, one per batch) through
    the DALI pipeline ``build(source)`` makes (built here, once), then calls ``after`` (a device sync)."""
    state = {"i": 0}

    def source():
        if state["i"] == len(feeds):
            raise StopIteration
        state["i"] += 1
        return feeds[state["i"] - 1]

    pipe = build(source)
    pipe.build()

    def run():
        state["i"] = 0
        try:
            while True:
                pipe.run()
        except StopIteration:
            pipe.reset()
        if after is not None:
            after()

    return run


def memory_source(name: str, blobs: list[bytes], passes: int):
    """A :class:`~dataferry.client.MemorySource` of ``blobs`` ``passes`` times over (labels ``id % 10``)."""
    from dataferry.client import MemorySource
    from dataferry.schema import Sample

    return MemorySource(name, [Sample(i, i % 10, blobs[i % len(blobs)]) for i in range(len(blobs) * passes)])


def _end_to_end(blobs: list[bytes], kind: str, threads: int, passes: int, batch: int):
    from dataferry.client import DaliIterator, DaliOptions, Loader, TorchIterator, TrainTransform

    loader = Loader(memory_source("bench", blobs, passes), "bench", batch_size=batch)
    if kind == "dali":
        it = DaliIterator(loader, TrainTransform(224), options=DaliOptions(device="cpu", num_threads=threads))
    else:
        it = TorchIterator(loader, TrainTransform(224), workers=threads)

    def run():
        for _ in it:
            pass

    return run


def run_decode_bench(images: int = 64, runs: int = 5, threads: int | None = None, passes: int = 4,
                     batch: int = 32) -> str:
    threads = threads or os.cpu_count() or 1
    blobs = _jpegs(images)
    n, nbytes = len(blobs) * passes, sum(map(len, blobs)) * passes
    rows = []

    def row(path: str, t: int, make) -> None:
        rate, mb = _median_rate(make, runs, n, nbytes)
        rows.append([path, str(t), f"{rate:,.0f}", f"{mb:,.1f}"])

    row("decode: Pillow", 1, _pillow(blobs, 1, passes))
    row("decode: Pillow, thread pool", threads, _pillow(blobs, threads, passes))
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        rows.append(["decode: DALI cpu", "-", "not installed", "-"])
        dali = False
    else:
        dali = True
        row("decode: DALI cpu", 1, _dali_decode(blobs, 1, passes, batch))
        row("decode: DALI cpu", threads, _dali_decode(blobs, threads, passes, batch))
    e2e = "decode+crop+flip+normalize 224: "
    row(e2e + "TorchIterator (Pillow)", threads, _end_to_end(blobs, "torch", threads, passes, batch))
    if dali:
        row(e2e + "DaliIterator cpu", threads, _end_to_end(blobs, "dali", threads, passes, batch))
    mean_kb = nbytes / n / 1e3
    head = (f"{len(blobs)} synthetic JPEGs (mean {mean_kb:.0f} KB) x {passes} passes, batch {batch}, "
            f"median of {runs} runs, {os.cpu_count()} CPUs")
    return head + "\n" + table(["path", "threads", "images/s", "MB/s"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataferry.bench.decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=64, help="distinct synthetic JPEGs (default 64)")
    ap.add_argument("--passes", type=int, default=4, help="times each image is decoded per run (default 4)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per row; the median is shown (default 5)")
    ap.add_argument("--threads", type=int, default=None, help="threads for the parallel rows (default: all CPUs)")
    ap.add_argument("--batch", type=int, default=32, help="batch size for DALI and the loader (default 32)")
    args = ap.parse_args(argv)
    print(run_decode_bench(args.images, args.runs, args.threads, args.passes, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
