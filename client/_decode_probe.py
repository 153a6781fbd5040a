"""How fast this machine decodes, for ``dataferry advise``: :func:`decode_probe`.

The advisor (``dataferry.schema``'s ingest package) measures storage strategies
on the lowest floor, which cannot import the client; the CLI hands it
:func:`decode_probe`, which answers with this machine's decoders as training
would run them: the usable cores that decode with Pillow, and DALI's decoder
(``mixed`` on the GPU, or its CPU decoder) timed by :func:`dali_decode_rate`
with the DALI iterator's own thread and hardware-decoder defaults.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dataferry.schema import ConfigError

from ._hardware import usable_cores

__all__ = ["DecodeProbe", "decode_probe", "dali_decode_rate"]


@dataclass(frozen=True, slots=True)
class DecodeProbe:
    """This machine's decoders: ``cores`` decode with Pillow; ``dali`` names what the DALI
    column measures (None: no column) and :meth:`dali_rate` times it over encoded images."""

    cores: int
    dali: str | None = None
    device: str | None = None  # DALI's "gpu" (mixed) or "cpu"; None with no DALI column

    def dali_rate(self, blobs: Sequence[bytes]) -> float:
        """Images/s of DALI's decoder over ``blobs`` (see :func:`dali_decode_rate`)."""
        if self.device is None:
            raise ConfigError("no DALI decoder to measure: decode_probe(dali='off') or no GPU")
        return dali_decode_rate(blobs, device=self.device)


def decode_probe(dali: str | None = None) -> DecodeProbe:
    """This machine's decoders for the advisor's DALI column choice (``AdviseOptions.dali``):
    None measures DALI's ``mixed`` path when a GPU is present, ``"gpu"`` insists on it
    (:class:`ConfigError` without one), ``"cpu"`` measures DALI's CPU decoder, ``"off"`` none."""
    if dali not in (None, "gpu", "cpu", "off"):
        raise ConfigError(f"dali must be None, 'gpu', 'cpu' or 'off', not {dali!r}")
    column = _dali_device(dali)
    return DecodeProbe(usable_cores(), column[1], column[0]) if column else DecodeProbe(usable_cores())


def _dali_device(choice: str | None) -> tuple[str, str] | None:
    """``(device, description)`` for the DALI column, or None for no column (see :class:`AdviseOptions`)."""
    if choice == "off":
        return None
    if choice == "cpu":
        return "cpu", "DALI's CPU decoder"
    name = _gpu_name()
    if name is None and choice == "gpu":
        raise ConfigError("no GPU for DALI's mixed decoder (DALI sees no CUDA device, or torch has no CUDA)")
    return ("gpu", f"{name}, DALI mixed") if name is not None else None


def _gpu_name() -> str | None:
    """The GPU DALI's mixed path would use, or None (no GPU, no driver, no CUDA torch, no DALI)."""
    from ._dali import dali_gpu_count

    if dali_gpu_count() == 0:
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(torch.cuda.current_device())


def dali_decode_rate(blobs: Sequence[bytes], *, device: str = "gpu", batch: int = 32, rounds: int = 3) -> float:
    """Images/s of DALI's image decoder over ``blobs``: ``mixed`` (nvJPEG, nvJPEG2000)
    on the current GPU for ``device="gpu"``, the CPU decoder for ``"cpu"``. Wall
    time of ``rounds`` passes over the blobs in batches of ``batch``, after one
    warm-up pass; threads and hardware-decoder share as the DALI iterator's defaults."""
    from ._dali import import_dali
    from ._hardware import decoder_defaults

    if not blobs:
        raise ConfigError("nothing to decode: no blobs")
    dali = import_dali()
    fn, types = dali.fn, dali.types
    arrays = [np.frombuffer(b, np.uint8) for b in blobs]
    n, batch = len(arrays), min(batch, len(arrays))
    per_pass = -(-n // batch)
    state = {"next": 0}

    def source():
        i = state["next"]
        state["next"] = i + batch
        return [arrays[(i + k) % n] for k in range(batch)]

    gpu = device == "gpu"
    capability, name, device_id, torch = None, "", None, None
    if gpu:
        import torch

        device_id = torch.cuda.current_device()
        capability, name = torch.cuda.get_device_capability(device_id), torch.cuda.get_device_name(device_id)
    auto = decoder_defaults("gpu" if gpu else "cpu", capability, name, usable_cores())
    dec = {"device": "mixed" if gpu else "cpu", "output_type": types.RGB}
    if gpu:
        dec["hw_decoder_load"] = auto.hw_decoder_load

    @dali.pipeline_def(batch_size=batch, num_threads=auto.threads, device_id=device_id, prefetch_queue_depth=2,
                       exec_dynamic=True)
    def pipe():
        return fn.decoders.image(fn.external_source(source=source, batch=True, dtype=types.UINT8, ndim=1), **dec)

    p = pipe()
    p.build()
    for _ in range(per_pass):  # warm-up: allocations, decoder start
        p.run()
    if torch is not None:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(per_pass * rounds):
        p.run()
    if torch is not None:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    del p
    return per_pass * rounds * batch / wall
