"""dataferry.server: the data service, an aiohttp app near the store.

``make_app(store, ServerOptions(...))`` builds the application; ``dataferry
serve`` (``cli.py``) runs it under ``Runner``, which an embedder uses too
(``web.AppRunner`` answering malformed HTTP with the JSON error body). The API is described in ``openapi.yaml`` and
the wire format in ``schema/README.md``. See ``README.md`` in this
folder for a map of the files and how a request flows through them.

Attributes are imported lazily (PEP 562) so ``dataferry --help`` stays fast.
"""

from __future__ import annotations

from dataferry.schema import lazy_face

__all__, __getattr__, __dir__ = lazy_face(__name__, {"_app": "make_app", "_options": "ServerOptions",
                                                     "_protocol": "Runner"})
