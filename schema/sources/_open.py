"""The one URL dispatcher: a URL in, a connected source out.

``open_source`` opens every source dataferry has by its URL: ``http(s)://`` the
data service (:class:`~dataferry.schema.sources.HttpSource`), ``sqlite:`` and
``cassandra://`` a store (``open_store``, which the server serves). A source's
module is imported only when its URL is opened, so the CLI starts fast.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from .._errors import ConfigError
from .._store import SampleSource, Store
from .._url import DEFAULT_STORE_URL, CassandraOptions, SqliteOptions, parse_store_url, redact_url

if TYPE_CHECKING:
    from .http._options import HttpOptions

__all__ = ["open_source", "open_store", "source_factory"]

#: ``PRAGMA mmap_size`` of a served SQLite file whose URL names none: all of it
#: (SQLite caps this at its build's limit, 2 GiB by default)
SERVED_MMAP_SIZE = 1 << 40
#: the schemes of the data service's URLs
_SERVICE = ("http://", "https://")


async def open_source(url: str = DEFAULT_STORE_URL, *, token: str | None = None, token_file: str | None = None,
                      ca_file: str | None = None, http: HttpOptions | None = None, create: bool = True,
                      serving: bool = False) -> SampleSource:
    """The source at ``url``: a data service (``http(s)://``, reached with ``token`` or
    ``token_file``, the CA bundle ``ca_file`` and ``http`` options) or a store (``sqlite:``,
    ``cassandra://``, opened as :func:`open_store` does with ``create`` and ``serving``)."""
    return await source_factory(url, token=token, token_file=token_file, ca_file=ca_file, http=http,
                                create=create, serving=serving)()


def source_factory(url: str, *, token: str | None = None, token_file: str | None = None,
                   ca_file: str | None = None, http: HttpOptions | None = None, create: bool = True,
                   serving: bool = False, checksums: bool = True) -> Callable[[], Awaitable[SampleSource]]:
    """:func:`open_source` with its arguments checked now and the opening left for later:
    a coroutine function of no arguments (the Loader runs it on its engine's loop).

    ``token``, ``token_file``, ``ca_file`` and ``http`` are for a data service URL only;
    ``ca_file`` for an ``https://`` one; ``token`` and ``token_file`` exclude each other.
    ``checksums=False`` (a Loader's ``ErrorPolicy(verify=False)``): a data service is asked
    for no checksums (``HttpOptions.checksums``); a store's come with its rows either way.
    """
    service = dict(token=token, token_file=token_file, ca_file=ca_file, http=http)
    given = ", ".join(f"{k}=" for k, v in service.items() if v is not None)
    if not (isinstance(url, str) and url.startswith(_SERVICE)):
        if given:
            raise ConfigError(f"{given} {'is' if given.count('=') == 1 else 'are'} for a data service URL "
                              "(http(s)://...); give an HttpSource factory its own")
        return functools.partial(open_store, url, create=create, serving=serving)
    if ca_file is not None and not url.startswith("https://"):
        raise ConfigError(f"ca_file= verifies an https:// service; {redact_url(url)} is plain HTTP")
    if token is not None and token_file is not None:
        raise ConfigError("pass token= or token_file=, not both")
    from .http._options import HttpOptions
    from .http._source import HttpSource

    options = http if http is not None else HttpOptions()
    if ca_file is not None:
        options = replace(options, ca_file=ca_file)
    if not checksums:
        options = replace(options, checksums=False)
    return functools.partial(HttpSource.open, url, token=token, token_file=token_file, options=options)


async def open_store(url: str = DEFAULT_STORE_URL, *, create: bool = True, serving: bool = False) -> Store:
    """Connect to the store at ``url`` (see :mod:`dataferry.schema._url`).

    ``create`` makes the SQLite file and its tables when missing. Cassandra's
    schema is applied separately (``dataferry schema apply``), since it needs
    replication choices; a missing keyspace raises StoreUnavailable naming it.

    ``serving``: opened by a long-lived data server (``dataferry serve``). A
    SQLite file is then read through mmap unless the URL names ``mmap_size``:
    a blob's pages are read where they lie in the OS page cache, not copied
    into SQLite's own cache by read() first (``bench/results/cpu_per_sample.md``).
    The mapped pages count in the server's RSS; they are the page cache's,
    shared and reclaimable. Otherwise (a loader opening the file directly)
    nothing is mapped unless the URL says so.
    """
    opts = parse_store_url(url)
    if isinstance(opts, SqliteOptions):
        from ._sqlite import SqliteStore

        if serving and opts.mmap_size is None:
            opts = replace(opts, mmap_size=SERVED_MMAP_SIZE)
        return await SqliteStore.open(opts, url=url, create=create)
    assert isinstance(opts, CassandraOptions)
    from .cassandra._store import CassandraStore

    return await CassandraStore.open(opts, url=url)
