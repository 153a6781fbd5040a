"""WebDataset read over HTTP, as its users do it: the baseline next to ours.

The shards hold the very samples the other loaders read. :func:`write_shards`
reads every sample of a dataset from a dataferry store (the ``fetch`` seam) and
writes them with ``wds.ShardWriter`` as POSIX tar shards, one sample per key::

    {"__key__": "<sample id>", "jpg": <the stored bytes>, "cls": <label>}

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence

from ._common import announced, store_samples
from ._loaders import Batches, collate_list, quiet_worker_count

__all__ = ["write_shards", "shard_size", "file_server", "webdataset_loader"]


def shard_size(total_bytes: int, *, workers: int, target: float = 100e6) -> int:
    """Bytes per shard: ``target``, or, for a dataset smaller than one such
    shard per worker, a shard per worker (at least 1 MiB)."""
    return max(1 << 20, int(min(target, total_bytes / max(workers, 1))))


def write_shards(store_url: str, dataset: str, folder: str, *, shard_bytes: int, chunk: int = 256) -> list[str]:
    """Write every sample of ``dataset`` into tar shards under ``folder``, in the
    order of its ``all`` split; return the shard file names, in order."""
    import webdataset as wds

    os.makedirs(folder, exist_ok=True)
    pattern = os.path.join(folder, f"{dataset}-%06d.tar")
    # maxcount: the size decides, not the count
    with wds.ShardWriter(pattern, maxsize=shard_bytes, maxcount=1 << 40, verbose=0) as sink:
        for i, data, label in store_samples(store_url, dataset, chunk=chunk):
            sink.write({"__key__": str(i), "jpg": data, "cls": label})
    return sorted(name for name in os.listdir(folder) if name.startswith(f"{dataset}-") and name.endswith(".tar"))


def file_server(folder: str, *, host: str = "127.0.0.1", wrap: Sequence[str] = ()):
    """Serve ``folder`` with ``python -m http.server`` on ``host``; yield ``(host, port)``."""
    cmd = [*wrap, sys.executable, "-u", "-m", "http.server", "--bind", host, "--directory", folder, "0"]
    return announced(cmd, "the shard file server", stderr=subprocess.DEVNULL)  # its stderr: one line per GET


def webdataset_loader(urls: list[str], *, batch_size: int, workers: int, shuffle: int = 1000):
    """A factory for :func:`~._common.measure_loader`: WebDataset over ``urls``, epochs back to back."""
    import webdataset as wds

    if len(urls) < workers:
        raise ValueError(f"{len(urls)} shards for {workers} DataLoader workers: some workers would read nothing")

    def make():
        quiet_worker_count()
        ds = (wds.WebDataset(urls, shardshuffle=len(urls)).shuffle(shuffle).to_tuple("jpg", "cls")
              .batched(batch_size, collation_fn=collate_list, partial=False))
        dl = wds.WebLoader(ds, batch_size=None, num_workers=workers, persistent_workers=True,
                           multiprocessing_context="fork")

        def batches():
            while True:
                for items in dl:
                    yield len(items), sum(len(data) for data, _ in items)

        return Batches(batches(), inflight=workers)  # a curl stream per worker

    return make
