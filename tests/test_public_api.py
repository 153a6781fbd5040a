"""Pin the public API: adding or removing a name is a deliberate change."""

from __future__ import annotations

import importlib
import pathlib

import pytest

PUBLIC = {
    "dataferry.schema": [
        "ALL_SPLIT", "CassandraOptions", "ConfigError", "DEFAULT_STORE_URL", "DataferryError",
        "DatasetInfo", "DatasetNotFound", "FetchResult", "IdList", "IntegrityError", "InvalidImage",
        "NotFound", "Sample", "SampleMeta", "CorruptSample", "UndecodableSample", "sample_checksum", "SampleNotFound", "SampleRecord", "SampleSource",
        "SplitInfo", "SplitNotFound", "SqliteOptions", "Store", "StoreError", "StoreTimeout",
        "StoreUnavailable", "PermanentStoreError", "AccessDenied", "TLSFailed", "ProtocolMismatch", "check_name", "open_store", "parse_store_url", "sample_id",
        "ingest", "IngestOptions", "IngestReport", "make_splits", "derive_split", "DerivedSplit", "FilterError", "parse_filter", "make_synthetic", "read_token_file", "encode_mask", "encode_multilabel",
    ],
    "dataferry.client": [
        "Batch", "ErrorPolicy", "Hedge", "Loader", "LoaderEpoch", "ProcessLoader", "MemorySource",
        "PlanOptions", "Prefetch", "Retry", "SampleFailed", "CorruptSample", "UndecodableSample", "Stats", "Interval", "ClientMetrics", "serve_metrics",
        "HttpSource", "HttpOptions", "TokenRefused", "RequestRejected",
        "DaliIterator", "DaliOptions", "TorchIterator", "ImageBatch", "TrainTransform", "EvalTransform",
        "TargetKind", "decode_probe",
    ],
    "dataferry.server": ["ServerOptions", "make_app", "Runner"],
    "dataferry.schema.sources": ["open_source", "open_store", "source_factory", "MemorySource", "HttpSource", "HttpOptions"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_all_is_pinned_and_resolves(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PUBLIC[module])
    for name in mod.__all__:
        assert getattr(mod, name) is not None, name


#: what the server, the client and the CLI take from the contract (``dataferry.schema._SHARED``):
#: public to them, not in ``__all__``; other packages import nothing else of schema's (test_layering)
SHARED = [
    "check", "TokenRefused", "WireFormatError", "RequestRejected", "redact_url", "LoopThread", "new_event_loop", "lazy_face",
    "valid_token", "content_hash", "derived_name", "parse_ratios", "ProgressBar", "verify_dataset", "apply_schema",
    "schema_statements", "parse_duration", "parse_rate", "parse_size",
    "DEFAULT_MAX_PIXELS", "LOSSLESS", "ValidateOptions", "prepare_image", "validate_bytes", "validator_pool",
    "require_images", "scan", "format_table", "store_arg", "positive", "run", "with_store",
    "AdviseOptions", "Link", "Rules", "advise_source", "advise_dataset", "recommend", "render", "ingest_command", "plot",
    "FRAMES_TYPE", "IDLIST_TYPE", "IDS_TYPE", "decode_ids", "encode_ids", "encode_end", "encode_error", "encode_not_found", "encode_sample",
    "idlist_header", "idlist_parts", "wants_sums",
]


def test_schema_shares_a_pinned_set_with_the_other_packages():
    import dataferry.schema as schema

    shared = sorted(name for names in schema._SHARED.values() for name in names.split())
    assert shared == sorted(SHARED)
    assert not set(shared) & set(schema.__all__)
    for name in shared:
        assert getattr(schema, name) is not None, name


@pytest.mark.parametrize("backend", ["dataferry.schema.sources._sqlite:SqliteStore", "dataferry.schema.sources.cassandra._store:CassandraStore"])
def test_every_backend_implements_the_whole_store_protocol(backend):
    import inspect

    from dataferry.schema import Store

    mod, cls = backend.split(":")
    impl = getattr(importlib.import_module(mod), cls)
    def is_async(member) -> bool:  # a coroutine, or an async generator (fetch)
        return inspect.iscoroutinefunction(member) or inspect.isasyncgenfunction(member)

    # the protocol's methods, its base's (SampleSource: fetch) included, the dunders set aside
    wanted = [
        name for klass in Store.__mro__ if klass.__module__ == Store.__module__
        for name, member in vars(klass).items() if inspect.isfunction(member) and not name.startswith("__")
    ]
    assert {"get_derived", "put_derived", "fetch", "read_split", "close"} <= set(wanted)
    missing = [name for name in wanted if not is_async(getattr(impl, name, None))]
    assert missing == []


def test_every_error_is_drawn_in_the_one_tree():
    """Every DataferryError the public faces reach is in the tree schema/README.md draws, under its real base."""
    from dataferry.schema import _errors

    for module in PUBLIC:
        mod = importlib.import_module(module)
        for name in mod.__all__:
            getattr(mod, name)

    def below(klass):
        for sub in klass.__subclasses__():
            yield sub
            yield from below(sub)

    # the tree is drawn in schema/README.md ("Errors"); the module docstring points there
    tree = (pathlib.Path(_errors.__file__).parent / "README.md").read_text()
    missing = [k.__name__ for k in below(_errors.DataferryError)
               if k.__module__.startswith("dataferry.") and f"── {k.__name__} " not in tree]
    assert missing == []
    for klass in below(_errors.DataferryError):  # drawn under the base it subclasses
        if klass.__module__.startswith("dataferry."):
            base = klass.__bases__[0].__name__
            at = tree.index(f"── {klass.__name__} ")
            assert tree.rfind(f"── {base} ", 0, at) != -1 or base == "DataferryError", klass
