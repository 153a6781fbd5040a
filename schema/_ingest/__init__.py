"""Ingest, and the advisor that measures how to store a dataset before it is ingested.

``_ingest.py``: ``ingest()``, a folder or manifest in, committed samples out.
The advisor (``dataferry advise``) in three steps: ``_advice.py`` holds its
values (strategies, options, measurements, the decode seam ``Probe``);
``_measure.py`` applies each strategy to a sample with ingest's own code and
measures it, decoding through ``Probe``, which the CLI fills with the client's
decoders; ``_recommend.py`` predicts the epoch over a link, recommends and
shows it. ``dataferry.schema`` re-exports the names other packages use, lazily.
"""

from __future__ import annotations

from ._advice import AdviseOptions, Link, Rules
from ._ingest import IngestOptions, IngestReport, ingest
from ._measure import advise_dataset, advise_source
from ._recommend import ingest_command, plot, recommend, render

__all__ = [
    "IngestOptions", "IngestReport", "ingest",
    "AdviseOptions", "Link", "Rules", "advise_source", "advise_dataset", "recommend", "render", "ingest_command", "plot",
]
