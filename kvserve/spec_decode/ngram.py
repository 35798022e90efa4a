"""Prompt-lookup drafting: the continuation of the sequence's last n tokens, found earlier in the sequence.

Repetition-heavy outputs (code edits, quoting, summaries reusing the passage's words) copy long runs of
their own context, so where the last n tokens occurred before, what followed them is a good guess for
what comes next. Free to compute: no model, and an index of the sequence kept as it grows (LookupIndex).

Whitespace-only tokens match each other when they hold the same number of newlines (token_classes): a model
asked to repeat code often re-indents it, and its indentation tokens then differ from the prompt's, so the
first two tokens of every line had no n-gram to match. Replayed on the default model's outputs for the
benchmark's copy prompts (benchmarks/speculative.py, greedy), this cut the steps without a draft from 158 to
121 of ~340 and raised the tokens per step from 2.44 to 2.68, with acceptance 0.65 -> 0.67; summaries and
chat were unchanged. The draft is the earlier occurrence's own tokens, with one exception (Indents): where
the copy's current line is indented by other than the prompt's, so are the draft's later lines.
Verification decides as always.
"""
from __future__ import annotations

import itertools

import numpy as np

from kvserve.tokenizer.tokenizer import Tokenizer


MAX_INDENT_WALK = 64  # tokens Indents looks back for the copy's current line's indentation


def token_texts(tokenizer: Tokenizer) -> list[str]:
    """Every token id's text on its own."""
    return tokenizer.backend.decode_batch([[i] for i in range(tokenizer.vocab_size)], skip_special_tokens=False)


def whitespace_classes(tokenizer: Tokenizer, vocab_size: int, texts: list[str] | None = None) -> np.ndarray:
    """token id -> the id it is matched as: -1 - (its newlines) for a token of whitespace only, else itself.
    texts: token_texts(tokenizer), where the caller has them."""
    classes = np.arange(max(vocab_size, tokenizer.vocab_size), dtype=np.int64)
    for i, text in enumerate(token_texts(tokenizer) if texts is None else texts):
        if text and text.isspace():
            classes[i] = -1 - text.count("\n")
    return classes


class Indents:
    """Moves a draft's indentation with the copy's. A model copying code often re-indents it (a method made
    a function, a block moved in or out): every line's first token, a newline and its indentation in one
    token, then differs from the prompt's. Matched as whitespace classes the lookup still follows the
    prompt, but a draft running past a line's end was wrong at the next line's first token. So the copy's
    current line says by how much it moved (its indentation token against the prompt's at the same place),
    and the draft's indentation tokens move by as many spaces; a draft stops before one that has no token
    for its new width. Only tokens holding a newline and then spaces count as indentation: a line at column 0
    (a bare newline) neither measures nor moves, and a tokenizer that splits newlines from the spaces after
    them (its indentation in tokens of spaces alone) is left as it was. The measure is the nearest
    whitespace pair behind the match, normally the current line's first token. Replayed on the default
    model's greedy copies of the benchmark's 8 copy prompts (4 of them code, 3 re-indented), drafting up to 8
    tokens: 340 -> 329 verification steps for the same 1369 tokens (up to 4: 439 -> 431), and 25 of the 35
    drafts whose first token was a wrong indentation right."""

    def __init__(self, texts: list[str]) -> None:
        self.spaces: dict[int, int] = {}              # indentation token id -> spaces after its last newline
        self.head: dict[int, str] = {}                # ... -> its text up to and with its last newline
        self.ids: dict[tuple[str, int], int] = {}     # (head, spaces) -> the token
        for i, text in enumerate(texts):
            nl = text.rfind("\n")
            width = len(text) - nl - 1
            if nl >= 0 and width > 0 and text.isspace() and text[nl + 1:] == " " * width:
                self.ids.setdefault((text[:nl + 1], width), i)
                self.spaces[i], self.head[i] = width, text[:nl + 1]

    def follow(self, token_ids: list[int], classes: list[int], start: int, draft: list[int]) -> list[int]:
        """draft (token_ids[start:...], an earlier occurrence's continuation of the sequence's end, matched by
        classes) re-indented as the sequence's current line is against the occurrence's."""
        num = len(token_ids)
        if not self.spaces:  # a vocabulary without indentation tokens (newlines and spaces apart)
            return draft
        for j in range(1, min(start, MAX_INDENT_WALK) + 1):  # back from the match to the nearest whitespace
            a, b = start - j, num - j
            if classes[a] != classes[b]:
                return draft
            if classes[b] < 0:
                break
        else:
            return draft
        was, now = self.spaces.get(token_ids[a]), self.spaces.get(token_ids[b])
        if was is None or now is None or was == now:
            return draft
        moved = []
        for t in draft:
            width = self.spaces.get(t)
            if width is not None:
                t = self.ids.get((self.head[t], width + now - was))
                if t is None:
                    break
            moved.append(t)
        return moved


class LookupIndex:
    """One sequence's tokens as they are matched (their classes), and where each n-gram of the proposer's
    shortest length ends: extended by the tokens appended since the last lookup, so a step's lookup walks
    the earlier ends of the sequence's last such n-gram, not the whole sequence."""

    def __init__(self) -> None:
        self.classes: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token, ascending

    def extend(self, token_ids: list[int], token_classes: np.ndarray | None, n: int) -> None:
        classes = self.classes
        if len(token_ids) == len(classes):  # up to date (suffix decoding's lookups of other sequences extend first)
            return
        if len(token_ids) < len(classes):  # never expected: a sequence's tokens only grow
            classes.clear()
            self.ends.clear()
        new = token_ids[len(classes):]
        classes.extend(new if token_classes is None else token_classes[new].tolist())
        for i in range(max(len(classes) - len(new), n - 1), len(classes)):
            self.ends.setdefault(tuple(classes[i - n + 1:i + 1]), []).append(i)


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, token_classes: np.ndarray | None = None,
                 indents: Indents | None = None) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self.token_classes = token_classes  # None: tokens match only themselves
        self.indents = indents              # None: drafts are the occurrence's tokens as they are

    def propose(self, token_ids: list[int], max_tokens: int, index: LookupIndex | None = None) -> list[int]:
        """Up to max_tokens draft tokens following token_ids (may be fewer, or none without a match).

        Longest n first; among matches of one n, the most recent one followed by max_tokens tokens (in a
        sequence that repeats, the latest occurrence is the one the text is currently copying), else the
        earliest (the longest continuation there is). index: the sequence's LookupIndex, kept between its
        steps (None: one made for this call)."""
        return self.propose_with_length(token_ids, max_tokens, index)[0]

    def propose_with_length(self, token_ids: list[int], max_tokens: int, index: LookupIndex | None = None,
                            salt: str | None = None) -> tuple[list[int], int]:
        """propose()'s draft and the length n of the match it continues (0 without a draft). salt (the request's
        cache_salt, which SuffixProposer's signature takes too) changes nothing: the text is the sequence's own.

        n says how far to trust the draft: replayed on the default model's greedy outputs for the
        benchmark's copy prompts, a 4-token draft after a 4-gram match had 3.2 tokens accepted on average,
        after a 2-gram 1.0 and after a single token 0.6 (draft_length.py keeps acceptance per n)."""
        num = len(token_ids)
        if max_tokens <= 0 or num < self.min_n + 1:
            return [], 0
        index = index if index is not None else LookupIndex()
        index.extend(token_ids, self.token_classes, self.min_n)
        classes = index.classes
        # Candidates: the earlier ends of the last min_n tokens' n-gram, each extended backwards, latest first.
        # (The whole-sequence scan with numpy this replaced took ~28 us a sequence a step at 4 streams of chat:
        # most of what prompt lookup cost a step that drafted nothing.)
        ends = index.ends[tuple(classes[num - self.min_n:])]  # its last entry: the sequence's own end
        cap = min(self.max_n, num - 1)
        best, best_ends = 0, []
        for e in itertools.islice(reversed(ends), 1, None):
            n = self.min_n
            while n < cap and e - n >= 0 and classes[e - n] == classes[num - 1 - n]:
                n += 1
            if n > best:
                best, best_ends = n, [e]
            elif n == best:
                best_ends.append(e)
            if n == cap and e + 1 + max_tokens <= num:
                break  # the latest full-length match with a whole draft after it: nothing earlier beats it
        if best < self.min_n:
            return [], 0
        starts = [e + 1 for e in best_ends]  # latest first
        full = [s for s in starts if s + max_tokens <= num]
        start = full[0] if full else starts[-1]
        draft = token_ids[start:start + max_tokens]
        if self.indents is not None and self.token_classes is not None:
            draft = self.indents.follow(token_ids, classes, start, draft)
        return (draft, best) if draft else ([], 0)
