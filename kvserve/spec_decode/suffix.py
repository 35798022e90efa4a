"""Suffix decoding (vLLM's method "suffix"): drafts from the sequence's own text and from earlier responses.

Prompt lookup (ngram.py) finds the sequence's last tokens earlier in the same sequence. Suffix decoding
(Oliaro et al., arXiv 2411.04975) also searches what earlier requests answered, so that a question asked
again, a prompt sampled again (rollouts, self-consistency, best-of-n) or an agent's loop that repeats itself
drafts what came the times before. As vLLM's method of that name:
- a match is the longest common suffix, up to suffix_decoding_max_tree_depth tokens;
- among earlier responses, the draft follows the continuation that most of the longest matches share, token
  by token, while the share of them still agreeing stays at least suffix_decoding_min_token_prob;
- a draft holds at most suffix_decoding_max_spec_factor x its match's length (a long match earns a long one);
- the longer of the two matches (the sequence's own, the earlier responses') drafts.
A draft is a function of the text so far, as prompt lookup's is: verification treats it as a draft of
probability one, so outputs are exactly the target's (verify.py).

Here the sequence's own match is prompt lookup's (NgramProposer from OWN_MIN_MATCH tokens up to the depth,
with its whitespace classes and re-indenting), which drafts the latest occurrence rather than the most
frequent one; and the earlier responses are searched through a hash chain of their ANCHOR-token n-grams, of
which only the latest MAX_CANDIDATES occurrences are extended, to bound a lookup's cost.
"""
from __future__ import annotations

from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence as Tokens

import numpy as np

from kvserve.spec_decode.ngram import Indents, LookupIndex, NgramProposer

OWN_MIN_MATCH = 2     # the sequence's own text: prompt lookup's usual shortest match
ANCHOR = 3            # earlier responses: the tokens a match shares at least (hashed: _bucket)
MAX_CANDIDATES = 64   # earlier responses: the latest occurrences of the anchor that a lookup extends
# A draft's class (draft_length.py keeps acceptance per class): for the sequence's own match its length, as
# prompt lookup's; for an earlier response's, this plus its length (the two kinds are trusted apart).
CORPUS_CLASS = 1000


class ResponseCorpus:
    """The responses of the most recent finished requests (up to max_requests, and max_tokens tokens together),
    each after the last `depth` tokens of its prompt, so that a new response's first tokens match where an
    earlier one began.

    Kept as a compressor keeps its window: the tokens in a ring of max_tokens slots, addressed by a position
    that only grows, and a hash chain through every position whose ANCHOR tokens a response token follows
    (`head`: a bucket's latest such position; `prev`: the one before it in the same bucket). The oldest
    responses leave by moving `oldest` past them, and a chain walk stops there, so nothing is unlinked. Measured
    with 1M tokens of responses (Zipf-distributed ids): 34 MiB, where a first index of Python dicts of deques
    took 706 MiB; adding a 152-token response ~0.2 ms, a lookup 8 us, or 60 us where it drafts 24 tokens."""

    def __init__(self, max_requests: int, depth: int, max_tokens: int = 1 << 20) -> None:
        self.max_requests = max_requests
        self.depth = depth
        self.capacity = max_tokens
        # Buckets: a power of two >= capacity (8 MiB of heads for 2**20 tokens; none needed without responses).
        self.mask = (1 << max(10, (max_tokens - 1).bit_length() if max_requests > 0 else 0)) - 1
        # Grown up to capacity as responses come, then reused ring-wise.
        self.tokens = array("q")
        self.prev = array("q")
        self.entry_of = array("q")   # position -> the id of the response it belongs to
        self.head = array("q", [-1]) * (self.mask + 1)  # bucket -> its latest position
        self.spans: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (first position, end), oldest first
        self.write = 0    # the next position
        self.oldest = 0   # positions below this are gone
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.spans)

    @property
    def num_tokens(self) -> int:
        return self.write - self.oldest

    def _bucket(self, t0: int, t1: int, t2: int) -> int:
        return ((t0 * 0x9E3779B1) ^ (t1 * 0x85EBCA77) ^ (t2 * 0xC2B2AE3D)) & self.mask

    def add(self, prompt: Tokens[int], response: Tokens[int]) -> None:
        tail = list(prompt[max(0, len(prompt) - self.depth):])
        new = tail + list(response)
        if self.max_requests <= 0 or not response or len(new) > self.capacity:
            return
        while self.spans and (len(self.spans) >= self.max_requests
                              or self.write + len(new) - self.oldest > self.capacity):
            self.spans.popitem(last=False)
            self.oldest = next(iter(self.spans.values()))[0] if self.spans else self.write
        entry, first, cap = self._next_id, self.write, self.capacity
        self._next_id += 1
        self.spans[entry] = (first, first + len(new))
        for i, t in enumerate(new):
            pos = first + i
            if pos < cap:
                self.tokens.append(t)
                self.prev.append(-1)
                self.entry_of.append(entry)
            else:
                self.tokens[pos % cap] = t
                self.entry_of[pos % cap] = entry
        self.write = first + len(new)
        # Index the anchors that a response token follows: ends from the response's first token - 1.
        for pos in range(first + max(ANCHOR - 1, len(tail) - 1), self.write - 1):
            b = self._bucket(new[pos - first - 2], new[pos - first - 1], new[pos - first])
            self.prev[pos % cap] = self.head[b]
            self.head[b] = pos

    def propose(self, context: list[int], max_tokens: int, max_spec_factor: float, min_token_prob: float
                ) -> tuple[list[int], int]:
        """The draft after context from earlier responses, and the length of the match it continues (0: none).
        The match: the longest suffix of context (up to depth tokens) that some response's occurrence ends
        with; the draft: token by token, what most of those occurrences continue with, while the share that
        agrees (of all of them) stays at least min_token_prob; at most max_spec_factor x the match's length."""
        num = len(context)
        if num < ANCHOR or max_tokens <= 0 or not self.spans:
            return [], 0
        a0, a1, a2 = context[num - 3], context[num - 2], context[num - 1]
        pos = self.head[self._bucket(a0, a1, a2)]
        tokens, cap, oldest = self.tokens, self.capacity, self.oldest
        depth = min(self.depth, num)
        best, matches = 0, []  # (where the continuation starts, its response's end), latest first
        seen = 0
        while pos >= oldest and seen < MAX_CANDIDATES:
            r = pos % cap
            if tokens[r] == a2 and tokens[(pos - 1) % cap] == a1 and tokens[(pos - 2) % cap] == a0:
                seen += 1
                first, end = self.spans[self.entry_of[r]]
                n = ANCHOR
                while n < depth and pos - n >= first and tokens[(pos - n) % cap] == context[num - 1 - n]:
                    n += 1
                if n > best:
                    best, matches = n, [(pos + 1, end)]
                elif n == best:
                    matches.append((pos + 1, end))
            pos = self.prev[r]
        limit = min(max_tokens, int(max_spec_factor * best))
        draft: list[int] = []
        share = 1.0
        alive = matches
        while len(draft) < limit and alive:
            d = len(draft)
            nexts = [tokens[(s + d) % cap] if s + d < end else -1 for s, end in alive]  # -1: that response ended
            token = nexts[0]
            if token < 0 or nexts.count(token) < len(nexts):  # not unanimous: the most common, if common enough
                counts = Counter(t for t in nexts if t >= 0)
                if not counts:
                    break
                token, count = counts.most_common(1)[0]  # a tie goes to the latest occurrence's token
                share *= count / len(alive)
                if share < min_token_prob:
                    break
            draft.append(token)
            alive = [m for m, t in zip(alive, nexts) if t == token]
        return (draft, best) if draft else ([], 0)


class SuffixProposer:
    """Method "suffix": propose_with_length() as prompt lookup's (the Speculator calls both alike), the
    earlier responses in `corpus`, which finished requests are added to (`add`)."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float,
                 token_classes: np.ndarray | None = None, indents: Indents | None = None,
                 max_corpus_tokens: int = 1 << 20) -> None:
        self.own = NgramProposer(min(OWN_MIN_MATCH, max_depth), max_depth, token_classes, indents)
        self.corpus = ResponseCorpus(max_cached_requests, max_depth, max_corpus_tokens)
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob

    def add(self, prompt: Tokens[int], response: Tokens[int]) -> None:
        """A finished sequence's response (after its prompt), for later requests to draft from."""
        self.corpus.add(prompt, response)

    def propose_with_length(self, token_ids: list[int], max_tokens: int, index: LookupIndex | None = None
                            ) -> tuple[list[int], int]:
        """Up to max_tokens draft tokens following token_ids, and the draft's class (0 without a draft): the
        sequence's own match's length, or CORPUS_CLASS plus an earlier response's."""
        own, n = self.own.propose_with_length(token_ids, max_tokens, index)
        own = own[:int(self.max_spec_factor * n)]
        theirs, m = self.corpus.propose(token_ids, max_tokens, self.max_spec_factor, self.min_token_prob)
        if theirs and (m > n or not own):
            return theirs, CORPUS_CLASS + m
        return (own, n) if own else ([], 0)
