"""What this process may use: cores, and the GPU's JPEG decoder.

The decode defaults of :class:`~dataferry.client.TorchIterator` and
:class:`~dataferry.client.DaliIterator` follow the machine instead of fixed
numbers; explicit options always win.

* **Cores**: the CPUs this process may run on (``sched_getaffinity``, so a
  container's or ``taskset``'s limit counts), shared evenly by the training
  processes of one node (``LOCAL_WORLD_SIZE``, which ``torchrun`` sets).
* **JPEG decoder**: A100/A30 (compute capability 8.0), H100/H200/GH200 (9.x)
  and B100/B200 (10.x) have hardware JPEG decoders (NVJPG) beside the CUDA
  cores; DALI sends the share ``hw_decoder_load`` of JPEGs to it and decodes
  the rest with CUDA plus its CPU threads (the Huffman stage runs on the CPU).
  On Hopper and later we send nearly all of them (0.99) and give DALI 4
  threads, from a run on an H100 with 110 KB JPEGs reported in the project's
  issues (not re-measured in this repository, which holds no GPU results
  yet): DALI's own default 0.65 left 35% of the images to the hybrid path at
  about 520 us of CPU each, while 0.99 cost about 110 us per image at the
  same or better throughput (22k images/s with 4 threads). On a GPU machine
  ``python -m dataferry.bench.gpu_check --e2e --hw-decoder-load 0.65`` and
  ``0.99`` compare them. On sm_80 (A100/A30) and on GPUs we have not
  measured, DALI's default 0.65 stays (its maintainers restored it after
  profiling on A100-class training: NVIDIA/DALI#6366). GPUs without a
  hardware decoder ignore the share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["usable_cores", "DecoderDefaults", "decoder_defaults"]

#: DALI's own default share for the hardware decoder (its documentation: tuned for the A100)
DALI_HW_LOAD = 0.65
#: the share when the hardware decoder is the fast path (Hopper, Blackwell)
FAST_HW_LOAD = 0.99


def usable_cores(environ: dict | None = None) -> int:
    """CPUs this process may use, divided among the node's training processes (at least 1)."""
    env = os.environ if environ is None else environ
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(env.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, cores // local)


@dataclass(frozen=True, slots=True)
class DecoderDefaults:
    """DALI's thread count and hardware-decoder share for one device, and why."""

    threads: int
    hw_decoder_load: float
    reason: str


def decoder_defaults(device: str, capability: tuple[int, int] | None, gpu_name: str, cores: int) -> DecoderDefaults:
    """The defaults for ``device`` (``"gpu"`` or ``"cpu"``) with this GPU (``capability``, ``gpu_name``) and ``cores``.

    CPU decode is the work itself: every core but one (the loader's engine
    thread needs one), at least one. GPU decode with the hardware decoder
    taking nearly everything: 4 threads (they only parse headers and feed the
    decoder). Otherwise up to 8 threads for the share the CPU decodes.
    """
    if device != "gpu":
        return DecoderDefaults(max(1, cores - 1), DALI_HW_LOAD, f"CPU decode on {cores} usable core(s)")
    major = capability[0] if capability else 0
    name = gpu_name or "GPU"
    if major in (9, 10):  # Hopper (H100, H200, GH200), datacenter Blackwell (B100, B200, B300)
        return DecoderDefaults(max(1, min(4, cores)), FAST_HW_LOAD,
                               f"{name} (sm_{major}x) has a fast hardware JPEG decoder")
    if capability == (8, 0):
        reason = f"{name} (sm_80): DALI's default hardware share"
    else:
        reason = f"{name}: no hardware JPEG decoder known, CUDA and CPU threads decode"
    return DecoderDefaults(max(1, min(8, cores)), DALI_HW_LOAD, reason)
