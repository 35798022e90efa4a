"""Prompt lookup against a brute-force reference over every n and every earlier occurrence."""
import random

import pytest

from kvserve.spec_decode.ngram import NgramProposer


def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    for n in range(hi, lo - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        starts = [i for i in range(len(tokens) - n) if tokens[i:i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= len(tokens)]
            i = full[-1] if full else starts[0]
            return tokens[i + n:i + n + k]
    return []


def test_examples():
    p = NgramProposer(2, 4)
    assert p.propose([1, 2, 3, 9, 9, 1, 2], 3) == [3, 9, 9]          # the continuation of "1 2"
    assert p.propose([1, 2, 3, 4, 5, 6], 3) == []                     # nothing repeats
    assert p.propose([7, 1, 2, 8, 1, 2, 3, 1, 2], 1) == [3]           # most recent match with a full draft
    assert p.propose([4, 1, 2, 5, 5, 6, 1, 2], 2) == [5, 5]
    assert p.propose([1, 2, 3, 1, 2, 3], 0) == []
    assert NgramProposer(1, 1).propose([5, 6, 5], 4) == [6, 5]        # short: only what follows exists
    # The longest n wins over a more recent shorter match.
    assert p.propose([1, 2, 3, 4, 0, 3, 4, 8, 8, 1, 2, 3, 4], 2) == [0, 3]


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_matches_brute_force(lo, hi):
    rng = random.Random(lo * 10 + hi)
    p = NgramProposer(lo, hi)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 6)
        assert p.propose(tokens, k) == reference(tokens, lo, hi, k), (tokens, k)
