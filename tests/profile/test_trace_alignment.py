"""The alignment of two micro-batch traces: the same verdict as difflib's, and linear on long repetitive traces."""

from __future__ import annotations

import difflib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memopt.profile.trace_alignment import alignment_opcodes


def _verdict(ops: list[tuple[str, int, int, int, int]]) -> str:
    kinds = {op for op, *_ in ops} - {"equal"}
    return "exact" if not kinds else "inserts" if kinds == {"insert"} else "mismatch"


def _check_edit_script(a: list, c: list, ops: list[tuple[str, int, int, int, int]]) -> None:
    """The opcodes cover both sequences in order, and an ``equal`` pairs equal events."""
    i = j = 0
    for op, i1, i2, j1, j2 in ops:
        assert (i1, j1) == (i, j)
        if op == "equal":
            assert a[i1:i2] == c[j1:j2]
        i, j = i2, j2
    assert (i, j) == (len(a), len(c))


events = st.lists(st.sampled_from(["mm", "add", "ws", "clone", "sum"]), max_size=40)


def _is_subsequence(a: list[str], c: list[str]) -> bool:
    it = iter(c)
    return all(any(e == x for x in it) for e in a)


@settings(max_examples=300, deadline=None)
@given(a=events, c=events)
def test_short_traces_get_difflibs_own_answer(a: list[str], c: list[str]) -> None:
    assert alignment_opcodes(a, c) == difflib.SequenceMatcher(None, a, c, autojunk=False).get_opcodes()


@settings(max_examples=400, deadline=None)
@given(a=events, c=events)
def test_the_fast_path_says_inserts_exactly_when_the_smaller_trace_is_a_subsequence(a: list[str], c: list[str]) -> None:
    """Above its work limit (forced here to 0) the verdict follows from the traces alone: exact when equal, inserts
    when every event of the smaller trace pairs with one of the larger in order, mismatch otherwise; and whenever
    difflib's answer is exact or inserts-only, so is this one."""
    ops = alignment_opcodes(a, c, max_work=0)
    _check_edit_script(a, c, ops)
    expected = "exact" if a == c else "inserts" if _is_subsequence(a, c) else "mismatch"
    assert _verdict(ops) == expected
    full = _verdict(difflib.SequenceMatcher(None, a, c, autojunk=False).get_opcodes())
    assert full == "mismatch" or full == _verdict(ops)


@settings(max_examples=200, deadline=None)
@given(a=events, extra=st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["mm", "copy"])), max_size=6))
def test_events_only_the_larger_size_has_are_inserts(a: list[str], extra: list[tuple[int, str]]) -> None:
    c = list(a)
    for at, e in sorted(extra, reverse=True):
        c.insert(min(at, len(c)), e)
    ops = alignment_opcodes(a, c, max_work=0)
    _check_edit_script(a, c, ops)
    assert _verdict(ops) == ("exact" if not extra else "inserts")


def _recurrent(steps: int, per_step: list[str]) -> list[str]:
    return [e for _ in range(steps) for e in per_step]


@pytest.mark.timeout(60)
def test_a_long_recurrent_trace_aligns_without_a_quadratic_search() -> None:
    """A GRU unrolled over 4096 steps: micro-batch 1 runs addmm where 2 runs clone + mm at every step (no
    alignment is inserts-only), and a size that adds one copy per step (every event of the smaller paired).
    Searched whole by difflib, each pair takes minutes."""
    one = _recurrent(4096, ["addmm", "ws", "sigmoid", "tanh", "mul"])
    two = _recurrent(4096, ["clone", "mm", "ws", "sigmoid", "tanh", "mul"])
    ops = alignment_opcodes(one, two)
    _check_edit_script(one, two, ops)
    assert _verdict(ops) == "mismatch"

    copied = _recurrent(4096, ["addmm", "ws", "copy", "sigmoid", "tanh", "mul"])
    ops = alignment_opcodes(one, copied)
    _check_edit_script(one, copied, ops)
    assert _verdict(ops) == "inserts"
    assert sum(i2 - i1 for op, i1, i2, *_ in ops if op == "equal") == len(one)
    assert alignment_opcodes(two, list(two)) == [("equal", 0, len(two), 0, len(two))]
