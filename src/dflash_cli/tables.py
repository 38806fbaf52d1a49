"""Aligned text tables: the one column aligner behind `bench`'s tables and the terminal's lists."""

from __future__ import annotations


def columns(rows: list[list[str]], *, gap: int = 2, numeric: bool = True, rule: bool = False) -> list[str]:
    """`rows` (the header first) as lines of columns as wide as their widest cell, `gap` spaces apart, with
    no trailing blanks. `numeric`: the columns after the first are right-aligned (figures); `rule`: a line of
    dashes under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]

    def line(cells: list[str]) -> str:
        return (" " * gap).join(c.rjust(w) if numeric and i else c.ljust(w)
                                for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [line(row) for row in rows]
    if rule:
        lines.insert(1, (" " * gap).join("-" * w for w in widths))
    return lines
