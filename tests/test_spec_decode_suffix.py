"""Method "suffix" (kvserve/spec_decode/suffix.py): drafts from the sequence's own text and from earlier
requests' responses. The corpus and proposer against hand-worked cases and a rebuilt index; the engine's
outputs against the same engine without speculation (greedy and seeded, with preemption, n = 2, prefix hits
and aborts), with drafts taken from earlier responses; vLLM's fields and their errors."""
import random

import pytest

from kvserve.config import EngineConfig
from kvserve.entrypoints.cli import build_parser, engine_config
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig
from kvserve.spec_decode.suffix import CORPUS_CLASS, ResponseCorpus, SuffixProposer
from engine_helpers import assert_no_leaks, drain
from spec_helpers import make_engine, prompts, run_waves

PROMPT = [50, 51, 52, 53, 54]


def test_a_prompt_asked_again_drafts_the_earlier_response():
    corpus = ResponseCorpus(max_requests=10, depth=4)
    corpus.add(PROMPT, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
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
        corpus.add(PROMPT, response)
    ctx = [0] + PROMPT
    # After the prompt: 1 in 3 of 4 matches (0.75); then 2 in 2 of those 3 (0.5); then 3, 4 (0.5 each).
    assert corpus.propose(ctx, 32, 4.0, 0.1) == ([1, 2, 3, 4], 5)
    assert corpus.propose(ctx, 32, 4.0, 0.6) == ([1], 5)
    assert corpus.propose(ctx, 32, 4.0, 0.8) == ([], 0)
    # A longer match wins over more frequent shorter ones: only the response whose prompt ended in 49, 50, ...
    corpus.add([49] + PROMPT, [8, 8, 8, 8, 8])
    assert corpus.propose([49] + PROMPT, 32, 4.0, 0.1) == ([8, 8, 8, 8, 8], 6)


@pytest.mark.parametrize("max_requests,max_tokens", [(5, 1 << 20), (1000, 60)])
def test_the_oldest_responses_leave_and_what_is_kept_drafts_as_if_alone(max_requests, max_tokens):
    """After many responses through a corpus bounded by count, or by tokens (a ring reused many times over),
    every lookup drafts what a corpus given only the responses still kept drafts."""
    rng = random.Random(0)
    corpus = ResponseCorpus(max_requests, depth=6, max_tokens=max_tokens)
    added = []
    for _ in range(60):  # a small vocabulary, so anchors repeat within and across responses
        entry = ([rng.randrange(5) for _ in range(rng.randrange(0, 9))],
                 [rng.randrange(5) for _ in range(rng.randrange(1, 15))])
        corpus.add(*entry)
        added.append(entry)
    kept = len(corpus)
    assert 0 < kept <= max_requests and corpus.num_tokens <= max_tokens
    rebuilt = ResponseCorpus(max_requests, depth=6, max_tokens=max_tokens)
    for entry in added[-kept:]:
        rebuilt.add(*entry)
    assert len(rebuilt) == kept and rebuilt.num_tokens == corpus.num_tokens
    drafted = 0
    for _ in range(300):
        context = [rng.randrange(5) for _ in range(rng.randrange(3, 12))]
        for factor, share in ((1.0, 0.1), (3.0, 0.5)):
            got = corpus.propose(context, 8, factor, share)
            assert got == rebuilt.propose(context, 8, factor, share), context
            drafted += len(got[0])
    assert drafted > 0
    off = ResponseCorpus(max_requests=0, depth=6)
    off.add(PROMPT, [1, 2, 3])
    assert len(off) == 0 and off.propose(PROMPT, 8, 1.0, 0.1) == ([], 0)


def test_the_longer_of_the_own_and_the_earlier_match_drafts():
    proposer = SuffixProposer(max_depth=24, max_cached_requests=10, max_spec_factor=1.0, min_token_prob=0.1)
    proposer.add(PROMPT, [1, 2, 3, 20, 21, 22, 7, 7, 7])
    # The sequence repeats its own 6 tokens (3 ... 22); an earlier response shares only its last 3 (20, 21, 22).
    own = [3, 4, 5, 20, 21, 22, 23, 24, 25, 3, 4, 5, 20, 21, 22]
    assert proposer.corpus.propose(own, 8, 1.0, 0.1) == ([7, 7, 7], 3)
    assert proposer.propose_with_length(own, 8) == ([23, 24, 25, 3, 4, 5], 6)
    # Nothing of its own to match: the earlier response's 5-token match (the prompt's) drafts.
    ctx = [9] + PROMPT
    assert proposer.propose_with_length(ctx, 8) == ([1, 2, 3, 20, 21], CORPUS_CLASS + 5)
    # A draft is at most max_spec_factor x the match.
    half = SuffixProposer(24, 10, 0.5, 0.1)
    half.add(PROMPT, [1, 2, 3, 20, 21, 22, 7, 7, 7])
    assert half.propose_with_length(ctx, 8) == ([1, 2], CORPUS_CLASS + 5)
    assert half.propose_with_length(own, 8) == ([23, 24, 25], 6)


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
    record = engine.speculator.record

    def counted(seq, num_drafted, num_accepted, *tree):
        kinds.append((seq.spec_state.draft_class >= CORPUS_CLASS, num_drafted, num_accepted))
        record(seq, num_drafted, num_accepted, *tree)
    engine.speculator.record = counted
    got = run_waves(engine, waves, check=True)
    for rid, want in ref.items():
        for g, w in zip(got[rid].outputs, want.outputs):
            assert g.token_ids == w.token_ids, rid
            assert [{t: e.logprob for t, e in lp.items()} for lp in g.logprobs or []] == \
                   [{t: e.logprob for t, e in lp.items()} for lp in w.logprobs or []], rid
    assert engine.get_stats().num_preemptions > 0 and ref_engine.get_stats().num_preemptions > 0
    from_corpus = [k for k in kinds if k[0]]
    assert from_corpus and sum(a for _, _, a in from_corpus) > 0.8 * sum(d for _, d, _ in from_corpus)
    # Every finished sequence's response is kept: 4 + 4 + 4 + the pair's 2.
    assert len(engine.speculator.proposer.corpus) == 14


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
    for value, message in [
        ({"prompt_lookup_max": 4}, "method 'suffix' matches up to suffix_decoding_max_tree_depth"),
        ({"model": "x"}, "applies only to methods 'draft' and 'eagle'"),
        ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth must be an integer >= 1"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests must be"),
        ({"suffix_decoding_corpus_tokens": 0}, "suffix_decoding_corpus_tokens must be an integer >= 1"),
        ({"suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor must be a number > 0"),
        ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob must be in [0, 1]"),
    ]:
        with pytest.raises(ValueError) as e:
            EngineConfig(speculative_config={"method": "suffix", "num_speculative_tokens": 8, **value})
        assert message in str(e.value)
    args = build_parser().parse_args(["serve", "--speculative-config", '{"method": "suffix", "num_speculative_tokens": '
                                      '32, "suffix_decoding_max_cached_requests": 100}'])
    spec = engine_config(args).speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.suffix_decoding_max_cached_requests) == ("suffix", 32, 100)
