"""An unknown dataset is the same error on every path: DatasetNotFound, naming
the dataset and the store (SQLite's file, Cassandra's hosts and keyspace, the
data service's URL), from every catalog call and from a Loader, never a
"has no split" nor a token.
"""

from __future__ import annotations

import contextlib
import pickle

import pytest

from dataferry.client import Loader
from dataferry.schema.sources.http._source import HttpSource
from dataferry.schema import DatasetNotFound, NotFound, SplitNotFound, open_store, parse_store_url
from dataferry.server import ServerOptions, make_app
from server_kit import live_server, make_samples, run, seed_url

TOKEN = "s3cret-token-value"


@pytest.fixture(params=["sqlite", pytest.param("cassandra", marks=pytest.mark.cassandra), "http"])
def path(request, tmp_path) -> tuple[str, str]:
    """``(kind, store URL)``: SQLite, Cassandra, and HTTP over a SQLite store."""
    if request.param == "cassandra":
        return "cassandra", request.getfixturevalue("cassandra_url")
    return request.param, f"sqlite://{tmp_path / 's.db'}"


def _store_named(kind: str, store_url: str, base: str | None) -> str:
    """How the message must name the store on this path."""
    if kind == "http":
        return base
    opts = parse_store_url(store_url)
    if kind == "sqlite":
        return opts.path
    return f"{','.join(opts.hosts)}:{opts.port}/{opts.keyspace}"


async def _drain(agen) -> list:
    return [r async for r in agen]


def test_an_unknown_dataset_is_dataset_not_found_on_every_path(path, dataset_name):
    kind, store_url = path
    known, unknown = dataset_name, f"{dataset_name}_missing"

    seed_url(store_url, known, make_samples(3), {"train": [0, 1]})
    with contextlib.ExitStack() as stack:
        base = None
        if kind == "http":  # the real app over the same store, in a loop thread (a Loader blocks this one)
            base = stack.enter_context(live_server(lambda: make_app(store_url, ServerOptions(token=TOKEN)))).base
        where = _store_named(kind, store_url, base)

        def check(exc: BaseException) -> None:
            assert type(exc) is DatasetNotFound, repr(exc)
            assert isinstance(exc, NotFound) and isinstance(exc, LookupError)  # old except clauses still catch it
            assert exc.dataset == unknown
            msg = str(exc)
            assert repr(unknown) in msg and where in msg and "has no split" not in msg, msg
            assert TOKEN not in msg and "\n" not in msg, msg
            again = pickle.loads(pickle.dumps(exc))  # crosses process boundaries intact
            assert type(again) is DatasetNotFound and str(again) == msg and again.dataset == unknown

        async def calls():
            if kind == "http":
                source = await HttpSource.open(base, token=TOKEN)
            else:
                source = await open_store(store_url, create=False)
            async with source:
                assert len(await source.read_split(known, "train")) == 2  # the store does answer
                with pytest.raises(SplitNotFound, match="nope") as info:  # a known dataset's unknown split
                    await source.read_split(known, "nope")
                assert type(info.value) is SplitNotFound and repr(known) in str(info.value)
                for call in (source.get_dataset(unknown), source.list_splits(unknown),
                             source.read_split(unknown, "all"), source.read_split(unknown, "train")):
                    with pytest.raises(DatasetNotFound) as info:
                        await call
                    check(info.value)
                if kind == "http":  # the service checks the dataset before a batch fetch too
                    with pytest.raises(DatasetNotFound) as info:
                        await _drain(source.fetch(unknown, [1, 2]))
                    check(info.value)

        run(calls())

        # a Loader on the same path raises it at first use
        if kind == "http":
            source = lambda: HttpSource.open(base, token=TOKEN)  # noqa: E731 - an async factory
        else:
            source = store_url
        with Loader(source, unknown, batch_size=2) as loader:
            with pytest.raises(DatasetNotFound) as info:
                len(loader)
            check(info.value)
        with Loader(source, unknown, split="train", batch_size=2) as loader:
            with pytest.raises(DatasetNotFound) as info:
                next(iter(loader))
            check(info.value)
