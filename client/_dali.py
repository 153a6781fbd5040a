"""NVIDIA DALI fed by the Loader: JPEG decode on the GPU (``mixed``) or the CPU.

``DaliIterator(loader, transform, options=DaliOptions(...), targets=, graph=, map=)``: the
loader's batches go to a DALI pipeline through ``external_source`` (batch mode, ``no_copy``).
Headers, crop windows and flips are computed first (``_imagebatch.prepare``); DALI decodes
(nvJPEG ``mixed``, or libjpeg-turbo), crops, resizes and normalizes, runs ``graph`` (your
DALI operators, if any), and the outputs reach torch through DLPack as an ``ImageBatch``.
Nothing is padded or dropped here. A fed batch stays alive until its outputs are out (the
``no_copy`` contract), so memory holds ``Prefetch.max_bytes`` plus ``decode_depth + 1``
batches of encoded bytes. Epochs, resume and ``map`` are shared with the PyTorch path
(``_imagebatch.py``). The data flow, the zero-copy lifetime, ``graph`` and the device
choice: client/README.md ("The DALI path").
"""

from __future__ import annotations

import logging
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import InitVar, dataclass
from typing import Literal

import numpy as np

from dataferry.schema import ConfigError, DataferryError, InvalidImage, UndecodableSample

from ._types import Batch
from ._hardware import decoder_defaults, usable_cores
from ._imagebatch import ImageBatch, ImageIterator, Prepared, Undecodable, prepare, renamed_prefetch
from ._transforms import EvalTransform, TargetKind, Transform, decode_rgb

__all__ = ["DaliOptions", "DaliIterator", "dali_gpu_count", "import_dali", "build_pipeline"]

log = logging.getLogger("dataferry.client")

DALI_PIP = "pip install nvidia-dali-cuda130==2.4.0 (or the nvidia-dali wheel for your CUDA)"


def import_dali():
    try:
        import nvidia.dali as dali
        import nvidia.dali.fn  # noqa: F401
        import nvidia.dali.types  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"this needs NVIDIA DALI: {DALI_PIP}") from exc
    return dali


def dali_gpu_count() -> int:
    """CUDA devices DALI can use (0 without a driver, or without DALI)."""
    try:
        from nvidia.dali import backend
    except ImportError:
        return 0
    try:
        return int(backend.GetCUDADeviceCount())
    except Exception:  # noqa: BLE001 - no driver, broken driver: no GPU for us
        return 0


@dataclass(frozen=True, slots=True)
class DaliOptions:
    """Where and how the DALI pipeline runs.

    ``device``: ``"gpu"`` (nvJPEG via the ``mixed`` decoder, transforms on the
    GPU), ``"cpu"`` (libjpeg-turbo and CPU operators), or None for the GPU
    when there is one. ``device_id``: the GPU (default
    ``torch.cuda.current_device()``). ``decode_depth``: DALI's
    ``prefetch_queue_depth``, batches processed ahead of the consumer
    (``prefetch=``, its old name, still works with a DeprecationWarning).
    ``num_threads`` (DALI's CPU threads) and ``hw_decoder_load`` (the share of
    JPEGs for the GPU's hardware decoder): None follows the machine (see
    ``_hardware.py``: 4 threads and 0.99 on H100/H200/B200, up to 8 threads
    and DALI's 0.65 on other GPUs, every usable core but one on the CPU; the
    choice is logged once per pipeline); a number overrides.
    """

    device: Literal["cpu", "gpu"] | None = None
    device_id: int | None = None
    num_threads: int | None = None
    decode_depth: int = 2
    hw_decoder_load: float | None = None
    prefetch: InitVar[int | None] = None  # decode_depth's old name

    def __post_init__(self, prefetch: int | None) -> None:
        object.__setattr__(self, "decode_depth", renamed_prefetch(prefetch, self.decode_depth, "DaliOptions", 4))
        if self.device not in (None, "cpu", "gpu"):
            raise ConfigError(f"device must be None, 'cpu' or 'gpu', not {self.device!r}")
        if self.device_id is not None and self.device_id < 0:
            raise ConfigError(f"device_id must be >= 0, not {self.device_id}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, not {self.num_threads}")
        if self.hw_decoder_load is not None and not 0 <= self.hw_decoder_load <= 1:
            raise ConfigError(f"hw_decoder_load must be in [0, 1], not {self.hw_decoder_load}")

    def resolve(self, torch) -> tuple[str, int | None]:
        """``(device, device_id)`` this process will use."""
        cuda = torch is not None and torch.cuda.is_available()
        gpus = dali_gpu_count() if self.device != "cpu" else 0
        device = self.device
        if device is None:
            device = "gpu" if gpus > 0 and cuda else "cpu"
        if device == "cpu":
            return "cpu", None
        if gpus == 0:
            raise ConfigError("device='gpu' but DALI sees no CUDA device (no GPU, or no driver)")
        if not cuda:
            raise ConfigError("device='gpu' but torch has no CUDA: install a CUDA build of torch")
        device_id = torch.cuda.current_device() if self.device_id is None else self.device_id
        if device_id >= gpus:
            raise ConfigError(f"device_id {device_id} out of range: {gpus} GPU(s) visible")
        return "gpu", device_id

    def decoding(self, device: str, device_id: int | None, torch) -> tuple[int, float]:
        """``(num_threads, hw_decoder_load)`` for this device: the options where set, else the machine's defaults."""
        capability, name = None, ""
        if device == "gpu" and torch is not None:
            props = torch.cuda.get_device_properties(device_id)
            capability, name = (props.major, props.minor), props.name
        auto = decoder_defaults(device, capability, name, usable_cores())
        threads = self.num_threads or auto.threads
        load = auto.hw_decoder_load if self.hw_decoder_load is None else self.hw_decoder_load
        if self.num_threads is None or (device == "gpu" and self.hw_decoder_load is None):
            log.info("DALI on %s: %d thread(s)%s (%s; set DaliOptions to override)", device, threads,
                     f", hw_decoder_load {load:g}" if device == "gpu" else "", auto.reason)
        return threads, load


def build_pipeline(source, transform: Transform, *, targets: TargetKind, batch_size: int, device: str,
                   device_id: int | None, options: DaliOptions, graph: Callable | None = None):
    """The DALI pipeline (not built). ``source()`` returns one batch as
    :func:`feed_arrays` makes it and raises StopIteration at the end of an
    epoch. Outputs: images[, masks], through ``graph`` if given."""
    dali = import_dali()
    fn, types = dali.fn, dali.types
    crop, mask = transform is not None, targets == "mask"
    dtypes = [types.UINT8] + ([types.FLOAT, types.FLOAT, types.INT32] if crop else []) + ([types.UINT8] if mask else [])
    ndims = [1] + ([1, 1, 0] if crop else []) + ([1] if mask else [])
    torch = None
    if device == "gpu":
        import torch
    threads, hw_load = options.decoding(device, device_id, torch)

    @dali.pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id,
                       prefetch_queue_depth=options.decode_depth, exec_dynamic=True)
    def pipe():
        inputs = fn.external_source(source=source, num_outputs=len(dtypes), batch=True, no_copy=True,
                                    dtype=dtypes, ndim=ndims)
        jpegs = inputs[0]
        dec = {"device": "mixed" if device == "gpu" else "cpu", "output_type": types.RGB, "adjust_orientation": False}
        if device == "gpu":
            dec["hw_decoder_load"] = hw_load
        mdec = {"device": "cpu", "output_type": types.GRAY, "adjust_orientation": False}
        if not crop:
            images = fn.decoders.image(jpegs, **dec)
            masks = fn.decoders.image(inputs[1], **mdec) if mask else None
        else:
            anchors, shapes, flips = inputs[1:4]
            s = transform.size
            slice_args = {"normalized_anchor": False, "normalized_shape": False, "axis_names": "WH"}
            images = fn.decoders.image_slice(jpegs, anchors, shapes, **dec, **slice_args)
            images = fn.resize(images, size=(s, s), interp_type=types.INTERP_LINEAR, antialias=True)
            images = fn.crop_mirror_normalize(
                images, mirror=flips, dtype=types.FLOAT, output_layout="CHW",
                mean=[255 * m for m in transform.mean], std=[255 * v for v in transform.std])
            masks = None
            if mask:
                masks = fn.decoders.image_slice(inputs[4], anchors, shapes, **mdec, **slice_args)
                masks = fn.resize(masks, size=(s, s), interp_type=types.INTERP_NN, antialias=False)
                masks = fn.flip(masks, horizontal=flips)
        outs = (images,) if masks is None else (images, masks.gpu() if device == "gpu" else masks)
        return outs if graph is None else _call_graph(graph, outs, dali.data_node.DataNode)

    return pipe()


def _call_graph(graph: Callable, outs: tuple, node_type: type) -> tuple:
    """``graph(*outs)``, checked to return as many DALI data nodes."""
    what = "(images, masks)" if len(outs) == 2 else "images"
    try:
        got = graph(*outs)
    except Exception as exc:
        exc.add_note(f"in graph={graph!r}, called with {what}")
        raise
    got = tuple(got) if isinstance(got, (tuple, list)) else (got,)
    if len(got) != len(outs) or not all(isinstance(g, node_type) for g in got):
        raise ConfigError(f"graph={graph!r} must return {what} as DALI data nodes, got {got!r}")
    return got


def feed_arrays(prep: Prepared, targets: TargetKind) -> tuple:
    """The external source's arrays for one prepared batch: the encoded
    images, then (with a transform) crop anchors, crop shapes and flips, then
    (with masks) the mask PNGs."""
    b = prep.batch
    arrays: tuple = (b.data,)
    if prep.windows is not None:
        arrays += (np.ascontiguousarray(prep.windows[:, :2], np.float32),
                   np.ascontiguousarray(prep.windows[:, 2:], np.float32),
                   prep.flips.astype(np.int32))
    if targets == "mask":
        arrays += ([np.frombuffer(t, np.uint8) for t in b.targets],)
    return arrays


def _first_line(exc: BaseException) -> str:
    """DALI's message on one line, shortened (its own lines are a stack of contexts)."""
    return " ".join(str(exc).split())[:300] or type(exc).__name__


def _undecodable_in(inflight, dataset: str) -> tuple[int, str] | None:
    """The first sample of the batches fed to DALI that Pillow cannot decode either, and why; None
    if each decodes (then DALI failed for another reason). Runs only after DALI failed: a sample's
    fault inside a DALI batch fails the whole batch, and DALI does not say which sample it was."""
    for prep, _ in inflight:
        for sid, data in zip(prep.batch.ids.tolist(), prep.batch.data):
            try:
                decode_rgb(data, f"dataset {dataset!r} sample {sid}")
            except InvalidImage as exc:
                return sid, exc.reason
    return None


class _Feeder:
    """The external source: the loader's next batch, remembered until its outputs come back.

    Separate from the iterator so the pipeline (which holds this callable)
    does not keep the iterator alive.
    """

    def __init__(self, loader, transform: Transform, targets: TargetKind, seed: int) -> None:
        self.loader, self.transform, self.targets, self.seed = loader, transform, targets, seed
        self.inflight: deque[tuple[Prepared, tuple]] = deque()
        self.epoch = None  # the LoaderEpoch fed from; set by the iterator
        self.undecodable = Undecodable(loader)  # ErrorPolicy for samples whose header does not parse

    def __call__(self):
        if self.epoch is None:
            self.epoch = iter(self.loader)
        while True:  # every header is read here, on the CPU, before DALI sees the bytes
            batch = self.epoch.get()  # StopIteration at the end of the epoch: DALI ends its epoch
            prep = prepare(batch, self.transform, self.targets, self.loader.dataset, self.seed, self.undecodable)
            if len(prep.batch):
                break  # (a batch whose every sample was left out is not fed)
        arrays = feed_arrays(prep, self.targets)
        self.inflight.append((prep, arrays))  # keeps the no_copy buffers alive
        return arrays


class DaliIterator(ImageIterator):
    """Batches of ``loader`` decoded and transformed by DALI, as :class:`ImageBatch`.

    ``transform``: :class:`TrainTransform`, :class:`EvalTransform` or None
    (decode only: a list of uint8 HWC tensors). ``targets``: ``"none"``,
    ``"mask"`` or ``"multilabel"``. ``options``: :class:`DaliOptions`.
    ``seed`` (default: the loader's plan seed) keys the crops and flips, which
    are the same as :class:`TorchIterator`'s for the same seed. ``graph``:
    your own DALI operators after the stock ones (see the module docstring).
    ``map``: a Python function from :class:`ImageBatch` to
    :class:`ImageBatch`, applied after DALI, as on the PyTorch path.

    ``for batch in it`` runs one epoch of the loader; the last batch is as
    short as the loader's. ``pipeline`` is the built DALI pipeline. The
    iterator does not own the loader: close both.
    """

    def __init__(
        self,
        loader,
        transform: Transform = EvalTransform(),
        *,
        targets: TargetKind = "none",
        options: DaliOptions = DaliOptions(),
        seed: int | None = None,
        graph: Callable | None = None,
        map: Callable[[ImageBatch], ImageBatch] | None = None,
    ) -> None:
        import_dali()
        super().__init__(loader, transform, targets, seed, map)
        if graph is not None and not callable(graph):
            raise ConfigError(f"graph must be a function of the DALI outputs, not {graph!r}")
        self.options = options
        self.device, self.device_id = options.resolve(self._torch)
        self._feeder = _Feeder(loader, transform, targets, self.seed)
        pipe = build_pipeline(self._feeder, transform, targets=targets, batch_size=loader.batch_size,
                              device=self.device, device_id=self.device_id, options=options, graph=graph)
        pipe.build()
        self._state = {"pipeline": pipe}
        self._finalizer = weakref.finalize(self, self._state.clear)

    @property
    def pipeline(self):
        """The built DALI pipeline (None once closed)."""
        return self._state.get("pipeline")

    @property
    def torch_device(self):
        return self._torch.device("cuda", self.device_id) if self.device == "gpu" else self._torch.device("cpu")

    def _begin(self, epoch) -> None:
        if self._feeder.inflight:
            raise DataferryError(
                f"epoch {self._feeder.epoch.epoch} still has {len(self._feeder.inflight)} batch(es) in DALI: "
                f"finish it before taking from epoch {epoch.epoch}"
            )
        self._feeder.epoch = epoch
        super()._begin(epoch)

    def _next_nowait(self) -> ImageBatch:
        raise NotImplementedError("DaliIterator has no get_nowait: DALI's run() blocks")

    def _decode_gauges(self) -> tuple[int, int, int]:
        threads = getattr(self._state.get("pipeline"), "num_threads", 0) or 0
        return threads, len(self._feeder.inflight), self.options.decode_depth

    def _next_decoded(self) -> ImageBatch:
        """The outputs of one ``pipeline.run()`` (the feeder takes from the loader inside it)."""
        pipe = self._state.get("pipeline")
        if pipe is None:
            raise DataferryError("iterator is closed")
        try:
            outs = pipe.run()
        except StopIteration:
            if self._feeder.inflight:
                raise DataferryError(f"DALI ended the epoch with {len(self._feeder.inflight)} batch(es) fed "
                                     "and not returned") from None
            pipe.reset()
            raise
        except RuntimeError as exc:  # DALI's own errors (a corrupt image, a device error)
            culprit = _undecodable_in(self._feeder.inflight, self.loader.dataset)
            if culprit is not None:  # named by decoding the batches in flight on the CPU, now
                sid, reason = culprit
                raise UndecodableSample(self.loader.dataset, sid, f"{reason} (DALI: {_first_line(exc)})") from exc
            ids = [int(i) for p, _ in self._feeder.inflight for i in p.batch.ids[:4]]
            raise DataferryError(f"DALI failed on a batch of dataset {self.loader.dataset!r} "
                                 f"(in flight, first ids {ids}): {exc}") from exc
        prep, _arrays = self._feeder.inflight.popleft()  # outputs are out: the no_copy buffers may go
        images, masks = (outs[0], outs[1]) if len(outs) > 1 else (outs[0], None)
        if len(images) != len(prep.batch):
            raise DataferryError(f"DALI returned {len(images)} samples for a batch of {len(prep.batch)}")
        if self.transform is None:
            images = self._samples(images)
            masks = None if masks is None else [m.squeeze(-1) for m in self._samples(masks)]
        else:
            images = self._tensor(images)
            masks = None if masks is None else self._tensor(masks).squeeze(-1)
        return self._deliver(prep, images, masks)

    def _tensor(self, tl):
        """A uniform DALI TensorList as one torch tensor, zero-copy (DLPack).

        Safe because the pipeline runs DALI's default (dynamic) executor,
        whose outputs are reference-counted and never overwritten; for GPU
        outputs DALI makes torch's current stream wait for them."""
        return self._torch.from_dlpack(tl.as_tensor())

    def _samples(self, tl) -> list:
        """A ragged DALI TensorList as a list of torch tensors (zero-copy)."""
        return [self._torch.from_dlpack(tl[i]) for i in range(len(tl))]

    # --- resume and lifetime ------------------------------------------------------------
    def _in_flight(self) -> list[Batch]:
        """The batches fed to DALI and not yet returned."""
        return [p.batch for p, _ in self._feeder.inflight]

    def close(self) -> None:
        """Drop the pipeline (not the loader). Idempotent."""
        self._feeder.inflight.clear()
        self._finalizer()
