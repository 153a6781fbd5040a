"""The epoch plan: a deterministic permutation per (seed, epoch), sharded.

Every rank computes the same permutation from the same split, seed and epoch,
then takes its own stride of it, so shards are disjoint (apart from padding)
and equal in size without any communication.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass

import numpy as np

from dataferry.schema import IdList
from dataferry.schema import ConfigError

from ._options import PlanOptions

__all__ = ["EpochPlan", "make_plan", "resolve_rank"]


def resolve_rank(opts: PlanOptions) -> tuple[int, int]:
    """``(rank, world_size)``: explicit options, else torch.distributed when
    initialized (never imported here), else ``RANK``/``WORLD_SIZE``, else 0/1."""
    rank, world = opts.rank, opts.world_size
    if rank is None or world is None:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank() if rank is None else rank
            world = dist.get_world_size() if world is None else world
        else:
            try:
                rank = int(os.environ.get("RANK", 0)) if rank is None else rank
                world = int(os.environ.get("WORLD_SIZE", 1)) if world is None else world
            except ValueError as exc:
                raise ConfigError(f"RANK/WORLD_SIZE environment variables are not integers: {exc}") from None
    if not (0 <= rank < world):
        raise ConfigError(f"rank {rank} out of range for world_size {world}")
    return rank, world


@dataclass(frozen=True, eq=False)
class EpochPlan:
    """This rank's ordered ids and labels for one epoch.

    Held as ``order``, indices into the split's id list (``split``, one array
    pair shared by every epoch's plan): int32 where the split allows, 4 bytes a
    sample rather than a copy of the ids and labels (12), since two plans
    are alive at an epoch's end (the current one and the look-ahead)."""

    epoch: int
    seed: int
    rank: int
    world_size: int
    #: this rank's positions -> indices into ``split``
    order: np.ndarray
    split: IdList
    #: fingerprint of the split the plan was built from (checked on resume)
    source_digest: str

    def __len__(self) -> int:
        return int(self.order.shape[0])

    @property
    def ids(self) -> np.ndarray:
        """The ids in plan order (a new array: the engine reads :meth:`ids_at`)."""
        return self.split.ids[self.order]

    @property
    def labels(self) -> np.ndarray:
        return self.split.labels[self.order]

    def ids_at(self, positions) -> np.ndarray:
        """The ids at ``positions`` (an int or a sequence of them) of the plan."""
        return self.split.ids[self.order[positions]]


def split_digest(idlist: IdList) -> str:
    h = hashlib.blake2b(digest_size=12)
    h.update(idlist.ids.astype("<i8").tobytes())
    return h.hexdigest()


def make_plan(idlist: IdList, epoch: int, opts: PlanOptions, *, digest: str | None = None) -> EpochPlan:
    """Build the plan for ``epoch``; identical on every rank for one seed."""
    if epoch < 0:
        raise ConfigError(f"epoch must be >= 0, not {epoch}")
    rank, world = resolve_rank(opts)
    n = len(idlist)
    order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
    if opts.shuffle:
        # shuffled in place: the same permutation as ``rng.permutation(n)``, without its int64 copy
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([opts.seed & (2**63 - 1), epoch])))
        rng.shuffle(order)
    if n % world:
        if opts.uneven == "pad" and n:
            need = world - n % world
            order = np.concatenate([order, np.resize(order, need)])
        else:
            order = order[: n - n % world]
    mine = order[rank::world]
    return EpochPlan(
        epoch=epoch,
        seed=opts.seed,
        rank=rank,
        world_size=world,
        order=np.ascontiguousarray(mine),  # a rank's stride copied: the whole permutation is let go
        split=idlist,
        source_digest=digest or split_digest(idlist),
    )
