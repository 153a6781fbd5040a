"""The exception tree of dataferry.

Every error the library raises on purpose is a :class:`DataferryError`.
Lower-level errors (cassandra-driver, sqlite3, aiohttp, Pillow, OS) are
translated where they cross into dataferry, with ``raise X from exc``, and the
message names the thing at fault: the dataset, split, sample id, file path,
store URL or address.

::

    DataferryError
    ├── ConfigError            bad option value, malformed store URL
    ├── StoreError             the store failed or could not be reached
    │   ├── StoreUnavailable   no connection (dead host, refused, auth failed)
    │   └── StoreTimeout       a request outlived its timeout
    ├── NotFound               (a LookupError)
    │   ├── DatasetNotFound    unknown dataset, naming it and the store, on every path
    │   ├── SplitNotFound      a known dataset's unknown split
    │   └── SampleNotFound     also *yielded* (not raised) by SampleSource.fetch
    ├── IntegrityError         stored data contradicts itself (id collision, ...)
    └── InvalidImage           a source file failed validation (path + reason)
"""

from __future__ import annotations

__all__ = [
    "check",
    "DataferryError",
    "ConfigError",
    "StoreError",
    "StoreUnavailable",
    "StoreTimeout",
    "NotFound",
    "DatasetNotFound",
    "SplitNotFound",
    "SampleNotFound",
    "IntegrityError",
    "InvalidImage",
]


class DataferryError(Exception):
    """Base class of every error dataferry raises on purpose."""


class ConfigError(DataferryError, ValueError):
    """An option or URL is malformed or out of range."""


class StoreError(DataferryError):
    """The store failed while serving a request."""


class StoreUnavailable(StoreError):
    """The store cannot be reached (refused, dead host, bad credentials)."""


class StoreTimeout(StoreError, TimeoutError):
    """A store request did not complete within its timeout."""


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


class InvalidImage(DataferryError):
    """A source file is not a usable image. ``path`` and ``reason`` say why."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason

    def __reduce__(self):
        return (InvalidImage, (self.path, self.reason))


def check(cond: bool, msg: str) -> None:
    """Raise :class:`ConfigError` with ``msg`` unless ``cond``: the one
    validation helper of every frozen option object."""
    if not cond:
        raise ConfigError(msg)
