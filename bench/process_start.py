"""Time to the first batch: ``ProcessLoader`` against ``Loader``, with the job's own start-up between.

    python -m dataferry.bench.process_start [--setup-s 0,1.5] [--engines 1,2] [--runs 5] [--images 1024]

``dataferry serve --workers 2`` on a SQLite store of synthetic JPEGs (no link delay: the start-up is
what is timed). Each run makes a fresh loader, waits ``--setup-s`` (what a job does after making its
loader and before its first batch, a DALI pipeline's build among it: about 2 s on the GPU machine), then
times ``get()``; it prints seconds from making the loader to the first batch and from the end of the
wait, medians of ``--runs``, the kinds alternated run by run. Issue 25 item 6: the engine processes'
start (spawn, imports) should hide behind the job's own start-up, not follow it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ._common import data_server, engine_count, prepared_store, table

__all__ = ["main"]


def first_batch(url: str, kind: str, setup_s: float) -> tuple[float, float]:
    """``(seconds from making the loader, seconds after the setup)`` to the first batch."""
    from dataferry.client import Loader, ProcessLoader

    engines = engine_count(kind)
    cls, kw = (ProcessLoader, {"engines": engines}) if engines else (Loader, {})
    t0 = time.perf_counter()
    with cls(url, "bench", batch_size=64, **kw) as loader:
        time.sleep(setup_s)
        t1 = time.perf_counter()
        loader.get(timeout=60)
        t2 = time.perf_counter()
    return t2 - t0, t2 - t1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.process_start", description=__doc__.split("\n")[0])
    p.add_argument("--setup-s", default="0,1.5", help="seconds of the job's own start-up, comma-separated")
    p.add_argument("--engines", default="1,2", help="ProcessLoader engine counts beside Loader")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--images", type=int, default=1024)
    args = p.parse_args(argv)
    kinds = ["thread", *(f"process:{n}" for n in args.engines.split(",") if n.strip())]
    setups = [float(s) for s in args.setup_s.split(",") if s.strip()]
    rows = []
    with prepared_store("sqlite", args.images) as (store_url, _, _), \
            data_server(store_url, args=("--workers", "2")) as (host, port):
        url = f"http://{host}:{port}"
        first_batch(url, "process:1", 0.0)  # the page cache and the interpreter's imports warm
        for setup in setups:
            got: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
            for i in range(args.runs):
                for kind in kinds if i % 2 == 0 else kinds[::-1]:
                    got[kind].append(first_batch(url, kind, setup))
            for kind in kinds:
                total = statistics.median(t for t, _ in got[kind])
                after = statistics.median(a for _, a in got[kind])
                rows.append([f"{setup:g}", kind, f"{total:.3f}", f"{after:.3f}",
                             f"{min(a for _, a in got[kind]):.3f}-{max(a for _, a in got[kind]):.3f}"])
    print(f"first batch of 64 from `dataferry serve --workers 2` on loopback, medians of {args.runs} runs, "
          f"the kinds alternated:")
    print(table(["setup s", "loader", "from making it s", "after the setup s", "after the setup, range"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
