"""Argument helpers every ``dataferry`` subcommand shares, wherever it lives.

Public to the subcommands through ``dataferry.schema`` (``store_arg``,
``positive``, ``run``, ``with_store``), so a subcommand of the server, the
client or the bench imports them downwards, never from the CLI dispatcher.
Cheap to import: ``dataferry --help`` loads this module.
"""

from __future__ import annotations

import argparse

from ._url import DEFAULT_STORE_URL

__all__ = ["store_arg", "positive", "run", "with_store"]


def store_arg(p: argparse.ArgumentParser, default: str = DEFAULT_STORE_URL) -> None:
    """Add ``--store URL`` (default ``default``)."""
    p.add_argument("--store", default=default, metavar="URL", help=f"store URL (default: {default})")


def positive(text: str) -> int:
    """An argparse ``type``: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run(coro) -> object:
    """Run ``coro`` to completion on a fresh event loop (asyncio imported only now)."""
    import asyncio

    return asyncio.run(coro)


async def with_store(url: str, fn, *, create: bool = True):
    """``await fn(store)`` with the store at ``url`` open, closing it after."""
    from .sources import open_store

    store = await open_store(url, create=create)
    try:
        return await fn(store)
    finally:
        await store.close()
