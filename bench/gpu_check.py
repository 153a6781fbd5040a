"""Check the GPU path: DALI's mixed (nvJPEG) decode fed by the loader.

    python -m dataferry.bench.gpu_check [--images 256] [--batch 128] [--runs 3] [--device-id 0]
    python -m dataferry.bench.gpu_check --allow-cpu     # no GPU: the same checks on DALI's CPU path

On a machine with a CUDA GPU it

1. checks that the mixed decoder agrees with Pillow on a few JPEGs (mean
   absolute difference on uint8; nvJPEG's IDCT and chroma upsampling differ
   from libjpeg-turbo's by a level or two);
2. measures **decode** throughput: DALI ``decoders.image(device="mixed")`` alone;
3. measures **end to end**: ``Loader`` (in-memory source, or ``--url`` for a
   data service and ``--dataset``) → ``DaliIterator`` (mixed decode of the
   crop window, resize, flip, normalize on the GPU, ``TrainTransform(224)``)
   → float32 NCHW torch tensors on ``cuda:N``.

Without a GPU it says so and exits with status 2, unless ``--allow-cpu``,
which runs the same checks on DALI's CPU path and labels every row "cpu".
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

from ._common import table

__all__ = ["main", "gpu_report"]

NO_GPU = 2


def gpu_report() -> tuple[bool, str]:
    """Whether DALI and torch can both use a GPU here, and what was found."""
    from dataferry.client._dali import dali_gpu_count

    try:
        import torch

        cuda = torch.cuda.is_available()
        name = torch.cuda.get_device_name(0) if cuda else None
    except ImportError:
        cuda, name = False, None
    n = dali_gpu_count()
    smi = shutil.which("nvidia-smi")
    lines = [f"DALI sees {n} CUDA device(s); torch.cuda.is_available() = {cuda}"
             + (f" ({name})" if name else "") + f"; nvidia-smi {'at ' + smi if smi else 'not found'}"]
    return n > 0 and cuda, "\n".join(lines)


def _median(fn, runs: int) -> float:
    fn()  # warm-up: builds, allocates, JIT
    secs = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t0)
    return statistics.median(secs)


def _agreement(blobs: list[bytes], device: str, device_id: int | None) -> float:
    """Mean |DALI - Pillow| over a few decoded JPEGs (uint8 levels)."""
    import numpy as np

    from dataferry.client import DaliOptions
    from dataferry.client._dali import build_pipeline
    from dataferry.client._transforms import decode_rgb

    few = [np.frombuffer(b, np.uint8) for b in blobs[:8]]
    done = []

    def source():
        if done:
            raise StopIteration
        done.append(1)
        return (few,)

    pipe = build_pipeline(source, None, targets="none", batch_size=len(few), device=device, device_id=device_id,
                          options=DaliOptions(device=device, device_id=device_id))
    pipe.build()
    (out,) = pipe.run()
    if device == "gpu":
        out = out.as_cpu()
    diffs = [np.abs(np.array(out[i], np.int16) - np.asarray(decode_rgb(b), np.int16)).mean()
             for i, b in enumerate(blobs[:8])]
    return float(np.mean(diffs))


def _decode_rate(blobs, device: str, device_id, batch: int, passes: int, runs: int) -> float:
    import numpy as np

    from dataferry.client import DaliOptions
    from dataferry.client._dali import build_pipeline

    arrays = [np.frombuffer(b, np.uint8) for b in blobs] * passes
    batches = [arrays[i : i + batch] for i in range(0, len(arrays), batch)]
    state = {"i": 0}

    def source():
        if state["i"] == len(batches):
            raise StopIteration
        state["i"] += 1
        return (batches[state["i"] - 1],)

    pipe = build_pipeline(source, None, targets="none", batch_size=batch, device=device, device_id=device_id,
                          options=DaliOptions(device=device, device_id=device_id))
    pipe.build()

    def run():
        state["i"] = 0
        try:
            while True:
                pipe.run()
        except StopIteration:
            pipe.reset()

    return len(arrays) / _median(run, runs)


def _end_to_end_rate(blobs, device: str, device_id, batch: int, passes: int, runs: int,
                     url: str | None, dataset: str | None) -> tuple[float, str]:
    import torch

    from dataferry.client import Loader, MemorySource
    from dataferry.client import DaliIterator, DaliOptions
    from dataferry.client import TrainTransform
    from dataferry.schema import Sample

    if url is None:
        source = MemorySource("check", [Sample(i, i % 10, blobs[i % len(blobs)]) for i in range(len(blobs) * passes)])
        loader, dataset = Loader(source, "check", batch_size=batch), "check"
    else:
        loader = Loader(url, dataset, batch_size=batch)
    with loader, DaliIterator(loader, TrainTransform(224),
                              options=DaliOptions(device=device, device_id=device_id)) as it:
        seen = {}

        def run():
            n = 0
            for b in it:
                n += len(b)
                seen["shape"], seen["device"], seen["dtype"] = tuple(b.images.shape), b.images.device, b.images.dtype
            if device == "gpu":
                torch.cuda.synchronize(device_id)
            seen["n"] = n

        secs = _median(run, runs)
    what = f"{seen['n']} images/epoch, last batch {seen['shape']} {seen['dtype']} on {seen['device']}"
    return seen["n"] / secs, what


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataferry.bench.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=256, help="distinct synthetic JPEGs (default 256)")
    ap.add_argument("--passes", type=int, default=4, help="times each image is decoded per run (default 4)")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3, help="timed runs; medians are shown (default 3)")
    ap.add_argument("--device-id", type=int, default=0)
    ap.add_argument("--url", help="end to end from this data service instead of memory (needs --dataset)")
    ap.add_argument("--dataset")
    ap.add_argument("--allow-cpu", action="store_true", help="without a GPU, run the checks on DALI's CPU path")
    args = ap.parse_args(argv)
    if args.url and not args.dataset:
        ap.error("--url needs --dataset")
    try:
        from dataferry.client._dali import import_dali

        import_dali()
    except ImportError as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return NO_GPU
    ok, found = gpu_report()
    print(found)
    if ok:
        device, device_id, label = "gpu", args.device_id, f"gpu {args.device_id} (mixed)"
    elif args.allow_cpu:
        device, device_id, label = "cpu", None, f"cpu (NO GPU; --allow-cpu), {os.cpu_count()} CPUs"
        print("no usable GPU: running the CPU path instead, as asked (--allow-cpu); these are not GPU numbers")
    else:
        print("no usable GPU: the GPU path cannot run here (use --allow-cpu for the CPU path)", file=sys.stderr)
        return NO_GPU
    from .decode import _jpegs

    blobs = _jpegs(args.images)
    n, nbytes = len(blobs) * args.passes, sum(map(len, blobs)) * args.passes
    mad = _agreement(blobs, device, device_id)
    print(f"decoder vs Pillow on 8 JPEGs: mean |diff| {mad:.2f} (uint8 levels)"
          + ("" if mad < 4 else "  <-- more than expected"))
    rate = _decode_rate(blobs, device, device_id, args.batch, args.passes, args.runs)
    e2e, what = _end_to_end_rate(blobs, device, device_id, args.batch, args.passes, args.runs, args.url, args.dataset)
    rows = [
        [f"decode ({label})", f"{rate:,.0f}", f"{rate * nbytes / n / 1e6:,.1f}"],
        [f"loader -> decode -> crop/flip/normalize 224 ({label})", f"{e2e:,.0f}", f"{e2e * nbytes / n / 1e6:,.1f}"],
    ]
    print(f"{len(blobs)} synthetic JPEGs (mean {nbytes / n / 1e3:.0f} KB), batch {args.batch}, "
          f"median of {args.runs} runs")
    print(table(["path", "images/s", "MB/s"], rows))
    print(f"end to end: {what}")
    return 0 if mad < 4 else 1


if __name__ == "__main__":
    sys.exit(main())
