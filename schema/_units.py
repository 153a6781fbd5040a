"""Durations and link rates as people write them: ``50ms``, ``1gbit``, ``10MB``.

``dataferry advise`` (``--link``, ``--rtt``), the latency proxy's command line
(``dataferry latency-proxy``) and the bench scripts take these; a bad value is
a :class:`~dataferry.schema.ConfigError` that names the value and the units it
may have.
"""

from __future__ import annotations

import math
import re

from ._errors import ConfigError

__all__ = ["parse_duration", "parse_rate", "parse_size"]

_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:[eE]([-+]?\d+))?"
_DURATION = re.compile(rf"\s*{_NUMBER}\s*([a-zµ]*)\s*", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_RATE = re.compile(rf"\s*{_NUMBER}\s*([a-z]*)(/s)?\s*", re.IGNORECASE)
_BIT_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8}
_BYTE_UNITS = {
    "": 1.0, "B": 1.0, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
    "KiB": 1024.0, "MiB": 1024.0**2, "GiB": 1024.0**3, "TiB": 1024.0**4,
}


def _number(match: re.Match) -> float:
    mantissa, exponent = match.group(1), match.group(2)
    return float(mantissa + (f"e{exponent}" if exponent else ""))


def parse_duration(text: str | float) -> float:
    """``"50ms"``, ``"200us"``, ``"1.5s"`` or ``"0.05"`` (seconds) -> seconds."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _DURATION.fullmatch(str(text))
        unit = match.group(3).lower() if match else None
        if unit not in _DURATION_UNITS:
            raise ConfigError(f"bad duration {text!r}: expected a number with an optional unit s, ms, us or ns, e.g. '50ms'")
        value = _number(match) * _DURATION_UNITS[unit]
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"bad duration {text!r}: must be a finite number of seconds >= 0")
    return value


def parse_rate(text: str | float) -> float:
    """A link rate -> bytes per second.

    Bits per second with ``bit``, ``kbit``, ``mbit``, ``gbit``, ``tbit`` (any
    case, powers of 1000, as in ``tc``); bytes per second with ``B``, ``KB``,
    ``MB``, ``GB``, ``TB`` or ``KiB``, ``MiB``, ``GiB``, ``TiB``; a bare number
    is bytes per second. An optional ``/s`` may follow. ``Mbps``, ``mb`` and
    the like are refused: they mean bits to some readers and bytes to others.
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _RATE.fullmatch(str(text))
        if match is None:
            raise ConfigError(f"bad rate {text!r}: expected a number with a unit, e.g. '1gbit', '100mbit' or '10MB'")
        unit = match.group(3)
        if unit.lower() in _BIT_UNITS:
            scale = _BIT_UNITS[unit.lower()]
        elif unit in _BYTE_UNITS:
            scale = _BYTE_UNITS[unit]
        else:
            raise ConfigError(
                f"bad rate {text!r}: unknown or ambiguous unit {unit!r}; write bits/s as kbit, mbit, gbit "
                f"(e.g. '100mbit') or bytes/s as KB, MB, GB, KiB, MiB, GiB (e.g. '10MB')"
            )
        value = _number(match) * scale
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"bad rate {text!r}: must be a positive, finite rate (leave the rate out for an unlimited link)")
    return value


_SIZE = re.compile(rf"\s*{_NUMBER}\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | int, what: str = "size") -> int:
    """A byte count: ``"6MB"``, ``"512KiB"``, ``"4194304"`` (bytes) -> bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = float(text)
    else:
        match = _SIZE.fullmatch(str(text))
        unit = match.group(3) if match else None
        if unit not in _BYTE_UNITS:
            raise ConfigError(f"bad {what} {text!r}: expected bytes with an optional unit KB, MB, GB, KiB, MiB, GiB, "
                              "e.g. '6MB'")
        value = _number(match) * _BYTE_UNITS[unit]
    if not (math.isfinite(value) and value >= 1):
        raise ConfigError(f"bad {what} {text!r}: must be at least one byte")
    return int(value)
