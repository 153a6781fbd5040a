"""From a measurement to advice: predict, recommend, and show it.

:func:`predict` turns a :class:`~._advice.Measurement` into the full dataset's
epoch over a :class:`~._advice.Link` (link- or decode-bound); :func:`recommend`
picks, among the strategies :class:`~._advice.Rules` allow, the one with the
shortest predicted epoch and says why; :func:`render`, :func:`ingest_command`
and :func:`plot` show it. All are pure functions of the measurement, so one
measurement answers for any link.
"""

from __future__ import annotations

import re
import shlex

from .._errors import ConfigError
from .._table import format_table
from ._advice import (
    DEFAULT_MIN_PSNR, SETUP_RTTS, TIE, Advice, Link, Measurement, Prediction, Recommendation, Rules, Strategy,
)

__all__ = ["predict", "recommend", "render", "ingest_command", "plot"]


# --- predicting and recommending --------------------------------------------------


def predict(m: Measurement, num_images: int, link: Link) -> Prediction:
    """The full dataset's epoch time over ``link``.

    :func:`predict` turns a measurement into the epoch time of the full dataset
    over a :class:`Link`: ``max(N * bytes / bandwidth, N / decode rate)`` plus
    set-up, ``4 * RTT`` (connection, TLS, the split's id list, the first batch;
    after that the engine keeps enough requests in flight to hide the RTT), and
    names the bound, ``link`` or ``decode``. The decode rate is the GPU's when one
    was measured, else the CPU's. :func:`recommend` picks, among the strategies
    :class:`Rules` allow, the one with the shortest predicted epoch (within 1%:
    the fewer bytes). Measuring and predicting are separate, so one measurement
    answers for any link.
    """
    link_s = num_images * m.mean_bytes / link.bandwidth
    decode_s = num_images / m.decode_rate
    setup_s = SETUP_RTTS * link.rtt
    return Prediction(max(link_s, decode_s) + setup_s, link_s, decode_s, setup_s,
                      "link" if link_s >= decode_s else "decode")


def _allowed(m: Measurement, kind: str, rules: Rules) -> str | None:
    """None when ``rules`` allow ``m``, else why not."""
    if not m.full_resolution:
        if rules.max_side is None:
            return "resized"
        if m.strategy.max_side is not None and m.strategy.max_side < rules.max_side:
            return f"side < {rules.max_side}"
    if kind == "lossless" and rules.min_psnr is None:
        return None if m.exact else "not exact"
    floor = DEFAULT_MIN_PSNR if rules.min_psnr is None else rules.min_psnr
    return None if m.psnr >= floor else f"PSNR < {floor:g} dB"


def _criteria(kind: str, rules: Rules) -> str:
    fidelity = ("exact (a lossless source)" if kind == "lossless" and rules.min_psnr is None
                else f"PSNR >= {DEFAULT_MIN_PSNR if rules.min_psnr is None else rules.min_psnr:g} dB")
    size = "full resolution" if rules.max_side is None else f"a maximum side of {rules.max_side} or more"
    return f"{fidelity}, {size}"


def recommend(advice: Advice, link: Link, rules: Rules = Rules()) -> Recommendation:
    """The allowed strategy with the shortest predicted epoch; within 1%, the fewer bytes."""
    scored = [(m, predict(m, advice.num_images, link)) for m in advice.rows if _allowed(m, advice.kind, rules) is None]
    best = min(p.epoch_s for _, p in scored)
    m, p = min(((m, p) for m, p in scored if p.epoch_s <= best * TIE), key=lambda mp: (mp[0].mean_bytes, mp[1].epoch_s))
    rate = f"{m.decode_rate:,.0f} img/s " + (f"through {advice.dali}" if m.gpu_rate is not None
                                             else f"on {advice.cores} core(s)")
    why = (f"link-bound: {m.mean_bytes / 1e3:,.1f} KB/img at {_rate(link.bandwidth)}" if p.bound == "link"
           else f"decode-bound: {rate}")
    reason = (f"{m.strategy.name}: the shortest predicted epoch ({_duration(p.epoch_s)}, {why}) of the "
              f"{len(scored)} strategies that keep {_criteria(advice.kind, rules)}")
    original = advice.rows[0]
    if m is not original:
        po = predict(original, advice.num_images, link)
        reason += f"; keeping the original bytes would take {_duration(po.epoch_s)} ({po.bound}-bound)"
    elif len(scored) > 1:
        reason += "; re-encoding would not make an epoch shorter"
    return Recommendation(m, p, tuple(m.strategy.name for m, _ in scored), reason)


# --- showing it ------------------------------------------------------------------------


def _duration(s: float) -> str:
    if s < 10:
        return f"{s:.2f} s"
    if s < 120:
        return f"{s:.1f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _rate(bps: float) -> str:
    bits = bps * 8
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def render(advice: Advice, link: Link, rules: Rules, rec: Recommendation) -> str:
    """The report: what was measured, the table, the bound of each row, the recommendation."""
    formats = ", ".join(f"{fmt} {n}" for fmt, n in advice.formats)
    head = [
        f"advise {advice.source}: {advice.num_images:,} images; measured {len(advice.sample)} sampled "
        f"(seed {advice.seed}): {formats}; a {advice.kind} source",
        f"decode: Pillow on {advice.cores} usable core(s); DALI: {advice.dali or 'no GPU'}; "
        f"link {_rate(link.bandwidth)}, RTT {link.rtt * 1e3:g} ms (set-up {SETUP_RTTS} RTT)",
    ]
    if advice.rejected:
        head.append(f"{len(advice.rejected)} sampled image(s) ingest would reject, left out "
                    f"(first: {advice.rejected[0][0]}: {advice.rejected[0][1]})")
    rows = []
    for m in advice.rows:
        p = predict(m, advice.num_images, link)
        why_not = _allowed(m, advice.kind, rules)
        note = "<- recommended" if m is rec.row else (why_not or "")
        rows.append((
            m.strategy.name, f"{m.mean_bytes / 1e3:,.1f}", f"{m.encode_s * 1e3:.1f}", f"{m.cpu_rate:,.0f}",
            f"{m.gpu_rate:,.0f}" if m.gpu_rate is not None else "fails" if m.gpu_error else "no GPU",
            "exact" if m.exact else f"{m.psnr:.1f} dB",
            f"{m.long_in:.0f}" if m.full_resolution else f"{m.long_in:.0f}->{m.long_out:.0f}",
            _duration(p.epoch_s), p.bound, note,
        ))
    table = format_table(("STRATEGY", "KB/IMG", "ENCODE ms", "CPU DECODE img/s", "DALI DECODE img/s", "FIDELITY",
                          "LONG SIDE", "EPOCH", "BOUND", "NOTE"), rows)
    foot = [
        f"EPOCH: {advice.num_images:,} images at max(bytes / link, images / decode rate) + set-up; "
        "BOUND: which of the two is longer. ENCODE: CPU per image at ingest. FIDELITY: PSNR against the "
        "source's pixels (resized ones against the source resized the same way).",
        *(f"DALI fails on {m.strategy.name}'s bytes: {m.gpu_error}" for m in advice.rows if m.gpu_error),
        f"recommended: {rec.reason}",
    ]
    return "\n".join([*head, table, *foot])


def ingest_command(rec: Recommendation, *, src: str | None, dataset: str, store: str) -> str:
    """The ``dataferry ingest`` command that applies ``rec`` (``src`` None: SRC, for a stored dataset)."""
    name = dataset if src is not None else _derived_name(dataset, rec.row.strategy)
    args = ["dataferry", "ingest", src if src is not None else "SRC", "--dataset", name, "--store", store,
            *rec.row.strategy.ingest_args()]
    return shlex.join(args).replace("'SRC'", "SRC")


def _derived_name(dataset: str, s: Strategy) -> str:
    return f"{dataset}-{re.sub(r'[^A-Za-z0-9]+', '-', s.name).strip('-')}"[:128]


def plot(advice: Advice, link: Link, rec: Recommendation, path: str) -> None:
    """A PNG: bytes per image against decode rate, and the predicted epoch per strategy."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ConfigError("--plot needs matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    names = [m.strategy.name for m in advice.rows]
    preds = [predict(m, advice.num_images, link) for m in advice.rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for m in advice.rows:
        mark = "*" if m is rec.row else "o"
        ax1.scatter(m.mean_bytes / 1e3, m.decode_rate, marker=mark, s=160 if m is rec.row else 40)
        ax1.annotate(m.strategy.name, (m.mean_bytes / 1e3, m.decode_rate), fontsize=8, xytext=(4, 4),
                     textcoords="offset points")
    ax1.set_xscale("log")
    ax1.set_yscale("log")
    ax1.set_xlabel("KB per image")
    ax1.set_ylabel(f"decode images/s ({advice.dali or f'Pillow, {advice.cores} cores'})")
    ax1.set_title("bytes against decode rate")
    colors = ["tab:blue" if p.bound == "link" else "tab:orange" for p in preds]
    bars = ax2.barh(names, [p.epoch_s for p in preds], color=colors)
    bars[advice.rows.index(rec.row)].set_edgecolor("black")
    bars[advice.rows.index(rec.row)].set_linewidth(2)
    ax2.invert_yaxis()
    ax2.set_xlabel(f"predicted epoch, s: {advice.num_images:,} images, {_rate(link.bandwidth)}, RTT {link.rtt * 1e3:g} ms")
    ax2.set_title(f"recommended: {rec.row.strategy.name}\nblue: link-bound, orange: decode-bound")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise ConfigError(f"cannot write plot {path!r}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)
