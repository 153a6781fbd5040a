"""An elastic DDP job: every rank reads the service, the loader's state is checkpointed every
``--every`` steps, and a restart with any number of ranks goes on from the last checkpoint.

    torchrun --nnodes 2 --nproc-per-node 2 --node-rank 0 --master-addr HOST --master-port 29500 \\
        -m dataferry.bench.train_elastic --url URL --dataset NAME --ckpt DIR/loader.json [--epochs 2]
    torchrun --standalone --nproc-per-node 3 -m dataferry.bench.train_elastic ...   # resumed by 3

``loader.state_dict()`` is a collective (every rank calls it at the same step); rank 0
writes it atomically. Each rank logs what it trained on to ``--trace DIR/rank<R>.jsonl``
(one line a step). Recipe and what a restart repeats: deploy/TRAINING.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time

__all__ = ["main"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--ckpt", required=True, help="the loader state file (read on start if there)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    ap.add_argument("--step-time", type=float, default=0.0, help="seconds a training step takes (emulated)")
    ap.add_argument("--trace", default=None, help="a folder for rank<R>.jsonl: the ids each step trained on")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    import torch.distributed as dist

    from dataferry.client import Loader, PlanOptions

    dist.init_process_group("gloo")  # torchrun's environment; "nccl" on GPUs
    rank, world = dist.get_rank(), dist.get_world_size()
    log = open(os.path.join(a.trace, f"rank{rank}.jsonl"), "a") if a.trace else None  # noqa: SIM115
    if a.trace:  # for a test that kills the job (torchrun's workers are not in its process group)
        with open(os.path.join(a.trace, f"rank{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    t0 = time.monotonic()
    try:
        with Loader(a.url, a.dataset, batch_size=a.batch_size, plan=PlanOptions(seed=a.seed)) as loader:
            if os.path.exists(a.ckpt):
                with open(a.ckpt) as f:
                    loader.load_state_dict(json.load(f))  # saved by any world size
            step = samples = 0
            first = None
            while loader.epoch < a.epochs:
                for batch in loader:  # one epoch (the rest of it, after a resume)
                    if first is None:
                        first = time.monotonic() - t0
                    samples += len(batch)
                    time.sleep(a.step_time)
                    if log:
                        log.write(json.dumps({"epoch": batch.epoch, "ids": batch.ids.tolist()}) + "\n")
                        log.flush()
                    step += 1
                    if step % a.every == 0:
                        state = loader.state_dict()  # collective: every rank, the same step
                        if rank == 0:
                            with open(a.ckpt + ".tmp", "w") as f:
                                json.dump(state, f)
                            os.replace(a.ckpt + ".tmp", a.ckpt)
            wall = time.monotonic() - t0
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            ranks: list = [None] * world
            dist.all_gather_object(ranks, (first, samples, wall, rss))
            if rank == 0:
                for r, (f, n, w, m) in enumerate(ranks):
                    print(f"rank {r} of {world}: first batch {f:.2f} s after creating the Loader, {n} samples "
                          f"in {w:.2f} s, max RSS {m:.0f} MiB", flush=True)
                total, longest = sum(x[1] for x in ranks), max(x[2] for x in ranks)
                print(f"job: {total} samples / {longest:.2f} s = {total / longest:.0f} samples/s", flush=True)
    finally:
        if log:
            log.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
