"""``dataferry demo``: synthetic images in, through a store, and back out.

Three stages, each a plain async function so a later stage can be swapped:

1. :func:`prepare` makes a synthetic ImageFolder tree (deterministic, so a
   second run makes the same files) and ingests it: idempotent, the second
   run reports every image as already present;
2. :func:`read_back` reads the whole ``all`` split back through the one seam,
   ``store.fetch``, and checks every sample against its stored sha256 (this
   is the stage a streaming demo replaces with the prefetching loader);
3. :func:`run_demo` wires them to a store URL and returns both reports.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import tempfile
import time
from dataclasses import dataclass

from ._errors import IntegrityError
from ._ingest import IngestOptions, IngestReport, ingest
from ._model import ALL_SPLIT
from ._open import open_store
from ._store import Store
from ._synthetic import SyntheticSet, make_synthetic

__all__ = ["DemoOptions", "ReadBackReport", "DemoReport", "prepare", "read_back", "run_demo", "DEMO_STORE_URL"]

DEMO_STORE_URL = "sqlite:dataferry-demo.db"
_READ_BATCH = 4096  # ids per read_meta + fetch round


@dataclass(frozen=True, slots=True)
class DemoOptions:
    images: int = 300
    store_url: str = DEMO_STORE_URL
    dataset: str = "demo"
    classes: int = 10
    seed: int = 0
    progress: bool | None = None  # None: a progress bar when stderr is a TTY


@dataclass(frozen=True, slots=True)
class ReadBackReport:
    samples: int
    bytes: int
    elapsed: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.elapsed if self.elapsed > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / self.elapsed if self.elapsed > 0 else 0.0


@dataclass(frozen=True, slots=True)
class DemoReport:
    synthetic: SyntheticSet
    generate_s: float
    ingest: IngestReport
    read_back: ReadBackReport

    def summary(self) -> str:
        syn, ing, rb = self.synthetic, self.ingest, self.read_back
        return "\n".join(
            [
                f"generated {syn.num_images} synthetic images ({syn.total_bytes / 1e6:.1f} MB, "
                f"mean {syn.mean_bytes / 1e3:.0f} KB) in {self.generate_s:.2f} s",
                f"ingest into {ing.dataset!r}: {ing.ingested} ingested, {ing.already_present} already present, "
                f"{len(ing.rejected)} rejected; "
                + (f"{ing.images_per_s:.0f} images/s, {ing.mb_per_s:.1f} MB/s" if ing.ingested else "nothing new to write"),
                f"read back split {ALL_SPLIT!r}: {rb.samples} samples, {rb.bytes / 1e6:.1f} MB in {rb.elapsed:.2f} s; "
                f"{rb.samples_per_s:.0f} samples/s, {rb.mb_per_s:.1f} MB/s; every checksum matches",
            ]
        )


async def prepare(store: Store, folder: str, options: DemoOptions) -> tuple[SyntheticSet, float, IngestReport]:
    """Generate the synthetic tree in ``folder`` and ingest it."""
    t0 = time.perf_counter()
    syn = await asyncio.to_thread(make_synthetic, folder, options.images, classes=options.classes, seed=options.seed)
    generate_s = time.perf_counter() - t0
    report = await ingest(store, folder, options.dataset, IngestOptions(), progress=options.progress)
    return syn, generate_s, report


async def read_back(store: Store, dataset: str) -> ReadBackReport:
    """Fetch every sample of ``dataset``'s ``all`` split; IntegrityError on any mismatch."""
    t0 = time.perf_counter()
    idlist = await store.read_split(dataset, ALL_SPLIT)
    ids = idlist.ids.tolist()
    samples = nbytes = 0
    for start in range(0, len(ids), _READ_BATCH):
        batch = ids[start : start + _READ_BATCH]
        metas = await store.read_meta(dataset, batch)
        async for result in store.fetch(dataset, batch):
            if isinstance(result, Exception):
                raise IntegrityError(f"dataset {dataset!r}: split {ALL_SPLIT!r} lists a missing sample: {result}")
            meta = metas.get(result.id)
            if meta is None or hashlib.sha256(result.data).hexdigest() != meta.checksum:
                raise IntegrityError(f"dataset {dataset!r}: sample {result.id} does not match its stored checksum")
            samples += 1
            nbytes += len(result.data)
    if samples != len(ids):
        raise IntegrityError(f"dataset {dataset!r}: read {samples} samples for {len(ids)} ids")
    return ReadBackReport(samples, nbytes, time.perf_counter() - t0)


async def run_demo(options: DemoOptions = DemoOptions()) -> DemoReport:
    """Generate, ingest and read back (see module docs)."""
    store = await open_store(options.store_url)
    try:
        with tempfile.TemporaryDirectory(prefix="dataferry-demo-") as tmp:
            folder = os.path.join(tmp, "images")
            syn, generate_s, report = await prepare(store, folder, options)
        rb = await read_back(store, options.dataset)
    finally:
        await store.close()
    return DemoReport(syn, generate_s, report, rb)
