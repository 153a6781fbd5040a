"""Server memory under steady load: does each worker's RSS level off, and which part grows?

    python -m dataferry.bench.server_memory [--workers 2] [--clients 8] [--rounds 10] [--seconds 35]
                                            [--images 4000] [--data random|synthetic] [--connections 2]
                                            [--depth 2] [--request-size 64] [--client raw|loader]
                                            [--bound 0.10] [--probe [--trim]]

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time

from ._common import announced, process_tree
from .load_server import DATASET, _client, _ids, prepare_store

__all__ = ["main", "proc_memory"]

_FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmRSS")


def proc_memory(pid: int) -> dict[str, float] | None:
    """``RssAnon``, ``RssFile``, ``RssShmem`` and ``VmRSS`` of ``pid`` from ``/proc/PID/status``, and ``Pss``
    (its resident pages, each shared one divided by the processes mapping it) from ``smaps_rollup``, in MiB
    (Linux); None if it is gone. ``Pss`` is 0 where the kernel has no ``smaps_rollup`` (before 4.14)."""
    kb = _read_kb(f"/proc/{pid}/status", _FIELDS)
    if kb is None:
        return None
    kb.update(_read_kb(f"/proc/{pid}/smaps_rollup", ("Pss",)) or {})
    return {k: kb.get(k, 0) / 1024 for k in (*_FIELDS, "Pss")}


def _loader_client(url: str, dataset: str, start: float, seconds: float, out) -> None:
    """``--client loader``: the real :class:`~dataferry.client.Loader` over HTTP, epochs until the deadline."""
    from dataferry.client import Loader

    samples = epochs = 0
    error = ""
    time.sleep(max(0.0, start - time.time()))
    deadline = start + seconds
    try:
        with Loader(url, dataset, batch_size=256) as loader:
            while time.time() < deadline:
                for batch in loader:
                    samples += len(batch)
                    if time.time() >= deadline:
                        break
                epochs += 1
    except Exception as exc:  # noqa: BLE001 - reported as the client's error
        error = f"{type(exc).__name__}: {exc}"
    out.put({"samples": samples, "errors": int(bool(error)), "first_error": error, "epochs": epochs})


def _read_kb(path: str, fields: tuple[str, ...]) -> dict[str, int] | None:
    try:
        with open(path) as fh:
            return {k: int(v.split()[0]) for k, _, v in (line.partition(":") for line in fh) if k in fields}
    except (OSError, ValueError):
        return None


def _server_cmd(store_url: str, workers: int, probe_dir: str | None, trim: bool = False) -> list[str]:
    head = [sys.executable, "-m", "dataferry.bench._memprobe", *(["--trim"] if trim else []), probe_dir] \
        if probe_dir else [sys.executable, "-m", "dataferry.server"]
    return [*head, "--store", store_url, "--host", "127.0.0.1", "--port", "0", "--workers", str(workers),
            "--no-access-log", "--log-level", "WARNING", "--max-concurrent", "1024"]


def run(args: argparse.Namespace) -> int:
    store_url = prepare_store(args.images, args.data, args.cache_dir)
    ids = list(range(args.images)) if args.data == "random" else _ids(store_url)
    total = args.rounds * args.seconds
    size = os.path.getsize(store_url.removeprefix("sqlite://")) / 2**20
    load = ("Loader clients (HTTP, batch_size 256, epochs in a loop)" if args.client == "loader" else
            f"raw-socket clients x {args.connections} connections x {args.depth} pipelined requests of "
            f"{args.request_size} ids")
    print(f"server memory: dataferry serve --workers {args.workers}, {args.clients} {load}, "
          f"{args.rounds} rounds of {args.seconds:g} s, {args.images} {args.data} samples ({size:.0f} MiB file), "
          f"{os.cpu_count()} cores shared by the server and the clients" + (", with --probe" if args.probe else ""),
          flush=True)
    probe_dir = tempfile.mkdtemp(prefix="dataferry-memprobe-") if args.probe else None
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    anon: dict[int, list[float]] = {}
    failed = False
    with announced(_server_cmd(store_url, args.workers, probe_dir, args.trim), "the data server") as server:
        host, port = server
        time.sleep(0.5)
        pids = process_tree(server.pid)
        workers = [p for p in pids if p != server.pid]
        start = time.time() + 1.0
        if args.client == "loader":
            procs = [ctx.Process(target=_loader_client, args=(f"http://{host}:{port}", DATASET, start, total, out))
                     for _ in range(args.clients)]
        else:
            procs = [ctx.Process(target=_client, args=(host, port, ids, args.request_size, args.connections,
                                                       args.depth, start, 0.0, total, k, out))
                     for k in range(args.clients)]
        for p in procs:
            p.start()
        print(f"{'round':>5} {'process':>14} {'RssAnon':>8} {'RssFile':>8} {'RssShmem':>8} {'VmRSS':>8} "
              f"{'Pss':>8}  MiB", flush=True)
        for rnd in range(1, args.rounds + 1):
            time.sleep(max(0.0, start + rnd * args.seconds - time.time()))
            if probe_dir:
                _ask_probes(workers)
                _print_probes(probe_dir, workers, rnd)
            for pid in pids:
                m = proc_memory(pid)
                role = "parent" if pid == server.pid else f"worker {pid}"
                if m is None:
                    print(f"{rnd:>5} {role:>14}  (gone)", flush=True)
                    failed = True
                    continue
                if pid != server.pid:
                    anon.setdefault(pid, []).append(m["RssAnon"])
                print(f"{rnd:>5} {role:>14} {m['RssAnon']:8.1f} {m['RssFile']:8.1f} {m['RssShmem']:8.1f} "
                      f"{m['VmRSS']:8.1f} {m['Pss']:8.1f}", flush=True)
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
    samples = sum(r["samples"] for r in results)
    errors = sum(r["errors"] for r in results)
    print(f"served {samples} samples ({samples / total:.0f}/s), errors {errors}"
          + (f" ({next(r['first_error'] for r in results if r['first_error'])})" if errors else ""))
    failed |= bool(errors) or not samples
    for pid, series in anon.items():
        if len(series) < 3:
            continue
        base, peak = series[1], max(series[2:])
        grew = peak / base - 1 if base else 0.0
        ok = grew <= args.bound
        failed |= not ok
        print(f"worker {pid}: RssAnon {base:.1f} MiB after round 2, at most {peak:.1f} MiB after ({grew:+.1%}; "
              f"bound {args.bound:.0%}): {'flat' if ok else 'GREW'}; round by round "
              + " ".join(f"{a:.0f}" for a in series))
    return 1 if failed else 0


def _ask_probes(workers: list[int]) -> None:
    import signal

    for pid in workers:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass


def _print_probes(folder: str, workers: list[int], rnd: int) -> None:
    """Each worker's ``rnd``-th report, waited for (the handler runs when the worker's loop next runs Python)."""
    for pid in workers:
        path = os.path.join(folder, f"{pid}-{rnd}.txt")
        deadline = time.time() + 15.0
        while not os.path.exists(path) and time.time() < deadline:
            time.sleep(0.1)
        try:
            with open(path) as fh:
                text = fh.read()
        except OSError:
            print(f"      worker {pid}: no probe report within 15 s", flush=True)
            continue
        print("\n".join(f"      {line}" for line in text.splitlines()), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dataferry.bench.server_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2, help="server worker processes (default: %(default)s)")
    p.add_argument("--clients", type=int, default=8, help="load generator processes (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=10, help="rounds; memory is read after each (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=35.0, help="seconds per round (default: %(default)s)")
    p.add_argument("--client", choices=("raw", "loader"), default="raw",
                   help="raw: load_server's raw-socket client; loader: the real Loader over HTTP, epochs in a loop "
                        "(its window and request sizes; costs the shared cores far more) (default: %(default)s)")
    p.add_argument("--connections", type=int, default=2, help="connections per client process (default: %(default)s)")
    p.add_argument("--depth", type=int, default=2, help="pipelined requests per connection (default: %(default)s)")
    p.add_argument("--request-size", type=int, default=64, help="ids per request (default: %(default)s)")
    p.add_argument("--images", type=int, default=4000, help="samples in the store (default: %(default)s)")
    p.add_argument("--data", choices=("synthetic", "random"), default="random",
                   help="random bytes of JPEG-like sizes (instant) or synthetic JPEGs (default: %(default)s)")
    p.add_argument("--cache-dir", help="where the store file is kept (default: the temp folder)")
    p.add_argument("--bound", type=float, default=0.10,
                   help="allowed growth of a worker's RssAnon after round 2 (default: %(default)s)")
    p.add_argument("--probe", action="store_true",
                   help="tracemalloc and mallinfo2 in each worker, reported per round (diagnosis; costs CPU)")
    p.add_argument("--trim", action="store_true",
                   help="with --probe: each report also calls malloc_trim(0) in the worker and prints what it gave "
                        "back (fragmentation's share; it changes what follows)")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be at least 3 (two rounds of warm-up, then the rounds judged)")
    if args.request_size > args.images:
        p.error("--request-size must not exceed --images")
    if args.trim and not args.probe:
        p.error("--trim goes with --probe")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
