"""Ingest under what production does to it: a full disk, a wrong path.

The full disk is real: a small tmpfs mounted for the test (as root, as in CI).
Where mounting is impossible, SQLite's own ``PRAGMA max_page_count`` is set on
the store's connections, which makes SQLite fail the same way
(``SQLITE_FULL``, "database or disk is full").
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import sqlite3
import subprocess
import sys
import uuid

import pytest
from oddfiles import noise_image

from dataferry.schema import ALL_SPLIT, ConfigError, open_store
from dataferry.schema._ingest import IngestOptions, ingest
from dataferry.schema._scan import scan

FAST = IngestOptions(workers=1, batch_size=4, max_inflight=2)

# The CLI with SQLite's page limit on every connection it opens (the fallback
# where no tmpfs can be mounted): argv[1] is the limit, the rest the CLI's.
_PAGE_LIMITED_CLI = """
import sqlite3, sys
limit = int(sys.argv.pop(1))
_connect = sqlite3.connect
def connect(*a, **k):
    conn = _connect(*a, **k)
    conn.execute(f"PRAGMA max_page_count={limit}")
    return conn
sqlite3.connect = connect
from dataferry.schema.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _tree(root, classes: dict[str, int], side: int, seed: int = 0):
    for c, n in classes.items():
        (root / c).mkdir(parents=True, exist_ok=True)
        for k in range(n):
            noise_image(side, side, seed=seed + k + 1000 * len(c)).save(root / c / f"{k}.png")
    return root


def _cli(*argv, page_limit: int | None = None) -> subprocess.CompletedProcess:
    args = [str(a) for a in argv]
    if page_limit is None:
        cmd = [sys.executable, "-m", "dataferry.schema.cli", *args]
    else:
        cmd = [sys.executable, "-c", _PAGE_LIMITED_CLI, str(page_limit), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _mount_tmpfs(where, size: str) -> bool:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return done.returncode == 0


def _snapshot(db: str) -> dict:
    """Everything a reader can see in the store, read with plain sqlite3."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {
            table: conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
            for table in ("datasets", "splits", "split_chunks", "samples", "sample_meta")
        }
    finally:
        conn.close()


@pytest.fixture
def small_disk(tmp_path):
    """``(folder, page_limit)``: a 2 MiB tmpfs (page_limit None), or a plain
    folder and the page limit that stands in for it."""
    disk = tmp_path / "disk"
    if _mount_tmpfs(disk, "2m"):
        try:
            yield disk, None
        finally:
            subprocess.run(["umount", "--lazy", str(disk)], check=True)
        return
    disk.mkdir(exist_ok=True)
    yield disk, 24  # pages of 64 KiB: 1.5 MiB


def test_full_disk_is_named_and_the_store_keeps_what_it_had(small_disk, tmp_path):
    disk, page_limit = small_disk
    db = str(disk / "store.db")
    store = f"sqlite://{db}"
    before = _tree(tmp_path / "before", {"a": 2, "b": 2}, 24)
    big = _tree(tmp_path / "big", {"x": 20, "y": 20}, 160, seed=7)  # ~77 KB each, ~3 MB
    done = _cli("ingest", before, "--dataset", "before", "--store", store, "-q", "--workers", 1)
    assert done.returncode == 0, done.stderr
    kept = _snapshot(db)
    assert len(kept["sample_meta"]) == 4

    done = _cli("ingest", big, "--dataset", "big", "--store", store, "-q", "--workers", 1, page_limit=page_limit)
    assert done.returncode != 0, done.stdout
    err = done.stderr.strip()
    assert "Traceback" not in done.stderr and len(err.splitlines()) == 1, done.stderr
    assert err.startswith("dataferry: error: ") and db in err, err
    assert ("disk full" if page_limit is None else "full") in err, err
    assert "cannot rollback" not in err

    after = _snapshot(db)  # readable, and what was there is untouched
    for table, rows in kept.items():
        assert [r for r in after[table] if r[0] == "before"] == rows, table
    metas = {r[1]: r for r in after["sample_meta"] if r[0] == "big"}
    blobs = {r[1]: r[3] for r in after["samples"] if r[0] == "big"}
    for sid, meta in metas.items():  # what looks committed is whole
        assert hashlib.sha256(blobs[sid]).hexdigest() == meta[8]
    assert len(metas) < 40

    if page_limit is None:  # room again: the same command finishes the job
        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
    done = _cli("ingest", big, "--dataset", "big", "--store", store, "-q", "--workers", 1)
    assert done.returncode == 0, done.stderr
    assert f"already present  {len(metas)}" in done.stdout
    final = _snapshot(db)
    assert sum(r[0] == "big" for r in final["sample_meta"]) == 40
    assert [r for r in final["samples"] if r[0] == "before"] == kept["samples"]


# --- nothing to ingest ---------------------------------------------------------


def _empty_sources(root):
    """``(source, words the error must contain)`` for sources with no images."""
    empty = root / "empty"
    empty.mkdir(parents=True)
    loose = root / "loose"
    loose.mkdir()
    for name in ("notes.txt", "labels.csv", "more.txt"):
        (loose / name).write_text("x")
    hollow = root / "hollow"
    for c in ("a", "b"):
        (hollow / c).mkdir(parents=True)
    (hollow / "b" / "readme.md").write_text("x")
    manifest = root / "m.csv"
    manifest.write_text("path,label\n")
    jsonl = root / "m.jsonl"
    jsonl.write_text("")
    textonly = root / "t.csv"
    textonly.write_text("path,label\nloose/notes.txt,a\n")
    return [
        (empty, ["no images", str(empty), "empty"]),
        (loose, ["no images", str(loose), "3 files", ".csv", ".txt", "no class folders"]),
        (hollow, ["no images", str(hollow), "class folders a, b", "1 other file", ".md"]),
        (manifest, ["no images", str(manifest), "no rows"]),
        (jsonl, ["no images", str(jsonl), "no rows"]),
        (textonly, ["no images", str(textonly), "1 path", ".txt"]),
    ]


def test_a_source_without_images_is_refused_and_creates_nothing(tmp_path):
    db = tmp_path / "store.db"
    for src, words in _empty_sources(tmp_path / "src"):
        done = _cli("ingest", src, "--dataset", "oops", "--store", f"sqlite://{db}", "-q")
        assert done.returncode != 0, (src, done.stdout)
        err = done.stderr.strip()
        assert err.startswith("dataferry: error: ") and len(err.splitlines()) == 1, done.stderr
        for word in words:
            assert word in err, (word, err)
    assert not db.exists()  # refused before the store was even opened


def test_ingest_api_refuses_an_empty_source_on_every_backend(store_url, dataset_name, tmp_path):
    async def go():
        async with await open_store(store_url) as store:
            for src, words in _empty_sources(tmp_path / "src"):
                with pytest.raises(ConfigError, match="no images") as caught:
                    await ingest(store, src, dataset_name, FAST, progress=False)
                assert str(src) in str(caught.value)
            with pytest.raises(ConfigError, match="no images"):  # a scanned Source too
                await ingest(store, scan(tmp_path / "src" / "hollow"), dataset_name, FAST, progress=False)
            assert dataset_name not in {d.name for d in await store.list_datasets()}
            with pytest.raises(Exception, match=dataset_name):
                await store.read_split(dataset_name, ALL_SPLIT)

    asyncio.run(go())


def test_an_existing_dataset_is_left_alone_by_an_empty_source(tmp_path):
    db = tmp_path / "store.db"
    src = _tree(tmp_path / "ok", {"a": 2}, 16)
    name = f"keep{uuid.uuid4().hex[:6]}"
    assert _cli("ingest", src, "--dataset", name, "--store", f"sqlite://{db}", "-q").returncode == 0
    kept = _snapshot(str(db))
    (tmp_path / "wrong").mkdir()
    done = _cli("ingest", tmp_path / "wrong", "--dataset", name, "--store", f"sqlite://{db}", "-q")
    assert done.returncode != 0 and "empty" in done.stderr
    assert _snapshot(str(db)) == kept
