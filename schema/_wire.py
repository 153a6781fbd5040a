"""The data service's wire format, shared by the server and :class:`HttpSource`.

Little-endian throughout. A batch fetch request is the ids as int64 (or JSON
``{"ids": [...]}``); its response (``application/x-dataferry-frames``) is
records in the store's completion order, each a 28-byte header (magic
``b"DF"``, version, kind SAMPLE / NOT_FOUND / ERROR / END, flags, id, label,
target and data lengths) then the target and data bytes; version 2 records
(only when the request asked for them) carry the stored XXH3-64 checksum. An
ERROR record ends a failed stream, an END record (counting the records before
it) a complete one. A split id list is a 16-byte ``b"DFIL"`` header, the ids
(int64), then the labels (int32). Malformed bytes raise ``WireFormatError``.
The layout byte by byte: README.md, The wire format.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from ._errors import SampleNotFound, WireFormatError
from ._model import IdList, Sample, sample_checksum

__all__ = [
    "FRAMES_TYPE",
    "ACCEPT_SUMS",
    "wants_sums",
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
SUMS_VERSION = 2  # a SAMPLE record followed by its 8-byte checksum
HEADER = struct.Struct("<2sBBB3xqiII")  # 28 bytes
_HEADER_SUM = struct.Struct("<2sBBB3xqiIIq")  # 36 bytes: version 2's SAMPLE record
_SUM = struct.Struct("<q")
#: the request header that asks for version 2 records (checksums)
ACCEPT_SUMS = "application/x-dataferry-frames; version=2"
SAMPLE, NOT_FOUND, ERROR, END = 0, 1, 2, 3
_HAS_TARGET = 1

#: the same header read with the magic as a number (no bytes object made per record)
_HEADER_IN = struct.Struct("<HBBB3xqiII")
_MAGIC_IN = int.from_bytes(MAGIC, "little")

IDLIST_MAGIC = b"DFIL"
IDLIST_HEADER = struct.Struct("<4sB3xQ")  # 16 bytes


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
def wants_sums(accept: str) -> bool:
    """Whether a request's ``Accept`` header asks for version 2 records (with checksums)."""
    return f"version={SUMS_VERSION}" in accept


def encode_sample(sample: Sample, sums: bool = False) -> tuple[bytes, ...]:
    """The record of one sample as parts to write in order (payloads not copied); with
    ``sums``, a version 2 record carrying the sample's checksum when it has one."""
    target = sample.target
    flags = 0 if target is None else _HAS_TARGET
    tlen = 0 if target is None else len(target)
    if sums and sample.checksum is not None:
        head = _HEADER_SUM.pack(MAGIC, SUMS_VERSION, SAMPLE, flags, sample.id, sample.label, tlen, len(sample.data),
                                sample.checksum)
    else:
        head = HEADER.pack(MAGIC, VERSION, SAMPLE, flags, sample.id, sample.label, tlen, len(sample.data))
    return (head, target, sample.data) if tlen else (head, sample.data)


def encode_not_found(id: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, NOT_FOUND, 0, id, 0, 0, 0)


def encode_error(error: str, detail: str) -> bytes:
    body = json.dumps({"error": error, "detail": detail}).encode()
    return HEADER.pack(MAGIC, VERSION, ERROR, 0, 0, 0, 0, len(body)) + body


def encode_end(count: int) -> bytes:
    return HEADER.pack(MAGIC, VERSION, END, 0, count, 0, 0, 0)


#: a decoded Sample made without the frozen dataclass's ``__init__`` (which sets each
#: field through ``object.__setattr__``: 1.06 against 0.65 us a record on the dev
#: machine), through its slots: the same object, fields in the same order
_new = object.__new__
_set_id, _set_label, _set_data, _set_target, _set_checksum = (
    Sample.id.__set__, Sample.label.__set__, Sample.data.__set__, Sample.target.__set__,  # type: ignore[attr-defined]
    Sample.checksum.__set__,  # type: ignore[attr-defined]
)


def _sample(id_: int, label: int, data, target: bytes | None, checksum: int | None) -> Sample:
    s = _new(Sample)
    _set_id(s, id_)
    _set_label(s, label)
    _set_data(s, data)
    _set_target(s, target)
    _set_checksum(s, checksum)
    return s


if hasattr(Sample, "__post_init__"):  # a Sample that checks itself is made the usual way
    _sample = Sample  # noqa: F811


class _Reader(Protocol):
    async def readexactly(self, n: int) -> bytes: ...


class FrameDecoder:
    """The records of a batch fetch response body, decoded incrementally.

    The body's bytes land in an *arena* (a region of a large ``bytearray``),
    one after the other, and each sample's data is a read-only ``memoryview``
    slice of it: one socket read carries many samples and no sample gets a
    buffer of its own. Bytes come in two ways: :meth:`sink` gives the writable
    view of the region's free room, where a reader has the socket write the
    next body bytes (no copy after the socket), and :meth:`sunk` says how many
    were written there; or :meth:`feed` copies them in. Either way the records
    complete in those bytes are parsed in one pass, in place.

    ``arena(n, least)`` gives ``(bytearray, start, stop)``, a region of
    ``n`` bytes or at least ``least`` (``BufferPool.take``); the decoder asks
    for what the rest of the response should need: ``expect`` records in all
    (0: unknown), of the mean size seen so far (``mean`` before the first: a
    hint from earlier responses), 1/16 more; and at least room for the record
    being read. A record that does not fit in what is left of its region
    moves, with the few bytes of it read so far, to a new one.
    ``give_back(bytearray, start, stop)`` takes back what the decoder did not
    write, once done. Decoded records wait in :attr:`records` (``ready_bytes``
    of sample data) until the caller takes them; :attr:`done` is set after END
    or ERROR; :attr:`count` and :attr:`nbytes` are the records parsed and their
    bytes, :attr:`mean` their mean size. Bytes that break the format raise
    WireFormatError.

    ``verify``: a version 2 record's bytes are checked against its checksum as
    it is parsed, right after the socket's copy put them in the cache (6.3 us
    a 110 KB sample against 9.1 in the engine, after they had left it:
    bench/results/client_cpu.md). A sample that matches comes without its
    checksum (nothing is left to check); one that does not keeps it, and the
    engine's check reports it (``CorruptSample``), as for every source.
    """

    __slots__ = ("dataset", "records", "ready_bytes", "done", "count", "nbytes", "_max", "_arena", "_give_back",
                 "_expect", "_mean", "_buf", "_w", "_ro", "_lo", "_hi", "_stop", "_need", "_verify")

    def __init__(self, dataset: str, *, max_record: int = 1 << 30, arena=None, give_back=None, expect: int = 0,
                 mean: float = 0.0, verify: bool = False) -> None:
        self.dataset = dataset
        self._verify = verify
        self.records: list[Sample | SampleNotFound | ErrorRecord | EndRecord] = []
        self.ready_bytes = 0
        self.done = False
        self.count = self.nbytes = 0
        self._max = max_record
        self._arena = arena or _own_arena
        self._give_back = give_back
        self._expect, self._mean = expect, mean
        self._buf: bytearray | None = None
        self._w = self._ro = None  # writable and read-only views of the arena
        self._lo = self._hi = self._stop = 0  # first byte not parsed, first not written, the region's end
        self._need = HEADER.size  # bytes of the record at _lo, once its header is in (else a header's)

    def wanted(self) -> int:
        """Bytes still due for the record (or header) being read (0 once done)."""
        return 0 if self.done else self._need - (self._hi - self._lo)

    def sink(self) -> memoryview | None:
        """The region's free room, where the next body bytes go; None once done."""
        if self.done:
            return None
        lo, hi, stop = self._lo, self._hi, self._stop
        if lo + self._need > stop or (hi - lo < HEADER.size and stop - hi < self._least()):
            self._move()
        return self._w[self._hi : self._stop]

    def sunk(self, n: int) -> None:
        """``n`` bytes were written at the start of the view :meth:`sink` gave."""
        self._hi += n
        if self._hi - self._lo >= self._need:
            self._parse()

    def feed(self, data) -> None:
        """Decode ``data`` (bytes-like): all of it is taken."""
        mv = memoryview(data).cast("B")
        i, n = 0, len(mv)
        while i < n:
            view = self.sink()
            if view is None:
                raise WireFormatError("bytes after the END record")
            k = min(len(view), n - i)
            view[:k] = mv[i : i + k]
            i += k
            self.sunk(k)

    def take(self) -> list[Sample | SampleNotFound | ErrorRecord | EndRecord]:
        """The records decoded so far, handed over (the list is emptied)."""
        out, self.records = self.records, []
        self.ready_bytes = 0
        return out

    @property
    def mean(self) -> float:
        """Bytes per record parsed so far (before the first: the ``mean`` hint)."""
        return self.nbytes / self.count if self.count else self._mean

    # --- in the arena ------------------------------------------------------------------
    def _rest(self) -> int:
        """Bytes the rest of the response should need (a guess: the region asked for)."""
        mean = self.mean
        if not self._expect or not mean:
            return _FIRST
        return int(max(self._expect - self.count, 0) * mean * 17 / 16) + HEADER.size

    def _least(self) -> int:
        """The room worth reading a record into, at its start: a mean record (at least
        _MIN_ROOM), unless the rest of the response should need less. With less, the
        next record starts in a new region rather than moving there half read."""
        return min(max(int(self.mean), _MIN_ROOM), self._rest())

    def _move(self) -> None:
        """To a new region with room for the record at ``_lo``, its bytes read so far copied over."""
        old_buf, old, lo, hi, stop = self._buf, self._w, self._lo, self._hi, self._stop
        need = max(self._need, hi - lo)
        buf, start, self._stop = self._arena(max(need, self._rest()), max(need, self._least()))
        if buf is not old_buf:
            self._buf, self._w = buf, memoryview(buf)
            self._ro = self._w.toreadonly()
        if hi > lo:
            self._w[start : start + hi - lo] = old[lo:hi]
        self._lo, self._hi = start, start + hi - lo
        if old_buf is not None and self._give_back is not None:
            del old
            self._give_back(old_buf, lo, stop)  # what the partial record would have used, for another response

    def _parse(self) -> None:
        """Every record complete in ``[_lo, _hi)``, in one pass."""
        buf, ro, lo, hi = self._buf, self._ro, self._lo, self._hi
        records = self.records
        append = records.append
        unpack, size, limit, unpack_sum = _HEADER_IN.unpack_from, HEADER.size, self._max, _SUM.unpack_from
        sum_size, verify, check, make = size + _SUM.size, self._verify, sample_checksum, _sample
        start, ready, listed = lo, 0, len(records)
        try:
            while hi - lo >= size:
                magic, version, kind, flags, id_, label, tlen, dlen = unpack(buf, lo)
                if magic != _MAGIC_IN or (version != VERSION and version != SUMS_VERSION) or kind > END:
                    raise WireFormatError(f"bad record header {bytes(buf[lo : lo + 8]).hex()} (magic, version or kind)")
                if tlen + dlen > limit:
                    raise WireFormatError(f"record of {tlen + dlen} bytes exceeds the limit of {limit}")
                end = lo + (size if version == VERSION else sum_size) + tlen + dlen
                if end > hi:
                    self._need = end - lo
                    break
                if kind == SAMPLE:
                    at = end - dlen
                    if flags & _HAS_TARGET:
                        target = ro[at - tlen : at].tobytes()
                    elif tlen:
                        raise WireFormatError(f"record of sample {id_} has target bytes but no target flag")
                    else:
                        target = None
                    data = ro[at:end] if dlen else b""
                    if version == VERSION:
                        checksum = None
                    else:  # checked here, while in the cache: a sample that matches goes on without it
                        checksum = unpack_sum(buf, lo + size)[0]
                        if verify and check(data) == checksum:
                            checksum = None
                    append(make(id_, label, data, target, checksum))
                    ready += dlen
                elif kind == NOT_FOUND:
                    append(SampleNotFound(self.dataset, id_))
                else:
                    listed += 1  # the END or ERROR record _finish adds is not one of the answers counted
                    self._finish(_error_record(ro[end - dlen : end]) if kind == ERROR else EndRecord(id_), end)
                    return
                lo = end
            else:
                self._need = size
        finally:
            self.ready_bytes += ready
            self.nbytes += lo - start
            self.count += len(records) - listed
        self._lo = lo

    def _finish(self, rec: ErrorRecord | EndRecord, lo: int) -> None:
        self.records.append(rec)
        self.done = True
        if lo != self._hi:
            raise WireFormatError("bytes after the END record")
        buf, self._buf, self._w, self._ro = self._buf, None, None, None  # nothing of ours keeps the arena now
        if self._give_back is not None:
            self._give_back(buf, lo, self._stop)


def _error_record(raw: memoryview) -> ErrorRecord:
    if not len(raw):
        return ErrorRecord("store_error", "")
    raw = raw.tobytes()
    try:
        doc = json.loads(raw)
        return ErrorRecord(str(doc.get("error", "store_error")), str(doc.get("detail", "")))
    except (ValueError, AttributeError):
        return ErrorRecord("store_error", raw.decode("utf-8", "replace"))


#: the least room worth a read at a record's start (unless the response should need less)
_MIN_ROOM = 1 << 16
#: the region asked for while the response's size cannot be guessed
_FIRST = 1 << 20


def _own_arena(n: int, least: int = 0) -> tuple[bytearray, int, int]:
    buf = bytearray(max(n, _MIN_ROOM))
    return buf, 0, len(buf)


async def read_frames(
    reader: _Reader, dataset: str, *, max_record: int = 1 << 30
) -> AsyncIterator[Sample | SampleNotFound | ErrorRecord | EndRecord]:
    """Decode records from ``reader`` as they arrive; stop after ERROR or END.

    A :class:`FrameDecoder` fed with ``readexactly`` of what it still wants.
    A cut stream raises ``asyncio.IncompleteReadError`` (an EOFError); a
    corrupt one WireFormatError. ``max_record`` bounds what one record may
    make the reader allocate.
    """
    dec = FrameDecoder(dataset, max_record=max_record)
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
