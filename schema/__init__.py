"""dataferry.schema: the data layer.

The data model, the error tree, the one store seam (:class:`SampleSource` /
:class:`Store`) and its backends (SQLite, Cassandra/ScyllaDB), the CQL schema,
and ingest. See ``README.md`` in this folder for a map of the files.

Attributes are imported lazily (PEP 562) so ``dataferry --help`` stays fast.
"""

from __future__ import annotations

import importlib

__all__ = [
    # errors
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
    # model
    "Sample",
    "SampleMeta",
    "DatasetInfo",
    "SplitInfo",
    "IdList",
    "sample_id",
    "check_name",
    "ALL_SPLIT",
    # the seam
    "SampleSource",
    "Store",
    "SampleRecord",
    "FetchResult",
    # stores
    "open_store",
    "parse_store_url",
    "SqliteOptions",
    "CassandraOptions",
    "DEFAULT_STORE_URL",
    # the data service's token file (read by the server and the client)
    "read_token_file",
    # ingest
    "ingest",
    "IngestOptions",
    "IngestReport",
    "make_splits",
    "make_synthetic",
]

_WHERE = {
    "_errors": (
        "DataferryError ConfigError StoreError StoreUnavailable StoreTimeout NotFound "
        "DatasetNotFound SplitNotFound SampleNotFound IntegrityError InvalidImage"
    ),
    "_model": "Sample SampleMeta DatasetInfo SplitInfo IdList sample_id check_name ALL_SPLIT",
    "_store": "SampleSource Store SampleRecord FetchResult",
    "_open": "open_store",
    "_url": "parse_store_url SqliteOptions CassandraOptions DEFAULT_STORE_URL",
    "_tokens": "read_token_file",
    "_ingest": "ingest IngestOptions IngestReport",
    "_splits": "make_splits",
    "_synthetic": "make_synthetic",
}
_LAZY = {name: mod for mod, names in _WHERE.items() for name in names.split()}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dataferry.schema' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
