"""Real outages with default options: the data service and a Cassandra node
killed with SIGKILL mid-epoch and restarted on the same port, on datasets at
least 10x the byte budget. Every id arrives exactly once per epoch, byte-exact.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter

import numpy as np
import pytest

from dataferry.bench._devcassandra import DevCassandra
from dataferry.client import Loader, Prefetch
from dataferry.schema import Sample
from dataferry.schema._ddl import apply_schema
from dataferry.schema._url import parse_store_url
from server_kit import ServerProcess, make_samples, run, seed_url

BUDGET = 4 << 20  # Prefetch.max_bytes: the datasets below are >= 10x this


def stream_until(loader, digest: dict[int, bytes], done: threading.Event, *, min_epochs: int = 2,
                 max_epochs: int = 50) -> int:
    """Whole epochs, each checked exactly once and byte-exact, until ``done``
    is set and that epoch has ended, and at least ``min_epochs`` (one epoch can
    outlast every outage on a loaded machine); returns the number of epochs."""
    for epoch in range(max_epochs):
        seen: Counter = Counter()
        for batch in loader:
            for i, data in zip(batch.ids.tolist(), batch.data):
                seen[i] += 1
                assert hashlib.sha256(data.tobytes()).digest() == digest[i], f"sample {i} corrupt"
            time.sleep(0.002)  # a training step
        assert seen == Counter(dict.fromkeys(digest, 1)), f"epoch {epoch}: not every id exactly once"
        if done.is_set() and epoch + 1 >= min_epochs:
            return epoch + 1
    raise AssertionError("the outages never finished")


def test_loader_with_default_options_streams_through_three_server_restarts(tmp_path):
    samples = make_samples(1200, size=40_000)  # 48 MB, 12x the budget
    assert sum(len(s.data) for s in samples) >= 10 * BUDGET
    db = f"sqlite://{tmp_path / 's.db'}"

    seed_url(db, "d", samples)
    digest = {s.id: hashlib.sha256(s.data).digest() for s in samples}
    servers = [ServerProcess(db)]
    done = threading.Event()
    downs = (0.5, 3.0, 10.0)
    log: list[str] = []

    def bounce():
        try:
            for down in downs:
                time.sleep(1.0)
                servers[-1].kill()
                time.sleep(down)
                servers.append(ServerProcess(db, servers[0].port))
                log.append(f"down {down} s")
        finally:
            done.set()

    try:
        with Loader(servers[0].url, "d", batch_size=32, prefetch=Prefetch(max_bytes=BUDGET)) as loader:
            bouncer = threading.Thread(target=bounce)
            bouncer.start()
            epochs = stream_until(loader, digest, done)
            bouncer.join()
            stats = loader.stats()
    finally:
        for s in servers:
            s.kill()
    assert log == [f"down {d} s" for d in downs]
    assert epochs >= 2 and stats.failures > 0


@pytest.mark.cassandra
@pytest.mark.slow
def test_loader_with_default_options_streams_through_a_cassandra_restart(cassandra_server, tmp_path):
    node = DevCassandra(str(tmp_path / "node"))
    try:
        node.start()
    except Exception as exc:  # noqa: BLE001
        node.stop()
        pytest.fail(f"cannot start a private Cassandra: {exc}")
    try:
        url = node.url("outage")
        run(apply_schema(parse_store_url(url)))
        n, size = 1000, 45_000  # 45 MB, 11x the budget
        rng = np.random.default_rng(1)
        samples = [Sample(i, i % 3, rng.integers(0, 256, size, dtype=np.uint8).tobytes()) for i in range(n)]
        seed_url(url, "d", samples)
        digest = {s.id: hashlib.sha256(s.data).digest() for s in samples}
        done = threading.Event()
        took: list[float] = []

        def bounce():
            try:
                time.sleep(1.0)
                t0 = time.monotonic()
                node.kill()
                time.sleep(2.0)
                node.start()  # same port, same data: the commit log is replayed
                took.append(time.monotonic() - t0)
            finally:
                done.set()

        with Loader(url, "d", batch_size=32, prefetch=Prefetch(max_bytes=BUDGET)) as loader:
            bouncer = threading.Thread(target=bounce)
            bouncer.start()
            epochs = stream_until(loader, digest, done, min_epochs=1)
            bouncer.join()
            stats = loader.stats()
        assert took and epochs >= 1 and stats.failures > 0, (took, epochs, stats)
    finally:
        node.stop()
