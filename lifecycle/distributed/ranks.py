"""The one way lifecycle prints a list of ranks: short whatever the world size.

``0-3,6,8-9`` (runs folded into ranges), ``0,8,...,16376`` (a long strided list), and after ``limit``
parts ``0-3,6,... (+12 more)``. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable


def fmt_ranks(ranks: Iterable[int | str], *, limit: int = 16) -> str:
    """Sorted, de-duplicated ranks folded into ranges (JSON keys may come back as strings)."""
    rs = sorted({int(r) for r in ranks})
    if len(rs) > 4 and rs[1] - rs[0] > 1 and all(b - a == rs[1] - rs[0] for a, b in zip(rs, rs[1:], strict=False)):
        return f"{rs[0]},{rs[1]},...,{rs[-1]}"
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(str(rs[i]) if i == j else f"{rs[i]}-{rs[j]}")
        i = j + 1
    if len(parts) > limit:
        return ",".join(parts[:limit]) + f",... (+{len(parts) - limit} more)"
    return ",".join(parts)
