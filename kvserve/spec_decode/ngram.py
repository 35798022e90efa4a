"""Prompt-lookup drafting: the continuation of the sequence's last n tokens, found earlier in the sequence.

Repetition-heavy outputs (code edits, quoting, summaries reusing the passage's words) copy long runs of
their own context, so where the last n tokens occurred before, what followed them is a good guess for
what comes next. Free to compute: no model, one vectorised scan of the sequence per step.
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to max_tokens draft tokens following token_ids (may be fewer, or none without a match).

        Longest n first; among matches of one n, the most recent one followed by max_tokens tokens (in a
        sequence that repeats, the latest occurrence is the one the text is currently copying), else the
        earliest (the longest continuation there is)."""
        num = len(token_ids)
        if max_tokens <= 0 or num < self.min_n + 1:
            return []
        tokens = np.array(token_ids, dtype=np.int64)
        # Candidates are the earlier occurrences of the last token (each with a token after it); their
        # matches are extended backwards one position at a time, all at once. A handful of array ops a step
        # (a scan of every n-gram size took ~150 us at 700 tokens: a few % of a decode step).
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)  # matched suffix length ending at each candidate
        for k in range(1, min(self.max_n, num - 1)):
            before = ends - k
            grow = (length == k) & (before >= 0)
            grow[grow] = tokens[before[grow]] == tokens[num - 1 - k]
            if not grow.any():
                break
            length += grow
        n = int(length.max())
        if n < self.min_n:
            return []
        starts = ends[length == n] + 1  # where each best match's continuation begins
        full = starts[starts + max_tokens <= num]
        start = int(full[-1] if full.size else starts[0])
        return tokens[start:start + max_tokens].tolist()
