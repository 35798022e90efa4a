"""Method "suffix" (kvserve/spec_decode/suffix.py): drafts from the sequence's own text and from earlier
requests' responses. The corpus and proposer against hand-worked cases and a rebuilt index; the engine's
outputs against the same engine without speculation (greedy and seeded, with preemption, n = 2, prefix hits
and aborts), with drafts taken from earlier responses; vLLM's fields and their errors."""
import random
from array import array
from collections import Counter

import pytest

from kvserve.config import EngineConfig
from kvserve.entrypoints.cli import build_parser, engine_config
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.ngram import LookupIndex
from kvserve.spec_decode.suffix import (ANCHORS, CORPUS_CLASS, MAX_CANDIDATES, MAX_PEERS, ResponseCorpus, Running,
                                       SuffixProposer, draft_limit)
from engine_helpers import assert_no_leaks, drain
from spec_helpers import make_engine, on_record, prompts, run_waves

PROMPT = [50, 51, 52, 53, 54]


def test_a_prompt_asked_again_drafts_the_earlier_response():
    corpus = ResponseCorpus(max_requests=10, depth=4)
    corpus.add(PROMPT + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], len(PROMPT))
    # The context ends as the prompt did: the match is the prompt's last 4 tokens (the depth), the draft at most
    # factor x 4 tokens of the response.
    assert corpus.propose([9, 9] + PROMPT, 32, 1.0, 0.1) == ([1, 2, 3, 4], 4)
    assert corpus.propose([9, 9] + PROMPT, 32, 2.0, 0.1) == ([1, 2, 3, 4, 5, 6, 7, 8], 4)
    assert corpus.propose([9, 9] + PROMPT, 3, 2.0, 0.1) == ([1, 2, 3], 4)  # max_tokens
    # Part way into the response: the match is the response's own tokens, and the draft what followed them.
    assert corpus.propose([7, 7, 7, 3, 4, 5], 32, 1.0, 0.1) == ([6, 7, 8], 3)
    # Fewer than ANCHOR tokens in common: no draft; nor past the response's end.
    assert corpus.propose([7, 7, 7, 8, 4, 5], 32, 1.0, 0.1) == ([], 0)
    assert corpus.propose([7, 8, 9, 10], 32, 1.0, 0.1) == ([], 0)


def test_the_continuation_most_matches_share_while_its_share_is_high_enough():
    corpus = ResponseCorpus(max_requests=10, depth=8)
    for response in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 5, 6, 7], [8, 9, 9, 9]):
        corpus.add(PROMPT + response, len(PROMPT))
    ctx = [0] + PROMPT
    # After the prompt: 1 in 3 of 4 matches (0.75); then 2 in 2 of those 3 (0.5); then 3, 4 (0.5 each).
    assert corpus.propose(ctx, 32, 4.0, 0.1) == ([1, 2, 3, 4], 5)
    assert corpus.propose(ctx, 32, 4.0, 0.6) == ([1], 5)
    assert corpus.propose(ctx, 32, 4.0, 0.8) == ([], 0)
    # A longer match wins over more frequent shorter ones: only the response whose prompt ended in 49, 50, ...
    corpus.add([49] + PROMPT + [8, 8, 8, 8, 8], len(PROMPT) + 1)
    assert corpus.propose([49] + PROMPT, 32, 4.0, 0.1) == ([8, 8, 8, 8, 8], 6)


def reference_propose(entries, depth: int, context: list[int], max_tokens: int, factor: float, min_prob: float):
    """ResponseCorpus.propose as its docstring says it, by brute force over the kept entries (tail + response,
    tail length; oldest first): the longest anchor (ANCHORS, at most depth) that some occurrence shares, the
    latest MAX_CANDIDATES occurrences of it, their longest matches, and the draft by majority."""
    num = len(context)
    for length in [a for a in ANCHORS if a <= min(depth, num)]:
        found = []  # (match, tokens, continuation start), latest first
        for tokens, tail in reversed(entries):
            for i in range(len(tokens) - 1, max(length - 1, tail - 1) - 1, -1):
                n = 0
                while n < min(depth, num) and i - n >= 0 and tokens[i - n] == context[num - 1 - n]:
                    n += 1
                if n >= length:
                    found.append((n, tokens, i + 1))
        found = found[:MAX_CANDIDATES]
        if found:
            best = max(n for n, _, _ in found)
            matches = [(tokens, start) for n, tokens, start in found if n == best]
            break
    else:
        return [], 0
    draft, alive = [], matches
    while len(draft) < min(max_tokens, int(factor * best + 1e-6)):
        nexts = [tokens[start + len(draft)] if start + len(draft) < len(tokens) else None for tokens, start in alive]
        counts = Counter(t for t in nexts if t is not None)
        if not counts:
            break
        token = counts.most_common(1)[0][0]
        alive = [a for a, t in zip(alive, nexts) if t == token]
        if len(alive) < min_prob * len(matches):
            break
        draft.append(token)
    return (draft, best) if draft else ([], 0)


@pytest.mark.parametrize("max_requests,depth,max_tokens,vocab,collide", [
    (5, 6, 1 << 20, 4, False),     # bounded by count
    (1000, 10, 90, 3, False),      # by tokens: a ring reused many times over, anchors of 8 and 3
    (1000, 4, 45, 3, False),       # the prompt's tail longer than... the depth cuts it
    (7, 24, 100, 6, False),
    (1000, 8, 12, 3, False),       # entries as long as the ring, and longer (not kept)
    (20, 9, 300, 1 << 20, True),   # ids up to 2**20 in 4 buckets: every anchor shares its bucket with others
])
def test_lookups_draft_what_the_kept_responses_give_by_brute_force(max_requests, depth, max_tokens, vocab, collide):
    rng = random.Random(max_requests * 7 + depth)
    corpus = ResponseCorpus(max_requests, depth, max_tokens)
    if collide:
        corpus.mask = 3
        corpus.heads = [array("q", [-1]) * 4 for _ in corpus.anchors]
    kept = []  # (tail + response, tail length), oldest first: what the corpus should hold
    drafted = 0
    symbols = [rng.randrange(vocab) for _ in range(4)] if collide else list(range(vocab))
    for _ in range(60):
        prompt = [rng.choice(symbols) for _ in range(rng.randrange(0, 12))]
        response = [rng.choice(symbols) for _ in range(rng.randrange(0, 14))]
        corpus.add(prompt + response, len(prompt))
        tail = prompt[max(0, len(prompt) - depth):]
        if response and len(tail) + len(response) <= max_tokens:
            while kept and (len(kept) >= max_requests or sum(map(len, (t for t, _ in kept))) + len(tail)
                            + len(response) > max_tokens):
                kept.pop(0)
            kept.append((tail + response, len(tail)))
        assert len(corpus) == len(kept) and corpus.num_tokens == sum(len(t) for t, _ in kept)
        for _ in range(6):
            if kept and rng.random() < 0.7:  # the end of a kept text, after some other tokens
                tokens, _ = rng.choice(kept)
                k = rng.randrange(1, len(tokens) + 1)
                context = [rng.choice(symbols) for _ in range(rng.randrange(0, 4))] + tokens[max(0, k - 12):k]
            else:
                context = [rng.choice(symbols) for _ in range(rng.randrange(0, 14))]
            for factor, share in ((1.0, 0.1), (2.5, 0.0), (0.5, 0.6), (3.0, 1.0)):
                got = corpus.propose(context, 8, factor, share)
                assert got == reference_propose(kept, depth, context, 8, factor, share), (context, factor, share)
                drafted += len(got[0])
    assert drafted > 0
    off = ResponseCorpus(max_requests=0, depth=6)
    off.add(PROMPT + [1, 2, 3], len(PROMPT))
    assert len(off) == 0 and off.propose(PROMPT, 8, 1.0, 0.1) == ([], 0)


def test_a_question_is_found_again_after_many_answers_that_began_alike():
    """Every chat answer starts after the same template tokens: the question's own tokens before them find
    its answer however many other answers came since (the last 3 tokens alone would find only the latest)."""
    rng = random.Random(1)
    template = [1, 2, 3, 4, 5]
    question, answer = [rng.randrange(100, 50000) for _ in range(12)] + template, list(range(600, 640))
    corpus = ResponseCorpus(10000, 24)
    corpus.add(question + answer, len(question))
    for _ in range(300):
        corpus.add([rng.randrange(100, 50000) for _ in range(12)] + template
                   + [rng.randrange(100, 50000) for _ in range(40)], 12 + len(template))
    assert corpus.propose([9] + question, 32, 1.0, 0.1) == (answer[:17], 17)
    assert corpus.propose([9] + question + answer[:10], 32, 1.0, 0.1) == (answer[10:34], 24)


def test_a_token_id_the_corpus_cannot_hold_changes_nothing():
    corpus = ResponseCorpus(10, 6)
    corpus.add(PROMPT + [1, 2, 3, 4], len(PROMPT))
    with pytest.raises(OverflowError):
        corpus.add(PROMPT + [1, 2, 1 << 40], len(PROMPT))
    assert len(corpus) == 1 and corpus.num_tokens == 9 and len(corpus.tokens) == 9
    corpus.add([7, 8, 9, 5, 6], 3)
    assert corpus.propose([0, 7, 8, 9], 8, 1.0, 0.1) == ([5, 6], 3)


def test_a_huge_spec_factor_is_the_draft_length_and_rounding_does_not_cut_a_token():
    assert draft_limit(32, 1e308, 3) == 32 and draft_limit(32, 1e308, 0) == 0
    assert draft_limit(32, 2.3, 10) == 23 and draft_limit(100, 0.58, 100) == 58


def test_the_longer_of_the_own_and_the_earlier_match_drafts():
    proposer = SuffixProposer(max_depth=24, max_cached_requests=10, max_spec_factor=1.0, min_token_prob=0.1)
    proposer.corpus.add(PROMPT + [1, 2, 3, 20, 21, 22, 7, 7, 7], len(PROMPT))
    # The sequence repeats its own 6 tokens (3 ... 22); an earlier response shares only its last 3 (20, 21, 22).
    own = [3, 4, 5, 20, 21, 22, 23, 24, 25, 3, 4, 5, 20, 21, 22]
    assert proposer.corpus.propose(own, 8, 1.0, 0.1) == ([7, 7, 7], 3)
    assert proposer.propose_with_length(own, 8) == ([23, 24, 25, 3, 4, 5], 6)
    # Nothing of its own to match: the earlier response's 5-token match (the prompt's) drafts.
    ctx = [9] + PROMPT
    assert proposer.propose_with_length(ctx, 8) == ([1, 2, 3, 20, 21], CORPUS_CLASS + 5)
    # A draft is at most max_spec_factor x the match.
    half = SuffixProposer(24, 10, 0.5, 0.1)
    half.corpus.add(PROMPT + [1, 2, 3, 20, 21, 22, 7, 7, 7], len(PROMPT))
    assert half.propose_with_length(ctx, 8) == ([1, 2], CORPUS_CLASS + 5)
    assert half.propose_with_length(own, 8) == ([23, 24, 25], 6)
    # A tie between the own match and an earlier response's goes to the own.
    tie = SuffixProposer(24, 10, 1.0, 0.1)
    tie.corpus.add([30, 31, 32, 40, 41], 0)
    seq = [7, 30, 31, 32, 50, 51, 30, 31, 32]
    assert tie.corpus.propose(seq, 8, 1.0, 0.1) == ([40, 41], 3)
    assert tie.propose_with_length(seq, 8) == ([50, 51, 30], 3)


def test_a_running_response_drafts_for_the_others_while_it_is_generated():
    """vLLM's suffix decoding adds a response to its corpus as it is generated: here another running sequence's
    response so far drafts, from a match at least MIN_CORPUS_MATCH long that a response token follows."""
    proposer = SuffixProposer(max_depth=24, max_cached_requests=10, max_spec_factor=1.0, min_token_prob=0.1)
    first = [9] + PROMPT + [1, 2, 3, 4, 5, 6]  # a prompt of 6 tokens, and 6 of its response so far
    proposer.set_running([Running(first, 6, LookupIndex(), None)])
    ctx = [8] + PROMPT  # the same question after another first token
    assert proposer.propose_with_length(ctx, 8) == ([1, 2, 3, 4, 5], CORPUS_CLASS + 5)  # factor 1 x 5 matched
    assert proposer.propose_with_length(ctx + [1, 2, 3], 8) == ([4, 5, 6], CORPUS_CLASS + 8)  # what it has so far
    assert proposer.propose_with_length(ctx + [1, 2, 3, 4, 5, 6], 8) == ([], 0)  # caught up: nothing follows yet
    assert proposer.propose_with_length([7, 9, 50, 51], 8) == ([], 0)  # in its prompt: a prompt token follows
    assert proposer.propose_with_length([7, 8, 3, 4], 8) == ([], 0)    # 2 tokens: shorter than MIN_CORPUS_MATCH
    # A response with a salt drafts only for requests with that salt; an unsalted one only for unsalted ones.
    salted = SuffixProposer(24, 10, 1.0, 0.1)
    salted.set_running([Running(first, 6, LookupIndex(), "a")])
    assert salted.propose_with_length(ctx, 8) == ([], 0)
    assert salted.propose_with_length(ctx, 8, salt="b") == ([], 0)
    assert salted.propose_with_length(ctx, 8, salt="a") == ([1, 2, 3, 4, 5], CORPUS_CLASS + 5)
    assert proposer.propose_with_length(ctx, 8, salt="a") == ([], 0)
    # The longer match drafts: the running response's 8 tokens over a finished one's 3, a finished one's 4 over
    # the running one's 3; a finished one as long wins the tie; the sequence's own match wins a tie against either.
    proposer.corpus.add([40, 1, 2, 3, 70, 71, 72], 1)
    assert proposer.propose_with_length(ctx + [1, 2, 3], 8) == ([4, 5, 6], CORPUS_CLASS + 8)
    assert proposer.propose_with_length([40, 1, 2, 3], 8) == ([70, 71, 72], CORPUS_CLASS + 4)
    proposer.corpus.add([0] + PROMPT + [1, 2, 3, 80, 81, 82], 6)  # the same 8 as the running one's
    assert proposer.propose_with_length(ctx + [1, 2, 3], 8) == ([80, 81, 82], CORPUS_CLASS + 8)
    own = [1, 2, 3, 60, 61, 62, 63, 64, 65, 1, 2, 3]  # its own 1, 2, 3 (3 tokens) against the running one's 3
    runs = SuffixProposer(24, 10, 1.0, 0.1)
    runs.set_running([Running([9, 9, 1, 2, 3, 4, 5, 6], 2, LookupIndex(), None)])
    assert runs.propose_with_length(own, 8) == ([60, 61, 62], 3)
    # Among running responses the longest match, then a whole draft after it, the latest.
    a, b = [5, 1, 2, 3, 4], [6, 1, 2, 3, 4, 7, 8]
    many = SuffixProposer(24, 10, 1.0, 0.1)
    many.set_running([Running(a, 1, LookupIndex(), None), Running(b, 1, LookupIndex(), None)])
    assert many.propose_with_length([0, 1, 2], 8) == ([], 0)
    assert many.propose_with_length([0, 1, 2, 3], 3) == ([4, 7, 8], CORPUS_CLASS + 3)
    assert many.propose_with_length([5, 1, 2, 3], 8) == ([4], CORPUS_CLASS + 4)
    repeats = [0, 0, 1, 2, 3, 10, 11, 12, 1, 2, 3, 20, 21, 22, 1, 2, 3, 30]
    latest = SuffixProposer(24, 10, 1.0, 0.1)
    latest.set_running([Running(repeats, 1, LookupIndex(), None)])
    assert latest.propose_with_length([9, 1, 2, 3], 3) == ([20, 21, 22], CORPUS_CLASS + 3)  # 30 alone is short
    assert latest.propose_with_length([9, 1, 2, 3], 1) == ([30], CORPUS_CLASS + 3)
    # A response that repeats the last tokens hundreds of times does not hide the others': each is searched
    # through its latest MAX_CANDIDATES occurrences.
    busy = Running([0] + [1, 2, 9] * 300, 1, LookupIndex(), None)
    exact = Running([0, 5, 6, 7, 1, 2, 42, 43], 1, LookupIndex(), None)
    crowd = SuffixProposer(24, 10, 1.0, 0.1)
    crowd.set_running([busy, exact])
    assert crowd.propose_with_length([5, 6, 7, 1, 2], 8) == ([42, 43], CORPUS_CLASS + 5)
    # Searched only with a corpus (vLLM keeps running responses in it) and while at most MAX_PEERS others run.
    assert many.searches_running(MAX_PEERS + 1) and not many.searches_running(MAX_PEERS + 2)
    assert not SuffixProposer(24, 0, 1.0, 0.1).searches_running(2)


SUFFIX = {"method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": None, "min_acceptance_rate": 0.0,
          "adaptive_draft_length": False}


def test_greedy_outputs_equal_with_drafts_from_earlier_responses(tiny_model_dirs):
    """A first wave, then the same prompts again and the same prompts with one token changed near their
    start: the second wave drafts the first's responses. Preemptions (a small pool), chunked prefill,
    prefix-cache hits and n = 2; the same tokens and logprobs as without speculation, and no leak."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(3, [7, 19, 11, 26])
    varied = [[p[0] + 1] + p[1:] for p in ps]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    pair = SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True)
    waves = [[(f"a{i}", p, params) for i, p in enumerate(ps)],
             [(f"b{i}", p, params) for i, p in enumerate(ps)] + [(f"c{i}", p, params) for i, p in enumerate(varied)]
             + [("n2", ps[0], pair)]]
    kw = dict(num_kv_blocks=40, max_num_seqs=6)
    ref_engine = make_engine(path, **kw)
    ref = run_waves(ref_engine, waves)
    engine = make_engine(path, SUFFIX, **kw)
    kinds = []
    on_record(engine, lambda seq, num_drafted, num_accepted: kinds.append(
        (seq.spec_state.draft_class >= CORPUS_CLASS, num_drafted, num_accepted)))
    got = run_waves(engine, waves, check=True)
    for rid, want in ref.items():
        for g, w in zip(got[rid].outputs, want.outputs):
            assert g.token_ids == w.token_ids, rid
            assert [{t: e.logprob for t, e in lp.items()} for lp in g.logprobs or []] == \
                   [{t: e.logprob for t, e in lp.items()} for lp in w.logprobs or []], rid
    assert engine.get_stats().num_preemptions > 0 and ref_engine.get_stats().num_preemptions > 0
    from_corpus = [k for k in kinds if k[0]]
    assert from_corpus and sum(a for _, _, a in from_corpus) > 0.8 * sum(d for _, d, _ in from_corpus)
    # Every finished sequence's response is kept, after its prompt's last 24 tokens: 4 + 4 + 4 + the pair's 2.
    corpus = engine.speculator.proposer.corpus
    texts = sorted(tuple(corpus.tokens[p % corpus.capacity] for p in range(first, end))
                   for first, end in corpus.spans.values())
    prompt_of = {**{f"a{i}": p for i, p in enumerate(ps)}, **{f"b{i}": p for i, p in enumerate(ps)},
                 **{f"c{i}": p for i, p in enumerate(varied)}, "n2": ps[0]}
    assert texts == sorted(tuple(prompt_of[rid][-24:] + o.token_ids) for rid, out in got.items() for o in out.outputs)


def test_seeded_samples_equal_and_aborted_responses_are_not_kept(tiny_model_dirs):
    """Rollouts: one prompt sampled with several seeds (and n = 2), each drafting from the earlier samples.
    Every sample equals the engine's without speculation; an aborted request adds nothing to the corpus."""
    path, _ = tiny_model_dirs["qwen2"]
    p = prompts(5, [9])[0]
    waves = [[(f"s{seed}", p, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=seed, ignore_eos=True,
                                              **({"n": 2} if seed == 3 else {})))]
             for seed in range(6)]
    ref = run_waves(make_engine(path), waves)
    engine = make_engine(path, SUFFIX)
    got = run_waves(engine, waves, check=True)
    for rid, want in ref.items():
        assert [o.token_ids for o in got[rid].outputs] == [o.token_ids for o in want.outputs], rid
    assert engine.get_stats().spec_num_draft_tokens > 0
    corpus = engine.speculator.proposer.corpus
    assert len(corpus) == 7
    engine.add_request("gone", p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.abort_request("gone")
    drain(engine)
    assert len(corpus) == 7
    assert_no_leaks(engine)


def test_vllm_fields_defaults_and_errors():
    c = SpeculativeConfig.parse({"method": "suffix", "num_speculative_tokens": 32})
    assert (c.suffix_decoding_max_tree_depth, c.suffix_decoding_max_cached_requests,
            c.suffix_decoding_max_spec_factor, c.suffix_decoding_min_token_prob,
            c.suffix_decoding_corpus_tokens) == (24, 10000, 1.0, 0.1, 1 << 20)
    assert c.matches_text and not c.uses_lookup and c.disable_by_batch_size == c.lookup_disable_by_batch_size
    # vLLM's default draft length for suffix decoding: the depth; the fields belong to method suffix alone.
    assert SpeculativeConfig.parse('{"method": "suffix"}').num_speculative_tokens == 24
    assert SpeculativeConfig.parse({"method": "suffix",
                                    "suffix_decoding_max_tree_depth": 12}).num_speculative_tokens == 12
    with pytest.raises(ValueError, match="num_speculative_tokens is required"):
        SpeculativeConfig.parse({"method": "ngram"})
    with pytest.raises(ValueError, match="suffix_decoding_min_token_prob applies only to method 'suffix'"):
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_min_token_prob": 0.5})
    for value, message in [
        ({"prompt_lookup_max": 4}, "do not apply with suffix decoding, which matches up to "
                                   "suffix_decoding_max_tree_depth tokens"),
        ({"model": "x"}, "applies only to methods 'draft' and 'eagle'"),
        ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be an integer >= 1"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests must be"),
        ({"suffix_decoding_corpus_tokens": 0}, "suffix_decoding_corpus_tokens must be an integer in [1, 67108864]"),
        ({"suffix_decoding_corpus_tokens": 1 << 27}, "(2**20 take 46 MiB), got 134217728"),
        ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be a finite number > 0"),
        ({"suffix_decoding_max_spec_factor": float("inf")}, "suffix_decoding_max_spec_factor must be a finite"),
        ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be in [0, 1]"),
    ]:
        with pytest.raises(ValueError) as e:
            EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 8, **value})
        assert message in str(e.value)
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "suffix", "num_speculative_tokens": '
                                      '32, "suffix_decoding_max_cached_requests": 100}'])
    spec = engine_config(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.suffix_decoding_max_cached_requests) == ("suffix", 32, 100)


def test_suffix_decoding_in_front_of_a_model_takes_the_suffix_fields_instead_of_prompt_lookup():
    """enable_suffix_decoding (Arctic Inference's field): methods draft and eagle only, with the suffix_decoding_*
    fields and without prompt lookup's bounds; its text drafts keep ngram's batch-size limit, as lookup's do."""
    c = SpeculativeConfig.parse({"method": "eagle", "num_speculative_tokens": 8, "enable_suffix_decoding": True,
                                 "suffix_decoding_max_cached_requests": 50})
    assert c.suffix_decoding and c.matches_text and not c.uses_lookup
    assert (c.suffix_decoding_max_cached_requests, c.draft_depth) == (50, 8)
    assert (c.disable_by_batch_size, c.lookup_disable_by_batch_size, c.max_drafting_seqs) == (1, 4, 4)
    assert not SpeculativeConfig.parse({"method": "draft", "num_speculative_tokens": 3}).suffix_decoding
    # With method suffix (as Arctic Inference takes it) the field changes nothing.
    same = SpeculativeConfig.parse({"method": "suffix", "enable_suffix_decoding": True})
    assert same.suffix_decoding and same.num_speculative_tokens == 24
    for value, message in [
        ({"method": "ngram", "enable_suffix_decoding": True}, "in front of methods 'draft' and 'eagle' (method "
                                                              "'suffix' is suffix decoding alone), got method 'ngram'"),
        ({"method": "eagle", "enable_suffix_decoding": "yes"}, "enable_suffix_decoding must be true or false"),
        ({"method": "draft", "enable_suffix_decoding": True, "prompt_lookup_min": 2}, "do not apply with suffix"),
        ({"method": "eagle", "suffix_decoding_max_tree_depth": 8}, "applies only to method 'suffix', or to 'draft' "
                                                                   "and 'eagle' with enable_suffix_decoding, got "
                                                                   "method 'eagle'"),
        ({"method": "eagle", "enable_suffix_decoding": True, "suffix_decoding_min_token_prob": -1},
         "suffix_decoding_min_token_prob must be in [0, 1]"),
    ]:
        with pytest.raises(ValueError) as e:
            SpeculativeConfig.parse({"num_speculative_tokens": 4, **value})
        assert message in str(e.value)
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "eagle", "num_speculative_tokens": '
                                      '8, "enable_suffix_decoding": true}'])
    spec = engine_config(args).speculative_config
    assert (spec.method, spec.enable_suffix_decoding, spec.suffix_decoding_max_tree_depth) == ("eagle", True, 24)


def test_a_salted_response_drafts_only_for_requests_with_its_salt():
    corpus = ResponseCorpus(max_requests=10, depth=8)
    corpus.add(PROMPT + [1, 2, 3, 4], len(PROMPT), salt="tenant a")
    corpus.add(PROMPT + [5, 6, 7, 8], len(PROMPT))
    ctx = [0] + PROMPT
    assert corpus.propose(ctx, 8, 4.0, 0.1, "tenant a") == ([1, 2, 3, 4], 5)
    assert corpus.propose(ctx, 8, 4.0, 0.1) == ([5, 6, 7, 8], 5)
    assert corpus.propose(ctx, 8, 4.0, 0.1, "tenant b") == ([], 0)
    for i in range(10):  # both leave, and their salts with them
        corpus.add([9, 9, 9, i, i], 3)
    assert len(corpus) == 10 and corpus.salts == {}


def test_a_cleared_corpus_drafts_only_what_comes_after():
    corpus = ResponseCorpus(max_requests=10, depth=8, max_tokens=64)
    corpus.add(PROMPT + [1, 2, 3, 4], len(PROMPT), salt="tenant a")
    corpus.add(PROMPT + [1, 2, 3, 4], len(PROMPT))
    corpus.clear()
    ctx = [0] + PROMPT
    assert len(corpus) == 0 and corpus.num_tokens == 0 and corpus.salts == {}
    assert corpus.propose(ctx, 8, 4.0, 0.1) == ([], 0) and corpus.propose(ctx, 8, 4.0, 0.1, "tenant a") == ([], 0)
    # New responses draft, the ring wraps over the forgotten ones, and the old chains never lead back to them.
    for i in range(12):
        corpus.add(PROMPT + [5, 6, 7, i], len(PROMPT))
    assert corpus.propose(ctx, 8, 4.0, 0.1) == ([5, 6, 7, 11], 5)
    assert corpus.propose([0] + PROMPT + [1, 2], 8, 4.0, 0.1) == ([], 0)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_requests_with_another_cache_salt_do_not_draft_a_tenants_responses(tiny_model_dirs, prefix_caching):
    """A response drafts a later request's answer to the same prompt only where both carry the same cache_salt
    (or neither does), whether or not the prefix cache uses the salt: a draft's acceptance would show in another
    tenant's stream speed what this one was told."""
    path, _ = tiny_model_dirs["llama"]
    p = prompts(8, [12])[0]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine = make_engine(path, SUFFIX, enable_prefix_caching=prefix_caching)
    ref = run_waves(make_engine(path), [[("ref", p, params)]])["ref"].outputs[0].token_ids
    drafted: dict[str, int] = {}

    def count(seq, num_drafted, num_accepted):
        if seq.spec_state.draft_class >= CORPUS_CLASS:
            drafted[seq.request_id] = drafted.get(seq.request_id, 0) + num_drafted
    on_record(engine, count)
    for rid, salt in [("a1", "tenant a"), ("b", "tenant b"), ("none", None), ("a2", "tenant a")]:
        engine.add_request(rid, p, params, cache_salt=salt)
        assert drain(engine)[rid].outputs[0].token_ids == ref, rid
    assert "a1" not in drafted and "b" not in drafted and "none" not in drafted, drafted
    assert drafted["a2"] > 10, drafted
    assert_no_leaks(engine)


def test_outputs_equal_where_running_responses_draft_for_each_other(tiny_model_dirs):
    """A question asked again while its first answer is still being generated drafts from that answer (no
    response has finished: the corpus is empty), beside seeded samples running side by side (n = 3), which
    may draft from each other: the same tokens as without speculation, and no leak."""
    path, _ = tiny_model_dirs["llama"]
    p, q = prompts(11, [14, 9])
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sampled = SamplingParams(n=3, temperature=0.9, max_tokens=30, seed=5, ignore_eos=True)
    ref_engine = make_engine(path)
    want = run_waves(ref_engine, [[("first", p, greedy), ("again", p, greedy), ("samples", q, sampled)]])
    engine = make_engine(path, SUFFIX)
    corpus = engine.speculator.proposer.corpus
    from_running: dict[str, list[int]] = {}

    def count(seq, num_drafted, num_accepted):
        if seq.spec_state.draft_class >= CORPUS_CLASS and not len(corpus):
            got = from_running.setdefault(seq.request_id, [0, 0])
            got[0] += num_drafted
            got[1] += num_accepted
    on_record(engine, count)
    steps = []

    def ask_again_at_step_10(engine):
        steps.append(1)
        if len(steps) == 10:
            engine.add_request("again", p, greedy)
    done = run_waves(engine, [[("first", p, greedy), ("samples", q, sampled)]], check=True,
                     after_step=ask_again_at_step_10)
    for rid, w in want.items():
        assert [o.token_ids for o in done[rid].outputs] == [o.token_ids for o in w.outputs], rid
    # The first answer's 10 or more tokens, drafted whole (the answers are equal), then the two in step.
    drafted, accepted = from_running["again"]
    assert drafted >= 10 and accepted == drafted, from_running
