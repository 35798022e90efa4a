"""Suffix decoding (vLLM's method "suffix"; or in front of a draft model or eagle head, enable_suffix_decoding):
drafts from the sequence's own text and from earlier responses.

Prompt lookup (ngram.py) finds the sequence's last tokens earlier in the same sequence. Suffix decoding
(Oliaro et al., arXiv 2411.04975) also searches what earlier requests answered, so that a question asked
again, a prompt sampled again one request after another (rollouts) or an agent's loop that repeats itself
drafts what came the times before. Here:
- a match is the longest common suffix, up to suffix_decoding_max_tree_depth tokens;
- from earlier responses the draft follows, token by token, the continuation most of the longest matches
  share, while the share of them that agrees stays at least suffix_decoding_min_token_prob;
- a draft holds at most suffix_decoding_max_spec_factor x its match's length (a long match earns a long one);
- the longer of the two matches (the sequence's own, the earlier responses') drafts; a tie goes to the own.
Whatever its source a draft is only a proposal: verification treats it as a draft of probability one and
draws nothing for it from a request's generator, so outputs are exactly the target's (verify.py).

Where vLLM's (Arctic Inference's suffix trees) differs:
- its depth bounds a match and its draft together, and among match lengths it keeps the draft whose token
  probabilities sum highest; here the depth bounds the match, num_speculative_tokens and the factor the draft;
- as there, a response drafts for other requests while it is generated (samples running side by side, n > 1,
  or a question asked again before its first answer is done); here a running response is searched where it
  is (the other sequence's own lookup index) rather than added to the corpus, which takes it when it
  finishes, and only while at most MAX_PEERS + 1 sequences run (prefilling ones included);
- its tree of earlier responses holds the responses alone; here each comes after its prompt's last `depth`
  tokens, so that an answer's first tokens are found after the same question;
- the sequence's own match here is prompt lookup's (NgramProposer, from OWN_MIN_MATCH tokens, with its
  whitespace classes and re-indenting), which drafts the latest occurrence rather than the most frequent;
- a response of a request with a cache_salt drafts only for requests with the same salt, prefix caching on
  or off (tenants kept apart in the prefix cache stay apart here).
"""
from __future__ import annotations

import itertools
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence as Tokens
from dataclasses import dataclass

import numpy as np

from kvserve.spec_decode.ngram import Indents, LookupIndex, NgramProposer

OWN_MIN_MATCH = 2     # the sequence's own text: prompt lookup's usual shortest match
# Earlier responses are found through hash chains on their last ANCHORS tokens, the longer tried first: every
# chat answer begins after the same template tokens, so the last 3 alone would find only the most recent
# answers' beginnings (measured: a question was not found again after 64 others).
ANCHORS = (8, 3)
MIN_CORPUS_MATCH = ANCHORS[-1]
MAX_CANDIDATES = 64   # occurrences that share the anchor, latest first, that a lookup extends
MAX_VISITS = 256      # chain links a lookup follows at most (occurrences that share only the hash included)
# Responses still being generated that a lookup searches: each costs a dict lookup and a walk of up to
# MAX_CANDIDATES occurrences a step, so above this many others running (where text drafts are off by default
# anyway: lookup_disable_by_batch_size) none.
MAX_PEERS = 8
# A draft's class (draft_length.py keeps acceptance per class): for the sequence's own match its length, as
# prompt lookup's; for an earlier response's, this plus its length (the two kinds are trusted apart). Above any
# match a context can hold, so that no depth makes the two kinds share a class.
CORPUS_CLASS = 1 << 32


def draft_limit(max_tokens: int, max_spec_factor: float, match: int) -> int:
    """How many tokens a match of this length may draft: max_spec_factor x its length, up to max_tokens (the
    small epsilon keeps 2.3 x 10 from rounding down to 22)."""
    spec = max_spec_factor * match
    return max_tokens if spec >= max_tokens else int(spec + 1e-6)


_B, _M = 0x100000001B3, (1 << 64) - 1  # a polynomial hash of a window of tokens, mod 2**64


def _window_hash(tokens, end: int, length: int) -> int:
    """The hash of the `length` tokens ending at position `end` of tokens (any indexable): the sum of each
    token times _B to the power of its distance from the end, so that it can also be rolled along (add)."""
    h = 0
    for i in range(end - length + 1, end + 1):
        h = (h * _B + tokens[i]) & _M
    return h


def _bucket(h: int, mask: int) -> int:
    h = (h ^ (h >> 31)) * 0x9E3779B97F4A7C15 & _M
    return (h >> 20) & mask


class ResponseCorpus:
    """The responses of the most recent finished requests (up to max_requests, and max_tokens tokens together),
    each after the last `depth` tokens of its prompt.

    Kept as a compressor keeps its window: the tokens in a ring of max_tokens slots, addressed by a position
    that only grows, and for each anchor length a hash chain through every position that ends such an anchor
    and is followed by a response token or ends the response (`heads`: a bucket's latest position; `prevs`:
    the one before it in the same bucket). The oldest responses leave by moving `oldest` past them, and a
    chain walk stops there, so nothing is unlinked. Arrays of 28 bytes a token and 16 a bucket with both
    anchors (the buckets a power of two >= max_tokens), and a dict entry a response. Measured with 2**20
    tokens of responses (Zipf-distributed ids, 152-token entries): 46 MiB (a first index of Python dicts of
    deques took 706 MiB); adding a response 0.2 ms; a lookup 6-7 us where the context is not in the corpus,
    ~31 us where it drafts 24 tokens."""

    def __init__(self, max_requests: int, depth: int, max_tokens: int = 1 << 20) -> None:
        self.max_requests = max_requests
        self.depth = depth
        self.capacity = max_tokens
        self.anchors = [a for a in ANCHORS if a <= depth] if max_requests > 0 else []
        self.mask = (1 << max(10, (max_tokens - 1).bit_length())) - 1 if self.anchors else 0
        self.heads = [array("q", [-1]) * (self.mask + 1) for _ in self.anchors]
        # Per position, grown up to capacity as responses come, then reused ring-wise.
        self.tokens = array("i")
        self.entry_of = array("q")   # the id of the response a position belongs to
        self.prevs = [array("q") for _ in self.anchors]
        self.spans: OrderedDict[int, tuple[int, int]] = OrderedDict()  # id -> (first position, end), oldest first
        # id -> the cache_salt its request carried (unsalted ones absent): a salted response drafts only for
        # requests with the same salt, so that tenants kept apart in the prefix cache are kept apart here too
        # (a draft's acceptance shows in a stream's speed what another tenant was answered).
        self.salts: dict[int, str] = {}
        self.write = 0    # the next position
        self.oldest = 0   # positions below this are gone
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.spans)

    def clear(self) -> None:
        """Forgets every response (the chains stop at `oldest`, so nothing else needs touching)."""
        self.spans.clear()
        self.salts.clear()
        self.oldest = self.write

    @property
    def num_tokens(self) -> int:
        return self.write - self.oldest

    def add(self, token_ids: Tokens[int], num_prompt_tokens: int, salt: str | None = None) -> None:
        """A finished sequence's tokens, its prompt's first: its response, kept after the prompt's last `depth`
        tokens (the oldest responses leave to make room); salt: its request's cache_salt."""
        start = max(0, num_prompt_tokens - self.depth)
        new = list(token_ids[start:])
        tail = num_prompt_tokens - start  # the prompt's tokens kept before the response
        if not self.anchors or len(new) == tail or len(new) > self.capacity:
            return
        stored = array("i", new)  # first, so that an id the array cannot hold fails before anything changes
        while self.spans and (len(self.spans) >= self.max_requests
                              or self.write + len(new) - self.oldest > self.capacity):
            gone, _ = self.spans.popitem(last=False)
            self.salts.pop(gone, None)
            self.oldest = next(iter(self.spans.values()))[0] if self.spans else self.write
        entry, first, cap = self._next_id, self.write, self.capacity
        self._next_id += 1
        self.spans[entry] = (first, first + len(new))
        if salt is not None:
            self.salts[entry] = salt
        self.write = first + len(new)
        grown = min(len(new), cap - first) if first < cap else 0  # the ring still growing: appended
        self.tokens.extend(stored[:grown])
        self.entry_of.extend(array("q", [entry]) * grown)
        for prev in self.prevs:
            prev.extend(array("q", [-1]) * grown)
        rest, r = stored[grown:], (first + grown) % cap  # then in place, wrapping round once at most
        while rest:
            n = min(len(rest), cap - r)
            self.tokens[r:r + n] = rest[:n]
            self.entry_of[r:r + n] = array("q", [entry]) * n
            rest, r = rest[n:], 0
        for length, head, prev in zip(self.anchors, self.heads, self.prevs):
            # Anchors inside this response and its tail whose next token is a response token, or that end it;
            # the hash rolled from one to the next.
            lo = max(length - 1, tail - 1)
            if lo >= len(new):
                continue
            h, drop = _window_hash(new, lo, length), pow(_B, length, 1 << 64)
            for i in range(lo, len(new)):
                if i > lo:
                    h = (h * _B + new[i] - new[i - length] * drop) & _M
                b = _bucket(h, self.mask)
                prev[(first + i) % cap] = head[b]
                head[b] = first + i

    def propose(self, context: list[int], max_tokens: int, max_spec_factor: float, min_token_prob: float,
                salt: str | None = None) -> tuple[list[int], int]:
        """The draft after context from earlier responses, and the length of the match it continues (0: none).
        The match: the longest suffix of context, up to depth tokens and at least MIN_CORPUS_MATCH, that some
        response's occurrence ends with (among the latest MAX_CANDIDATES that share the longest anchor that
        any shares); the draft: token by token, what most of those occurrences continue with, while the
        ones that agree are at least min_token_prob of them all; at most max_spec_factor x the match. Only
        responses added with this salt (a request's cache_salt) are looked at."""
        num = len(context)
        if max_tokens <= 0 or not self.spans:
            return [], 0
        for length, head, prev in zip(self.anchors, self.heads, self.prevs):
            if num >= length:
                best, matches = self._longest(context, length, head, prev, salt)
                if matches:
                    break
        else:
            return [], 0
        limit = draft_limit(max_tokens, max_spec_factor, best)
        tokens, cap = self.tokens, self.capacity
        draft: list[int] = []
        alive = matches
        while len(draft) < limit:
            d = len(draft)
            nexts = [tokens[(s + d) % cap] if s + d < end else -1 for s, end in alive]  # -1: that response ended
            token = nexts[0]
            if token < 0 or nexts.count(token) < len(nexts):
                counts = Counter(t for t in nexts if t >= 0)
                if not counts:
                    break
                token = counts.most_common(1)[0][0]  # a tie goes to the latest occurrence's token
            alive = [m for m, t in zip(alive, nexts) if t == token]
            if len(alive) < min_token_prob * len(matches):  # an occurrence that ended counts against
                break
            draft.append(token)
        return (draft, best) if draft else ([], 0)

    def _longest(self, context: list[int], length: int, head: array, prev: array, salt: str | None
                 ) -> tuple[int, list[tuple[int, int]]]:
        """The longest match among the latest occurrences of context's last `length` tokens, and for each
        occurrence that long (latest first): where its continuation starts, and its response's end."""
        num, tokens, cap, oldest = len(context), self.tokens, self.capacity, self.oldest
        depth = min(self.depth, num)
        pos = head[_bucket(_window_hash(context, num - 1, length), self.mask)]
        best, matches = 0, []
        seen = visits = 0
        while pos >= oldest and seen < MAX_CANDIDATES and visits < MAX_VISITS:
            visits += 1
            r = pos % cap
            entry = self.entry_of[r]
            if self.salts.get(entry) != salt:  # another tenant's
                pos = prev[r]
                continue
            first, end = self.spans[entry]
            n = 0
            while n < depth and pos - n >= first and tokens[(pos - n) % cap] == context[num - 1 - n]:
                n += 1
            if n >= length:  # else only the hash was shared
                seen += 1
                if n > best:
                    best, matches = n, [(pos + 1, end)]
                elif n == best:
                    matches.append((pos + 1, end))
            pos = prev[r]
        return best, matches


@dataclass
class Running:
    """A response being generated, as another sequence's lookup reads it: its sequence's tokens (the prompt's
    first) and prompt lookup's index of them (ngram.LookupIndex), kept by the sequence's own drafting."""
    token_ids: list[int]
    num_prompt_tokens: int
    index: LookupIndex
    salt: str | None  # its request's cache_salt


class SuffixProposer:
    """Suffix decoding (method "suffix", or enable_suffix_decoding in front of a model): propose_with_length()
    as prompt lookup's, with the request's cache_salt besides; the earlier responses in `corpus`, which the
    Speculator adds finished sequences to, and the running ones in `running`, which it sets each step."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_spec_factor: float, min_token_prob: float,
                 token_classes: np.ndarray | None = None, indents: Indents | None = None,
                 max_corpus_tokens: int = 1 << 20) -> None:
        self.own = NgramProposer(min(OWN_MIN_MATCH, max_depth), max_depth, token_classes, indents)
        self.corpus = ResponseCorpus(max_cached_requests, max_depth, max_corpus_tokens)
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.running: list[Running] = []

    def searches_running(self, num_running: int) -> bool:
        """Whether a step of this many running sequences drafts from their responses too: not without a corpus
        (as vLLM keeps them in its corpus's tree) or a depth that holds a corpus match, nor above MAX_PEERS
        others."""
        return bool(self.corpus.anchors) and num_running <= MAX_PEERS + 1

    def set_running(self, running: list[Running]) -> None:
        """This step's running responses (where searches_running), their indexes brought up to date once for
        every lookup of the step; [] after it, so that no finished sequence's tokens are held."""
        for r in running:
            r.index.extend(r.token_ids, self.own.token_classes, self.own.min_n)
        self.running = running

    def propose_with_length(self, token_ids: list[int], max_tokens: int, index: LookupIndex | None = None,
                            salt: str | None = None) -> tuple[list[int], int]:
        """Up to max_tokens draft tokens following token_ids, and the draft's class (0 without a draft): the
        sequence's own match's length, or CORPUS_CLASS plus an earlier response's (one its request's
        cache_salt, `salt`, may see), finished or still running (a finished one's match wins a tie)."""
        index = index if index is not None else LookupIndex()
        own, n = self.own.propose_with_length(token_ids, max_tokens, index)
        own = own[:draft_limit(max_tokens, self.max_spec_factor, n)]
        if own and n >= self.corpus.depth:  # no earlier response can match longer
            return own, n
        theirs, m = self.corpus.propose(token_ids, max_tokens, self.max_spec_factor, self.min_token_prob, salt)
        if self.running:
            index.extend(token_ids, self.own.token_classes, self.own.min_n)  # if the own lookup returned early
            running, r = self._propose_running(index, max_tokens, salt)
            if running and r > m:
                theirs, m = running, r
        if theirs and (m > n or not own):
            return theirs, CORPUS_CLASS + m
        return (own, n) if own else ([], 0)

    def _propose_running(self, index: LookupIndex, max_tokens: int, salt: str | None) -> tuple[list[int], int]:
        """The draft from the longest match, up to depth tokens and at least MIN_CORPUS_MATCH, of the sequence's
        end (its index's classes, as its own lookup matches) in another running response that this salt may
        see, followed there by at least one response token. Among equal matches, one with a whole draft after
        it, the latest (in a response that repeats, what it is doing now), as prompt lookup chooses; else the
        one with the most after it. Each response's latest MAX_CANDIDATES occurrences of the last n0 tokens."""
        classes, n0 = index.classes, self.own.min_n
        num = len(classes)
        if num < n0:
            return [], 0
        key, depth = tuple(classes[num - n0:]), min(self.corpus.depth, num)
        full = (depth, draft_limit(max_tokens, self.max_spec_factor, depth))  # what nothing can beat
        best, best_start, best_peer = (0, 0), 0, None  # best: (match, draft tokens after it)
        for peer in self.running:
            if best == full:
                break
            if peer.index is index or peer.salt != salt:  # the sequence itself: its own match is prompt lookup's
                continue
            theirs, total = peer.index.classes, len(peer.token_ids)
            for e in itertools.islice(reversed(peer.index.ends.get(key, ())), MAX_CANDIDATES):  # latest first
                if e < peer.num_prompt_tokens - 1:  # this and all earlier ones: a prompt token follows
                    break
                if e + 1 >= total:  # the response's end: nothing follows yet
                    continue
                n = n0
                while n < depth and e - n >= 0 and theirs[e - n] == classes[num - 1 - n]:
                    n += 1
                limit = draft_limit(max_tokens, self.max_spec_factor, n)
                found = (n, min(total - e - 1, limit))
                if found > best:
                    best, best_start, best_peer = found, e + 1, peer
                    if found == full:
                        break
        match, length = best
        if match < MIN_CORPUS_MATCH or not length:
            return [], 0
        return best_peer.token_ids[best_start:best_start + length], match
