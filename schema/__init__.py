"""dataferry.schema: the data layer.

The data model, the error tree, the one source seam (:class:`SampleSource` /
:class:`Store`), the CQL schema, and ingest with its storage advisor
(``_ingest/``); every source (SQLite, Cassandra/ScyllaDB, the data service's
HTTP client, memory) lives in ``sources/``, behind its one URL dispatcher. The lowest floor, importing no
other dataferry package. Its public face: ``__all__`` (a training script's
names), ``_SHARED`` (what the server, the client and the CLI in ``cli/`` take
from the contract) and ``dataferry.schema.sources``; other packages import
nothing else of it. See ``README.md`` for a map of the files.

Attributes are imported lazily (PEP 562) so ``dataferry --help`` stays fast.
"""

from __future__ import annotations

from ._lazy import lazy_face

#: the public API: module -> the names it defines (imported lazily, PEP 562)
_WHERE = {
    "_errors": (
        "DataferryError ConfigError StoreError StoreUnavailable StoreTimeout PermanentStoreError AccessDenied "
        "TLSFailed ProtocolMismatch NotFound "
        "DatasetNotFound SplitNotFound SampleNotFound IntegrityError CorruptSample UndecodableSample InvalidImage "
        "FilterError"
    ),
    "_model": "Sample SampleMeta DatasetInfo SplitInfo IdList sample_id sample_checksum check_name ALL_SPLIT",
    "_store": "SampleSource Store SampleRecord FetchResult",
    "sources": "open_store",
    "_url": "parse_store_url SqliteOptions CassandraOptions DEFAULT_STORE_URL",
    "_tokens": "read_token_file",
    "_ingest": "ingest IngestOptions IngestReport",
    "_splits": "make_splits derive_split DerivedSplit",
    "_filter": "parse_filter",
    "_synthetic": "make_synthetic",
    "_targets": "encode_mask encode_multilabel",
}
#: the names dataferry's other packages (server, client, the CLI) take from the
#: contract: public to them on purpose, not part of a training script's API
#: (so not in ``__all__``); tests/test_public_api.py pins them too.
_SHARED = {
    "_errors": "check TokenRefused WireFormatError RequestRejected",
    "_url": "redact_url",
    "_aio": "LoopThread new_event_loop",
    "_lazy": "lazy_face",
    "_tokens": "valid_token",
    "_splits": "content_hash derived_name parse_ratios",
    "_verify": "ProgressBar verify_dataset",
    "_ddl": "apply_schema schema_statements",
    "_units": "parse_duration parse_rate parse_size",
    "_validate": "DEFAULT_MAX_PIXELS LOSSLESS ValidateOptions prepare_image validate_bytes validator_pool",
    "_scan": "require_images scan",
    "_ingest": "AdviseOptions Link Rules advise_source advise_dataset recommend render ingest_command plot",
    "_table": "format_table",
    "_args": "store_arg positive run with_store",
    "_wire": (
        "FRAMES_TYPE IDLIST_TYPE IDS_TYPE decode_ids "
        "encode_ids encode_end encode_error encode_not_found encode_sample idlist_header idlist_parts wants_sums"
    ),
}
__all__, __getattr__, __dir__ = lazy_face(__name__, _WHERE, _SHARED)  # each public name is written once, in _WHERE
