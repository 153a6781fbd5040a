"""Ingest, and the advisor that measures how to store a dataset before it is ingested.

``_ingest.py`` holds ``ingest()``: a folder or manifest in, committed samples
out. ``_advise.py`` is ``dataferry advise``: each storage strategy applied to a
sample with ingest's own code and measured, the epoch predicted over a link,
one recommended. It measures decoding through one seam, ``Probe``, which the
CLI fills with the client's decoders. ``dataferry.schema`` re-exports the
names other packages use from here, lazily.
"""

from __future__ import annotations

from ._advise import (
    AdviseOptions, Link, Rules, advise_dataset, advise_source, ingest_command, plot, recommend, render,
)
from ._ingest import IngestOptions, IngestReport, ingest

__all__ = [
    "IngestOptions", "IngestReport", "ingest",
    "AdviseOptions", "Link", "Rules", "advise_source", "advise_dataset", "recommend", "render", "ingest_command", "plot",
]
