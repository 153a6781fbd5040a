"""The data service's wire format, shared by the server and :class:`HttpSource`.

Everything is little-endian. Three payloads:

**Batch fetch request** (``POST /v1/datasets/{name}/samples``,
``Content-Type: application/octet-stream``): the sample ids as int64, 8 bytes
each, no header. (``application/json`` ``{"ids": [...]}`` is accepted too.)

**Batch fetch response** (``application/x-dataferry-frames``): records in the
order the store completes them, each a 28-byte header, then the target bytes,
then the data bytes::

    offset size field
    0      2    magic b"DF"
    2      1    version (1)
    3      1    kind: 0 SAMPLE, 1 NOT_FOUND, 2 ERROR, 3 END
    4      1    flags: bit 0 set = the sample has a target (which may be empty)
    5      3    zero
    8      8    id, int64
    16     4    label, int32
    20     4    target length, uint32
    24     4    data length, uint32

* ``SAMPLE``: one sample. ``NOT_FOUND``: the id is not in the dataset
  (lengths 0).
* ``ERROR``: the store failed mid-stream; the data is UTF-8 JSON
  ``{"error": ..., "detail": ...}``; it is the last record. Ids not answered
  before it were not served.
* ``END``: the last record of a complete response; ``id`` is the number of
  SAMPLE and NOT_FOUND records before it. A response with neither ERROR nor
  END at its end was cut.

**Split id list** (``GET /v1/datasets/{name}/splits/{split}``,
``application/x-dataferry-idlist``): a 16-byte header ``b"DFIL"``, version
(uint8, 1), 3 zero bytes, count (uint64); then ``count`` int64 ids; then
``count`` int32 labels. ``Content-Length`` is always ``16 + 12 * count``.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ._errors import DataferryError, SampleNotFound
from ._model import IdList, Sample

__all__ = [
    "FRAMES_TYPE",
    "IDLIST_TYPE",
    "IDS_TYPE",
    "HEADER",
    "SAMPLE",
    "NOT_FOUND",
    "ERROR",
    "END",
    "WireFormatError",
    "ErrorRecord",
    "EndRecord",
    "encode_ids",
    "decode_ids",
    "encode_sample",
    "encode_not_found",
    "encode_error",
    "encode_end",
    "read_frames",
    "FrameDecoder",
    "idlist_header",
    "idlist_parts",
    "decode_idlist",
]

FRAMES_TYPE = "application/x-dataferry-frames"
IDLIST_TYPE = "application/x-dataferry-idlist"
IDS_TYPE = "application/octet-stream"

MAGIC = b"DF"
VERSION = 1
HEADER = struct.Struct("<2sBBB3xqiII")  # 28 bytes
SAMPLE, NOT_FOUND, ERROR, END = 0, 1, 2, 3
_HAS_TARGET = 1

IDLIST_MAGIC = b"DFIL"
IDLIST_HEADER = struct.Struct("<4sB3xQ")  # 16 bytes


class WireFormatError(DataferryError, ValueError):
    """Bytes that do not follow the wire format (a bad body, a corrupt stream)."""


@dataclass(frozen=True, slots=True)
class ErrorRecord:
    """An ERROR record: the store failed after the response had begun."""

    error: str
    detail: str


@dataclass(frozen=True, slots=True)
class EndRecord:
    """The END record: the response is complete; ``count`` records preceded it."""

    count: int


# --- request bodies --------------------------------------------------------------
def encode_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    return np.asarray(ids, dtype="<i8").tobytes()


def decode_ids(body: bytes) -> np.ndarray:
    """The int64 ids of a binary request body; WireFormatError if malformed."""
    if len(body) % 8:
        raise WireFormatError(f"binary body of {len(body)} bytes is not a whole number of int64 ids (8 bytes each)")
    return np.frombuffer(body, dtype="<i8")


# --- batch fetch responses ----------------------------------------------------------
def encode_sample(sample: Sample) -> tuple[bytes, ...]:
    """The record of one sample as parts to write in order (payloads not copied)."""
    target = sample.target
    flags = 0 if target is None else _HAS_TARGET
    tlen = 0 if target is None else len(target)
    head = HEADER.pack(MAGIC, VERSION, SAMPLE, flags, sample.id, sample.label, tlen, len(sample.data))
    return (head, target, sample.data) if tlen else (head, sample.data)


def encode_not_found(id: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, NOT_FOUND, 0, id, 0, 0, 0)


def encode_error(error: str, detail: str) -> bytes:
    body = json.dumps({"error": error, "detail": detail}).encode()
    return HEADER.pack(MAGIC, VERSION, ERROR, 0, 0, 0, 0, len(body)) + body


def encode_end(count: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, END, 0, count, 0, 0, 0)


class _Reader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


_HEAD, _TARGET, _DATA, _ERROR, _DONE = range(5)


class FrameDecoder:
    """The records of a batch fetch response body, decoded incrementally.

    Body bytes come in two ways: :meth:`feed` (copied out of the caller's
    buffer), or straight into the record being read: :meth:`sink` gives the
    writable view where the next body bytes belong (when at least
    ``direct_min`` bytes of a payload are still due), and :meth:`sunk` says
    how many were written there. So a reader can have the socket write a
    sample's bytes where they will stay: no copy after the socket.

    Decoded records wait in :attr:`records` (``ready_bytes`` of sample data)
    until the caller takes them; :attr:`done` is set after END or ERROR.
    ``alloc(n)`` gives ``(writable, readonly)`` views of ``n`` bytes for a
    sample's data (the readonly one becomes ``Sample.data``); the default is a
    ``bytearray`` of its own. Bytes that break the format raise WireFormatError.
    """

    __slots__ = ("dataset", "records", "ready_bytes", "done", "_max", "_alloc", "_min", "_head", "_stage",
                 "_view", "_pos", "_end", "_rec", "_target")

    def __init__(self, dataset: str, *, max_record: int = 1 << 30, alloc=None, direct_min: int = 1 << 13) -> None:
        self.dataset = dataset
        self.records: list[Sample | SampleNotFound | ErrorRecord | EndRecord] = []
        self.ready_bytes = 0
        self.done = False
        self._max, self._alloc, self._min = max_record, alloc or _own_buffer, direct_min
        self._head = bytearray()
        self._stage = _HEAD
        self._view: memoryview | None = None  # where the payload being read goes
        self._pos = self._end = 0
        self._rec: tuple = ()  # (id, label, public data view) of the sample being read
        self._target: bytes | None = None

    def wanted(self) -> int:
        """Bytes still due for the header or payload being read (0 once done)."""
        if self._stage == _HEAD:
            return HEADER.size - len(self._head)
        return self._end - self._pos if self._stage != _DONE else 0

    def sink(self) -> memoryview | None:
        """Where the next body bytes go directly, or None (then :meth:`feed`)."""
        if self._stage == _DATA and self._end - self._pos >= self._min:
            return self._view[self._pos : self._end]
        return None

    def sunk(self, n: int) -> None:
        """``n`` bytes were written into the view :meth:`sink` gave."""
        self._pos += n
        if self._pos == self._end:
            self._complete()

    def feed(self, data) -> None:
        """Decode ``data`` (bytes-like): all of it is taken."""
        mv = memoryview(data)
        n = len(mv)
        i = 0
        size = HEADER.size
        while i < n:
            stage = self._stage
            if stage == _HEAD:
                if not self._head and n - i >= size:
                    self._header(mv, i)
                    i += size
                else:
                    take = min(size - len(self._head), n - i)
                    self._head += mv[i : i + take]
                    i += take
                    if len(self._head) == size:
                        head, self._head = self._head, bytearray()
                        self._header(head, 0)
            elif stage == _DONE:
                raise WireFormatError("bytes after the END record")
            else:
                take = min(self._end - self._pos, n - i)
                self._view[self._pos : self._pos + take] = mv[i : i + take]
                i += take
                self._pos += take
                if self._pos == self._end:
                    self._complete()

    def take(self) -> list[Sample | SampleNotFound | ErrorRecord | EndRecord]:
        """The records decoded so far, handed over (the list is emptied)."""
        out, self.records = self.records, []
        self.ready_bytes = 0
        return out

    # --- the states ------------------------------------------------------------------
    def _header(self, buf, at: int) -> None:
        magic, version, kind, flags, id_, label, tlen, dlen = HEADER.unpack_from(buf, at)
        if magic != MAGIC or version != VERSION or kind > END:
            raise WireFormatError(f"bad record header {bytes(buf[at : at + 8]).hex()} (magic, version or kind)")
        if tlen + dlen > self._max:
            raise WireFormatError(f"record of {tlen + dlen} bytes exceeds the limit of {self._max}")
        if kind == SAMPLE:
            if not flags & _HAS_TARGET:
                if tlen:
                    raise WireFormatError(f"record of sample {id_} has target bytes but no target flag")
                self._target = None
                self._data(id_, label, dlen)
            elif tlen:
                self._rec = (id_, label, dlen)
                self._expect(_TARGET, memoryview(bytearray(tlen)))
            else:
                self._target = b""
                self._data(id_, label, dlen)
        elif kind == NOT_FOUND:
            self.records.append(SampleNotFound(self.dataset, id_))
        elif kind == ERROR:
            if dlen:
                self._expect(_ERROR, memoryview(bytearray(dlen)))
            else:
                self._finish(ErrorRecord("store_error", ""))
        else:
            self._finish(EndRecord(id_))

    def _data(self, id_: int, label: int, dlen: int) -> None:
        if not dlen:
            self.records.append(Sample(id_, label, b"", self._target))
            return
        writable, public = self._alloc(dlen)
        self._rec = (id_, label, public)
        self._expect(_DATA, writable)

    def _expect(self, stage: int, view: memoryview) -> None:
        self._stage, self._view, self._pos, self._end = stage, view, 0, len(view)

    def _complete(self) -> None:
        stage, view = self._stage, self._view
        self._view = None
        self._stage = _HEAD
        if stage == _DATA:
            id_, label, public = self._rec
            self.records.append(Sample(id_, label, public, self._target))
            self.ready_bytes += self._end
        elif stage == _TARGET:
            self._target = view.tobytes()
            id_, label, dlen = self._rec
            self._data(id_, label, dlen)
        else:
            raw = view.tobytes()
            try:
                doc = json.loads(raw)
                rec = ErrorRecord(str(doc.get("error", "store_error")), str(doc.get("detail", "")))
            except (ValueError, AttributeError):
                rec = ErrorRecord("store_error", raw.decode("utf-8", "replace"))
            self._finish(rec)

    def _finish(self, rec: ErrorRecord | EndRecord) -> None:
        self.records.append(rec)
        self._stage = _DONE
        self.done = True


def _own_buffer(n: int) -> tuple[memoryview, memoryview]:
    mv = memoryview(bytearray(n))
    return mv, mv.toreadonly()


async def read_frames(
    reader: _Reader, dataset: str, *, max_record: int = 1 << 30
) -> AsyncIterator[Sample | SampleNotFound | ErrorRecord | EndRecord]:
    """Decode records from ``reader`` as they arrive; stop after ERROR or END.

    A :class:`FrameDecoder` fed with ``readexactly`` of what it still wants.
    A cut stream raises ``asyncio.IncompleteReadError`` (an EOFError); a
    corrupt one WireFormatError. ``max_record`` bounds what one record may
    make the reader allocate.
    """
    dec = FrameDecoder(dataset, max_record=max_record, direct_min=1 << 62)
    while not dec.done:
        dec.feed(await reader.readexactly(dec.wanted()))
        for rec in dec.take():
            yield rec


# --- split id lists --------------------------------------------------------------------
def idlist_header(count: int) -> bytes:
    return IDLIST_HEADER.pack(IDLIST_MAGIC, VERSION, count)


def idlist_parts(idlist: IdList, chunk: int = 1 << 20) -> Iterator[memoryview]:
    """The body after the header, as views of at most ``chunk`` bytes (no copies
    on little-endian hosts)."""
    for arr, dtype in ((idlist.ids, "<i8"), (idlist.labels, "<i4")):
        view = memoryview(np.ascontiguousarray(arr, dtype=dtype)).cast("B")
        for start in range(0, len(view), chunk):
            yield view[start : start + chunk]


def decode_idlist(body: bytes) -> IdList:
    """Inverse of the server's id list encoding; WireFormatError if malformed."""
    if len(body) < IDLIST_HEADER.size:
        raise WireFormatError(f"id list of {len(body)} bytes is shorter than its header")
    magic, version, count = IDLIST_HEADER.unpack_from(body)
    if magic != IDLIST_MAGIC or version != VERSION:
        raise WireFormatError(f"bad id list header {body[:8].hex()}")
    if len(body) != IDLIST_HEADER.size + 12 * count:
        raise WireFormatError(f"id list says {count} ids but carries {len(body) - IDLIST_HEADER.size} bytes")
    off = IDLIST_HEADER.size
    ids = np.frombuffer(body, dtype="<i8", count=count, offset=off)
    labels = np.frombuffer(body, dtype="<i4", count=count, offset=off + 8 * count)
    return IdList(ids, labels)
