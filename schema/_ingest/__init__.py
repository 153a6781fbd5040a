"""Ingest, and the advisor that measures how to store a dataset before it is ingested.

``_ingest.py`` holds ``ingest()``: a folder or manifest in, committed samples
out. ``dataferry.schema`` re-exports the public names from here, lazily.
"""

from __future__ import annotations

from ._ingest import IngestOptions, IngestReport, ingest

__all__ = ["IngestOptions", "IngestReport", "ingest"]
