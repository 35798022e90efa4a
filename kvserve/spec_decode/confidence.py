"""How far to trust each row of an eagle head's token tree, from the head's own probability for its token.

A step's rows are worth what they are likely to bring, and the head says how sure it is of each token it
drafts. Teacher-forced on the benchmark's chat questions, its first token was right 5% of the time where it
gave it under 0.2 and 92% where it gave it over 0.9 (benchmarks/results/eagle_confidence.md). Class averages
(draft_length.py) price every step's rows alike, so a tree step carried the same alternatives whether the
head was sure of its first token or not. Here each row's gain is the rate at which the target picked the
head's token where the head gave it about that probability, kept per kind of row and per tenth of
probability as a moving average that starts at the probability itself (the head is roughly calibrated), so
a head that is over- or under-confident on this traffic is corrected by what the target did.

Kinds of rows: the chain's first token (the head's first choice), an alternative to it (its j-th choice,
j >= 2), and a later chain token given that all before it were accepted.

A head may ship a table to start from instead (`read_calibration`: the JSON file next to the head, made by
benchmarks/eagle_calibration.py from the engine's own drafting on held-out prompts). Started at the head's
probability, a fresh engine trusted the shipped head's middle buckets, and its later chain tokens, too far
until a few hundred drafts had corrected them: its first run of the benchmark's chat questions took 7-10% more
steps than the next (743 against 694, the mean of 10 fresh engines; 714 and 678 from the shipped table).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from kvserve.utils.value_checks import is_number

FIRST, ALTERNATIVE, NEXT = 0, 1, 2
KINDS = ("first", "alternative", "next")  # the table file's keys, in that order
_BUCKETS = 10
_WEIGHT = 1 / 32  # moving-average weight of one observed outcome


@dataclass
class TreeDraft:
    """What the head offered at one position: its chain (its first choice at each step) and its next choices
    for the chain's first token, with its probability for each token."""
    chain: list[int]
    chain_probs: list[float]
    alternatives: list[int]
    alternative_probs: list[float]


class Calibration:
    """P(the target's token is the head's) by kind of row and the head's probability for it."""

    def __init__(self, start: list[list[float]] | None = None) -> None:
        """start: rates to begin from, per kind of row and bucket (read_calibration); else the buckets' centres."""
        self.rate = [list(r) for r in start] if start is not None else [bucket_centres() for _ in KINDS]
        self.counts: list[list[list[int]]] | None = None  # see count_outcomes

    def count_outcomes(self) -> None:
        """From now on also count every outcome: counts[kind][bucket] = [taken by the target, rows]
        (benchmarks/eagle_calibration.py builds a table from them)."""
        self.counts = [[[0, 0] for _ in range(_BUCKETS)] for _ in KINDS]

    def chain_rates(self) -> list[float]:
        """The rates chain_gains reads, as the head's native chain takes them (EagleHead.draft_chains): the
        first token's by bucket, then a later token's."""
        return self.rate[FIRST] + self.rate[NEXT]

    def _rate(self, kind: int, p: float) -> float:
        return self.rate[kind][_bucket(p)]

    def chain_gains(self, probs: list[float]) -> list[float]:
        """[i]: the expected tokens chain token i adds (accepted only with all before it)."""
        gains, g = [], 1.0
        for i, p in enumerate(probs):
            g *= self._rate(NEXT if i else FIRST, p)
            gains.append(g)
        return gains

    def alternative_gains(self, probs: list[float], first: float) -> list[float]:
        """[j]: the expected tokens alternative j + 1 adds; never more than the first token's or the one before
        it (a step keeps a prefix of them, best first)."""
        gains, last = [], first
        for p in probs:
            last = min(last, self._rate(ALTERNATIVE, p))
            gains.append(last)
        return gains

    def observe(self, draft: TreeDraft, target: list[int]) -> None:
        """The target's tokens from the draft's position on (as many as it has emitted, at least one)."""
        first = target[0]
        self._record(FIRST, draft.chain_probs[0], draft.chain[0] == first)
        for token, p in zip(draft.alternatives, draft.alternative_probs):
            self._record(ALTERNATIVE, p, token == first)
        # Chain token i's outcome given all before it were right: known where the target went that far.
        for i in range(1, min(len(draft.chain), len(target))):
            if draft.chain[i - 1] != target[i - 1]:
                break
            self._record(NEXT, draft.chain_probs[i], draft.chain[i] == target[i])

    def _record(self, kind: int, p: float, right: bool) -> None:
        rates, b = self.rate[kind], _bucket(p)
        rates[b] += _WEIGHT * (float(right) - rates[b])
        if self.counts is not None:
            self.counts[kind][b][0] += right
            self.counts[kind][b][1] += 1


def bucket_centres() -> list[float]:
    return [(b + 0.5) / _BUCKETS for b in range(_BUCKETS)]


def calibration_path(head_path: str | Path) -> Path:
    """Where a head's table lives: beside it, NAME.calibration.json for NAME.safetensors."""
    return Path(head_path).with_suffix(".calibration.json")


class CalibrationFileError(ValueError):
    """A head's table file that cannot be used (read_calibration)."""


def read_calibration(path: str | Path) -> list[list[float]]:
    """A table file's rates, per kind of row (FIRST, ALTERNATIVE, NEXT) and tenth of probability."""
    try:
        data = json.loads(Path(path).read_text())
        rates = [data[kind] for kind in KINDS]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CalibrationFileError(f"eagle head calibration {str(path)!r} is unreadable ({e}); it should hold "
                                   f"{', '.join(KINDS)}: {_BUCKETS} rates in [0, 1] each") from None
    if not all(isinstance(r, list) and len(r) == _BUCKETS and all(_is_rate(x) for x in r) for r in rates):
        raise CalibrationFileError(f"eagle head calibration {str(path)!r}: {', '.join(KINDS)} must each hold "
                                   f"{_BUCKETS} rates in [0, 1]")
    return [[float(x) for x in r] for r in rates]


def _is_rate(x: object) -> bool:
    return is_number(x) and 0.0 <= x <= 1.0


def _bucket(p: float) -> int:
    """The tenth of probability p falls in (p = 1 in the last)."""
    return min(int(p * _BUCKETS), _BUCKETS - 1)
