"""``dataferry advise``: its arguments and its run (the CLI imports this module only for that command).

The advisor lives with ingest (``dataferry.schema``) and measures decoding on
the machine that will train; from up here, the top floor, this module hands it
the client's decoders (``dataferry.client.decode_probe``): :func:`advise_source`
and :func:`advise_dataset` are the advisor's, measured with them.
"""

from __future__ import annotations

import argparse

from dataferry.schema import ConfigError, positive as _positive, run as _run, store_arg as _store_arg
from dataferry.schema import with_store as _with_store

__all__ = ["add_cli_arguments", "cli", "advise_source", "advise_dataset"]


def advise_source(src: str, options=None):
    """``dataferry.schema.advise_source`` with this machine's decoders (``options``: an ``AdviseOptions``)."""
    from dataferry.client import decode_probe
    from dataferry.schema import AdviseOptions, advise_source as measure_source

    return measure_source(src, AdviseOptions() if options is None else options, probe=decode_probe)


async def advise_dataset(store, dataset: str, options=None):
    """``dataferry.schema.advise_dataset`` with this machine's decoders (``options``: an ``AdviseOptions``)."""
    from dataferry.client import decode_probe
    from dataferry.schema import AdviseOptions, advise_dataset as measure_dataset

    return await measure_dataset(store, dataset, AdviseOptions() if options is None else options, probe=decode_probe)


def add_cli_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", nargs="?", metavar="SRC", help="ImageFolder directory, or a .csv/.jsonl manifest")
    p.add_argument("--dataset", metavar="NAME",
                   help="with SRC: the dataset name in the printed ingest command (default: SRC's name); "
                        "alone: advise on this stored dataset")
    _store_arg(p)
    p.add_argument("--sample", type=_positive, default=200, metavar="N", help="images to measure (default: 200)")
    p.add_argument("--seed", type=int, default=0, help="which images are sampled (default: 0)")
    p.add_argument("--link", default="1gbit", metavar="RATE",
                   help="link bandwidth to the training job: 1gbit, 100mbit, 50MB (bytes/s) (default: 1gbit)")
    p.add_argument("--rtt", default="100ms", metavar="TIME", help="round trip to the training job (default: 100ms)")
    p.add_argument("--min-psnr", type=float, metavar="DB",
                   help="the fidelity a recommendation must keep (default: exact for a lossless source, 38 dB "
                        "otherwise)")
    p.add_argument("--max-side", type=_positive, metavar="N",
                   help="allow strategies resized to a maximum side of N or more (measured too); default: full "
                        "resolution only")
    p.add_argument("--workers", type=_positive, metavar="N", help="measuring processes (default: one per core)")
    p.add_argument("--dali", choices=("auto", "gpu", "cpu", "off"), default="auto",
                   help="the DALI decode column: auto (the GPU's mixed decoder when there is a GPU), gpu, cpu "
                        "(DALI's CPU decoder), off (default: auto)")
    p.add_argument("--plot", metavar="FILE", help="also draw the measurements as a PNG chart")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def cli(args: argparse.Namespace) -> int:
    if args.src is None and args.dataset is None:
        raise ConfigError("advise needs a source: SRC (a folder or manifest), or --dataset NAME for a stored dataset")
    from dataferry.schema import AdviseOptions, Link, Rules, check_name, ingest_command, parse_duration, parse_rate
    from dataferry.schema import plot, recommend, render

    link = Link(parse_rate(args.link), parse_duration(args.rtt))
    rules = Rules(min_psnr=args.min_psnr, max_side=args.max_side)
    sides = tuple(sorted({512, 384, 256} | ({args.max_side} if args.max_side else set()), reverse=True))
    options = AdviseOptions(sample=args.sample, seed=args.seed, sides=sides, workers=args.workers,
                            dali=None if args.dali == "auto" else args.dali, progress=False if args.quiet else None)
    if args.src is not None:
        dataset = check_name("dataset", args.dataset or _name_of(args.src))
        advice = advise_source(args.src, options)
    else:
        dataset = check_name("dataset", args.dataset)
        advice = _run(_with_store(args.store, lambda s: advise_dataset(s, dataset, options), create=False))
    rec = recommend(advice, link, rules)
    print(render(advice, link, rules, rec))
    if args.src is None and rec.row is advice.rows[0]:
        print(f"keep dataset {dataset!r} as it is stored: nothing to re-ingest")
    else:
        print(ingest_command(rec, src=args.src, dataset=dataset, store=args.store))
        if args.src is None:
            print(f"(SRC: the folder or manifest {dataset!r} was ingested from; a new dataset name, because ingest "
                  "keeps the samples a dataset already holds)")
    if args.plot:
        plot(advice, link, rec, args.plot)
        print(f"plot: {args.plot}")
    return 0


def _name_of(src: str) -> str:
    """A dataset name from a folder or manifest path: ``/data/Pets 2/`` -> ``Pets-2``."""
    import os
    import re

    base = os.path.basename(os.path.normpath(os.path.abspath(src)))
    if os.path.isfile(src):
        base = os.path.splitext(base)[0]
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", base).strip("-._")[:128] or "dataset"
