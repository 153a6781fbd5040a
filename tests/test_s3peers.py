"""The MosaicML Streaming and LitData peers of ``dataferry bench`` (bench/_s3peers.py).

Real parts only: a SQLite store filled by the synthetic generator, moto's S3
server in its own process on loopback, MDS and LitData written by the
libraries themselves, and the libraries' own loaders with worker processes.
Skipped without the ``bench`` extra; a peer that cannot be imported here is
skipped with the reason :func:`available` gives.
"""

from __future__ import annotations

import collections
import multiprocessing
import tempfile

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from dataferry.bench._common import prepared_store  # noqa: E402
from dataferry.bench._s3peers import (  # noqa: E402
    _KEY, PEERS, store_samples, available, litdata, mosaic, read_epoch, s3_datasets,
)

IMAGES = 240
RUNNABLE = tuple(p for p in PEERS if available(p) is None)
FACTORIES = {"mosaic": mosaic, "litdata": litdata}
# Streaming 0.10 reads each index.json with json.load(open(...)) (streaming/base/stream.py) and leaves
# the file to the garbage collector: that one leak of theirs is let through, nothing else
_MOSAIC_LEAK = pytest.mark.filterwarnings(
    r"ignore:Exception ignored in. <_io.FileIO name='[^']*/index.json':pytest.PytestUnraisableExceptionWarning")
PEER_PARAMS = [pytest.param("mosaic", marks=_MOSAIC_LEAK), "litdata"]


def _need(peer: str) -> None:
    why = available(peer)
    if why:
        pytest.skip(why)


@pytest.fixture(scope="module")
def s3():
    """``(the store's samples by id, S3Datasets)``: every runnable peer's format in one moto server."""
    if not RUNNABLE:
        pytest.skip("; ".join(f"{p}: {available(p)}" for p in PEERS))
    with prepared_store("sqlite", IMAGES, "s3t") as (url, _, report):
        want = {i: (data, label) for i, data, label in store_samples(url, "s3t")}
        assert len(want) == report.num_samples == IMAGES
        # shards of ~4 MB: a few per worker, as with 100 MB shards on a full-size dataset
        with s3_datasets(url, "s3t", shard_mb=4, peers=RUNNABLE) as datasets:
            yield want, datasets


def _endpoint(datasets) -> str:
    host, port = datasets.endpoint
    return f"http://{host}:{port}"


@pytest.mark.parametrize("peer", PEER_PARAMS)
def test_one_epoch_delivers_every_sample_once_byte_equal(peer, s3):
    _need(peer)
    want, datasets = s3
    assert datasets.samples == IMAGES
    assert (datasets.mds_shards if peer == "mosaic" else datasets.litdata_chunks) >= 4, "too few shards to spread over the workers"
    got = list(read_epoch(peer, _endpoint(datasets), datasets.remote(peer), batch_size=16, workers=2))
    counts = collections.Counter(i for i, _, _ in got)
    assert len(got) == IMAGES and set(counts) == set(want), (len(got), len(set(counts)))
    assert max(counts.values()) == 1
    for i, data, label in got:
        assert (data, label) == want[i], f"sample {i} differs from the store"


@pytest.mark.parametrize("peer", PEER_PARAMS)
def test_factory_runs_epochs_back_to_back_until_closed_and_cleans_its_cache(peer, s3, tmp_path, monkeypatch, capfd):
    _need(peer)
    want, datasets = s3
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the cache folder goes here
    before = set(multiprocessing.active_children())
    it = FACTORIES[peer](_endpoint(datasets), datasets.remote(peer), batch_size=32, workers=1)()
    totals = []  # (samples, bytes) after each batch
    for n, b in it:
        if not totals:
            assert [p.name for p in tmp_path.iterdir() if p.name.startswith("dataferry-")], "no fresh cache folder"
        samples, nbytes = totals[-1] if totals else (0, 0)
        totals.append((samples + n, nbytes + b))
        if totals[-1][0] > IMAGES + 64:  # well into the second epoch
            break
    # batches do not straddle epochs: the first epoch ends on a batch, with every byte counted once
    assert (IMAGES, sum(len(data) for data, _ in want.values())) in totals
    assert set(multiprocessing.active_children()) - before, "no worker process"
    it.close()
    assert next(it, None) is None
    assert not set(multiprocessing.active_children()) - before, "workers outlive close()"
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("dataferry-")], "cache folder left behind"
    out, err = capfd.readouterr()
    assert _KEY not in out + err


def test_bad_peer_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown S3 peer 'webdataset'; choose from mosaic, litdata"):
        available("webdataset")
    with pytest.raises(ValueError, match="unknown S3 peers \\['wds'\\]"):
        with s3_datasets("sqlite:///nonexistent.db", "d", peers=("wds",)):
            pass
    with pytest.raises(ValueError, match="written without 'mosaic'"):
        from dataferry.bench._s3peers import S3Datasets

        S3Datasets(("127.0.0.1", 1), None, "s3://b/litdata", 1).remote("mosaic")
