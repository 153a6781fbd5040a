"""ProcessLoader: the engine in a child process, batches in shared memory (issue 25 item 3)."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from dataferry.client import MemorySource, PlanOptions, Prefetch
from dataferry.client._subprocess import ProcessLoader, _Arena
from dataferry.schema import (
    ConfigError, DataferryError, DatasetInfo, IdList, Sample, SampleMeta, SampleRecord, open_store, sample_id,
)

N = 300
EXPECTED: dict[int, bytes] = {}


def _bytes(k: int) -> bytes:
    return bytes([k % 251]) * (200 + (k * 37) % 900)


@pytest.fixture(scope="module")
def url(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("proc") / "s.db"

    async def fill():
        async with await open_store(f"sqlite://{path}", create=True) as store:
            rows = [SampleMeta(sample_id("d", f"{k}.jpg"), k % 5, f"{k}.jpg", "jpeg", 8, 8, len(_bytes(k)),
                               "0" * 64, {}) for k in range(N)]
            recs = [SampleRecord(Sample(m.id, m.label, _bytes(k)), m) for k, m in enumerate(rows)]
            await store.put_samples("d", recs)
            when = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
            await store.put_dataset(DatasetInfo("d", ["a", "b", "c", "d", "e"], N, when))
            await store.put_split("d", "all", IdList([m.id for m in rows], [m.label for m in rows]))
        return {m.id: _bytes(k) for k, m in enumerate(rows)}

    EXPECTED.update(asyncio.run(fill()))
    return f"sqlite://{path}"


def _shm() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("psm_")}


def _check(batch, expected) -> None:
    for i, d in zip(batch.ids.tolist(), batch.data):
        assert d.tobytes() == expected[i]


def test_exact_once_two_epochs_and_close_twice(url):
    before = _shm()
    with ProcessLoader(url, "d", batch_size=32, plan=PlanOptions(seed=1), prefetch=Prefetch(max_bytes=1 << 20),
                       arena_bytes=1 << 20) as ld:
        for _ in range(2):
            seen = []
            for b in ld:
                _check(b, EXPECTED)
                seen += b.ids.tolist()
            assert sorted(seen) == sorted(EXPECTED)
        st = ld.stats()
        assert st.samples == 2 * N and st.received > 0 and st.requests > 0  # the child's figures reach stats()
        pid = ld.engine_pid
        ld.close()
        ld.close()
    assert not _alive(pid)
    assert _shm() <= before
    with pytest.raises(DataferryError, match="closed"):
        ld.get()


def test_resume_mid_epoch(url):
    with ProcessLoader(url, "d", batch_size=20, plan=PlanOptions(seed=3), arena_bytes=1 << 20) as ld:
        it = iter(ld)
        first = [i for _ in range(5) for i in next(it).ids.tolist()]
        state = ld.state_dict()
    with ProcessLoader(url, "d", batch_size=20, plan=PlanOptions(seed=3), arena_bytes=1 << 20) as ld2:
        ld2.load_state_dict(state)
        rest = [i for b in ld2 for i in b.ids.tolist()]
    assert len(first) == 100 and sorted(first + rest) == sorted(EXPECTED)


def test_arena_bounds_held_batches(url):
    """Batches held by the consumer hold the arena: the child waits, memory stays bounded."""
    arena = 64 << 10
    with ProcessLoader(url, "d", batch_size=16, arena_bytes=arena, prefetch=Prefetch(max_bytes=1 << 16)) as ld:
        held = [ld.get(timeout=60)]  # the child's start
        with pytest.raises(TimeoutError):
            while True:
                held.append(ld.get(timeout=1.0))
        assert 0 < sum(b.nbytes for b in held) <= arena
        _check(held[0], EXPECTED)
        n = len(held)
        held.clear()  # dropping the views gives their regions back
        more = [b.ids.tolist() for b in iter(lambda: _next(ld), None)]
        assert n * 16 + sum(map(len, more)) >= N - 16


def _next(ld):
    try:
        return ld.get(timeout=5)
    except StopIteration:
        return None


def test_arena_ring():
    a = _Arena(100)
    x, y = a.alloc(40), a.alloc(40)
    assert (x, y) == (0, 40) and a.alloc(30) is None
    a.free(y)
    assert a.alloc(30) is None  # y is behind x: nothing comes back until x is freed
    a.free(x)
    assert a.alloc(30) == 0 and a.alloc(60) == 30 and a.alloc(20) is None
    with pytest.raises(ConfigError, match="arena"):
        a.alloc(101)


def test_source_object_refused():
    with pytest.raises(ConfigError, match="URL"):
        ProcessLoader(MemorySource("d", []), "d", ids=IdList([], []))


def test_child_killed_raises_at_once(url):
    with ProcessLoader(url, "d", batch_size=8, arena_bytes=1 << 16, prefetch=Prefetch(max_bytes=1 << 16)) as ld:
        ld.get()
        os.kill(ld.engine_pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DataferryError, match="killed by signal 9"):
            while True:
                ld.get(timeout=30)
        assert time.monotonic() - t0 < 10


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] != "Z"


def test_parent_killed_leaves_no_orphan(url):
    before = _shm()
    code = textwrap.dedent(f"""
        import sys, time
        from dataferry.client._subprocess import ProcessLoader
        if __name__ == "__main__":
            ld = ProcessLoader({url!r}, "d", batch_size=8, arena_bytes=1 << 16)
            ld.get()
            print(ld.engine_pid, flush=True)
            time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    assert _alive(child)
    p.kill()
    p.wait()
    p.stdout.close()
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    deadline = time.monotonic() + 5  # the resource tracker unlinks the dead parent's segment
    while not _shm() <= before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _shm() <= before


def test_attribution_names_the_consumer(url):
    """The child's figures feed the parent's intervals: a slow loop is named as the limit."""
    with ProcessLoader(url, "d", batch_size=4, arena_bytes=1 << 20, log_interval=0.25) as ld:
        it = iter(ld)
        deadline = time.monotonic() + 20
        while not (ld.intervals() and ld.intervals()[-1].limit == "consumer") and time.monotonic() < deadline:
            try:
                next(it)
            except StopIteration:
                it = iter(ld)
            time.sleep(0.02)
        ivs = ld.intervals()  # (the first ones: the child's start-up, the loop waiting)
        assert ivs[-1].limit == "consumer", str(ivs[-1])
        assert "limited by consumer" in str(ivs[-1]) and ld.stats().requests > 0


def test_batch_larger_than_arena_is_a_clear_error(url):
    with ProcessLoader(url, "d", batch_size=N, arena_bytes=1 << 16) as ld:
        with pytest.raises(ConfigError, match="does not fit the shared-memory arena"):
            ld.get(timeout=60)


# -- several engine processes (engines=N) ---------------------------------------------


def test_shard_state_takes_each_engines_own_positions():
    from dataferry.client._subprocess import _shard_state

    state = {"num_samples": 10, "frontier": 5, "beyond": [6, 7, 9], "epoch": 2}
    shards = [_shard_state(state, i, 3) for i in range(3)]
    assert [s["num_samples"] for s in shards] == [4, 3, 3]  # 0 3 6 9 | 1 4 7 | 2 5 8
    assert [s["frontier"] for s in shards] == [2, 2, 1]  # under 5: 0 3 | 1 4 | 2
    assert [s["beyond"] for s in shards] == [[2, 3], [2], []]  # 6 9 -> 2 3; 7 -> 2
    assert all(s["epoch"] == 2 for s in shards)
    done = {i + j * 3 for i, s in enumerate(shards) for j in [*range(s["frontier"]), *s["beyond"]]}
    assert done == {0, 1, 2, 3, 4, 6, 7, 9}


@pytest.mark.parametrize("engines", [2, 3])
def test_several_engines_deliver_each_sample_once_an_epoch_and_stop_together(url, engines):
    before = _shm()
    with ProcessLoader(url, "d", batch_size=32, plan=PlanOptions(seed=5), engines=engines,
                       prefetch=Prefetch(max_bytes=1 << 20), arena_bytes=1 << 20) as ld:
        assert len(ld) == sum(-(-len(range(i, N, engines)) // 32) for i in range(engines))
        for _ in range(3):
            seen, batches = [], 0
            for b in ld:
                _check(b, EXPECTED)
                seen += b.ids.tolist()
                batches += 1
            assert sorted(seen) == sorted(EXPECTED) and batches == len(ld)
        pids = ld.engine_pids
        assert len(set(pids)) == engines and all(map(_alive, pids))
        st = ld.stats()
        assert st.samples == 3 * N and st.received >= 3 * sum(map(len, EXPECTED.values()))  # every engine's figures
        assert 0 < st.engine_cpu < st.elapsed  # the busiest engine process's thread, not this process's
    assert not any(map(_alive, pids))
    assert _shm() <= before


def test_several_engines_resume_mid_epoch_from_and_into_any_engine_count(url):
    for saved, resumed in [(2, 3), (3, 1), (1, 2)]:
        with ProcessLoader(url, "d", batch_size=10, plan=PlanOptions(seed=7), engines=saved, arena_bytes=1 << 20) as ld:
            it = iter(ld)
            first = [i for _ in range(7) for i in next(it).ids.tolist()]
            state = ld.state_dict()
        with ProcessLoader(url, "d", batch_size=10, plan=PlanOptions(seed=7), engines=resumed,
                           arena_bytes=1 << 20) as ld2:
            ld2.load_state_dict(state)
            rest = [i for b in ld2 for i in b.ids.tolist()]
            nxt = [i for b in ld2 for i in b.ids.tolist()]  # the next epoch, whole
        assert len(first) == 70 and sorted(first + rest) == sorted(EXPECTED), (saved, resumed)
        assert sorted(nxt) == sorted(EXPECTED)


def test_one_of_several_engines_killed_raises_at_once(url):
    with ProcessLoader(url, "d", batch_size=8, engines=2, arena_bytes=1 << 16,
                       prefetch=Prefetch(max_bytes=1 << 17)) as ld:
        ld.get(timeout=60)
        os.kill(ld.engine_pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DataferryError, match="killed by signal 9"):
            while True:
                ld.get(timeout=30)
        assert time.monotonic() - t0 < 10


def test_several_engines_refuse_what_they_cannot_keep(url):
    for bad, match in [({"engines": 0}, "engines must be a whole number >= 1 .or None: by the cores., not 0"),
                       ({"engines": True}, "engines must be"),
                       ({"engines": 2, "drop_last": True}, "drop_last=True and order='input' need engines=1"),
                       ({"engines": 2, "order": "input"}, "need engines=1")]:
        with pytest.raises(ConfigError, match=match):
            ProcessLoader(url, "d", batch_size=8, **bad)
    with ProcessLoader(url, "d", batch_size=8, engines=4, prefetch=Prefetch(max_bytes=1 << 20)) as ld:
        assert ld._child_args[1]["prefetch"].max_bytes == 1 << 18  # the fixed budget is shared, not multiplied


def test_engines_follow_the_usable_cores_unless_the_batches_must_stay_whole(url, monkeypatch):
    import dataferry.client._subprocess as sub

    for cores, want in [(2, 1), (8, 1), (10, 2), (16, 3), (128, 3)]:
        monkeypatch.setattr(sub, "usable_cores", lambda cores=cores: cores)
        assert sub.default_engines() == want, cores
    with ProcessLoader(url, "d", batch_size=8) as ld:  # (16 cores, from the last patch)
        assert ld.engines == 3 and len(ld.engine_pids) == 3
    with ProcessLoader(url, "d", batch_size=8, drop_last=True) as ld:
        assert ld.engines == 1
    with ProcessLoader(url, "d", batch_size=8, order="input") as ld:
        assert ld.engines == 1


def test_several_engines_abandon_an_epoch_for_set_epoch_and_deliver_the_new_one_whole(url):
    with ProcessLoader(url, "d", batch_size=16, plan=PlanOptions(seed=9), engines=2, arena_bytes=1 << 20,
                       prefetch=Prefetch(max_bytes=1 << 20)) as ld:
        it = iter(ld)
        for _ in range(4):
            next(it)  # part of epoch 0, and the engines are ahead of it
        ld.set_epoch(5)
        got = [b for b in ld]
        assert {b.epoch for b in got} == {5}
        assert sorted(i for b in got for i in b.ids.tolist()) == sorted(EXPECTED)
        for b in got:
            _check(b, EXPECTED)
        assert sorted(i for b in ld for i in b.ids.tolist()) == sorted(EXPECTED)  # epoch 6, whole


def test_engines_start_with_the_loader_and_a_loader_closed_unused_leaves_nothing(url):
    before = _shm()
    ld = ProcessLoader(url, "d", batch_size=8, engines=2, arena_bytes=1 << 16)
    pids = ld.engine_pids
    assert len(pids) == 2 and all(map(_alive, pids))  # started with the loader, before any get()
    ld.close()
    assert not any(map(_alive, pids)) and _shm() <= before


def test_engines_get_the_id_list_from_the_loader_not_each_across_the_link(url):
    """The split's id list is read once, by the loader, and handed to its engine processes."""
    import urllib.request

    from server_kit import live_server, parse_metrics

    from dataferry.server import make_app

    with live_server(lambda: make_app(url)) as live:
        with ProcessLoader(live.base, "d", batch_size=32, engines=2, arena_bytes=1 << 20) as ld:
            assert sorted(i for b in ld for i in b.ids.tolist()) == sorted(EXPECTED)
        with urllib.request.urlopen(live.base + "/metrics", timeout=10) as resp:
            metrics = parse_metrics(resp.read().decode())
    reads = {k: v for k, v in metrics.items() if "requests_total" in k and "/splits/{split}" in k}
    assert reads and sum(reads.values()) == 1, reads
