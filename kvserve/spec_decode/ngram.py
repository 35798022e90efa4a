"""Prompt-lookup drafting: the continuation of the sequence's last n tokens, found earlier in the sequence.

Repetition-heavy outputs (code edits, quoting, summaries reusing the passage's words) copy long runs of
their own context, so where the last n tokens occurred before, what followed them is a good guess for
what comes next. Free to compute: no model, one vectorised scan of the sequence per step.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            # Windows start at 0 .. num - n - 1: every n-gram except the suffix itself, each with at least
            # one token after it.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[num - n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + max_tokens <= num]
                start = int(full[-1] if full.size else hits[0]) + n
                return tokens[start:start + max_tokens].tolist()
        return []
