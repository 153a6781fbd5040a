"""A Cassandra node frozen mid-epoch: how long the training loop waits.

``python -m dataferry.bench.frozen_node --runs 3`` starts a 3-node Cassandra
5.0 cluster on 127.0.0.1-3 (``_devcassandra``; hinted handoff off), writes
1,000 samples of 45 KB to a keyspace of replication factor 3, and per run
streams them with a ``Loader`` (default options but a 4 MiB budget, batches
of 32, a 2 ms step) while the second node is SIGSTOPped for 30 s (three
request timeouts) a second after the run starts. Each run prints the longest
waits between two batches, when they began after the freeze, the epochs and
the engine's hedges. ``--speculative-retry 99p`` sets the tables back to
Cassandra's default (the schema's is ``50ms``) to compare. What it cannot
show: a real cluster's GC pauses or packet loss (a SIGSTOP is a clean
freeze), or more than 2 cores' worth of contention.
Results: deploy/OPERATIONS.md (a node that stops answering).
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dataferry.bench._devcassandra import DevCluster, _query
from dataferry.client import Batch, Loader, Prefetch, Stats
from dataferry.schema import Sample, open_store, parse_store_url
from dataferry.schema._ddl import apply_schema

BUDGET = 4 << 20


async def _write(url: str, samples: list[Sample]) -> None:
    """The samples, the dataset row and its ``all`` split."""
    import datetime as dt

    from dataferry.schema import ALL_SPLIT, DatasetInfo, IdList, SampleMeta, SampleRecord

    async with await open_store(url) as store:
        for i in range(0, len(samples), 50):
            await store.put_samples("d", [SampleRecord(s, SampleMeta(s.id, s.label, f"{s.id}.bin", "RAW", 1, 1,
                                                                     len(s.data), "0")) for s in samples[i:i + 50]])
        await store.put_dataset(DatasetInfo("d", ("a", "b", "c"), len(samples), dt.datetime.now(dt.timezone.utc)))
        await store.put_split("d", ALL_SPLIT, IdList([s.id for s in samples], [s.label for s in samples]))


@dataclass(frozen=True, slots=True)
class FreezeRun:
    """One Loader's stream through a freeze."""

    #: ``(wait, when it ended)`` before each batch, ``time.monotonic()``
    gaps: list[tuple[float, float]]
    #: when the node was frozen
    frozen_at: float
    #: epochs streamed, each exactly once
    epochs: int
    stats: Stats

    def longest(self, k: int = 1) -> list[tuple[float, float]]:
        """The ``k`` longest waits: ``(seconds, when the wait began in seconds after the freeze)``."""
        return [(g, at - g - self.frozen_at) for g, at in sorted(self.gaps, reverse=True)[:k]]


def stream_through_a_freeze(cluster: DevCluster, url: str, ids: set[int], *, freeze_s: float = 30.0,
                            check: Callable[[Batch], None] | None = None) -> FreezeRun:
    """Stream dataset ``d`` at ``url`` with a Loader (a 4 MiB budget, batches of 32, a 2 ms step)
    while the second node of ``cluster`` is frozen for ``freeze_s`` seconds, a second after the
    start; whole epochs until it has been thawed for 2 s. Each epoch must hold ``ids`` exactly once
    (AssertionError); ``check(batch)`` sees every batch."""
    done = threading.Event()
    frozen_at: list[float] = []

    def freeze() -> None:
        try:
            time.sleep(1.0)
            frozen_at.append(time.monotonic())
            cluster.nodes[1].freeze()
            time.sleep(freeze_s)
        finally:
            cluster.nodes[1].thaw()
            time.sleep(2.0)
            done.set()

    gaps: list[tuple[float, float]] = []
    epochs = 0
    with Loader(url, "d", batch_size=32, prefetch=Prefetch(max_bytes=BUDGET)) as loader:
        freezer = threading.Thread(target=freeze)
        freezer.start()
        last = time.monotonic()
        while True:
            seen: Counter = Counter()
            for batch in loader:
                now = time.monotonic()
                gaps.append((now - last, now))
                last = now
                seen.update(batch.ids.tolist())
                if check is not None:
                    check(batch)
                time.sleep(0.002)  # a training step
            if seen != Counter(dict.fromkeys(ids, 1)):
                raise AssertionError(f"epoch {epochs}: not every id exactly once")
            epochs += 1
            if done.is_set():
                break
        freezer.join()
        stats = loader.stats()
    return FreezeRun(gaps, frozen_at[0], epochs, stats)


def _describe(run: FreezeRun) -> str:
    waits = ", ".join(f"{g:.2f} s at {began:+.1f} s" for g, began in run.longest(4))
    return (f"longest waits {waits} (after the freeze); {run.epochs} epochs exact; hedges {run.stats.hedges}, "
            f"retries {run.stats.retries}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataferry.bench.frozen_node", description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--freeze", type=float, default=30.0, help="seconds the node stays frozen (default 30)")
    ap.add_argument("--speculative-retry", default=None,
                    help="set samples and sample_meta to this (e.g. 99p, Cassandra's default); default: the schema's")
    args = ap.parse_args(argv)
    with DevCluster(3, hints=False) as cluster:
        name = f"frozen_{uuid.uuid4().hex[:10]}"
        asyncio.run(apply_schema(parse_store_url(cluster.url(name, replication="SimpleStrategy:3"))))
        url = cluster.url(name)
        if args.speculative_retry:
            for table in ("samples", "sample_meta"):
                _query(cluster.host, cluster.port,
                       f"ALTER TABLE {name}.{table} WITH speculative_retry = '{args.speculative_retry}'")
        rows = _query(cluster.host, cluster.port,
                      f"SELECT speculative_retry FROM system_schema.tables WHERE keyspace_name='{name}' "
                      "AND table_name='samples'")
        rng = np.random.default_rng(1)
        samples = [Sample(i, i % 3, rng.integers(0, 256, 45_000, dtype=np.uint8).tobytes()) for i in range(1000)]
        asyncio.run(_write(url, samples))
        print(f"3 nodes, RF 3, 1,000 samples of 45 KB, budget 4 MiB; samples.speculative_retry {rows[0][0]}; "
              f"node 127.0.0.2 frozen {args.freeze:g} s per run", flush=True)
        for run in range(args.runs):
            got = stream_through_a_freeze(cluster, url, {s.id for s in samples}, freeze_s=args.freeze)
            print(f"run {run}: {_describe(got)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
