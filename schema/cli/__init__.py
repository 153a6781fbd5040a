"""The ``dataferry`` command line: the top floor of the house.

It loads its subcommands downwards and by name, only the one being run:
the store's own (``ingest``, ``verify``, ``split``, ``ls``, ``schema``) in
``_main.py``, through ``dataferry.schema``'s public face; ``advise`` in
``_advise.py``, which hands the advisor the client's decoders; ``serve``
(``dataferry.server.cli``), ``demo``, ``bench`` and ``latency-proxy``
(``dataferry.bench``). Nothing below
imports this package; the argument helpers the subcommands share
(``store_arg``, ``positive``, ``run``, ``with_store``) are public in
``dataferry.schema``. ``python -m dataferry.schema.cli`` runs it too.
"""

from __future__ import annotations

from ._main import command, main

__all__ = ["main", "command"]
