"""Prompt lookup against a brute-force reference over every n and every earlier occurrence."""
import random

import pytest

from kvserve.spec_decode.ngram import NgramProposer


def reference(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    return reference_with_length(tokens, lo, hi, k)[0]


def reference_with_length(tokens: list[int], lo: int, hi: int, k: int) -> tuple[list[int], int]:
    """The draft, and the n of the match it continues (0 without one)."""
    start, n = reference_start(tokens, lo, hi, k)
    return (tokens[start:start + k], n) if n else ([], 0)


def reference_start(matched: list[int], lo: int, hi: int, k: int) -> tuple[int, int]:
    """Where the draft begins in the sequence (tokens as matched), and the n of its match (0 without one)."""
    for n in range(hi, lo - 1, -1):
        if len(matched) < n + 1:
            continue
        suffix = matched[-n:]
        starts = [i for i in range(len(matched) - n) if matched[i:i + n] == suffix]
        if starts:
            full = [i for i in starts if i + n + k <= len(matched)]
            i = full[-1] if full else starts[0]
            return i + n, n
    return 0, 0


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
    # ... and says how long the match was: what draft_length.py trusts a draft by.
    assert p.propose_with_length([1, 2, 3, 4, 0, 3, 4, 8, 8, 1, 2, 3, 4], 2) == ([0, 3], 4)
    assert p.propose_with_length([1, 2, 3, 9, 9, 1, 2], 3) == ([3, 9, 9], 2)
    assert p.propose_with_length([1, 2, 3, 4, 5, 6], 3) == ([], 0)


@pytest.mark.parametrize("lo,hi", [(1, 1), (1, 3), (2, 4), (3, 5)])
def test_matches_brute_force(lo, hi):
    rng = random.Random(lo * 10 + hi)
    p = NgramProposer(lo, hi)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        k = rng.randrange(1, 6)
        assert p.propose(tokens, k) == reference(tokens, lo, hi, k), (tokens, k)
        assert p.propose_with_length(tokens, k) == reference_with_length(tokens, lo, hi, k), (tokens, k)


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 4)])
def test_classes_that_are_the_ids_change_nothing(lo, hi):
    """token_classes naming every token as itself gives the plain proposer's drafts."""
    import numpy as np

    rng = random.Random(lo + 7 * hi)
    p, same = NgramProposer(lo, hi), NgramProposer(lo, hi, np.arange(8))
    for _ in range(200):
        tokens = [rng.randrange(8) for _ in range(rng.randrange(1, 40))]
        assert same.propose(tokens, 4) == p.propose(tokens, 4)


def test_reindented_code_still_drafts_with_whitespace_classes():
    """The default model's tokenizer: a copy of code re-indented by 4 spaces where the prompt had 8. The
    indentation tokens differ ('\\n   ' against '\\n       '), so the plain proposer finds no 2-gram after
    the line's first word; matched as whitespace classes, it drafts the rest of the prompt's line."""
    from kvserve.models.default import default_model_path
    from kvserve.models.loader import load_tokenizer
    from kvserve.spec_decode.ngram import whitespace_classes

    tok = load_tokenizer(default_model_path())
    classes = whitespace_classes(tok, tok.vocab_size)
    ids = {text: tok.encode(text, add_special_tokens=False) for text in (" ", "  ", "\n", "\n   ", " total")}
    assert all(len(v) == 1 for v in ids.values()), ids
    assert classes[ids[" "][0]] == classes[ids["  "][0]] < 0                 # spaces: one class
    assert classes[ids["\n"][0]] == classes[ids["\n   "][0]] < 0             # a newline and its indent: another
    assert classes[ids[" "][0]] != classes[ids["\n"][0]]
    assert classes[ids[" total"][0]] == ids[" total"][0]                     # words match only themselves

    prompt = tok.encode("def area(width, height):\n        total = width * height\n        return total\n",
                        add_special_tokens=False)
    out = tok.encode("def area(width, height):\n    total", add_special_tokens=False)
    assert NgramProposer(2, 4).propose(prompt + out, 4) == []
    draft = NgramProposer(2, 4, classes).propose(prompt + out, 4)
    assert tok.decode(draft) == " = width * height"


def test_a_draft_past_the_line_end_takes_the_copys_indentation():
    """The default model's tokenizer: the copy re-indents the prompt's code from 8 spaces to 4. A draft that
    runs past the line's end drafts the next line's indentation as the copy has it (4 spaces) rather than as
    the prompt has it; without Indents the same draft carries the prompt's. Moved out (4 -> 8), the same."""
    from kvserve.models.default import default_model_path
    from kvserve.models.loader import load_tokenizer
    from kvserve.spec_decode.ngram import Indents, token_texts, whitespace_classes

    tok = load_tokenizer(default_model_path())
    texts = token_texts(tok)
    classes, indents = whitespace_classes(tok, tok.vocab_size, texts), Indents(texts)
    for was, now in (("        ", "    "), ("    ", "        ")):
        code = "def area(width, height):\n{0}total = width * height\n{0}return total\n"
        prompt = tok.encode(code.format(was), add_special_tokens=False)
        out = tok.encode(code.format(now).split(" * ")[0], add_special_tokens=False)  # "... total = width"
        plain = NgramProposer(2, 8, classes).propose(prompt + out, 8)
        assert tok.decode(plain).startswith(f" * height\n{was}return")
        draft, n = NgramProposer(2, 8, classes, indents).propose_with_length(prompt + out, 8)
        assert n > 0 and tok.decode(draft).startswith(f" * height\n{now}return total\n")


def test_indents_change_no_draft_where_no_indentation_differs():
    """Where no match pairs two different indentations, drafts with Indents are the plain ones: random
    sequences over words and one indentation token per class ('\n' has none: it moves nothing)."""
    import numpy as np

    from kvserve.spec_decode.ngram import Indents

    texts = ["a", "b", "c", " =", "\n", "\n   ", "\n\n       ", " "]
    classes = np.array([0, 1, 2, 3, -2, -2, -3, -1])
    rng = random.Random(3)
    plain, indented = NgramProposer(2, 6, classes), NgramProposer(2, 6, classes, Indents(texts))
    for _ in range(300):
        tokens = [rng.randrange(len(texts)) for _ in range(rng.randrange(3, 60))]
        assert indented.propose_with_length(tokens, 6) == plain.propose_with_length(tokens, 6)


def test_indents_only_move_indentation_and_never_lengthen_a_draft():
    """Random sequences over words and indentations of several widths per newline count (so matches do pair
    different widths): with Indents, a draft is the plain draft's prefix with indentation tokens swapped for
    ones of the same newlines, never longer, every id in the vocabulary, and no draft exactly when the match
    length is 0."""
    import numpy as np

    from kvserve.spec_decode.ngram import Indents

    texts = ["a", "b", " =", "\n", "\n ", "\n   ", "\n       ", "\n\n   ", "\n\n       ", "\r\n   ", "\n\t"]
    classes = np.array([0, 1, 2] + [-1 - t.count("\n") for t in texts[3:]])
    head = {i: t[:t.rfind("\n") + 1] for i, t in enumerate(texts) if "\n" in t}
    rng = random.Random(5)
    plain, indented = NgramProposer(2, 6, classes), NgramProposer(2, 6, classes, Indents(texts))
    moved_any = False
    for _ in range(3000):
        tokens = [rng.randrange(len(texts)) for _ in range(rng.randrange(3, 50))]
        k = rng.randrange(1, 7)
        (p, _), (d, dn) = plain.propose_with_length(tokens, k), indented.propose_with_length(tokens, k)
        assert len(d) <= len(p) <= k and (dn == 0) == (not d) and all(0 <= t < len(texts) for t in d)
        for x, y in zip(d, p):
            assert x == y or (classes[x] == classes[y] < 0 and head[x] == head[y]), (tokens, k, d, p)
        moved_any |= d != p[:len(d)]
    assert moved_any  # the toy sequences did exercise the move


def test_indents_move_a_toy_draft_and_stop_where_no_token_fits():
    """Toy vocabulary: the copy's line starts with '\n   ' where the prompt's had '\n       ' (4 spaces
    out); the draft's next indentation moves by -4, and a draft stops before an indentation with no token
    at its new width."""
    import numpy as np

    from kvserve.spec_decode.ngram import Indents

    texts = ["a", "b", "c", "d", "\n   ", "\n       ", "\n           "]
    classes = np.array([0, 1, 2, 3, -2, -2, -2])
    p = NgramProposer(2, 6, classes, Indents(texts))
    prompt = [5, 0, 1, 5, 2, 3, 6, 0, 4, 1]  # "\n       a b\n       c d\n           a\n   b"
    copy = [4, 0, 1]                         # the first line again, 4 spaces out
    assert p.propose(prompt + copy, 6) == [4, 2, 3, 5, 0]  # next lines 4 out; '\n   ' - 4 has no token


@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 4), (2, 8)])
def test_an_index_kept_as_the_sequence_grows_drafts_as_a_fresh_one(lo, hi):
    """The engine keeps one LookupIndex per sequence and extends it step by step (tokens appended one or
    several at a time, as accepted runs append them); its drafts equal the brute-force reference at every
    length, with whitespace-like classes too."""
    import numpy as np

    from kvserve.spec_decode.ngram import LookupIndex

    rng = random.Random(lo * 100 + hi)
    classes = np.array([0, 1, 2, 3, -1, -1])  # tokens 4 and 5 match each other
    for proposer, as_matched in ((NgramProposer(lo, hi), lambda t: t),
                                 (NgramProposer(lo, hi, classes), lambda t: [int(classes[x]) for x in t])):
        for _ in range(40):
            tokens, index = [], LookupIndex()
            while len(tokens) < 60:
                tokens += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
                k = rng.randrange(1, 6)
                start, n = reference_start(as_matched(tokens), lo, hi, k)
                expected = (tokens[start:start + k], n) if n else ([], 0)  # the occurrence's own tokens
                assert proposer.propose_with_length(tokens, k, index) == expected, (tokens, k)
