"""Elastic resume: a mid-epoch state of 4 ranks (gloo, out of order) resumed by 3 and 2
ranks covers the epoch exactly once; rank states merged without torch.distributed; bad merges refused."""

from __future__ import annotations

import json
import socket
from collections import Counter

import pytest

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import elastic_kit as kit  # noqa: E402
from dataferry.client import Loader, PlanOptions  # noqa: E402
from dataferry.schema import ConfigError  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(tmp_path, name: str, world: int, take: list[int], load=None, finish=True) -> list[dict]:
    out = tmp_path / name
    out.mkdir()
    # forked: the children start with torch imported (spawn re-imports it in each, seconds on 2 cores)
    mp.start_processes(kit.rank_main, args=(world, _port(), load and str(load), take, str(out), finish),
                       nprocs=world, start_method="fork")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _ids(ranks: list[dict], key: str) -> list[int]:
    return [i for r in ranks for i in r[key]]


def _save(tmp_path, name: str, state: dict):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(state))
    return path


def _pad(left: int, world: int) -> int:
    return -left % world  # uneven="pad": the repeats that make the rest's shards equal


def _rest_in_process(state: dict, world: int) -> list[list[int]]:
    """The rest of the state's epoch on each of ``world`` ranks (no torch.distributed)."""
    shards = []
    for rank in range(world):
        with Loader(kit.source(), "d", batch_size=kit.BATCH, plan=PlanOptions(seed=kit.SEED, rank=rank,
                                                                              world_size=world)) as loader:
            loader.load_state_dict(state)
            shards.append([i for b in iter(loader) for i in b.ids.tolist()])
    return shards


def test_four_ranks_resume_with_three_then_two(tmp_path):
    four = _spawn(tmp_path, "four", 4, [2, 3, 1, 4], finish=False)
    states = [r["state"] for r in four]
    assert all(s == states[0] for s in states), "every rank's gathered state is the same"
    a = states[0]
    assert a["elastic"]["ranks"] == [0, 1, 2, 3] and a["epoch"] == 0
    seen_a = _ids(four, "before")
    assert len(seen_a) == 10 * kit.BATCH == len(set(seen_a))

    # three ranks resume, take some, save again (a re-dealt epoch), and finish
    three = _spawn(tmp_path, "three", 3, [1, 2, 1], load=_save(tmp_path, "a", a))
    b = three[0]["state"]
    assert all(r["state"] == b for r in three) and b["epoch"] == 0
    shard_sizes = {len(r["before"]) + len(r["rest"]) for r in three}
    assert len(shard_sizes) == 1, "the rest is dealt in equal shards"
    epoch = Counter(seen_a + _ids(three, "before") + _ids(three, "rest"))
    left = kit.N - len(seen_a)
    assert set(epoch) == set(range(kit.N))
    assert sum(epoch.values()) - kit.N == _pad(left, 3)
    # the next epoch is a normal one: every sample, shards of ceil(N / 3)
    after = Counter(_ids(three, "after"))
    assert set(after) == set(range(kit.N)) and sum(after.values()) == 3 * -(-kit.N // 3)
    assert {r["after_len"] for r in three} == {-(-(-(-kit.N // 3)) // kit.BATCH)}

    # two ranks resume the three ranks' save, taken in the re-dealt epoch (loading needs no torch.distributed)
    two = _rest_in_process(b, 2)
    seen_b = seen_a + _ids(three, "before")
    epoch = Counter(seen_b + two[0] + two[1])
    assert set(epoch) == set(range(kit.N))
    assert sum(epoch.values()) - kit.N <= _pad(left, 3) + _pad(kit.N - len(set(seen_b)), 2)

    # and two ranks resume the four ranks' save (no torch.distributed: explicit ranks)
    shards = _rest_in_process(a, 2)
    assert len(shards[0]) == len(shards[1])
    epoch = Counter(seen_a + shards[0] + shards[1])
    assert set(epoch) == set(range(kit.N)) and sum(epoch.values()) - kit.N == _pad(left, 2)


def _rank_states(world: int, take: list[int], seed: int = kit.SEED, epoch: int = 0):
    states, seen = [], []
    for rank in range(world):
        with Loader(kit.source(), "d", batch_size=kit.BATCH,
                    plan=PlanOptions(seed=seed, rank=rank, world_size=world)) as loader:
            loader.set_epoch(epoch)
            it = iter(loader)
            for _ in range(take[rank]):
                seen += next(it).ids.tolist()
            states.append(loader.state_dict())
    return states, seen


def test_merge_states_without_distributed():
    states, seen = _rank_states(4, [3, 0, 2, 5])
    merged = Loader.merge_states(reversed(states))
    assert merged == Loader.merge_states(states)
    assert merged["elastic"]["frontier"] < kit.N and len(merged["elastic"]["bits"]) < kit.N  # a bitmap, not a list
    shards = _rest_in_process(merged, 3)
    assert len({len(s) for s in shards}) == 1
    epoch = Counter(seen + [i for s in shards for i in s])
    assert set(epoch) == set(range(kit.N))
    assert sum(epoch.values()) - kit.N == _pad(kit.N - len(seen), 3)
    # a rank state resumes as before on its own rank
    with Loader(kit.source(), "d", batch_size=kit.BATCH, plan=PlanOptions(seed=kit.SEED, rank=3,
                                                                          world_size=4)) as loader:
        loader.load_state_dict(states[3])
        assert len([i for b in iter(loader) for i in b.ids.tolist()]) == -(-kit.N // 4) - 5 * kit.BATCH


def test_bad_merges_are_refused():
    states, _ = _rank_states(2, [1, 1])
    other_seed, _ = _rank_states(2, [1, 1], seed=kit.SEED + 1)
    other_epoch, _ = _rank_states(2, [1, 1], epoch=1)
    for bad, what in ((other_seed, "seed"), (other_epoch, "epoch")):
        with pytest.raises(ConfigError, match=f"differ in {what}") as err:
            Loader.merge_states([states[0], bad[1]])
        assert "\n" not in str(err.value)
    split = dict(states[1], split="train")
    with pytest.raises(ConfigError, match="differ in split"):
        Loader.merge_states([states[0], split])
    with pytest.raises(ConfigError, match="repeat a rank"):
        Loader.merge_states([states[0], states[0]])
    partial = Loader.merge_states(states[:1])
    with Loader(kit.source(), "d", batch_size=kit.BATCH, plan=PlanOptions(seed=kit.SEED, rank=0,
                                                                          world_size=3)) as loader:
        with pytest.raises(ConfigError, match="covers ranks \\[0\\] of a world of 2"):
            loader.load_state_dict(partial)
