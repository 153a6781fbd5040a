"""A rank of the elastic-resume tests: a Loader under torch.distributed (gloo on loopback)."""

from __future__ import annotations

import json
import os

N, BATCH, SEED = 103, 4, 7


def source():
    from dataferry.client import MemorySource

    return MemorySource.synthetic("d", N, size=16, latency=0.002)


def rank_main(rank: int, world: int, port: int, load: str | None, take: list[int], out: str, finish: bool) -> None:
    """Take ``take[rank]`` batches (after loading ``load``), save a gathered state, and with
    ``finish`` run the rest of the epoch and the next one; write what this rank saw to ``out``."""
    import torch.distributed as dist

    from dataferry.client import Loader, PlanOptions

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        with Loader(source(), "d", batch_size=BATCH, plan=PlanOptions(seed=SEED)) as loader:
            if load:
                with open(load) as f:
                    loader.load_state_dict(json.load(f))
            epoch = iter(loader)
            before = [i for _ in range(take[rank]) for i in next(epoch).ids.tolist()]
            dist.barrier()
            state = loader.state_dict()  # collective
            rest, after, after_len = [], [], 0
            if finish:
                rest = [i for b in epoch for i in b.ids.tolist()]
                after = [i for b in iter(loader) for i in b.ids.tolist()]
                after_len = len(loader)
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"state": state, "before": before, "rest": rest, "after": after, "after_len": after_len}, f)
    finally:
        dist.destroy_process_group()
