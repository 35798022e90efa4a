"""Speculative decoding through the whole engine on tiny transformers-built models: rows of 1 + k tokens,
rollback of rejected drafts, and outputs identical to non-speculative decoding of the same engine
(float32), with chunked prefill, preemption and prefix-cache hits forced."""
import random
from types import SimpleNamespace

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.config import SpeculativeConfig
from engine_helpers import assert_no_leaks
from spec_helpers import (ScriptedProposer, abort_mid_speculation, drafts_by_batch_size, every_step_ngram,
                          logprob_tolerance, make_engine, prompts, reference_and_drafts, run_waves)

K = 4
NGRAM = every_step_ngram(K)


def run(engine: LLMEngine, waves, check: bool = False) -> dict:
    return run_waves(engine, waves, check)


def drafting_matches_reference(path, ps, params, wrong: float) -> LLMEngine:
    """Decodes ps without speculation, then with drafts of that output, each draft token wrong with
    probability `wrong`, checking the KV bookkeeping after every step: the same tokens and logprobs (values
    and ranks). Returns the drafting engine."""
    ref, proposer = reference_and_drafts(path, ps, params, wrong)
    engine = make_engine(path, NGRAM)
    engine.speculator.proposer = proposer
    got = run(engine, [[(str(i), p, params) for i, p in enumerate(ps)]], check=True)
    for i, r in enumerate(ref):
        out = got[str(i)].outputs[0]
        assert out.token_ids == r.token_ids
        for lp, rlp in zip(out.logprobs, r.logprobs):
            assert lp.keys() == rlp.keys()
            for t in lp:
                assert lp[t].logprob == pytest.approx(rlp[t].logprob, abs=logprob_tolerance(engine), rel=0)
                assert lp[t].rank == rlp[t].rank
    return engine


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("wrong", [0.0, 0.3, 1.0])
def test_greedy_identical_to_non_speculative_with_partial_acceptance(arch, wrong, tiny_model_dirs):
    """Drafts right, wrong at random positions, or always wrong: the same tokens and logprobs as without
    speculation; after every step the KV bookkeeping holds only kept tokens."""
    path, _ = tiny_model_dirs[arch]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    engine = drafting_matches_reference(path, prompts(1, [3, 17, 9, 30, 5]), params, wrong)
    s = engine.get_stats()
    assert s.spec_num_drafts > 0 and s.spec_num_draft_tokens > s.spec_num_drafts
    if wrong == 0.0:  # every draft accepted: steps emit 1 + K tokens
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
        assert engine._num_steps < 24
    elif wrong == 1.0:
        assert s.spec_num_accepted_tokens == 0
    else:
        assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
        assert s.spec_accepted_per_pos[K - 1] > 0  # whole runs accepted, too
    assert s.spec_accepted_per_pos == sorted(s.spec_accepted_per_pos, reverse=True)


def test_preemption_chunked_prefill_and_prefix_hits_on_speculated_blocks(tiny_model_dirs):
    """A pool too small for the batch (preemptions), prompts chunked over steps, and a second wave whose
    prompts extend the first wave's outputs: their prefix-cache hits land on blocks filled by accepted
    drafts, so a rejected draft's K/V committed to the cache would change their outputs."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(2, [6, 23, 14, 31])
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    kw = dict(num_kv_blocks=60, max_num_seqs=4)

    def waves(first_outs):
        second = [p + o[:20] + [7, 8, 9] for p, o in zip(ps, first_outs)]
        return second

    ref_engine = make_engine(path, **kw)
    ref1 = run(ref_engine, [[(f"a{i}", p, params) for i, p in enumerate(ps)]])
    ref_outs = [ref1[f"a{i}"].outputs[0].token_ids for i in range(len(ps))]
    second = waves(ref_outs)
    ref2 = run(ref_engine, [[(f"b{i}", p, params) for i, p in enumerate(second)]])

    conts = {tuple(p): o for p, o in zip(ps, ref_outs)}
    conts.update({tuple(p): ref2[f"b{i}"].outputs[0].token_ids for i, p in enumerate(second)})
    engine = make_engine(path, NGRAM, **kw)
    engine.speculator.proposer = ScriptedProposer(conts, wrong=0.25)
    got = run(engine, [[(f"a{i}", p, params) for i, p in enumerate(ps)],
                       [(f"b{i}", p, params) for i, p in enumerate(second)]], check=True)
    for rid, out in {**ref1, **ref2}.items():
        assert got[rid].outputs[0].token_ids == out.outputs[0].token_ids, rid
    s = engine.get_stats()
    assert s.num_preemptions > 0
    assert s.spec_num_accepted_tokens > 0
    # The second wave found the first wave's blocks, including ones its drafts filled.
    hits = [got[f"b{i}"].num_cached_tokens for i in range(len(ps))]
    assert all(h > len(p) for h, p in zip(hits, ps)), hits


def test_stops_inside_an_accepted_run(tiny_model_dirs):
    """Drafts run past a stop token id, a stop string and max_tokens; nothing after them is emitted, and
    min_tokens keeps stop ids masked inside the run, as without speculation."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(3, [5, 12])
    free = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref, _ = reference_and_drafts(path, ps, free, 0.0)
    stop_tok = ref[0].token_ids[9]        # the first run would go on past it
    text = ref[1].text
    stop_str = text[len(text) // 2: len(text) // 2 + 2]
    cases = [
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok], min_tokens=12),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop_str]),
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
    ]
    for params in cases:
        expected = run(make_engine(path), [[(str(i), p, params) for i, p in enumerate(ps)]])
        engine = make_engine(path, NGRAM)
        # Drafts of the unstopped continuation: they always reach past the stop.
        engine.speculator.proposer = ScriptedProposer({tuple(p): r.token_ids for p, r in zip(ps, ref)}, 0.0)
        got = run(engine, [[(str(i), p, params) for i, p in enumerate(ps)]], check=True)
        for i in range(len(ps)):
            e, g = expected[str(i)].outputs[0], got[str(i)].outputs[0]
            assert (g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
                   (e.token_ids, e.text, e.finish_reason, e.stop_reason), params
        assert engine.get_stats().spec_num_accepted_tokens > 0
    assert expected["0"].outputs[0].finish_reason == "length"  # the last case: max_tokens inside a run


def test_seeded_sampling_identical_to_non_speculative(tiny_model_dirs):
    """Every logits stage at once, n = 2, preemptions: a seeded request draws the same tokens with
    speculation (drafts right and wrong) as without it, because each position is sampled with the same
    noise and rejected positions' draws are given back to its generator."""
    path, _ = tiny_model_dirs["qwen2"]
    ps = prompts(4, [5, 13, 21, 8])
    params = SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 3.0, 9: -2.0},
                            min_tokens=5, stop_token_ids=[7], max_tokens=24, seed=11, logprobs=1)
    kw = dict(num_kv_blocks=40)
    ref_engine = make_engine(path, **kw)
    ref = run(ref_engine, [[(str(i), p, params) for i, p in enumerate(ps)]])
    assert ref_engine.get_stats().num_preemptions > 0
    conts = {tuple(p): ref[str(i)].outputs[0].token_ids for i, p in enumerate(ps)}
    engine = make_engine(path, NGRAM, **kw)
    engine.speculator.proposer = ScriptedProposer(conts, wrong=0.2)
    got = run(engine, [[(str(i), p, params) for i, p in enumerate(ps)]], check=True)
    for i in range(len(ps)):
        for e, g in zip(ref[str(i)].outputs, got[str(i)].outputs):
            assert g.token_ids == e.token_ids
            assert [list(lp) for lp in g.logprobs] == [list(lp) for lp in e.logprobs]
            for lg, le in zip(g.logprobs, e.logprobs):
                for t in lg:
                    assert lg[t].logprob == pytest.approx(le[t].logprob, abs=logprob_tolerance(engine), rel=0)
    s = engine.get_stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens


def test_abort_mid_speculation_frees_everything(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(5, [9, 14, 6])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    _, proposer = reference_and_drafts(path, ps, params, 0.3)
    engine = make_engine(path, NGRAM)
    engine.speculator.proposer = proposer  # drafts the same prompts' outputs, 30% of its tokens wrong
    abort_mid_speculation(engine)
    engine.abort_request("1")  # already finished: a no-op
    assert_no_leaks(engine)


def test_ngram_drafts_on_repetitive_text_keep_greedy_output(tiny_model_dirs):
    """The real proposer, on prompts that repeat themselves: it drafts, and the output is unchanged."""
    path, _ = tiny_model_dirs["mistral"]
    rng = random.Random(6)
    unit = [rng.randrange(256) for _ in range(7)]
    ps = [unit * 4, unit * 3 + unit[:3], [rng.randrange(256) for _ in range(11)] * 2]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ref = run(make_engine(path), [[(str(i), p, params) for i, p in enumerate(ps)]])
    engine = make_engine(path, NGRAM)
    got = run(engine, [[(str(i), p, params) for i, p in enumerate(ps)]], check=True)
    for i in range(len(ps)):
        assert got[str(i)].outputs[0].token_ids == ref[str(i)].outputs[0].token_ids
    assert engine.get_stats().spec_num_draft_tokens > 0


def test_drafts_stop_at_max_model_len(tiny_model_dirs):
    """Right drafts up to the context limit: no position past max_model_len is computed, and the output is
    the non-speculative one, ended by the length limit."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(7, [9, 14])
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    ref, proposer = reference_and_drafts(path, ps, params, 0.0, max_model_len=37)
    engine = make_engine(path, NGRAM, max_model_len=37)
    engine.speculator.proposer = proposer
    got = run(engine, [[(str(i), p, params) for i, p in enumerate(ps)]], check=True)
    for i, p in enumerate(ps):
        out = got[str(i)].outputs[0]
        assert out.token_ids == ref[i].token_ids and len(p) + len(out.token_ids) == 37
        assert out.finish_reason == "length"
    assert engine.get_stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("name", ["tied_softcap", "untied_pattern_scaled"])
def test_greedy_identical_on_a_sliding_window_model(name, tmp_path):
    """Gemma 3 (tiny, random): sliding-window layers (window 8) beside global ones, prompts and outputs much
    longer than the window, so each verified row sees its own window's keys. Drafts right and wrong at
    random: the non-speculative tokens and logprobs. (tied_softcap's head_dim 32 takes the native attention
    kernel where the CPU has one, untied_pattern_scaled's 48 the torch path.)"""
    from test_gemma3_parity import WINDOW, build_gemma3

    build_gemma3(name, tmp_path)
    ps = prompts(11, [5, 19, 30])
    assert max(map(len, ps)) > 3 * WINDOW
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, logprobs=2)
    s = drafting_matches_reference(tmp_path, ps, params, 0.3).get_stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens


def test_drafts_take_only_blocks_that_later_decodes_do_not_need():
    """A pool of 5 blocks of 4 with one free: A (5 of 6 tokens computed) drafts 3 tokens, which would take
    the free block; B, served after A, needs that block for its next token. A's drafts are cut to the 2 that
    fit in its own last block, and nobody is preempted."""
    from kvserve.engine.block_manager import BlockManager
    from kvserve.engine.scheduler import Scheduler
    from kvserve.engine.sequence import Sequence, SequenceStatus

    bm = BlockManager(num_blocks=5, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=64), bm)
    params = SamplingParams(temperature=0, max_tokens=20)
    a = Sequence(seq_id=0, request_id="a", index=0, token_ids=list(range(6)), num_prompt_tokens=3, params=params,
                 arrival_time=0)
    b = Sequence(seq_id=1, request_id="b", index=0, token_ids=list(range(9)), num_prompt_tokens=3, params=params,
                 arrival_time=1)
    for seq, computed in ((a, 5), (b, 8)):
        assert bm.allocate(seq, computed)
        seq.num_computed_tokens = computed
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
    a.spec_token_ids = [7, 7, 7]
    assert bm.num_free_blocks == 1
    out = sched.schedule()
    assert out.preempted == []
    assert [(seq.request_id, n) for seq, n in out.scheduled] == [("a", 3), ("b", 1)]
    assert out.spec_token_ids == {0: [7, 7]}
    assert len(a.block_table) == 2 and len(b.block_table) == 3


def test_rejected_drafts_blocks_go_back_and_cost_no_preemption(tiny_model_dirs):
    """A tight pool: A's always-wrong drafts cross into a new block while B, served after it, needs the
    last free one. With speculation the engine preempts no more than without (here: never), returns the
    blocks only rejected drafts wrote, and gives the same outputs."""
    path, _ = tiny_model_dirs["llama"]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ref = run(make_engine(path), [[("a", [10, 11, 12, 13, 14], greedy)]])
    stop = ref["a"].outputs[0].token_ids[1]  # a ends at its second token
    wave = [("a", [10, 11, 12, 13, 14], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])),
            ("b", list(range(20, 28)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
    tight = dict(max_num_batched_tokens=64, num_kv_blocks=5, max_num_seqs=8, max_model_len=20)
    got = {}
    for spec in (None, every_step_ngram(3)):
        engine = make_engine(path, spec, **tight)
        if spec:
            def never_right(ids, k, index=None, salt=None):
                return [258] * k, 2
            engine.speculator.proposer.propose_with_length = never_right
        got[spec is not None] = (run(engine, [wave], check=True), engine.get_stats())
    (plain, s0), (drafted, s1) = got[False], got[True]
    assert s1.spec_num_draft_tokens > 0 and s1.spec_num_accepted_tokens == 0
    assert s0.num_preemptions == 0 and s1.num_preemptions == 0
    for rid in ("a", "b"):
        assert drafted[rid].outputs[0].token_ids == plain[rid].outputs[0].token_ids


def test_the_batch_size_schedule_caps_each_steps_drafts(tiny_model_dirs):
    """vLLM's num_speculative_tokens_per_batch_size with right drafts on offer every step: 4 tokens a sequence
    while it runs alone, 1 beside another, none among three or more; the output is the non-speculative one."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(8, [6, 9, 12, 7])
    waves = [[(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
              for i, (p, n) in enumerate(zip(ps, (6, 14, 22, 40)))]]
    ref = run(make_engine(path), waves)
    engine = make_engine(path, {**NGRAM, "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 2, 1], [3, 8, 0]]})
    outs = [ref[str(i)].outputs[0] for i in range(len(ps))]
    engine.speculator.proposer = ScriptedProposer({tuple(p): o.token_ids for p, o in zip(ps, outs)}, 0.0)
    seen = drafts_by_batch_size(engine)
    got = run(engine, waves, check=True)
    assert all(got[str(i)].outputs[0].token_ids == outs[i].token_ids for i in range(len(ps)))
    assert max(seen[1]) == 4 and max(seen[2]) == 1
    assert all(n == 0 for size, lengths in seen.items() if size >= 3 for n in lengths) and 4 in seen


def test_drafts_stop_at_the_drafts_max_model_len(tiny_model_dirs):
    """speculative_config's max_model_len below the engine's: right drafts stop where a sequence would pass it
    (a step's drafts and bonus token stay inside), and decoding goes on without them to the engine's limit."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(7, [9, 14])
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref, proposer = reference_and_drafts(path, ps, params, 0.0)
    engine = make_engine(path, {**NGRAM, "max_model_len": 24})
    engine.speculator.proposer = proposer
    longest = []

    def check(running):
        engine.speculator.__class__.propose(engine.speculator, running)
        for seq in running:
            if seq.spec_token_ids:
                longest.append(seq.num_tokens + len(seq.spec_token_ids))
    engine.speculator.propose = check
    got = run(engine, [[(str(i), p, params) for i, p in enumerate(ps)]], check=True)
    assert all(got[str(i)].outputs[0].token_ids == ref[i].token_ids for i in range(len(ps)))
    assert longest and max(longest) == 23  # the bonus token lands at position 23, the limit's last
    assert all(len(p) + 30 > 24 for p in ps)  # both sequences outgrew it


def test_draft_fields_only_the_engine_can_check(tiny_model_dirs):
    """speculative_config's max_model_len may not pass the target's (vLLM's check); int8 / int4 draft weights
    are a CPU format, refused by the field's name elsewhere (the engine's check, called as a CUDA engine would)."""
    path, _ = tiny_model_dirs["llama"]
    with pytest.raises(ValueError, match=r"max_model_len \(65\) cannot be larger than the target's \(64\)"):
        make_engine(path, {**NGRAM, "max_model_len": 65}, max_model_len=64)
    make_engine(path, {**NGRAM, "max_model_len": 64}, max_model_len=64)
    cuda = SimpleNamespace(device=torch.device("cuda"))
    for q in ("int8", "int4"):
        with pytest.raises(ValueError, match=f"quantization '{q}' .the draft's weights. runs on the CPU only"):
            LLMEngine._check_draft_fields(cuda, SpeculativeConfig(method="eagle", num_speculative_tokens=1,
                                                                  quantization=q), 64)
    LLMEngine._check_draft_fields(cuda, SpeculativeConfig(method="eagle", num_speculative_tokens=1,
                                                          quantization="auto"), 64)
