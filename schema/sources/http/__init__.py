"""The data service's client: ``HttpSource`` (``_source.py``), its options
(``_options.py``), the HTTP/1.1 connections (``_connection.py``) and their pool
(``_pool.py``), the receive arenas (``_buffers.py``), and what the service's heads say of
its time and CPU (``_timing.py``).

Open it with :func:`dataferry.schema.sources.open_source` (``http(s)://`` URLs) or
:meth:`HttpSource.open`; see ``schema/README.md`` for the map.
"""
