"""The exception tree of dataferry.

Every error the library raises on purpose is a :class:`DataferryError`.
Lower-level errors (cassandra-driver, sqlite3, aiohttp, Pillow, OS) are
translated where they cross into dataferry, with ``raise X from exc``, and the
message names the thing at fault: the dataset, split, sample id, file path,
store URL or address.

The tree, each class with what it means, is drawn in schema/README.md, "Errors".
"""

from __future__ import annotations

__all__ = [
    "check",
    "DataferryError",
    "ConfigError",
    "StoreError",
    "StoreUnavailable",
    "StoreTimeout",
    "PermanentStoreError",
    "AccessDenied",
    "TLSFailed",
    "ProtocolMismatch",
    "NotFound",
    "DatasetNotFound",
    "SplitNotFound",
    "SampleNotFound",
    "IntegrityError",
    "CorruptSample",
    "UndecodableSample",
    "InvalidImage",
    "FilterError",
    "TokenRefused",
    "WireFormatError",
    "RequestRejected",
]


class DataferryError(Exception):
    """Base class of every error dataferry raises on purpose."""


class ConfigError(DataferryError, ValueError):
    """An option or URL is malformed or out of range."""


class StoreError(DataferryError):
    """The store failed while serving a request."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (refused, dead host, reset): worth retrying."""


class StoreTimeout(StoreError, TimeoutError):
    """A store request did not complete within its timeout."""


class PermanentStoreError(StoreError):
    """The store answered, or the peer can be reached, but no retry will help:
    the engine and the catalog reads raise it at once instead of retrying for
    ``Retry.deadline``. The message names the cause and the URL."""


class AccessDenied(PermanentStoreError):
    """The store refused the credentials (bad, missing or revoked): HTTP 401 or 403."""


class TLSFailed(PermanentStoreError):
    """The server's certificate failed verification (untrusted, expired, another
    host's), or the TLS handshake failed for a reason a retry cannot change."""


class ProtocolMismatch(PermanentStoreError):
    """The peer does not speak what the URL says: not HTTP at all, ``http://``
    to a TLS port, ``https://`` to a plain HTTP port."""


class NotFound(DataferryError, LookupError):
    """A named thing does not exist in the store."""


class DatasetNotFound(NotFound):
    """The store has no dataset of that name; the same error on every path
    (SQLite, Cassandra, the data service), from every catalog call.

    ``store`` names where it was looked for ("sqlite store '/data/x.db'",
    "cassandra store db1:9042/dataferry", "data service https://host:8470").
    """

    def __init__(self, dataset: str, store: str | None = None) -> None:
        super().__init__(f"unknown dataset {dataset!r}" + (f" in {store}" if store else ""))
        self.dataset = dataset
        self.store = store

    def __reduce__(self):
        return (DatasetNotFound, (self.dataset, self.store))


class SplitNotFound(NotFound):
    """A dataset that exists has no split of that name (an unknown dataset is DatasetNotFound)."""

    def __init__(self, dataset: str, split: str, store: str | None = None) -> None:
        super().__init__(f"dataset {dataset!r} has no split {split!r}" + (f" in {store}" if store else ""))
        self.dataset = dataset
        self.split = split
        self.store = store

    def __reduce__(self):
        return (SplitNotFound, (self.dataset, self.split, self.store))


class SampleNotFound(NotFound):
    """A sample id is not in the store.

    ``SampleSource.fetch`` *yields* this for an unknown id instead of raising,
    so one bad id does not fail the other ids of the same request.
    """

    def __init__(self, dataset: str, id: int) -> None:
        super().__init__(f"dataset {dataset!r} has no sample with id {id}")
        self.dataset = dataset
        self.id = id

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, SampleNotFound)
            and other.dataset == self.dataset
            and other.id == self.id
        )

    def __hash__(self) -> int:
        return hash((SampleNotFound, self.dataset, self.id))

    def __reduce__(self):
        return (SampleNotFound, (self.dataset, self.id))


class IntegrityError(DataferryError):
    """Stored data contradicts itself, e.g. two paths hash to one sample id."""


class CorruptSample(IntegrityError):
    """A sample's bytes do not match the checksum stored with them: changed after
    ingest (on disk, in the store, on the way). Never delivered; ``ErrorPolicy``
    decides whether it raises or is skipped and counted."""

    def __init__(self, dataset: str, id: int, store: str | None = None, detail: str = "") -> None:
        where = f" in {store}" if store else ""
        super().__init__(
            f"corrupt sample {id} of dataset {dataset!r}{where}: checksum mismatch"
            + (f" ({detail})" if detail else "") + "; run `dataferry verify` to list every damaged sample"
        )
        self.dataset = dataset
        self.id = id
        self.store = store
        self.detail = detail

    def __reduce__(self):
        return (CorruptSample, (self.dataset, self.id, self.store, self.detail))


class InvalidImage(DataferryError):
    """A source file is not a usable image. ``path`` and ``reason`` say why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self):
        return (InvalidImage, (self.path, self.reason))


class UndecodableSample(InvalidImage):
    """A delivered sample's bytes failed to decode in an iterator (``reason`` says how);
    an :class:`InvalidImage` whose ``path`` names the dataset and the sample id."""

    def __init__(self, dataset: str, id: int, reason: str) -> None:
        super().__init__(f"dataset {dataset!r} sample {id}", f"failed to decode: {reason}")
        self.dataset = dataset
        self.id = id
        self.reason = reason

    def __reduce__(self):
        return (UndecodableSample, (self.dataset, self.id, self.reason))


class FilterError(ConfigError):
    """A filter that does not parse or does not type-check; names the position."""

    def __init__(self, text: str, position: int, reason: str) -> None:
        self.text, self.position, self.reason = text, position, reason
        super().__init__(f"filter: {reason} at position {position}")

    def __reduce__(self):
        return (FilterError, (self.text, self.position, self.reason))

    @property
    def caret(self) -> str:
        """Two lines: the filter (whitespace shown as spaces) and a ``^`` under the position."""
        shown = "".join(" " if c.isspace() else c for c in self.text)
        return f"  {shown}\n  {' ' * (self.position - 1)}^"


class TokenRefused(AccessDenied):
    """The data service answered 401 or 403: the token is missing, wrong or
    revoked (and a token file had no other to try). Never retried."""


class WireFormatError(DataferryError, ValueError):
    """Bytes that do not follow the wire format (a bad body, a corrupt stream)."""


class RequestRejected(DataferryError):
    """The data service rejected a request as malformed (a 4xx other than 401/404),
    or what answered is not a data service (``error == "not_a_data_service"``)."""

    def __init__(self, url: str, status: int, error: str, detail: str, *, message: str | None = None) -> None:
        super().__init__(message or f"{url} rejected the request ({status} {error}): {detail}")
        self.status, self.error, self.detail = status, error, detail

    def __reduce__(self):
        return (_rejected, (str(self), self.status, self.error, self.detail))


def _rejected(message: str, status: int, error: str, detail: str) -> RequestRejected:
    return RequestRejected("", status, error, detail, message=message)


def check(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``cond``: the one
    validation helper of every frozen option object."""
    if not cond:
        raise ConfigError(msg)
