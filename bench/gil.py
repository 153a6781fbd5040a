"""The engine in the training process against the engine in its own process (issue 25 item 3).

``dataferry serve --workers 2`` on a SQLite store of synthetic JPEGs, behind the latency proxy
at each round trip; a training loop that takes batches and runs a step of ``--step-ms``:
``gil`` runs a fixed amount of pure Python for half of it (a model's Python overhead, holding
the GIL; longer when the GIL is shared), then sleeps the other half; ``sleep`` sleeps all of it
(GPU work). For each (RTT, consumer): alternated pairs of ``Loader`` (in-process) and
``ProcessLoader`` (its default engines: 1 on 2 cores, 3 on 16); per run samples/s (total
samples over the timed wall time, from the first batch on), the loop's wait on the loader
(% of wall time), the mean ``get()`` in us (and the
median of those that found a batch ready: a handover's cost to the loop), client CPU per sample
(training plus engine process; the server's apart); the ratio's median over pairs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from ._common import cpu_seconds, data_server, live_descendants, prepared_store, process_cpu_s, table


def _work(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


_PER_S: list[float] = []


def spin(seconds: float) -> None:
    """Hold the GIL in pure Python for a fixed amount of work: what takes ``seconds`` alone (measured
    once, single-threaded), so that sharing the GIL with the engine makes the step longer, as it
    makes a model's Python longer (a spin until a deadline would hide that)."""
    if not _PER_S:
        t = time.perf_counter()
        _work(2_000_000)
        _PER_S.append(2_000_000 / (time.perf_counter() - t))
    _work(int(seconds * _PER_S[0]))


def run_once(url: str, engine: str, consumer: str, *, seconds: float, step: float, batch_size: int,
             server_pid: int, gil: float = 0.5, engines: int | None = None) -> dict:
    from dataferry.client import Loader, Prefetch
    from dataferry.client._subprocess import ProcessLoader

    cls, kw = (ProcessLoader, {"engines": engines}) if engine == "process" else (Loader, {})
    exclude = live_descendants()
    with cls(url, "bench", batch_size=batch_size, prefetch=Prefetch(max_bytes=256 << 20), **kw) as loader:
        it = iter(loader)
        next(it)  # the first batch: start-up (the child's spawn) is not timed
        c0, s0, t0 = cpu_seconds(exclude=exclude), process_cpu_s(server_pid), time.perf_counter()
        samples = batches = 0
        get_s, ready_us = 0.0, []
        while True:
            ready = not loader._queue.empty()  # a batch is there: what get() itself costs the loop
            g = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                it = iter(loader)
                continue
            now = time.perf_counter()
            get_s += now - g
            if ready:
                ready_us.append((now - g) * 1e6)
            samples += len(b)
            batches += 1
            del b
            if consumer == "gil":
                spin(step * gil)
                time.sleep(step * (1 - gil))
            else:
                time.sleep(step)
            if now - t0 >= seconds:
                break
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(exclude=exclude) - c0
        srv = process_cpu_s(server_pid) - s0
    return {"rate": samples / wall, "wait": get_s / wall, "get_us": get_s / batches * 1e6,
            "ready_us": statistics.median(ready_us) if ready_us else float("nan"),
            "cpu_us": cpu / samples * 1e6, "srv_us": srv / samples * 1e6, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.gil", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=2048)
    p.add_argument("--rtts", default="0,100", help="round trips in ms (latency proxy)")
    p.add_argument("--consumers", default="gil,sleep")
    p.add_argument("--step-ms", type=float, default=10.0, help="training step per batch")
    p.add_argument("--gil", type=float, default=0.5, help="the part of a gil consumer's step spent holding the GIL")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seconds", type=float, default=6.0, help="timed seconds per run")
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--engines", type=int, default=None,
                   help="ProcessLoader's engine processes (default: its own, by the cores)")
    args = p.parse_args(argv)
    from dataferry.client._subprocess import default_engines

    from ._links import Condition, ProxyLink

    summary = []
    spin(0.01)  # calibrate before any other thread runs
    with prepared_store("sqlite", args.images) as (store_url, _, _), \
            data_server(store_url, args=("--workers", "2")) as address:
        for rtt in [float(x) for x in args.rtts.split(",")]:
            with ProxyLink().emulate(Condition(rtt)) as route:
                host, port = route(address)
                url = f"http://{host}:{port}"
                kw = dict(seconds=args.seconds, step=args.step_ms / 1e3, batch_size=args.batch_size,
                          server_pid=address.pid, gil=args.gil, engines=args.engines)
                run_once(url, "thread", "sleep", **(kw | {"seconds": 1.0}))  # warm the page cache and proxy
                for consumer in args.consumers.split(","):
                    rows, ratios = [], []
                    for i in range(args.pairs):
                        order = ("thread", "process") if i % 2 == 0 else ("process", "thread")
                        got = {e: run_once(url, e, consumer, **kw) for e in order}
                        ratios.append(got["process"]["rate"] / got["thread"]["rate"])
                        for e in order:
                            r = got[e]
                            rows.append([str(i + 1), e, f"{r['rate']:,.0f}", f"{r['wait'] * 100:.0f}%",
                                         f"{r['get_us']:.0f}", f"{r['ready_us']:.0f}", f"{r['cpu_us']:.0f}",
                                         f"{r['srv_us']:.0f}"])
                    held = f", GIL held {args.gil:.0%}" if consumer == "gil" else ""
                    print(f"\n{rtt:g} ms RTT, consumer {consumer} (step {args.step_ms:g} ms{held}, batch "
                          f"{args.batch_size}: at most {args.batch_size / args.step_ms * 1e3:,.0f}/s), "
                          f"{args.images} JPEGs, runs of {args.seconds:g} s; ProcessLoader engines: "
                          f"{args.engines or default_engines()}:", flush=True)
                    print(table(["pair", "engine", "samples/s", "loop waited", "get() us", "ready get() us",
                                 "client CPU us/sample",
                                 "server CPU us/sample"], rows), flush=True)
                    summary.append(f"{rtt:g} ms, {consumer}: process / in-process median "
                                   f"{statistics.median(ratios):.2f} (range {min(ratios):.2f}-{max(ratios):.2f}, "
                                   f"{len(ratios)} alternated pairs)")
    print("\n" + "\n".join(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
