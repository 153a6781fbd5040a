"""The event loop both sides run on: uvloop when installed, and one loop in one
background thread for sync callers (the client's Loader, the bench's proxy)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "LoopThread"]

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop event loop when uvloop is installed, else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class LoopThread:
    """One event loop running in one daemon thread named ``name``.

    :meth:`call` runs a coroutine there and waits for its result; :meth:`stop`
    ends the loop and joins the thread (safe to call twice, and from the loop
    thread itself, which it then does not join).
    """

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.run_until_complete(self.loop.shutdown_default_executor())  # its threads end with the loop
        for _ in range(3):  # transports closed last need a few turns of the loop to release their handles
            self.loop.run_until_complete(asyncio.sleep(0.005))
        try:
            self.loop.close()
        except OSError:  # uvloop: EBUSY, a handle still closing; the loop is closed, the process frees it
            pass

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, timeout: float | None = 10.0) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if threading.current_thread() is not self.thread:
            self.thread.join(timeout)
