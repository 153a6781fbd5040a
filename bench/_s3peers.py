"""MosaicML Streaming and LitData, reading from S3: two more peers for ``dataferry bench``.

Both libraries stream shards from an object store into a local cache and read
samples out of the cache. Here the object store is moto's S3 server
(``moto[server]``: a real S3 HTTP endpoint, in its own process on loopback),
and the bench puts the same emulated link in front of it as in front of the
data service. Everything is set up as the libraries' docs show:

``s3_datasets`` writes a store's samples as MDS and LitData chunks (~100 MB) and
uploads them; ``mosaic`` and ``litdata`` read them with each library's
``StreamingDataLoader``; each ``make()`` starts from an empty cache.

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ._common import all_ids, announced, store_samples
from ._loaders import collate_list

__all__ = ["PEERS", "S3Datasets", "available", "s3_datasets", "s3_server", "mosaic", "litdata", "read_epoch",
           "store_samples"]

#: peer name -> what it is
PEERS: dict[str, str] = {
    "mosaic": "MosaicML Streaming, MDS shards from S3 (moto), StreamingDataLoader",
    "litdata": "LitData, optimize() chunks from S3 (moto), StreamingDataLoader",
}
BUCKET = "dataferry-bench"
_REGION = "us-east-1"
_KEY = "dataferry-dummy-key"  # moto takes any key and secret; a dummy, never printed
_INSTALL = "pip install 'dataferry[bench]'"
# LitData asks PyPI for a newer version of itself when a dataset is made (a request and a warning
# per process) unless this is set before it is imported; a benchmark has no business doing either.
os.environ.setdefault("LITDATA_DISABLE_VERSION_CHECK", "1")

Address = tuple[str, int]
Sample = tuple[int, bytes, int]  # id, stored bytes, label


def _why_not(module: str, package: str) -> str | None:
    try:
        __import__(module)
    except ImportError:
        return f"{package} not installed: {_INSTALL}"
    except Exception as exc:  # noqa: BLE001 - a package that is there but cannot be imported
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{package} cannot be imported here ({type(exc).__name__}: {first})"
    return None


def available(peer: str | None = None) -> str | None:
    """None if ``peer`` ("mosaic" or "litdata"; None: both) can run here, else one line saying why not.

    MosaicML Streaming imports torchvision when it is imported; a torchvision
    built for another torch (PyPI's CUDA wheel next to a CPU torch) fails
    there with a RuntimeError, which is reported, not raised.
    """
    if peer is not None and peer not in PEERS:
        raise ValueError(f"unknown S3 peer {peer!r}; choose from {', '.join(PEERS)}")
    needs = [("boto3", "boto3"), ("moto.moto_server.threaded_moto_server", "moto[server]")]
    if peer in (None, "mosaic"):
        needs.append(("streaming", "mosaicml-streaming"))
    if peer in (None, "litdata"):
        needs.append(("litdata", "litdata"))
    for module, package in needs:
        why = _why_not(module, package)
        if why:
            return why
    return None


@dataclass(frozen=True, slots=True)
class S3Datasets:
    """Where the peers read: the S3 server's address (a :class:`~._common.Listening`, to route
    across the link) and the two datasets' ``s3://`` URLs (None for a format not written)."""

    endpoint: Address
    mds_remote: str | None
    litdata_remote: str | None
    samples: int
    mds_shards: int = 0
    litdata_chunks: int = 0

    def remote(self, peer: str) -> str:
        url = self.mds_remote if peer == "mosaic" else self.litdata_remote
        if url is None:
            raise ValueError(f"the S3 datasets were written without {peer!r}")
        return url


def _s3_client(endpoint_url: str):
    import boto3

    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name=_REGION,
                                          aws_access_key_id=_KEY, aws_secret_access_key=_KEY)


def _litdata_item(ids: list[int], *, store_url: str, dataset: str):
    """``optimize()``'s function: one input is a list of ids, and it yields their samples."""
    for i, data, label in store_samples(store_url, dataset, ids):
        yield {"id": i, "data": data, "label": label}


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set environment variables for the duration (child processes started meanwhile inherit them)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _write_mds(store_url: str, dataset: str, folder: str, size_limit: int) -> int:
    from streaming import MDSWriter

    columns = {"id": "int", "data": "bytes", "label": "int"}
    with MDSWriter(out=folder, columns=columns, size_limit=size_limit) as out:
        for i, data, label in store_samples(store_url, dataset):
            out.write({"id": i, "data": data, "label": label})
    return sum(name.endswith(".mds") for name in os.listdir(folder))


def _write_litdata(store_url: str, dataset: str, folder: str, chunk_bytes: int, ids: list[int]) -> int:
    from litdata import optimize

    inputs = [ids[start:start + 256] for start in range(0, len(ids), 256)]
    # optimize() stages its chunks in ~/.lightning/chunks or /tmp/chunks, shared by every run on the
    # machine, unless told otherwise: keep them next to the output
    staging = {"DATA_OPTIMIZER_CACHE_FOLDER": folder + ".chunks", "DATA_OPTIMIZER_DATA_CACHE_FOLDER": folder + ".data"}
    with _environ(staging):
        optimize(functools.partial(_litdata_item, store_url=store_url, dataset=dataset), inputs, output_dir=folder,
                 chunk_bytes=chunk_bytes, num_workers=1, mode="overwrite", start_method="fork", verbose=False)
    return sum(name.endswith(".bin") for name in os.listdir(folder))


def _upload(client, folder: str, prefix: str) -> str:
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            client.upload_file(path, BUCKET, f"{prefix}/{os.path.relpath(path, folder)}")
    return f"s3://{BUCKET}/{prefix}"


def s3_server(*, host: str = "127.0.0.1", wrap: Sequence[str] = ()):
    """Run moto's S3 server in its own process, listening on ``host``; yield its ``(host, port)``."""
    cmd = [*wrap, sys.executable, "-m", "dataferry.bench._s3peers", "--host", host]
    return announced(cmd, "the S3 server (moto)", stderr=subprocess.DEVNULL)  # its stderr: one line per request


@contextlib.contextmanager
def s3_datasets(sqlite_url: str, dataset: str, *, host: str = "127.0.0.1", wrap: Sequence[str] = (),
                shard_mb: float = 100.0, peers: Sequence[str] = tuple(PEERS)) -> Iterator[S3Datasets]:
    """Start the S3 server (as :func:`~._common.data_server` starts the data service: on ``host``,
    its command prefixed by ``wrap``), write ``dataset`` of the store at ``sqlite_url`` into it for
    each of ``peers``, and yield an :class:`S3Datasets`. Its ``endpoint`` is the server's own
    address: route it across the link as the other servers' are."""
    unknown = [p for p in peers if p not in PEERS]
    if unknown or not peers:
        raise ValueError(f"unknown S3 peers {unknown or '(none)'}; choose from {', '.join(PEERS)}")
    size = int(shard_mb * 1e6)
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(s3_server(host=host, wrap=wrap))
        client = _s3_client(f"http://{address[0]}:{address[1]}")
        client.create_bucket(Bucket=BUCKET)
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="dataferry-s3peers-"))
        ids = all_ids(sqlite_url, dataset)
        mds = lit = None
        mds_shards = lit_chunks = 0
        if "mosaic" in peers:
            mds_shards = _write_mds(sqlite_url, dataset, os.path.join(tmp, "mds"), size)
            mds = _upload(client, os.path.join(tmp, "mds"), "mds")
            shutil.rmtree(os.path.join(tmp, "mds"))
        if "litdata" in peers:
            lit_chunks = _write_litdata(sqlite_url, dataset, os.path.join(tmp, "litdata"), size, ids)
            lit = _upload(client, os.path.join(tmp, "litdata"), "litdata")
            shutil.rmtree(os.path.join(tmp, "litdata"))
        client.close()
        yield S3Datasets(address, mds, lit, len(ids), mds_shards, lit_chunks)


# --- the readers ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _workers_stopped(loader):
    """Stop ``loader``'s persistent workers on the way out, not when it is collected: they
    would go on filling the cache folder that is removed next, and live on uncounted."""
    try:
        yield
    finally:
        running, loader._iterator = loader._iterator, None  # where torch keeps persistent workers
        if running is not None and hasattr(running, "_shutdown_workers"):
            running._shutdown_workers()


@contextlib.contextmanager
def _mosaic_dataloader(endpoint_url: str, remote: str, *, batch_size: int, workers: int):
    from streaming import StreamingDataLoader, StreamingDataset

    env = {"S3_ENDPOINT_URL": endpoint_url, "AWS_ACCESS_KEY_ID": _KEY, "AWS_SECRET_ACCESS_KEY": _KEY,
           "AWS_DEFAULT_REGION": _REGION}
    local = tempfile.mkdtemp(prefix="dataferry-mds-cache-")
    try:
        with _environ(env):  # read where the shards are downloaded: in the workers, forked from here
            ds = StreamingDataset(remote=remote, local=local, shuffle=True, batch_size=batch_size)
            loader = StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers,
                                         persistent_workers=workers > 0, collate_fn=collate_list,
                                         multiprocessing_context="fork" if workers else None)
            with _workers_stopped(loader):
                yield loader
    finally:
        shutil.rmtree(local, ignore_errors=True)


@contextlib.contextmanager
def _litdata_dataloader(endpoint_url: str, remote: str, *, batch_size: int, workers: int):
    import litdata as ld

    cache = tempfile.mkdtemp(prefix="dataferry-litdata-cache-")
    options = {"endpoint_url": endpoint_url, "aws_access_key_id": _KEY, "aws_secret_access_key": _KEY,
               "region_name": _REGION}
    try:
        ds = ld.StreamingDataset(remote, cache_dir=cache, shuffle=True, storage_options=options)
        loader = ld.StreamingDataLoader(ds, batch_size=batch_size, num_workers=workers,
                                        persistent_workers=workers > 0, collate_fn=collate_list)
        with _workers_stopped(loader):
            yield loader
    finally:
        shutil.rmtree(cache, ignore_errors=True)


_DATALOADERS = {"mosaic": _mosaic_dataloader, "litdata": _litdata_dataloader}


def _factory(peer: str, endpoint_url: str, remote: str, *, batch_size: int, workers: int, epochs: int | None):
    opener = _DATALOADERS[peer]

    def make() -> Iterator[tuple[int, int]]:
        def batches():
            with opener(endpoint_url, remote, batch_size=batch_size, workers=workers) as dl:
                epoch = 0
                while epochs is None or epoch < epochs:
                    for items in dl:
                        yield len(items), sum(len(item["data"]) for item in items)
                    epoch += 1

        return batches()

    return make


def mosaic(endpoint_url: str, remote: str, *, batch_size: int, workers: int,
           epochs: int | None = None) -> Callable[[], Iterator[tuple[int, int]]]:
    """A factory for :func:`~._common.measure_loader`: MosaicML Streaming over ``remote`` at ``endpoint_url``.

    Epochs run back to back (``epochs``: stop after that many); only the first reads the link."""
    return _factory("mosaic", endpoint_url, remote, batch_size=batch_size, workers=workers, epochs=epochs)


def litdata(endpoint_url: str, remote: str, *, batch_size: int, workers: int,
            epochs: int | None = None) -> Callable[[], Iterator[tuple[int, int]]]:
    """A factory for :func:`~._common.measure_loader`: LitData over ``remote`` at ``endpoint_url``.

    Epochs run back to back (``epochs``: stop after that many); only the first reads the link."""
    return _factory("litdata", endpoint_url, remote, batch_size=batch_size, workers=workers, epochs=epochs)


def read_epoch(peer: str, endpoint_url: str, remote: str, *, batch_size: int, workers: int) -> Iterator[Sample]:
    """Every ``(id, bytes, label)`` that ``peer``'s loader delivers in one epoch, in delivery order."""
    with _DATALOADERS[peer](endpoint_url, remote, batch_size=batch_size, workers=workers) as dl:
        for items in dl:
            for item in items:
                yield int(item["id"]), bytes(item["data"]), int(item["label"])


def _serve(host: str) -> int:
    """moto's S3 server on ``host`` (a free port), until SIGTERM or SIGINT; its address on stdout's first line."""
    import signal
    import threading

    from moto.moto_server.threaded_moto_server import ThreadedMotoServer

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = ThreadedMotoServer(host, 0, verbose=False)
    server.start()
    bound_host, port = server.get_host_and_port()
    print(f"listening on {bound_host}:{port}", flush=True)
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m dataferry.bench._s3peers", description=_serve.__doc__)
    p.add_argument("--host", default="127.0.0.1")
    sys.exit(_serve(p.parse_args().host))
