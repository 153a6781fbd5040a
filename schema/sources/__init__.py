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

from .._lazy import lazy_face

#: module -> the names it defines
_WHERE = {
    "_open": "open_source open_store source_factory",
    "_memory": "MemorySource",
    "http._source": "HttpSource",
    "http._options": "HttpOptions",
}
__all__, __getattr__, __dir__ = lazy_face(__name__, _WHERE)
