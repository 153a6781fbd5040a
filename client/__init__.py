"""dataferry.client: the async prefetch engine and its sync facade.

See ``README.md`` in this folder for a map of the files and the data flow.
"""

from dataferry.schema import CorruptSample, RequestRejected, TokenRefused, UndecodableSample
from dataferry.schema.sources import HttpOptions, HttpSource, MemorySource

from ._dali import DaliIterator, DaliOptions
from ._decode_probe import decode_probe
from ._types import Batch, SampleFailed
from ._imagebatch import ImageBatch
from ._attribution import Interval
from ._loader import Loader, LoaderEpoch
from ._subprocess import ProcessLoader
from ._metrics import ClientMetrics, serve_metrics
from ._options import ErrorPolicy, Hedge, PlanOptions, Prefetch, Retry
from ._stats import Stats
from ._torch import TorchIterator
from ._transforms import EvalTransform, TargetKind, TrainTransform

__all__ = [
    "Loader",
    "LoaderEpoch",
    "ProcessLoader",
    "Batch",
    "Stats",
    "Interval",
    "ClientMetrics",
    "serve_metrics",
    "PlanOptions",
    "Prefetch",
    "Retry",
    "Hedge",
    "ErrorPolicy",
    "SampleFailed",
    "CorruptSample",
    "UndecodableSample",
    "MemorySource",
    "HttpSource",
    "HttpOptions",
    "TokenRefused",
    "RequestRejected",
    "DaliIterator",
    "DaliOptions",
    "TorchIterator",
    "ImageBatch",
    "TrainTransform",
    "EvalTransform",
    "TargetKind",
    "decode_probe",
]
