"""The data model shared by the stores, ingest, the client and the server.

Plain frozen value objects; no I/O here.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ._errors import ConfigError

__all__ = [
    "Sample",
    "SampleMeta",
    "DatasetInfo",
    "SplitInfo",
    "IdList",
    "sample_id",
    "sample_checksum",
    "normalize_relpath",
    "check_name",
    "ALL_SPLIT",
    "SPLIT_CHUNK",
]

#: The reserved split that lists every committed sample of a dataset.
ALL_SPLIT = "all"

#: Ids per stored chunk of a split's id list: 65,536 ids are 768 KiB with
#: labels, so a 1M-sample split is 16 rows, read concurrently.
SPLIT_CHUNK = 65_536

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}")


def check_name(kind: str, name: object) -> str:
    """Return ``name`` if it is a valid dataset or split name, else raise.

    Names are 1-128 characters of ``[A-Za-z0-9_.-]`` starting with a letter
    or digit: safe in URLs, file names and CQL string literals.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(
            f"invalid {kind} name {name!r}: use 1-128 characters of "
            "letters, digits, '_', '.', '-', starting with a letter or digit"
        )
    return name


def normalize_relpath(relpath: str) -> str:
    """The canonical form of a path relative to the dataset root.

    Forward slashes, no leading ``./``, Unicode NFC, so that the same file gets
    the same id on every machine (macOS hands out NFD names).
    """
    p = relpath.replace("\\", "/")
    while p.startswith("./"):
        p = p[2:]
    return unicodedata.normalize("NFC", p)


def sample_id(dataset: str, relpath: str) -> int:
    """The deterministic signed 64-bit id of ``relpath`` in ``dataset``.

    blake2b over ``dataset NUL relpath``; collisions are detected at ingest.
    """
    key = f"{dataset}\x00{normalize_relpath(relpath)}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little", signed=True)


_xxh3 = xxhash.xxh3_64_intdigest


def sample_checksum(data) -> int:
    """The fast checksum stored with a sample: XXH3-64 of its stored bytes (``data``
    only, not the target), as a signed 64-bit int (a Cassandra ``bigint``).

    About 2-5 us for 110 KB, by machine (``bench/checksum.py``); computed by the stores' write
    path and verified by the client engine on every read path.
    """
    v = _xxh3(data)
    return v - 0x10000000000000000 if v >= 0x8000000000000000 else v


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sample: encoded bytes plus its label and optional target.

    ``checksum`` is :func:`sample_checksum` of ``data`` as the store recorded it
    (None for samples written before stores kept one, or from a source that
    has none); it takes no part in equality.
    """

    id: int
    label: int
    data: bytes
    target: bytes | None = None
    checksum: int | None = field(default=None, compare=False)

    def __repr__(self) -> str:
        t = "None" if self.target is None else f"<{len(self.target)} bytes>"
        return f"Sample(id={self.id}, label={self.label}, data=<{len(self.data)} bytes>, target={t})"


@dataclass(frozen=True, slots=True)
class SampleMeta:
    """What ingest recorded about a sample's source file."""

    id: int
    label: int
    path: str  # relative to the dataset root, normalized
    format: str  # PIL format name of the stored bytes: JPEG, PNG, ...
    width: int
    height: int
    size: int  # stored byte size
    checksum: str  # sha256 hex of the stored bytes
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    name: str
    label_names: tuple[str, ...]
    num_samples: int
    created: _dt.datetime

    @property
    def num_classes(self) -> int:
        return len(self.label_names)


@dataclass(frozen=True, slots=True)
class SplitInfo:
    dataset: str
    name: str
    num_ids: int


@dataclass(frozen=True, eq=False)
class IdList:
    """A split's contents: sample ids (int64) and their labels (int32)."""

    ids: np.ndarray
    labels: np.ndarray

    def __post_init__(self) -> None:
        ids = np.ascontiguousarray(self.ids, dtype=np.int64)
        labels = np.ascontiguousarray(self.labels, dtype=np.int32)
        if ids.ndim != 1 or ids.shape != labels.shape:
            raise ConfigError(f"ids and labels must be 1-d and equal in length, got {ids.shape} and {labels.shape}")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "labels", labels)

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, IdList)
            and np.array_equal(self.ids, other.ids)
            and np.array_equal(self.labels, other.labels)
        )

    def chunks(self, size: int = SPLIT_CHUNK):
        """Yield ``(index, ids_bytes, labels_bytes)`` in little-endian chunks."""
        for i, start in enumerate(range(0, len(self), size)):
            yield (
                i,
                self.ids[start : start + size].astype("<i8").tobytes(),
                self.labels[start : start + size].astype("<i4").tobytes(),
            )

    @classmethod
    def from_chunks(cls, chunks) -> IdList:
        """Inverse of :meth:`chunks`; ``chunks`` are ``(ids_bytes, labels_bytes)`` in order."""
        ids = [np.frombuffer(a, dtype="<i8") for a, _ in chunks]
        labels = [np.frombuffer(b, dtype="<i4") for _, b in chunks]
        if not ids:
            return cls(np.empty(0, np.int64), np.empty(0, np.int32))
        return cls(np.concatenate(ids), np.concatenate(labels))
