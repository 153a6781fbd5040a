"""The ``dataferry`` command line: the dispatcher and the store's own subcommands.

Each subcommand is two plain functions: ``configure(parser)`` declares its
arguments (cheap: it runs for ``--help``) and ``run(args) -> int`` does the
work, importing numpy, Pillow and the stores only then, so ``dataferry
--help`` answers at once. :func:`command` registers a pair. Subcommands in
modules of their own (``advise`` here; ``serve``, ``demo``, ``bench``, ``latency-proxy``)
are listed in ``_MODULES`` and imported only when they are the command being run.

Exit status: 0 on success; 1 when ingest rejected files (unless
``--allow-rejects``) or ``verify`` found damaged samples; 2 for usage, configuration and store errors, printed as
one line ``dataferry: error: <message>``; 130 when interrupted.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from dataferry.schema import ConfigError, DataferryError
from dataferry.schema import positive as _positive, run as _run, store_arg as _store_arg, with_store as _with_store

__all__ = ["main", "command"]

Configure = Callable[[argparse.ArgumentParser], None]
_COMMANDS: dict[str, tuple[str, Configure]] = {}

#: Subcommands in modules of their own, here (advise) or in other packages: name -> (module, help). The module
#: has ``add_cli_arguments(parser)`` and ``cli(args) -> int``, and is imported
#: only when its subcommand is the one asked for.
_MODULES: dict[str, tuple[str, str]] = {
    "serve": ("dataferry.server.cli", "serve a store's samples over HTTP to remote training jobs"),
    "latency-proxy": ("dataferry.bench.latency_proxy_cli", "a TCP proxy that adds delay, jitter and a bandwidth cap"),
    "demo": ("dataferry.bench.demo", "ingest synthetic images, serve them, and stream epochs across an emulated WAN link"),
    "advise": ("dataferry.schema.cli._advise",
               "measure how to store a dataset (original, JPEG qualities, resized, lossless) and recommend one"),
    "bench": ("dataferry.bench.cli", "throughput against RTT, loss and link rate: ours, a naive DataLoader, WebDataset"),
}


def command(name: str, help: str) -> Callable[[Configure], Configure]:
    """Register ``configure(parser)``; it must ``parser.set_defaults(run=...)``."""

    def register(configure: Configure) -> Configure:
        _COMMANDS[name] = (help, configure)
        return configure

    return register




# --- ingest -------------------------------------------------------------------


@command("ingest", "validate images (a folder or a manifest) and store them as a dataset")
def _configure_ingest(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", nargs="?", metavar="SRC", help="ImageFolder directory, or a .csv/.jsonl manifest")
    p.add_argument("--dataset", required=True, help="dataset name")
    _store_arg(p)
    p.add_argument("--format", choices=("jpeg", "png", "jpeg2000"),
                   help="re-encode to this format (default: keep the bytes); jpeg2000 is lossless, and DALI "
                        "can decode it on the GPU (nvJPEG2000)")
    p.add_argument("--quality", type=_positive, default=90, help="JPEG quality when re-encoding (default: 90)")
    p.add_argument("--max-side", type=_positive, metavar="N", help="downscale so no side exceeds N (needs --format)")
    p.add_argument("--max-pixels", type=_positive, metavar="N", help="decompression-bomb limit (default: Pillow's)")
    p.add_argument("--workers", type=_positive, metavar="N", help="validation processes (default: one per core)")
    p.add_argument("--allow-rejects", action="store_true", help="exit 0 even when some files were rejected")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    g = p.add_argument_group("synthetic data (instead of SRC)")
    g.add_argument("--synthetic", type=_positive, metavar="N", help="generate N ImageNet-like JPEGs and ingest them")
    g.add_argument("--classes", type=_positive, metavar="K", help="synthetic classes (default: 10)")
    g.add_argument("--seed", type=int, help="synthetic seed (default: 0)")
    g.add_argument("--keep-dir", metavar="DIR", help="generate into DIR and keep it (default: a temporary folder)")
    p.set_defaults(run=_run_ingest)


def _run_ingest(args: argparse.Namespace) -> int:
    if (args.src is None) == (args.synthetic is None):
        raise ConfigError("ingest needs a source: give SRC or --synthetic N (not both)")
    if args.synthetic is None and (args.classes or args.seed is not None or args.keep_dir):
        raise ConfigError("--classes, --seed and --keep-dir go with --synthetic")
    from dataferry.schema import DEFAULT_MAX_PIXELS, IngestOptions, ingest, require_images, scan

    options = IngestOptions(
        format=args.format,
        quality=args.quality,
        max_side=args.max_side,
        max_pixels=args.max_pixels or DEFAULT_MAX_PIXELS,
        workers=args.workers,
        allow_rejects=args.allow_rejects,
    )
    progress = False if args.quiet else None

    def go(path: str) -> int:
        src = scan(path)
        require_images(src)  # before the store is opened: a wrong path creates nothing
        report = _run(_with_store(args.store, lambda s: ingest(s, src, args.dataset, options, progress=progress)))
        print(report.summary())
        return 0 if report.ok else 1

    if args.src is not None:
        return go(args.src)
    return _with_synthetic(args, go)


def _with_synthetic(args: argparse.Namespace, go: Callable[[str], int]) -> int:
    import tempfile
    import time

    from dataferry.schema import make_synthetic

    def make(folder: str) -> int:
        t0 = time.perf_counter()
        syn = make_synthetic(folder, args.synthetic, classes=args.classes or 10, seed=args.seed or 0)
        print(
            f"generated {syn.num_images} images in {len(syn.label_names)} classes "
            f"({syn.total_bytes / 1e6:.1f} MB, mean {syn.mean_bytes / 1e3:.0f} KB) "
            f"in {time.perf_counter() - t0:.2f} s under {folder}"
        )
        return go(folder)

    if args.keep_dir:
        return make(args.keep_dir)
    with tempfile.TemporaryDirectory(prefix="dataferry-synthetic-") as tmp:
        return make(tmp)


# --- split ----------------------------------------------------------------------


@command("verify", "check every sample of a dataset against its stored checksum and list the damaged ones")
def _configure_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, help="dataset name")
    _store_arg(p)
    p.add_argument("--split", default="all", help="the split to check (default: all, every committed sample)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    p.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from dataferry.schema import ProgressBar, verify_dataset

    bar = ProgressBar(args.dataset, show=False if args.quiet else None)
    try:
        report = _run(_with_store(args.store, lambda store: verify_dataset(
            store, args.dataset, split=args.split, on_progress=bar), create=False))
    finally:
        bar.close()
    if report.damaged:
        print(_table(("ID", "PATH", "DAMAGE"), [(d.id, d.path or "-", d.reason) for d in report.damaged]))
    print(report.summary())
    return 0 if report.ok else 1


@command("split", "make disjoint splits (train/val/...) of a dataset, or a derived split from a metadata filter")
def _configure_split(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset", required=True, help="dataset name")
    p.add_argument("--where", metavar="FILTER",
                   help='keep the samples whose metadata match FILTER, e.g. \'width >= 256 and label_name in ("cat", "dog")\' '
                        "(the language: dataferry/schema/_filter.py), stored as the derived split --name")
    p.add_argument("--name", metavar="NAME", help="the derived split's name (with --where)")
    p.add_argument("--from", dest="parent", default=None, metavar="SPLIT",
                   help="the split to filter (with --where) or to divide (with --ratios alone); default: all")
    p.add_argument("--ratios", metavar="NAME=R,...",
                   help="e.g. train=0.8,val=0.1,test=0.1; with --where, splits of the derived split")
    p.add_argument("--stratify", action="store_true", help="keep each label's proportions in every split")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (default: 0)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    _store_arg(p)
    p.set_defaults(run=_run_split)


def _run_split(args: argparse.Namespace) -> int:
    from dataferry.schema import ALL_SPLIT, derive_split, make_splits, parse_ratios

    if args.where is None and args.ratios is None:
        raise ConfigError("split needs --ratios (train=0.8,val=0.2), or --where FILTER --name NAME, or both")
    if (args.where is None) != (args.name is None):
        raise ConfigError("--where and --name go together: --where FILTER --name NAME")
    ratios = parse_ratios(args.ratios) if args.ratios is not None else None
    parent = args.parent or ALL_SPLIT

    async def go(store):
        derived, source = None, parent
        if args.where is not None:
            derived = await derive_split(store, args.dataset, args.where, name=args.name, parent=parent,
                                         progress=False if args.quiet else None)
            source = derived.name
        if ratios is None:
            return derived, source, 0, {}, []
        idlist = await store.read_split(args.dataset, source)
        splits = make_splits(idlist, ratios, stratify=args.stratify, seed=args.seed)
        for name, ids in splits.items():
            await store.put_split(args.dataset, name, ids)
        others = [s.name for s in await store.list_splits(args.dataset) if s.name not in splits and s.name != ALL_SPLIT]
        return derived, source, len(idlist), splits, others

    from dataferry.schema import FilterError, parse_filter

    try:
        if args.where is not None:
            parse_filter(args.where)  # a bad filter fails here, before the store is opened
        derived, source, total, splits, others = _run(_with_store(args.store, go, create=False))
    except FilterError as exc:  # the one-line error, and the filter pointed at under it
        print(f"dataferry: error: {exc}\n{exc.caret}", file=sys.stderr)
        return 2
    if derived is not None:
        how = "reused (same filter, parent unchanged)" if derived.reused else "made"
        print(f"derived split {derived.name!r} of dataset {args.dataset!r}: {derived.num_ids} samples of split "
              f"{derived.parent!r} match {derived.where!r}; {how}, content {derived.content_hash}")
    if ratios is None:
        return 0
    rows = [(name, len(ids), f"{len(ids) / total:.1%}" if total else "-") for name, ids in splits.items()]
    print(f"split {args.dataset}/{source}: {total} samples split{' (stratified)' if args.stratify else ''}, seed {args.seed}")
    print(_table(("SPLIT", "SAMPLES", "SHARE"), rows))
    if others and source == ALL_SPLIT:
        print(f"note: other splits left as they were and may overlap these: {', '.join(others)}")
    return 0


# --- ls -------------------------------------------------------------------------


@command("ls", "list datasets, their splits and sizes")
def _configure_ls(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", nargs="?", metavar="DATASET", help="show one dataset in detail")
    _store_arg(p)
    p.set_defaults(run=_run_ls)


def _run_ls(args: argparse.Namespace) -> int:
    async def go(store):
        infos = [await store.get_dataset(args.dataset)] if args.dataset else await store.list_datasets()
        return [(info, await store.list_splits(info.name)) for info in infos]

    listing = _run(_with_store(args.store, go, create=False))
    if not listing:
        print(f"no datasets in {args.store}")
        return 0
    if args.dataset:
        info, splits = listing[0]
        names = ", ".join(info.label_names[:20]) + (", ..." if info.num_classes > 20 else "")
        print(f"dataset {info.name!r}: {info.num_samples} samples, {info.num_classes} classes, "
              f"created {info.created:%Y-%m-%d %H:%M:%S}")
        print(f"classes: {names}")
        print(_table(("SPLIT", "SAMPLES"), [(s.name, s.num_ids) for s in splits]))
        return 0
    rows = [
        (info.name, info.num_samples, info.num_classes, " ".join(f"{s.name}={s.num_ids}" for s in splits),
         f"{info.created:%Y-%m-%d %H:%M}")
        for info, splits in listing
    ]
    print(_table(("DATASET", "SAMPLES", "CLASSES", "SPLITS", "CREATED"), rows))
    return 0


def _table(header: tuple[str, ...], rows: list[tuple]) -> str:
    from dataferry.schema import format_table

    return format_table(header, rows)


# --- schema -----------------------------------------------------------------------


@command("schema", "create (apply) or print (show) the Cassandra/ScyllaDB schema")
def _configure_schema(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for action, text in (("apply", "create the keyspace and tables (idempotent)"), ("show", "print the CQL")):
        q = sub.add_parser(action, help=text, description=text)
        q.add_argument("--store", required=action == "apply", metavar="URL", help="cassandra://HOSTS/KEYSPACE")
        q.add_argument("--replication", metavar="R", help="SimpleStrategy:RF or NetworkTopologyStrategy:dc1=RF,...")
        q.set_defaults(run=_run_schema)


def _run_schema(args: argparse.Namespace) -> int:
    import dataclasses

    from dataferry.schema import CassandraOptions, parse_store_url

    opts = parse_store_url(args.store) if args.store else CassandraOptions()
    if not isinstance(opts, CassandraOptions):
        raise ConfigError(f"schema {args.action} is for cassandra:// stores; {args.store!r} creates its own tables")
    if args.replication:
        opts = dataclasses.replace(opts, replication=args.replication)
    from dataferry.schema import apply_schema, schema_statements

    if args.action == "show":
        print("\n\n".join(f"{stmt};" for stmt in schema_statements(opts)))
        return 0
    applied = _run(apply_schema(opts))
    print(f"schema applied to keyspace {opts.keyspace!r}: {len(applied)} statements (existing objects kept)")
    return 0


# --- main -------------------------------------------------------------------------


def _parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The parser; of the ``_MODULES`` commands only ``chosen`` gets its arguments."""
    parser = argparse.ArgumentParser(
        prog="dataferry",
        description="Store images in Cassandra/ScyllaDB or SQLite and stream them to training jobs.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (text, configure) in _COMMANDS.items():
        configure(sub.add_parser(name, help=text, description=text))
    for name, (module, text) in _MODULES.items():
        p = sub.add_parser(name, help=text, description=text)
        if name == chosen:
            import importlib

            mod = importlib.import_module(module)
            mod.add_cli_arguments(p)
            p.set_defaults(run=mod.cli)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``dataferry`` command line; return the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser(argv[0] if argv else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error (already printed)
        return exc.code if isinstance(exc.code, int) else 2
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.run(args)
    except DataferryError as exc:
        print(f"dataferry: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dataferry: interrupted", file=sys.stderr)
        return 130

