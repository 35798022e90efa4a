"""The auto-routing benchmark's questions and scorer (benchmarks/auto_routing_tasks.py): references checked
against independent computations (Python arithmetic, the datetime calendar, string methods), and the scorer
on answers in the forms the two models give."""
from __future__ import annotations

import calendar
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from auto_routing_tasks import make_tasks, score  # noqa: E402

TASKS = make_tasks(400, seed=0)


def test_tasks_are_deterministic_and_distinct() -> None:
    assert make_tasks(400, seed=0) == TASKS
    assert len({t.question for t in TASKS}) == len(TASKS)
    assert not {t.question for t in make_tasks(50, seed=1, exclude=frozenset(t.question for t in TASKS[:5]))} \
        & {t.question for t in TASKS[:5]}


def test_references_match_independent_computations() -> None:
    days = list(calendar.day_name)
    months = list(calendar.month_name)[1:]
    checked = 0
    for t in TASKS:
        q, a = t.question, t.answer
        if t.family.startswith("arith"):
            x, op, y = re.fullmatch(r"What is (\d+) ([-+*]) (\d+)\?", q).groups()
            assert int(a) == {"+": int(x) + int(y), "-": int(x) - int(y), "*": int(x) * int(y)}[op], q
        elif t.family == "sequence":
            nums = [int(n) for n in re.findall(r"\d+", q)]
            assert int(a) - nums[-1] == nums[1] - nums[0] and len(set(b - c for b, c in zip(nums[1:], nums))) == 1
        elif t.family == "weekday":
            rel, day = re.fullmatch(r"What day of the week comes (after|before) (\w+)\?", q).groups()
            assert days.index(a) == (days.index(day) + (1 if rel == "after" else -1)) % 7
        elif t.family == "month":
            rel, m = re.fullmatch(r"Which month comes (after|before) (\w+)\?", q).groups()
            assert months.index(a) == (months.index(m) + (1 if rel == "after" else -1)) % 12
        elif t.family in ("uppercase", "reverse", "first_letter", "last_letter", "letter_count"):
            w = re.search(r'"(\w+)"', q).group(1)
            assert a == {"uppercase": w.upper(), "reverse": w[::-1], "first_letter": w[0], "last_letter": w[-1],
                         "letter_count": str(len(w))}[t.family]
        elif t.family == "compare":
            which, x, y = re.fullmatch(r"Which number is (larger|smaller), (\d+) or (\d+)\?", q).groups()
            assert int(a) == (max if which == "larger" else min)(int(x), int(y))
        elif t.family == "copy":
            assert q.endswith(a)
        else:
            continue
        checked += 1
    assert checked > 300


@pytest.mark.parametrize("answer, reference, want", [
    ("Paris", "Paris", 1.0), (" Paris.", "Paris", 1.0), ("Paris, France", "Paris", 1.0),
    ("Parisian", "Paris", 0.0), ("The capital of France is Paris.", "Paris", 1.0),
    ('The opposite of "wet" is "dry".', "dry", 1.0), ("74 - 18 = 56", "56", 1.0), ("74 - 18 = 65", "56", 0.0),
    ("3 is 3, and 5 is 5.", "5", 0.0),           # states no one answer
    ("CAT", "CAT", 1.0), ("cat", "CAT", 0.0),    # case counts only for a capitalised word
    ("n", "N", 1.0), ("", "7", 0.0), ("\n\n7\nmore", "7", 1.0), ("8", "7", 0.0),
    (" O, sir, I find her milder than she was.", "O, sir, I find her milder than she was;", 1.0),
])
def test_score(answer: str, reference: str, want: float) -> None:
    assert score(answer, reference) == want
