"""What is worth another try (:func:`retryable`), and :func:`retrying`: a catalog read
(the split's ids, a derived split) retried with ``Retry``'s backoff until its deadline."""

from __future__ import annotations

import asyncio
import logging
import random

from dataferry.schema import PermanentStoreError, StoreError, redact_url

from ._options import Retry

__all__ = ["RETRYABLE", "retryable", "retrying", "describe_source"]

log = logging.getLogger("dataferry.client")

#: errors worth another try, but a PermanentStoreError (``retryable``); anything else is a bug and stops the epoch
RETRYABLE = (StoreError, OSError, TimeoutError, asyncio.TimeoutError, EOFError)


def retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is worth another try: a RETRYABLE error that is not a PermanentStoreError
    (a certificate, a refused token, a wrong scheme: raised at once, not retried for the deadline)."""
    return isinstance(exc, RETRYABLE) and not isinstance(exc, PermanentStoreError)


def describe_source(source: object) -> str:
    """A source's name for messages: its URL (password redacted), else its repr."""
    url = getattr(source, "url", None)
    return redact_url(url) if isinstance(url, str) and url else repr(source)


async def retrying(call, retry: Retry, what: str, store: str):
    """``await call()``, retried on store errors with ``retry``'s backoff until
    its deadline (catalog reads: a store restart passes unnoticed)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    rand = random.Random()
    attempt = 1
    while True:
        try:
            async with asyncio.timeout(retry.timeout):
                return await call()
        except RETRYABLE as exc:
            if not retryable(exc):
                raise
            if isinstance(exc, TimeoutError) and not str(exc):  # retry.timeout's own: say so
                exc = TimeoutError(f"no answer within {retry.timeout:g} s")
            failing = loop.time() - start
            if retry.gives_up(attempt, failing):
                raise StoreError(
                    f"{what} from {store} failed after {attempt} attempt(s) over {failing:.1f} s: {exc}"
                ) from exc
            if attempt == 1:
                log.warning("%s from %s failed (%s); retrying for up to %.0f s", what, store, exc, retry.deadline)
            attempt += 1
            await asyncio.sleep(retry.delay(attempt, rand.random()))
