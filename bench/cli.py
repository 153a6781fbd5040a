"""``dataferry bench``: every loader against RTT, loss and link rate; a table and plots.

    dataferry bench --quick                 # about 6 minutes: RTT 0 and 50 ms, 1 run each, 2,000 images
    dataferry bench                         # the full sweep, about 40 minutes (see bench/results/README.md)
    sudo dataferry bench --link veth        # a real link-wide rate (tbf), the delay by the proxy
    sudo dataferry bench --link netem       # kernel shaping in namespaces, loss included

Results go to ``--out`` (default ``bench-results/``): ``runs.csv``,
``summary.json``, ``table.md``, ``throughput.png``, ``first_batch.png``,
``cpu.png``, ``inflight.png``. Exit status 0; 1 when some run failed (its error is in
``runs.csv``); 2 for bad options; 3 for ``--link netem`` on a kernel without
``sch_netem`` (with a pointer to ``--link proxy`` and ``--link veth``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["add_cli_arguments", "cli", "QUICK"]

#: what --quick changes (options given explicitly win); 2,000 images are two rounds of the naive loader's
#: 16 workers x 64 samples, so that its window is not one burst of batches arriving together
QUICK = {"images": 2000, "rtts": (0, 50), "rates": (None,), "repeats": 1, "seconds": 2.0}
EXIT_NO_NETEM = 3


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _rates(text: str) -> tuple[str | None, ...]:
    return tuple(None if r in ("", "0", "none", "unlimited") else r for r in text.lower().split(","))


def add_cli_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="a short run: 2,000 images, RTT 0,50, 1 run of at least 2 s each (about 6 minutes)")
    p.add_argument("--out", default="bench-results", metavar="DIR", help="where results go (default: bench-results)")
    p.add_argument("--link", choices=("proxy", "veth", "netem"), default="proxy",
                   help="proxy: latency-proxy processes on loopback (default; no loss; the rate caps each connection); "
                        "veth: network namespaces, a tbf link rate and latency proxies for the delay (root; no loss); "
                        "netem: network namespaces shaped by tc netem (root and sch_netem); see deploy/netem/")
    g = p.add_argument_group("the sweep (defaults: the full sweep)")
    g.add_argument("--rtt", type=_floats, dest="rtts", metavar="MS,...", help="round-trip times (default: 0,50,100,200)")
    g.add_argument("--loss", type=_floats, dest="losses", metavar="PCT,...",
                   help="packet loss per direction, %% (default: 0; above 0 needs --link netem)")
    g.add_argument("--rate", type=_rates, dest="rates", metavar="RATE,...",
                   help="link rates, tc style, e.g. unlimited,1gbit (default: unlimited)")
    g.add_argument("--jitter", type=float, dest="jitter_ms", metavar="MS", help="delay jitter per direction (default: 0)")
    g.add_argument("--loaders", type=lambda t: tuple(t.split(",")), metavar="NAME,...",
                   help="default: http-ooo,http-inorder,http-concurrent,http-naive,cql-ooo,cql-inorder,cql-naive,"
                        "webdataset,mosaic,litdata")
    g.add_argument("--no-cql", action="store_true", help="leave out the CQL loaders (and Cassandra)")
    g.add_argument("--images", type=int, help="synthetic ~110 KB JPEGs (default: 20000)")
    g.add_argument("--repeats", type=int, help="runs per loader and condition; the medians are reported (default: 3)")
    g.add_argument("--seconds", type=float, help="steady-state seconds per run, at most one epoch (default: 4)")
    g.add_argument("--max-samples", type=int, help="samples per run at most, first batch included "
                                                   "(default: one epoch, --images)")
    g.add_argument("--batch-size", type=int, help="samples per batch, every loader (default: 64)")
    g.add_argument("--workers", type=int, help="DataLoader workers of WebDataset, MosaicML Streaming and LitData "
                                               "(default: 4)")
    g.add_argument("--naive-workers", type=int, help="DataLoader workers of http-naive and cql-naive, "
                                                     "one request in flight each (default: 16)")
    g.add_argument("--concurrent-workers", type=int, help="DataLoader workers of http-concurrent (default: 4)")
    g.add_argument("--pool", type=int, help="requests in flight per http-concurrent worker (default: 16)")
    g.add_argument("--inflight", type=int, help="cap the engine's requests in flight (default: none, the Loader's "
                                                "own window, tuned to the link)")
    g.add_argument("--concurrency", type=int, help="CQL requests in flight per store (default: 768)")
    g.add_argument("--shard-mb", type=float, help="shard size of WebDataset, MosaicML Streaming and LitData, MB "
                                                  "(default: 100; smaller only where the dataset has less than "
                                                  "one such shard per worker)")
    p.add_argument("--netem-prefix", default="dfbench", help="name of the netem topology (default: dfbench)")


def options_from(args: argparse.Namespace):
    from .sweep import LOADERS, SweepOptions

    given = {k: v for k, v in vars(args).items() if v is not None and k in SweepOptions.__dataclass_fields__}
    values = ({k: v for k, v in QUICK.items() if k not in given} if args.quick else {}) | given
    if args.no_cql:
        values["loaders"] = tuple(n for n in values.get("loaders", LOADERS) if not n.startswith("cql-"))
    return SweepOptions(**values)


def cli(args: argparse.Namespace) -> int:
    from ._links import ProxyLink
    from .sweep import run_and_report

    opts = options_from(args)
    out = Path(args.out)
    if args.link == "proxy":
        return run_and_report(opts, ProxyLink(), out, command_line(args))
    return _run_in_namespaces(opts, out, args.netem_prefix, args.link, command_line(args))


def command_line(args: argparse.Namespace) -> str:
    """The ``dataferry bench`` command that repeats this sweep: the options given, as given."""
    words = ["dataferry", "bench"]
    if args.quick:
        words.append("--quick")
    if args.link != "proxy":
        words += ["--link", args.link]
    if args.no_cql:
        words.append("--no-cql")
    if args.out != "bench-results":
        words += ["--out", args.out]
    for key, flag in (("rtts", "--rtt"), ("losses", "--loss"), ("rates", "--rate"), ("loaders", "--loaders")):
        value = getattr(args, key)
        if value is not None:
            words += [flag, ",".join("unlimited" if v is None else f"{v:g}" if isinstance(v, float) else v
                                     for v in value)]
    for key in ("jitter_ms", "images", "repeats", "seconds", "max_samples", "batch_size", "workers", "naive_workers",
                "concurrent_workers", "pool", "inflight", "concurrency", "shard_mb"):
        value = getattr(args, key)
        if value is not None:
            flag = "--jitter" if key == "jitter_ms" else "--" + key.replace("_", "-")
            words += [flag, f"{value:g}"]
    return " ".join(words)


def _run_in_namespaces(opts, out: Path, prefix: str, kind: str, command: str) -> int:
    """Build the deploy/netem/ topology, run the sweep inside its client namespace, tear it down."""
    from dataferry.schema import ConfigError

    from ._links import NETEM_SCRIPTS

    if not (NETEM_SCRIPTS / "up.sh").is_file():
        raise ConfigError(f"--link {kind} needs the scripts of a dataferry checkout; {NETEM_SCRIPTS} has none")
    if os.geteuid() != 0:
        raise ConfigError(f"--link {kind} builds network namespaces and qdiscs: run it as root (sudo)")
    if kind == "netem" and any(c.rtt_ms or c.loss_pct or c.jitter_ms for c in opts.conditions()):
        check = subprocess.run([NETEM_SCRIPTS / "check.sh"])  # prints the pointer to the proxy when it fails
        if check.returncode == EXIT_NO_NETEM:
            return EXIT_NO_NETEM
        if check.returncode != 0:
            raise ConfigError(f"the netem probe failed ({NETEM_SCRIPTS / 'check.sh'} exited {check.returncode})")
    if subprocess.run([NETEM_SCRIPTS / "up.sh", "--prefix", prefix]).returncode != 0:
        raise ConfigError(f"could not build the namespaces (see above); a topology left by an earlier run goes with "
                          f"{NETEM_SCRIPTS / 'down.sh'} --prefix {prefix}")
    try:
        child = [sys.executable, "-m", "dataferry.bench.sweep", "--netns-prefix", prefix, "--link", kind,
                 "--out", str(out.resolve()), "--options", json.dumps(opts.to_json()), "--command", command]
        return subprocess.run(["ip", "netns", "exec", f"{prefix}-cli", *child]).returncode
    finally:
        subprocess.run([NETEM_SCRIPTS / "down.sh", "--prefix", prefix], check=False)


def main(argv: list[str] | None = None) -> int:
    """``python -m dataferry.bench.cli``: the same as ``dataferry bench``."""
    p = argparse.ArgumentParser(prog="dataferry bench", description=__doc__.split("\n\n")[0])
    add_cli_arguments(p)
    from dataferry.schema import DataferryError

    try:
        return cli(p.parse_args(argv))
    except DataferryError as exc:
        print(f"dataferry: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
