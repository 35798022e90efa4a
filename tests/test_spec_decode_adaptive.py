"""Adaptive speculation: no drafting in a step with more running sequences than disable_by_batch_size, and a
request whose drafts keep failing stops drafting for a while; outputs stay those without speculation."""
import random

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from engine_helpers import assert_no_leaks, drain
from spec_helpers import ScriptedProposer
from tiny_models import TINY_KV


def engine_for(path, spec=None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=64,
                                  kv_cache_memory=TINY_KV, speculative_config=spec))


def continuations(path, ps, params):
    e = engine_for(path)
    for i, p in enumerate(ps):
        e.add_request(str(i), p, params[i] if isinstance(params, list) else params)
    done = drain(e)
    return {tuple(p): done[str(i)].outputs[0].token_ids for i, p in enumerate(ps)}, done


def test_no_drafts_in_steps_above_the_batch_size_limit(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama"]
    rng = random.Random(0)
    ps = [[rng.randrange(256) for _ in range(5)] for _ in range(3)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 30, 30)]
    conts, ref = continuations(path, ps, params)
    engine = engine_for(path, {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2,
                               "min_acceptance_rate": 0.0, "adaptive_draft_length": False})
    engine.speculator.proposer = ScriptedProposer(conts, wrong=0.0)
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, params[i])
    done = {}
    drafted_with = []  # (running sequences, drafts verified) per step
    while engine.has_unfinished_requests():
        running = len(engine.scheduler.running)
        before = engine.get_stats().spec_num_drafts
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        drafted_with.append((running, engine.get_stats().spec_num_drafts - before))
    assert_no_leaks(engine)
    assert all(d == 0 for r, d in drafted_with if r > 2)
    assert any(d > 0 for r, d in drafted_with if r <= 2)
    assert any(r == 3 for r, _ in drafted_with)
    for i in range(3):
        assert done[str(i)].outputs[0].token_ids == ref[str(i)].outputs[0].token_ids


def one_request(tiny_model_dirs, seed: int, max_tokens: int):
    """The tiny llama's path, a 7-token prompt, greedy params for it, {prompt: its continuation without
    speculation} and that continuation."""
    path, _ = tiny_model_dirs["llama"]
    prompt = [random.Random(seed).randrange(256) for _ in range(7)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    conts, ref = continuations(path, [prompt], params)
    return path, prompt, params, conts, ref["0"].outputs[0].token_ids


def pausing_ngram(k: int, min_acceptance_rate: float, acceptance_window: int) -> dict:
    """ngram drafting k tokens in every step that is not paused: no batch limit, no length rule."""
    return {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": None,
            "min_acceptance_rate": min_acceptance_rate, "acceptance_window": acceptance_window,
            "adaptive_draft_length": False}


def test_a_request_with_failing_drafts_pauses_drafting(tiny_model_dirs):
    path, prompt, params, conts, ref = one_request(tiny_model_dirs, seed=1, max_tokens=60)
    counts = {}
    for wrong in (1.0, 0.0):
        engine = engine_for(path, pausing_ngram(4, 0.3, 8))
        engine.speculator.proposer = ScriptedProposer(conts, wrong=wrong)
        engine.add_request("r", prompt, params)
        out = drain(engine)["r"].outputs[0]
        assert out.token_ids == ref
        counts[wrong] = engine.get_stats()
    bad, good = counts[1.0], counts[0.0]
    # Always wrong: each draft tests one token (its first, rejected), so the average falls by 1/8 a draft: below
    # 0.3 after ten drafts, then pauses of 8 and 16 steps with one draft between them, and one of 32 past the end.
    assert bad.spec_num_accepted_tokens == 0 and bad.spec_num_drafts == 12
    # Always right: never paused, every step drafts as far as max_tokens allows.
    assert good.spec_num_accepted_tokens == good.spec_num_draft_tokens and good.spec_num_drafts >= 59 // 5


class OneWrongDraft(ScriptedProposer):
    """Drafts the known continuation, except its `bad`-th draft, whose every token is wrong."""

    def __init__(self, continuations, bad: int) -> None:
        super().__init__(continuations, wrong=0.0)
        self.bad = bad

    def propose(self, token_ids, max_tokens):
        draft = super().propose(token_ids, max_tokens)
        return [(t + 1) % self.vocab for t in draft] if self.calls == self.bad else draft


def test_a_long_draft_rejected_at_its_first_token_does_not_pause_a_request(tiny_model_dirs):
    """A draft's tokens after its first rejected one were never tested: one 16-token draft rejected at its first
    token is one miss, not sixteen. Counted as sixteen, it took a copy whose every draft had been accepted to an
    acceptance of 0 and paused it (a 16-token prompt-lookup draft on the default model's copies)."""
    path, prompt, params, conts, ref = one_request(tiny_model_dirs, seed=2, max_tokens=80)
    engine = engine_for(path, pausing_ngram(16, 0.2, 16))
    engine.speculator.proposer = OneWrongDraft(conts, bad=3)
    engine.add_request("r", prompt, params)
    steps, done = 0, []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        steps += 1
    assert [o.outputs[0].token_ids for o in done] == [ref]
    stats = engine.get_stats()
    # Drafts 1-2 accepted whole (34 tokens after the prompt's), draft 3 rejected at its first token (1 token),
    # then every step drafts again: no step after the prompt's went without a draft.
    assert stats.spec_num_drafts == steps - 1
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens - 16
    assert_no_leaks(engine)
