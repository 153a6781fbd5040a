"""Train/val/test splits of a dataset's id list.

:func:`make_splits` is deterministic (same ids, ratios, seed: same splits,
whatever order the ids come in), disjoint and covering (every id lands in
exactly one split). Counts come from the largest-remainder method, so each is
within one of ``n * ratio``; with ``stratify`` that holds within every label,
and the leftovers are spread so that rare labels do not all land in the first
split. Each split lists its ids sorted.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ._errors import ConfigError
from ._model import ALL_SPLIT, IdList, check_name

__all__ = ["make_splits", "parse_ratios", "split_counts"]

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
