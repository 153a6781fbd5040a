"""One text-table formatter for the CLI's listings and the bench's reports."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["format_table"]


def _numeric(cell: str) -> bool:
    return cell.replace(",", "").replace("%", "").replace(".", "").replace("x", "").lstrip("-").isdigit()


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *, markdown: bool = False) -> str:
    """``rows`` under ``header``, columns padded to their widest cell. Plain:
    numbers right-aligned, text left-aligned. ``markdown``: a GitHub table,
    every cell right-aligned (as the bench's reports have always been)."""
    cells = [[str(c) for c in header], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    right = [markdown or (bool(rows) and all(_numeric(r[i]) for r in cells[1:])) for i in range(len(header))]

    def line(r: list[str]) -> list[str]:
        return [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(r, widths, right)]

    if not markdown:
        return "\n".join("  ".join(line(r)).rstrip() for r in cells)
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    out = ["| " + " | ".join(line(cells[0])) + " |", sep]
    out += ["| " + " | ".join(line(r)) + " |" for r in cells[1:]]
    return "\n".join(out)
