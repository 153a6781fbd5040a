"""Elastic resume: one epoch's progress over every rank, re-dealt over a new world size.

A rank's state covers its own stride of the epoch's permutation. ``gather``
(inside ``Loader.state_dict()`` when torch.distributed is initialised: a
collective, every rank must call it) and ``merge_states`` turn rank states
into one over the whole permutation: a frontier plus a bitmap past it
(``elastic``). Loading such a state with any world size deals the epoch's
undelivered samples, in permutation order, over the new ranks by stride
(disjoint, deterministic; ``uneven`` pads with repeats or drops the rest, as
for a normal epoch); the epoch after it is a normal one. A rank state of a
re-dealt epoch carries the deal (``dealt``) so the same rank can resume it alone.
"""

from __future__ import annotations

import base64
import dataclasses
import sys
from dataclasses import dataclass

import numpy as np

from dataferry.schema import ConfigError, IdList

from ._doneset import DoneSet
from ._options import PlanOptions
from ._plan import EpochPlan, make_plan, resolve_rank

__all__ = ["DealtPlan", "dealt_of", "gather", "merge_states", "resume_plan", "plan_length"]

_MATCH = ("version", "dataset", "split", "split_hash", "epoch", "seed", "split_digest")


@dataclass(frozen=True, eq=False)
class DealtPlan(EpochPlan):
    """A resumed epoch's rest dealt over this world: ``base`` is the epoch's
    done section at the deal, ``uneven`` the policy the deal used, ``next_len``
    the length of a normal epoch's plan on this rank."""

    base: dict
    uneven: str
    next_len: int


def plan_length(n: int, world: int, uneven: str) -> int:
    return -(-n // world) if uneven == "pad" and n else n // world


def _pack(done: np.ndarray) -> dict:
    """``done`` (bool over the permutation) as a frontier and a bitmap past it."""
    undone = np.flatnonzero(~done)
    f = int(undone[0]) if undone.size else int(done.size)
    return {"n": int(done.size), "frontier": f, "bits": base64.b64encode(np.packbits(done[f:]).tobytes()).decode()}


def _unpack(sec: dict) -> np.ndarray:
    n, f = int(sec["n"]), int(sec["frontier"])
    done = np.zeros(n, dtype=bool)
    done[:f] = True
    bits = np.unpackbits(np.frombuffer(base64.b64decode(sec["bits"]), np.uint8), count=n - f)
    done[f:] = bits.astype(bool)
    return done


def _deal(base_done: np.ndarray, rank: int, world: int, uneven: str) -> np.ndarray:
    """The permutation indices rank ``rank`` of ``world`` takes of what ``base_done`` leaves."""
    rest = np.flatnonzero(~base_done)
    m = rest.size
    if m % world:
        if uneven == "pad" and m:
            rest = np.concatenate([rest, np.resize(rest, world - m % world)])
        else:
            rest = rest[: m - m % world]
    return rest[rank::world]


def _local_done(state: dict) -> np.ndarray:
    fr = int(state["frontier"])
    return np.concatenate([np.arange(fr, dtype=np.int64), np.asarray(state["beyond"], dtype=np.int64)])


def _contribution(state: dict) -> np.ndarray:
    """What one rank's ``state`` says is done, over the whole permutation (bool)."""
    dealt = state.get("dealt")
    if dealt is not None:
        done = _unpack(dealt)
        perm = _deal(done, state["rank"], state["world_size"], dealt["uneven"])
        done[perm[_local_done(state)]] = True
        return done
    if "split_len" not in state:
        raise ConfigError("loader state has no split_len: saved by an older dataferry, it cannot be merged")
    n, world, rank, k = int(state["split_len"]), int(state["world_size"]), int(state["rank"]), int(state["num_samples"])
    done = np.zeros(n, dtype=bool)
    if not n:
        return done
    if k * world < n:
        done[k * world:] = True  # dropped by uneven="drop": not part of this epoch
    done[(_local_done(state) * world + rank) % n] = True
    return done


def _merged(states: list[dict], sections: list[dict], ranks: list[int]) -> dict:
    first = states[0]
    done = np.zeros(int(sections[0]["n"]), dtype=bool)
    for sec in sections:
        done |= _unpack(sec)
    world = int(first["world_size"])
    return dict({k: v for k, v in first.items() if k != "dealt"}, rank=None, frontier=0, beyond=[],
                elastic=dict(_pack(done), world_size=world, ranks=sorted(set(ranks))))


def _sections(state: dict) -> tuple[list[dict], list[int]]:
    el = state.get("elastic")
    if el is not None:
        return [el], list(el["ranks"])
    return [_pack(_contribution(state))], [int(state["rank"])]


def merge_states(states) -> dict:
    """One state for the whole epoch from rank states of one save (every rank's, in any order)."""
    states = list(states)
    if not states:
        raise ConfigError("merge_states needs at least one loader state")
    first = states[0]
    for s in states[1:]:
        for key in _MATCH + ("world_size",):
            if s.get(key) != first.get(key):
                raise ConfigError(f"loader states differ in {key} ({first.get(key)!r} vs {s.get(key)!r}): "
                                  "only states of one save of one epoch can be merged")
    secs, ranks = [], []
    for s in states:
        sec, r = _sections(s)
        secs += sec
        ranks += r
    if len(ranks) != len(set(ranks)):
        raise ConfigError(f"loader states repeat a rank ({sorted(ranks)}): one state per rank")
    return _merged(states, secs, ranks)


def gather(state: dict) -> dict:
    """``state`` merged with every rank's under torch.distributed (collective); else as is."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return state
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, state)
    return merge_states(out)


def dealt_of(plan: EpochPlan) -> dict:
    """The keys a rank state of ``plan`` adds (the deal of a re-dealt epoch; the split's length)."""
    extra = {"split_len": len(plan.split)}
    if isinstance(plan, DealtPlan):
        extra["dealt"] = dict(plan.base, uneven=plan.uneven)
    return extra


def resume_plan(state: dict, idlist: IdList, opts: PlanOptions, digest: str) -> tuple[EpochPlan, DoneSet] | None:
    """This rank's plan and done set for ``state`` if it is a merged or a dealt one, else None."""
    el, dealt = state.get("elastic"), state.get("dealt")
    if el is None and dealt is None:
        return None
    rank, world = resolve_rank(opts)
    epoch = int(state["epoch"])
    full = make_plan(idlist, epoch, dataclasses.replace(opts, rank=0, world_size=1), digest=digest)
    if el is not None:
        saved_world, ranks = int(el["world_size"]), list(el["ranks"])
        if ranks != list(range(saved_world)):
            raise ConfigError(f"loader state covers ranks {ranks} of a world of {saved_world}: merge every "
                              "rank's state (Loader.merge_states) before resuming with another world size")
        base, local, uneven = el, DoneSet(0), opts.uneven
    else:
        if (state.get("rank"), state.get("world_size")) != (rank, world):
            raise ConfigError(f"loader state is rank {state.get('rank')} of {state.get('world_size')} in a re-dealt "
                              f"epoch, this loader is rank {rank} of {world}: merge every rank's state first")
        base = {k: dealt[k] for k in ("n", "frontier", "bits")}
        uneven = dealt["uneven"]
    base_done = _unpack(base)
    if base_done.size != len(idlist):
        raise ConfigError(f"loader state is over {base_done.size} samples, the split has {len(idlist)}")
    mine = _deal(base_done, rank, world, uneven)
    plan = DealtPlan(epoch=epoch, seed=opts.seed, rank=rank, world_size=world,
                     order=np.ascontiguousarray(full.order[mine]), split=idlist, source_digest=full.source_digest,
                     base={k: base[k] for k in ("n", "frontier", "bits")}, uneven=uneven,
                     next_len=plan_length(len(idlist), world, opts.uneven))
    if el is None:
        local = DoneSet(len(plan), int(state["frontier"]), state["beyond"])
    else:
        local = DoneSet(len(plan))
    return plan, local
