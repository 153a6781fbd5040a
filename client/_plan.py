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
from dataferry.schema._errors import ConfigError

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
    """This rank's ordered ids and labels for one epoch."""

    epoch: int
    seed: int
    rank: int
    world_size: int
    ids: np.ndarray
    labels: np.ndarray
    #: fingerprint of the split the plan was built from (checked on resume)
    source_digest: str

    def __len__(self) -> int:
        return int(self.ids.shape[0])


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
    if opts.shuffle:
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([opts.seed & (2**63 - 1), epoch])))
        order = rng.permutation(n)
    else:
        order = np.arange(n)
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
        ids=idlist.ids[mine],
        labels=idlist.labels[mine],
        source_digest=digest or split_digest(idlist),
    )
