"""Train a small CNN from a dataferry data service, through the client.

    python -m dataferry.bench.train --url http://host:8470 --dataset NAME [--steps 300]
        [--device cpu|cuda] [--loader dali|torch] [--size 64] [--batch-size 64]
    python -m dataferry.bench.train --synthetic 512      # self-contained

Method details: bench/README.md, "Methods".
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, replace

__all__ = ["TrainOptions", "TrainResult", "train", "main"]


@dataclass(frozen=True, slots=True)
class TrainOptions:
    url: str | None = None
    dataset: str = "synthetic"
    split: str = "all"
    steps: int = 300
    device: str | None = None  # "cpu" | "cuda"; None: cuda when available
    loader: str | None = None  # "dali" | "torch"; None: dali when installed
    size: int = 64
    batch_size: int = 64
    workers: int | None = None
    lr: float = 0.05
    seed: int = 0
    synthetic: int = 512
    interval: float = 1.0  # seconds per attribution interval
    plot: str | None = "train.png"  # the PNG of throughput, wait and limits; None: no plot


@dataclass(frozen=True, slots=True)
class TrainResult:
    steps: int
    images: int
    seconds: float
    wait: float
    loader_stall: float
    first_loss: float
    last_loss: float
    epochs: int
    device: str
    loader: str
    #: the loader's intervals (``Interval``: figures and limit), oldest first
    intervals: tuple = ()

    @property
    def images_per_s(self) -> float:
        return self.images / self.seconds if self.seconds > 0 else 0.0

    @property
    def stall(self) -> float:
        return self.wait / self.seconds if self.seconds > 0 else 0.0

    def limits(self) -> dict[str, float]:
        """Share of the intervals' time per limit, largest first."""
        return limit_shares(self.intervals)

    def __str__(self) -> str:
        shares = ", ".join(f"{k} {v:.0%}" for k, v in self.limits().items())
        return (f"{self.steps} steps ({self.epochs} epoch(s)) on {self.device} with the {self.loader} loader: "
                f"{self.images_per_s:,.0f} images/s, data stall {self.stall:.1%} "
                f"(loader network stall {self.loader_stall:.1%}), loss {self.first_loss:.3f} -> {self.last_loss:.3f}"
                + (f"; limited by {shares}" if shares else ""))


def limit_shares(intervals) -> dict[str, float]:
    """Share of the intervals' time per limit, largest first."""
    seconds: dict[str, float] = {}
    for iv in intervals:
        seconds[iv.limit] = seconds.get(iv.limit, 0.0) + iv.stats.elapsed
    total = sum(seconds.values())
    return {k: v / total for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])} if total > 0 else {}


#: one colour per limit in the plot
LIMIT_COLOURS = {"link": "tab:blue", "service": "tab:red", "decode": "tab:orange", "consumer": "tab:green",
                 "engine": "tab:purple"}


def plot_intervals(intervals, path: str, title: str = "") -> str:
    """A PNG at ``path``: samples/s (top) and the training loop's wait (bottom)
    per interval over time, each interval shaded by what limited it; ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 5.5), height_ratios=(3, 2))
    try:
        ends = [iv.end for iv in intervals]
        for ax in (top, bottom):
            for iv in intervals:
                ax.axvspan(iv.start, iv.end, color=LIMIT_COLOURS.get(iv.limit, "white"), alpha=0.18, lw=0)
        top.step(ends, [iv.stats.samples_per_s for iv in intervals], where="pre", color="black", lw=1.5)
        top.set_ylabel("samples/s")
        top.set_ylim(bottom=0)
        bottom.step(ends, [100 * iv.stats.loop_wait_fraction for iv in intervals], where="pre", color="black",
                    lw=1.5, label="training loop waited")
        bottom.step(ends, [100 * min(1.0, iv.stats.decode_wait / iv.stats.elapsed) if iv.stats.elapsed > 0 else 0
                           for iv in intervals], where="pre", color="tab:orange", lw=1, ls="--", label="of it on decode")
        bottom.set_ylabel("wait, % of interval")
        bottom.set_ylim(0, 105)
        bottom.set_xlabel("seconds since the first batch was asked for")
        shares = limit_shares(intervals)
        handles = [Patch(color=LIMIT_COLOURS[k], alpha=0.4, label=f"{k} {v:.0%}") for k, v in shares.items()]
        top.legend(handles=handles, title="limited by", loc="upper left", fontsize="small")
        bottom.legend(loc="upper left", fontsize="small")
        top.set_title(title or "throughput, wait and the bottleneck per interval")
        if not intervals:
            top.text(0.5, 0.5, "no interval finished", transform=top.transAxes, ha="center")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path


def small_cnn(torch, classes: int):
    nn = torch.nn

    def block(cin: int, cout: int):
        return [nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]

    return nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 64), *block(64, 128),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


def _classes(url: str, dataset: str) -> int:
    from dataferry.client import HttpSource

    async def get():
        async with await HttpSource.open(url) as source:
            return (await source.get_dataset(dataset)).num_classes

    return asyncio.run(get())


def train(opts: TrainOptions, log=print) -> TrainResult:
    import torch

    from dataferry.client import Loader, PlanOptions
    from dataferry.client import TrainTransform

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    kind = opts.loader
    if kind is None:
        try:
            import nvidia.dali  # noqa: F401

            kind = "dali"
        except ImportError:
            kind = "torch"
    torch.manual_seed(opts.seed)
    classes = _classes(opts.url, opts.dataset)
    model = small_cnn(torch, classes).to(device)
    optim = torch.optim.SGD(model.parameters(), lr=opts.lr, momentum=0.9, weight_decay=5e-5)
    loss_fn = torch.nn.CrossEntropyLoss()
    transform = TrainTransform(size=opts.size, scale=(0.25, 1.0))
    with contextlib.ExitStack() as stack:
        loader = stack.enter_context(Loader(opts.url, opts.dataset, split=opts.split, batch_size=opts.batch_size,
                                            plan=PlanOptions(seed=opts.seed), drop_last=True,
                                            log_interval=opts.interval))
        if kind == "dali":
            from dataferry.client import DaliIterator, DaliOptions

            it = DaliIterator(loader, transform, options=DaliOptions(
                device="gpu" if device.startswith("cuda") else "cpu", num_threads=opts.workers))
        else:
            from dataferry.client import TorchIterator

            it = TorchIterator(loader, transform, workers=opts.workers)
        stack.callback(it.close)
        log(f"training a small CNN ({classes} classes, {opts.size}x{opts.size} crops, batch {opts.batch_size}) "
            f"on {device}, {kind} loader, {opts.steps} steps")
        step = images = epochs = 0
        wait = 0.0
        losses = []
        t_start = stall0 = None
        while step < opts.steps:
            epochs += 1
            batches = iter(it)
            start_step = step
            while step < opts.steps:
                t0 = time.perf_counter()
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                x = batch.images.to(device, non_blocking=True)
                y = batch.labels.to(device, non_blocking=True)
                t1 = time.perf_counter()
                loss = loss_fn(model(x), y)
                optim.zero_grad(set_to_none=True)
                loss.backward()
                optim.step()
                step += 1
                if t_start is None:  # the first step pays for start-up: time from its end
                    if device.startswith("cuda"):
                        torch.cuda.synchronize()
                    t_start, stall0 = time.perf_counter(), loader.stats().wait
                    losses.append(loss.item())
                    continue
                wait += t1 - t0
                images += len(batch)
                if step % 50 == 0 or step == opts.steps:
                    losses.append(loss.item())
                    log(f"step {step}: loss {losses[-1]:.3f}")
            if step == start_step:
                raise SystemExit(f"an epoch of {opts.dataset!r} gave no batch of {opts.batch_size} on this rank")
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t_start if t_start is not None else 0.0
        loader_stall = (loader.stats().wait - (stall0 or 0.0)) / seconds if seconds > 0 else 0.0
        intervals = loader.intervals()
    losses.append(loss.item())
    result = TrainResult(step, images, seconds, wait, loader_stall, losses[0], losses[-1], epochs, device, kind,
                         intervals)
    if opts.plot:
        plot_intervals(intervals, opts.plot, f"small CNN on {device}, {kind} loader, batch {opts.batch_size}")
        log(f"plot of {len(intervals)} interval(s) of {opts.interval:g} s: {opts.plot}")
    return result


@contextlib.contextmanager
def _synthetic_service(images: int, dataset: str, log=print):
    from ._common import data_server, prepared_store

    t0 = time.perf_counter()
    with prepared_store("sqlite", images, dataset) as (store_url, _, report):
        log(f"{report.ingested} synthetic JPEGs ingested into {store_url} in {time.perf_counter() - t0:.1f} s")
        with data_server(store_url) as (host, port):
            yield f"http://{host}:{port}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dataferry.bench.train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="the data service (default: start one on synthetic data)")
    ap.add_argument("--dataset", default="synthetic")
    ap.add_argument("--split", default="all")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    ap.add_argument("--loader", choices=["dali", "torch"], default=None, help="default: dali when installed")
    ap.add_argument("--size", type=int, default=64, help="crop size (default 64)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=None,
                    help="decode threads (default: CPUs, at most 16 for torch, 8 for DALI)")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--synthetic", type=int, default=512, metavar="N",
                    help="without --url: JPEGs to make and serve (default 512)")
    ap.add_argument("--interval", type=float, default=1.0,
                    help="seconds per attribution interval (default 1)")
    ap.add_argument("--plot", default="train.png", metavar="PNG",
                    help="where to write the plot of throughput, wait and limits (default train.png; '' for none)")
    args = ap.parse_args(argv)
    if args.interval <= 0:
        ap.error(f"--interval must be > 0 seconds, not {args.interval}")
    opts = TrainOptions(url=args.url, dataset=args.dataset, split=args.split, steps=args.steps, device=args.device,
                        loader=args.loader, size=args.size, batch_size=args.batch_size, workers=args.workers,
                        lr=args.lr, seed=args.seed, synthetic=args.synthetic, interval=args.interval,
                        plot=args.plot or None)
    if opts.url is None:
        with _synthetic_service(opts.synthetic, opts.dataset) as url:
            print(f"data service on {url}")
            result = train(replace(opts, url=url))
    else:
        result = train(opts)
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
