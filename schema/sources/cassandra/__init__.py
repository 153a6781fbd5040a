"""The Cassandra/ScyllaDB store: ``CassandraStore`` (``_store.py``), its hot read path
(``_hot.py``), cluster set-up and driver-error translation (``_connect.py``), the
driver patches (``_driver_patches.py``) and the metadata scans (``_scan.py``).

Open it with :func:`dataferry.schema.open_store` (``cassandra://`` URLs); see
``schema/README.md`` for the map. Nothing is imported here, so the driver loads
only when a ``cassandra://`` URL is opened.
"""
