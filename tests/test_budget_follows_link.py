"""The byte budget follows the link (issue 25, item 4): by default (``Prefetch.max_bytes=None``)
it starts at 512 MiB and grows only while the training loop waits on the loader with the budget
holding requests back, up to 2 GiB; a number fixes it. Rates are measured in bench/ (tune.py,
gpu_check --e2e), not asserted here: these tests pin who grows the budget and when.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import pytest
from window_kit import shared

from dataferry.client import Loader, MemorySource, Prefetch
from dataferry.schema import ConfigError

MiB = 1 << 20
TUNE_LOG = "dataferry.client.tune"


def one_epoch(loader, pause: float = 0.0) -> Counter:
    got = Counter()
    for b in loader:
        got.update(b.ids.tolist())
        if pause:
            time.sleep(pause)
    return got


def budget_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == TUNE_LOG and r.getMessage().startswith("byte budget")]


def test_the_default_budget_follows_the_link_and_says_so():
    p = Prefetch()
    assert p.max_bytes is None and p.start_bytes == 512 * MiB and p.ceiling_bytes == 2048 * MiB
    fixed = Prefetch(max_bytes=64 * MiB)
    assert fixed.start_bytes == fixed.ceiling_bytes == 64 * MiB
    with pytest.raises(ConfigError, match="max_bytes must be at least 64 KiB"):
        Prefetch(max_bytes=1000)


def test_a_loop_that_waits_on_a_long_round_trip_grows_the_budget(caplog):
    # 200 ms a request, 110 kB samples, a loop that takes each batch at once: 512 MiB in flight
    # carries about 512 MiB / (0.2 s x 110 kB) = 23k samples/s at most, and the loop waits
    n = 30000
    caplog.set_level(logging.INFO, logger=TUNE_LOG)
    with Loader(MemorySource("d", shared(n, 110_000), latency=0.2), "d", batch_size=256) as loader:
        got = one_epoch(loader)
        stats = loader.stats()
    assert got == Counter(range(n))  # exact, as ever
    assert 512 * MiB < stats.budget <= 2048 * MiB, stats.budget
    assert stats.peak_bytes <= stats.budget + 256 * 110_000  # the accounting stays within what it grew to
    lines = budget_lines(caplog)
    assert lines and "the training loop waited on the loader" in lines[0] and "while the budget held requests back" in lines[0]
    assert "up to 2,048 MiB; Prefetch(max_bytes=) fixes it" in lines[0]


def test_a_fixed_budget_never_grows_however_long_the_loop_waits(caplog):
    n = 2000
    caplog.set_level(logging.INFO, logger=TUNE_LOG)
    with Loader(MemorySource("d", shared(n, 110_000), latency=0.2), "d", batch_size=256,
                prefetch=Prefetch(max_bytes=32 * MiB)) as loader:
        got = one_epoch(loader)
        stats = loader.stats()
    assert got == Counter(range(n))
    assert stats.budget == 32 * MiB and stats.peak_bytes <= 32 * MiB + 256 * 110_000
    assert stats.budget_full > 0  # it was the limit, and still did not grow
    assert not budget_lines(caplog)


def test_a_loop_slower_than_the_link_leaves_the_budget_where_it_starts(caplog):
    # 10 ms a request, 200 kB samples: the link brings 1.2 GB faster than the loop (20 ms a batch
    # of 64) takes it, so ready batches fill the 512 MiB budget; the loop never waits for one
    # after the first, and memory stays at the start
    n = 6000
    caplog.set_level(logging.INFO, logger=TUNE_LOG)
    with Loader(MemorySource("d", shared(n, 200_000), latency=0.01), "d", batch_size=64) as loader:
        got = one_epoch(loader, pause=0.02)
        stats = loader.stats()
    assert got == Counter(range(n))
    assert stats.budget_full > 0 and stats.peak_bytes > 256 * MiB  # the budget was full ...
    assert stats.budget == 512 * MiB, stats.budget  # ... of ready batches: no growth
    assert not budget_lines(caplog)
