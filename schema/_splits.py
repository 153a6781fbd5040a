"""Train/val/test splits of a dataset's id list.

:func:`make_splits` is deterministic (same ids, ratios, seed: same splits, in
any input order), disjoint and covering. Counts come from the
largest-remainder method, each within one of ``n * ratio``; with ``stratify``
that holds within every label, leftovers spread so rare labels do not all land
in the first split. Each split lists its ids sorted.

:func:`derive_split` keeps the samples of a split whose metadata match a
filter, reading it through ``store.scan_meta(dataset, ids, *, fields)``, which
each backend implements its fastest way (SQLite by id; Cassandra by
token-range scans or by id, ``sources/cassandra/_scan.py``); the selection is the same
everywhere.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
import sys
from collections.abc import Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, replace

import numpy as np

from ._errors import ConfigError, SplitNotFound
from ._model import ALL_SPLIT, IdList, check_name

__all__ = [
    "make_splits", "parse_ratios", "split_counts", "DerivedSplit", "derive_split", "content_hash", "derived_name",
    "filter_fields",
]

_TOLERANCE = 1e-6


def parse_ratios(text: str) -> dict[str, float]:
    """``"train=0.8,val=0.2"`` -> ``{"train": 0.8, "val": 0.2}``, validated."""
    ratios: dict[str, float] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or not name.strip():
            raise ConfigError(f"bad ratios {text!r}: use name=fraction pairs, e.g. train=0.8,val=0.2")
        name = name.strip()
        if name in ratios:
            raise ConfigError(f"bad ratios {text!r}: split {name!r} given twice")
        try:
            ratios[name] = float(value)
        except ValueError:
            raise ConfigError(f"bad ratios {text!r}: {value.strip()!r} is not a number") from None
    _check_ratios(ratios)
    return ratios


def _check_ratios(ratios: Mapping[str, float]) -> None:
    if not ratios:
        raise ConfigError("no splits given: pass ratios such as train=0.8,val=0.2")
    for name, r in ratios.items():
        check_name("split", name)
        if name == ALL_SPLIT:
            raise ConfigError(f"split name {ALL_SPLIT!r} is reserved for the dataset's full id list")
        if not isinstance(r, (int, float)) or not math.isfinite(r) or r <= 0 or r > 1:
            raise ConfigError(f"ratio of split {name!r} must be in (0, 1], got {r!r}")
    total = math.fsum(ratios.values())
    if abs(total - 1.0) > _TOLERANCE:
        raise ConfigError(f"split ratios must sum to 1, got {total:g} ({', '.join(f'{k}={v:g}' for k, v in ratios.items())})")


def split_counts(n: int, ratios: Mapping[str, float], carry: dict[str, float] | None = None) -> dict[str, int]:
    """Whole counts summing to ``n``, each ``floor`` or ``ceil`` of ``n * ratio``.

    The leftover units go to the splits with the largest remainders (ties to
    the split named first). ``carry`` holds, per split, how far earlier calls
    fell short of their exact share; it steers the leftovers and is updated,
    so that across the labels of a stratified split the totals stay close too.
    """
    carry = carry if carry is not None else {}
    names = list(ratios)
    total = math.fsum(ratios.values())
    exact = [n * ratios[k] / total for k in names]
    counts = [math.floor(x + 1e-9) for x in exact]  # 2.0000000000000004 is 2

    def key(i: int):  # a split already at its exact share gets a leftover last
        frac = exact[i] - counts[i]
        return (frac <= 1e-9, -(carry.get(names[i], 0.0) + frac), i)

    order = sorted(range(len(names)), key=key)
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    for k, x, c in zip(names, exact, counts):
        carry[k] = carry.get(k, 0.0) + x - c
    return dict(zip(names, counts))


def make_splits(
    idlist: IdList, ratios: Mapping[str, float], *, stratify: bool = False, seed: int = 0
) -> dict[str, IdList]:
    """Split ``idlist`` by ``ratios`` (see module docs); ConfigError on bad input."""
    _check_ratios(ratios)
    order = np.argsort(idlist.ids, kind="stable")
    ids, labels = idlist.ids[order], idlist.labels[order]
    if len(ids) > 1 and np.any(ids[1:] == ids[:-1]):
        dup = int(ids[1:][ids[1:] == ids[:-1]][0])
        raise ConfigError(f"cannot split: id {dup} appears more than once")
    rng = np.random.default_rng(seed)
    groups = [np.arange(len(ids))]
    if stratify:
        groups = [np.flatnonzero(labels == lab) for lab in np.unique(labels)]
    picked: dict[str, list[np.ndarray]] = {name: [] for name in ratios}
    carry: dict[str, float] = {}
    for group in groups:
        shuffled = group[rng.permutation(len(group))]
        start = 0
        for name, count in split_counts(len(group), ratios, carry).items():
            picked[name].append(shuffled[start : start + count])
            start += count
    out = {}
    for name, parts in picked.items():
        idx = np.sort(np.concatenate(parts)) if parts else np.empty(0, np.int64)
        out[name] = IdList(ids[idx], labels[idx])
    return out


# --- derived splits ------------------------------------------------------------------------------
def content_hash(idlist: IdList) -> str:
    """A split's content in 32 hex digits: its ids and labels, in stored order."""
    h = hashlib.blake2b(digest_size=16)
    h.update(idlist.ids.astype("<i8").tobytes())
    h.update(idlist.labels.astype("<i4").tobytes())
    return h.hexdigest()


@dataclass(frozen=True, slots=True)
class DerivedSplit:
    """A split computed from a filter, as stored next to its id list."""

    dataset: str
    name: str
    where: str  # the filter, as given
    parent: str  # the split it was computed from
    created: _dt.datetime
    num_ids: int
    content_hash: str  # of the derived split (content_hash)
    parent_hash: str  # of the parent when it was computed
    #: True when derive_split found it stored and up to date (not stored)
    reused: bool = False

    def to_json(self) -> dict:
        return {
            "dataset": self.dataset, "name": self.name, "where": self.where, "parent": self.parent,
            "created": self.created.isoformat(), "num_ids": self.num_ids,
            "content_hash": self.content_hash, "parent_hash": self.parent_hash, "reused": self.reused,
        }

    @classmethod
    def from_json(cls, d: Mapping) -> DerivedSplit:
        return cls(
            str(d["dataset"]), str(d["name"]), str(d["where"]), str(d["parent"]),
            _dt.datetime.fromisoformat(str(d["created"])), int(d["num_ids"]),
            str(d["content_hash"]), str(d["parent_hash"]), bool(d.get("reused", False)),
        )


def derived_name(canonical: str, parent: str) -> str:
    """The name ``Loader(where=...)`` gives a derived split: same filter and parent, same name."""
    digest = hashlib.blake2b(f"{parent}\0{canonical}".encode(), digest_size=6).hexdigest()
    return f"where-{digest}"


async def derive_split(
    store, dataset: str, where: str, *, name: str | None = None, parent: str = ALL_SPLIT,
    progress: bool | None = None, on_progress: Callable[[int, int], None] | None = None,
) -> DerivedSplit:
    """The split of ``parent``'s samples whose metadata match ``where``, stored as ``name``.

    ``name`` defaults to :func:`derived_name`. A stored derived split of that
    name with the same filter over an unchanged parent is returned as it is
    (``reused``); otherwise the metadata is read and the split (re)written. A
    name held by a split that is not derived (``all``, ``train`` from
    ``dataferry split --ratios``) is refused. ``progress``: a tqdm bar on
    stderr; ``None`` shows it when stderr is a TTY. ``on_progress(done, total)``: called
    after each page of metadata, ``done`` of the parent's ``total`` samples found so far.

    The metadata is read by ``store.scan_meta(dataset, ids, fields=...)``, a page at a
    time: the seam every store implements for this (SQLite by id, Cassandra by
    token-range scans or by id, whichever is cheaper for the parent's size).
    """
    from ._filter import compile_filter, parse_filter

    flt = parse_filter(where)  # a bad filter fails before any I/O
    check_name("split", parent)
    name = check_name("split", name if name is not None else derived_name(flt.canonical, parent))
    if name in (ALL_SPLIT, parent):
        raise ConfigError(f"a derived split cannot be named {name!r}: that is {'the reserved split' if name == ALL_SPLIT else 'its parent'}")
    info = await store.get_dataset(dataset)
    source = await store.read_split(dataset, parent)
    parent_hash = content_hash(source)
    old = await store.get_derived(dataset, name)
    if old is None:
        if name in {s.name for s in await store.list_splits(dataset)}:
            raise ConfigError(
                f"split {name!r} of dataset {dataset!r} exists and is not a derived split: choose another name"
            )
    elif old.parent == parent and old.parent_hash == parent_hash and _canonical(old.where) == flt.canonical:
        try:
            current = await store.read_split(dataset, name)
        except SplitNotFound:
            current = None
        if current is not None and content_hash(current) == old.content_hash:
            return replace(old, reused=True)
    keep = compile_filter(flt, info.label_names)
    picked = await _select(store, dataset, source, keep, filter_fields(flt), progress, f"filter {dataset}/{parent}",
                           on_progress)
    picked = IdList(source.ids[picked], source.labels[picked])
    order = np.argsort(picked.ids, kind="stable")
    result = IdList(picked.ids[order], picked.labels[order])
    record = DerivedSplit(
        dataset, name, where, parent, _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0),
        len(result), content_hash(result), parent_hash,
    )
    # The record first: a split whose content disagrees with its record is
    # recomputed, never reused, so an interrupted write is repaired by a re-run.
    await store.put_derived(record)
    await store.put_split(dataset, name, result)
    return record


def _canonical(where: str) -> str | None:
    from ._filter import parse_filter

    try:
        return parse_filter(where).canonical
    except ConfigError:
        return None


async def _select(store, dataset: str, source: IdList, keep, fields: frozenset[str], progress: bool | None,
                  desc: str, on_progress: Callable[[int, int], None] | None) -> np.ndarray:
    """Positions in ``source`` whose metadata ``keep`` accepts (a sample without metadata is not kept).

    The metadata comes from ``store.scan_meta`` a page at a time (each backend reads
    its fastest way); only the ids kept are held, one array per page."""
    from tqdm import tqdm

    show = sys.stderr.isatty() if progress is None else progress
    total = len(source)
    kept: list[np.ndarray] = []
    seen = 0
    bar = tqdm(total=total, unit="samples", file=sys.stderr, disable=not show, desc=desc, leave=False)
    try:
        async with aclosing(store.scan_meta(dataset, source.ids, fields=fields)) as pages:
            async for page in pages:
                kept.append(np.fromiter((m.id for m in page if keep(m)), dtype=np.int64))
                seen += len(page)
                bar.update(len(page))
                if on_progress is not None:
                    on_progress(seen, total)
    finally:
        bar.close()
    if not kept:
        return np.empty(0, dtype=np.int64)
    return np.flatnonzero(np.isin(source.ids, np.concatenate(kept)))


def filter_fields(flt) -> frozenset[str]:
    """The ``SampleMeta`` fields a parsed filter reads (``label_name`` reads ``label``, ``tags.KEY`` ``tags``)."""
    from ._filter import And, Not, Or

    out: set[str] = set()
    todo = [flt.root]
    while todo:
        node = todo.pop()
        if isinstance(node, (And, Or)):
            todo.extend(node.items)
        elif isinstance(node, Not):
            todo.append(node.item)
        else:
            f = node.field
            out.add("tags" if f.tag is not None else "label" if f.name == "label_name" else f.name)
    return frozenset(out)
