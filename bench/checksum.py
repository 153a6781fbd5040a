"""What end-to-end verification costs the client, per sample of about 110 KB.

    python -m dataferry.bench.checksum [--size 110000] [--images 2048] [--epochs 3] [--repeats 5]

Two parts, each the median of ``--repeats``:

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
import zlib

__all__ = ["main"]


def _per_call(fn, data, n: int, repeats: int) -> float:
    """Median seconds per call of ``fn(data)`` over ``repeats`` rounds of ``n`` calls."""
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(data)
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def hashes() -> dict:
    from dataferry.schema import sample_checksum

    found = {"xxh3-64 (sample_checksum)": sample_checksum}
    try:
        import crc32c

        found["crc32c"] = crc32c.crc32c
    except ImportError:
        pass
    found["zlib.crc32"] = zlib.crc32
    found["sha256"] = lambda d: hashlib.sha256(d).digest()
    return found


def loader_cpu(images: int, size: int, epochs: int, verify: bool) -> float:
    """This process's CPU seconds per sample for a Loader over checksummed samples in memory."""
    from dataferry.client import ErrorPolicy, Loader, MemorySource
    from dataferry.schema import Sample, sample_checksum

    blob = os.urandom(size + images)
    samples = [Sample(i, i % 10, d := blob[i : i + size], checksum=sample_checksum(d)) for i in range(images)]
    with Loader(MemorySource("bench", samples), "bench", batch_size=256,
                errors=ErrorPolicy(verify=verify)) as loader:
        n = 0
        it = iter(loader)
        first = next(it)  # the start-up and the id list left out
        c0 = time.process_time()
        for batch in it:
            n += len(batch)
        for _ in range(epochs - 1):
            for batch in loader:
                n += len(batch)
        cpu = time.process_time() - c0
        del first
    return cpu / max(n, 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.checksum", description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=110_000, help="bytes per sample (default: 110000)")
    p.add_argument("--images", type=int, default=2048, help="samples in the loader's source (default: 2048)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per loader run (default: 3)")
    p.add_argument("--repeats", type=int, default=5, help="runs of each (default: 5; the median is printed)")
    args = p.parse_args(argv)

    data = os.urandom(args.size)
    print(f"checksum of {args.size:,} bytes (median of {args.repeats} rounds):")
    for name, fn in hashes().items():
        s = _per_call(fn, data, 2000 if "sha" not in name else 200, args.repeats)
        print(f"  {name:<28} {s * 1e6:8.2f} us   {args.size / s / 1e9:6.1f} GB/s")

    on, off = [], []
    for _ in range(args.repeats):  # interleaved, so a busy moment hits both
        on.append(loader_cpu(args.images, args.size, args.epochs, True))
        off.append(loader_cpu(args.images, args.size, args.epochs, False))
    m_on, m_off = statistics.median(on), statistics.median(off)
    print(f"Loader over MemorySource, {args.images} x {args.size:,} bytes, {args.epochs} epochs, "
          f"CPU per sample (median of {args.repeats}):")
    print(f"  verify=True  (default)      {m_on * 1e6:8.2f} us")
    print(f"  verify=False                {m_off * 1e6:8.2f} us")
    print(f"  verification adds           {(m_on - m_off) * 1e6:8.2f} us per sample")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
