"""What is worth another try (:func:`retryable`); :func:`retrying`, a catalog read (the
split's ids, a derived split) retried with ``Retry``'s backoff until its deadline; and the
engine's circuit :class:`Breaker`."""

from __future__ import annotations

import asyncio
import logging
import random

from dataferry.schema import PermanentStoreError, StoreError, redact_url

from ._options import Retry

__all__ = ["RETRYABLE", "retryable", "retrying", "describe_source", "Breaker"]

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


class Breaker:
    """The circuit breaker: after ``Retry.breaker_after`` failed requests in a row with no
    answer in between it is open, and the engine sends one request at a time (a probe), not
    before ``probe_at`` (spaced by the backoff), until the store answers. Both transitions are
    logged. Lives on the engine's loop."""

    def __init__(self, retry: Retry, store: str, rand: random.Random) -> None:
        self.retry, self._store, self._rand = retry, store, rand
        self.fails = 0  # failed requests in a row
        self.down_since: float | None = None  # when the first of them failed
        self.probe_at = 0.0  # open: the next probe not before this (loop time)
        self._probes = 0

    @property
    def open(self) -> bool:
        return self.fails >= self.retry.breaker_after

    def failed(self, now: float) -> None:
        """A request failed: count towards opening the breaker (or keep it open)."""
        self.fails += 1
        if self.down_since is None:
            self.down_since = now
        n = self.fails - self.retry.breaker_after
        if n >= 0:
            if n == 0:
                log.warning(
                    "%s: %d requests in a row failed; probing it one request at a time, "
                    "retrying each sample for up to %.0f s", self._store, self.fails, self.retry.deadline,
                )
            self._probes += 1
            self.probe_at = now + self.retry.delay(self._probes + 1, self._rand.random())

    def answered(self, now: float) -> None:
        """The store answered a request sent since ``down_since``: the breaker closes."""
        if self.open:
            log.warning("%s answers again after %.1f s", self._store, now - (self.down_since or 0.0))
        self.fails = 0
        self.down_since = None
        self._probes = 0
