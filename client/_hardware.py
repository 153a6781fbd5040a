"""What this process may use: cores, and the GPU's JPEG decoder.

The decode defaults of ``TorchIterator`` and ``DaliIterator`` follow the machine instead
of fixed numbers; explicit options always win. Cores: the CPUs this process may run on
(``sched_getaffinity``), shared evenly by the node's training processes
(``LOCAL_WORLD_SIZE``). The JPEG decoder: on a GPU with a hardware decoder (NVJPG) DALI
sends it the share ``hw_decoder_load``: 0.99 with 4 DALI threads on Hopper and later,
DALI's 0.65 elsewhere. Why, and the command that compares the two: client/README.md
("Decode defaults").
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
