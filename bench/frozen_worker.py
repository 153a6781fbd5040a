"""A frozen worker of ``dataferry serve --workers N``: what fresh Loaders pay for it.

``python -m dataferry.bench.frozen_worker --workers 4 --loaders 8`` serves a SQLite
store of 2,048 synthetic JPEGs (~110 KB) with ``serve --workers N`` on loopback,
runs one Loader epoch to warm every worker, SIGSTOPs one worker (its kernel keeps
accepting the connections ``SO_REUSEPORT`` gives it, and nothing answers them),
then times ``--loaders`` fresh Loaders (default options, batches of 128), one epoch
each, every epoch checked whole; ``--no-freeze``: nobody stopped, the baseline.
The server's watchdog is off unless ``--worker-timeout S``: by default this
measures the client. Each line: the epoch's seconds, the pool's requests sent
again on a new connection, the engine's hedges and retries. What it cannot show:
a frozen process that also stops its kernel from accepting (a dead host), or a
load balancer's own health checks. Results: ``bench/results/http_receive.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import time

from ._common import _proc_table, data_server, prepared_store


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.frozen_worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--loaders", type=int, default=8)
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--no-freeze", action="store_true", help="stop no worker (the baseline)")
    p.add_argument("--worker-timeout", type=float, default=0.0, metavar="S",
                   help="the server's watchdog (serve --worker-timeout; default 0: off, the client alone)")
    args = p.parse_args(argv)
    from dataferry.client import Loader

    with prepared_store("sqlite", args.images) as (url, _, _), \
            data_server(url, args=("--workers", str(args.workers), "--worker-timeout", str(args.worker_timeout))) \
            as address:
        base = f"http://{address[0]}:{address[1]}"
        with Loader(base, "bench", batch_size=128) as loader:  # every worker started and warm
            sum(len(b) for b in loader)
        stopped = None
        if not args.no_freeze:
            stopped = _proc_table()[0][address.pid][0]
            os.kill(stopped, signal.SIGSTOP)
        print(f"serve --workers {args.workers} --worker-timeout {args.worker_timeout:g} at {base}: "
              f"{'worker %d stopped (SIGSTOP)' % stopped if stopped else 'no worker stopped'}", flush=True)
        took = []
        try:
            for i in range(args.loaders):
                t = time.perf_counter()
                with Loader(base, "bench", batch_size=128) as loader:
                    ids = [i for b in loader for i in b.ids.tolist()]
                    stats = loader.stats()
                    resent = loader._source._pool.resent
                took.append(time.perf_counter() - t)
                if len(ids) != args.images or len(set(ids)) != args.images:
                    raise RuntimeError(f"loader {i}: the epoch was not exact")
                print(f"loader {i + 1}: {args.images} samples in {took[-1]:.2f} s; sent again on a new connection "
                      f"{resent}, hedges {stats.hedges}, retries {stats.retries}", flush=True)
        finally:
            if stopped:
                with contextlib.suppress(ProcessLookupError):  # the server's watchdog killed it
                    os.kill(stopped, signal.SIGCONT)
    print(f"epochs: median {statistics.median(took):.2f} s, range {min(took):.2f}-{max(took):.2f} s "
          f"({len(took)} fresh Loaders)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
