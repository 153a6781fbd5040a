"""dataferry.server: the data service, an aiohttp app near the store.

``make_app(store, ServerOptions(...))`` builds the application; ``dataferry
serve`` (``cli.py``) runs it under ``Runner``, which an embedder uses too
(``web.AppRunner`` answering malformed HTTP with the JSON error body). The API is described in ``openapi.yaml`` and
the wire format in ``schema/README.md``. See ``README.md`` in this
folder for a map of the files and how a request flows through them.

Attributes are imported lazily (PEP 562) so ``dataferry --help`` stays fast.
"""

from __future__ import annotations

import importlib

__all__ = ["make_app", "ServerOptions", "Runner"]

_LAZY = {"make_app": "_app", "ServerOptions": "_options", "Runner": "_protocol"}


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dataferry.server' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
