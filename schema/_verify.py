"""``dataferry verify``: scrub a dataset against the checksums stored with its samples.

Every sample of a split (``all`` by default) is read through the store's own
``fetch`` (the read path a loader takes) and checked: against the XXH3-64
kept with it (``samples.xxh3``), or, for a sample ingested before stores kept
one, against the sha256 that ``sample_meta`` has recorded since the first
release. A sample whose bytes match neither, or that the split lists and the
store no longer has, is damaged; the report names each by id and path.
Memory is bounded by one page of samples.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from ._model import ALL_SPLIT, Sample, sample_checksum
from ._store import Store

__all__ = ["Damage", "VerifyReport", "verify_dataset"]

#: ids read per page
_PAGE = 512


@dataclass(frozen=True, slots=True)
class Damage:
    """One damaged sample: its id, its path relative to the dataset root ("" if unknown), why."""

    id: int
    path: str
    reason: str


@dataclass
class VerifyReport:
    dataset: str
    split: str
    store: str
    checked: int = 0  # samples read and checked
    by_xxh3: int = 0  # of them, against the stored XXH3-64
    by_sha256: int = 0  # against sample_meta's sha256 (no fast checksum stored)
    unchecked: int = 0  # neither recorded: read, not checked
    damaged: list[Damage] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.damaged

    def summary(self) -> str:
        head = (f"verified {self.checked} samples of {self.dataset}/{self.split} in {self.store}: "
                f"{len(self.damaged)} damaged")
        parts = [f"{self.by_xxh3} by xxh3"]
        if self.by_sha256:
            parts.append(f"{self.by_sha256} by sha256 (ingested before samples kept a fast checksum)")
        if self.unchecked:
            parts.append(f"{self.unchecked} with no checksum at all (not checked)")
        return f"{head} ({', '.join(parts)})"


async def verify_dataset(store: Store, dataset: str, *, split: str = ALL_SPLIT,
                         on_progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check every sample of ``dataset``'s ``split`` in ``store``; ``on_progress(n, total)`` after
    each page of ``n`` ids (and once with 0 before the first)."""
    report = VerifyReport(dataset, split, getattr(store, "url", repr(store)))
    await store.get_dataset(dataset)  # DatasetNotFound naming the store
    ids = (await store.read_split(dataset, split)).ids.tolist()
    if on_progress is not None:
        on_progress(0, len(ids))
    for start in range(0, len(ids), _PAGE):
        page = ids[start : start + _PAGE]
        without: dict[int, Sample] = {}
        bad: dict[int, str] = {}
        async for result in store.fetch(dataset, page):
            if not isinstance(result, Sample):
                bad[result.id] = "missing: listed in the split, not in the store"
                continue
            report.checked += 1
            if result.checksum is not None:
                report.by_xxh3 += 1
                if sample_checksum(result.data) != result.checksum:
                    bad[result.id] = "checksum mismatch (xxh3)"
            else:
                without[result.id] = result
        need_meta = sorted(set(bad) | set(without))
        meta = await store.read_meta(dataset, need_meta) if need_meta else {}
        for sid, sample in without.items():
            recorded = getattr(meta.get(sid), "checksum", None)
            if not recorded or set(recorded) == {"0"}:
                report.unchecked += 1
            else:
                report.by_sha256 += 1
                if hashlib.sha256(sample.data).hexdigest() != recorded:
                    bad[sid] = "checksum mismatch (sha256)"
        for sid in sorted(bad):
            report.damaged.append(Damage(sid, getattr(meta.get(sid), "path", ""), bad[sid]))
        if on_progress is not None:
            on_progress(len(page), len(ids))
    return report


class ProgressBar:
    """``on_progress`` as a tqdm bar on stderr, as ingest's (shown when stderr is a terminal)."""

    def __init__(self, dataset: str, show: bool | None = None) -> None:
        self.dataset, self.show, self.bar = dataset, sys.stderr.isatty() if show is None else show, None

    def __call__(self, n: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="img", file=sys.stderr, disable=not self.show,
                            desc=f"verify {self.dataset}", leave=False)
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
