"""dataferry.schema.sources: every :class:`~dataferry.schema.SampleSource`, behind one URL dispatcher.

``open_source(url)`` (``_open.py``) opens any of them: ``sqlite:`` (``_sqlite.py``),
``cassandra://`` (``cassandra/``), ``http(s)://`` the data service (``http/``);
:class:`MemorySource` (``_memory.py``) is built from samples in hand. ``open_store``
is the same dispatcher for the stores alone (what the server serves). Part of
floor 0, it imports no other dataferry package; the client takes its sources
from this public face. Names load lazily (PEP 562), so ``dataferry --help``
and a client that never opens Cassandra stay fast.
"""

from __future__ import annotations

import importlib

#: module -> the names it defines
_WHERE = {
    "_open": "open_source open_store source_factory",
    "_memory": "MemorySource",
    "http._source": "HttpSource",
    "http._options": "HttpOptions",
}
_LAZY = {name: mod for mod, names in _WHERE.items() for name in names.split()}
__all__ = list(_LAZY)


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'dataferry.schema.sources' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
