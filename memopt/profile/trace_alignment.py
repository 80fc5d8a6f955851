"""Pairing the events of two traces of one step taken at two micro-batch sizes.

``memopt.profile.trace`` traces a step at micro-batches 1 and 2 (or 2 and 3) and pairs their allocations to
extrapolate each one linearly; this module finds the pairing: difflib's opcodes, computed where it can be done
fast.
"""

from __future__ import annotations

import difflib
from typing import Any

_DIFFLIB_MAX_WORK = 4_000_000  # events of one trace times events of the other: above it, difflib takes seconds


def alignment_opcodes(a: list[Any], c: list[Any], *,
                      max_work: int = _DIFFLIB_MAX_WORK) -> list[tuple[str, int, int, int, int]]:
    """Opcodes (difflib's) turning ``a`` into ``c``.

    difflib's alignment is quadratic in the events it searches, and a recurrent layer unrolled over a long sequence
    repeats the same few events tens of thousands of times: aligned by it, two micro-batch sizes of such a trace take
    minutes. Up to ``max_work`` (the product of the lengths) the answer is difflib's own. Above it the common prefix
    and suffix are matched first and only the stretch between them is searched, and only when the verdict can be
    other than "mismatch": when ``a`` is not a subsequence of ``c`` no alignment is exact or inserts-only, and one
    ``replace`` says so; when it is, the stretch is searched by difflib if small, else matched greedily (every event
    of ``a`` paired, the rest inserts).
    """
    if len(a) * len(c) <= max_work:
        return difflib.SequenceMatcher(None, a, c, autojunk=False).get_opcodes()
    n = min(len(a), len(c))
    head = 0
    while head < n and a[head] == c[head]:
        head += 1
    tail = 0
    while tail < n - head and a[len(a) - 1 - tail] == c[len(c) - 1 - tail]:
        tail += 1
    a_end, c_end = len(a) - tail, len(c) - tail
    out: list[tuple[str, int, int, int, int]] = [("equal", 0, head, 0, head)] if head else []
    if head < a_end or head < c_end:
        out.extend(_middle_opcodes(a, c, head, a_end, c_end, max_work))
    if tail:
        out.append(("equal", a_end, len(a), c_end, len(c)))
    return out


def _middle_opcodes(a: list[Any], c: list[Any], head: int, a_end: int, c_end: int,
                    max_work: int) -> list[tuple[str, int, int, int, int]]:
    embedding = _embedding(a, c, head, a_end, c_end)
    if embedding is None:
        return [("replace", head, a_end, head, c_end)]
    if (a_end - head) * (c_end - head) <= max_work:
        matcher = difflib.SequenceMatcher(None, a[head:a_end], c[head:c_end], autojunk=False)
        return [(op, i1 + head, i2 + head, j1 + head, j2 + head) for op, i1, i2, j1, j2 in matcher.get_opcodes()]
    out: list[tuple[str, int, int, int, int]] = []
    i = head
    for j in range(head, c_end):
        op = "equal" if embedding[j] else "insert"
        if out and out[-1][0] == op:
            out[-1] = (op, out[-1][1], i + (op == "equal"), out[-1][3], j + 1)
        else:
            out.append((op, i, i + (op == "equal"), j, j + 1))
        i += op == "equal"
    return out


def _embedding(a: list[Any], c: list[Any], head: int, a_end: int, c_end: int) -> list[bool] | None:
    """Which events of ``c[head:c_end]`` (indexed as in ``c``) pair with ``a[head:a_end]`` in a greedy embedding of
    the one in the other; None when ``a``'s stretch is not a subsequence of ``c``'s."""
    matched = [False] * c_end
    i = head
    for j in range(head, c_end):
        if i < a_end and a[i] == c[j]:
            matched[j] = True
            i += 1
    return matched if i == a_end else None
