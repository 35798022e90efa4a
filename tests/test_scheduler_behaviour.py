"""Prefix caching, preemption, priorities, batching policies, n > 1 and bad input, on a tiny model."""
import random

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from engine_helpers import assert_no_leaks, drain
from tiny_models import TINY_KV

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=32, max_num_seqs=16,
               kv_cache_memory=TINY_KV)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def run(engine: LLMEngine, prompts, params=GREEDY, priorities=None) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, priority=priorities[i] if priorities else 0)
    done = drain(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def path(tiny_model_dirs):
    return tiny_model_dirs["llama"][0]


def prompts_(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_second_request_with_shared_prefix_computes_only_its_suffix(path):
    engine = make_engine(path)
    shared = prompts_(1, 40, 40, seed=3)[0]
    engine.add_request("a", shared + [1, 2, 3], GREEDY)
    drain(engine)
    stats0 = engine.get_stats()
    engine.add_request("b", shared + [7, 8, 9, 10, 11], GREEDY)
    first_step_tokens = None
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o
        if first_step_tokens is None:
            first_step_tokens = engine.get_stats().last_step_num_tokens
    # 40 shared tokens = 10 full blocks of 4; only the 5-token suffix is computed.
    assert out.num_cached_tokens == 40
    assert first_step_tokens == 5
    stats = engine.get_stats()
    assert stats.prefix_cache_hits - stats0.prefix_cache_hits == 40
    assert stats.prefix_cache_queries - stats0.prefix_cache_queries == 45
    assert_no_leaks(engine)


def test_cached_tokens_are_those_of_the_admission_that_ran(path):
    """A request whose cached prefix was matched while the pool had no room for the rest waits; meanwhile another
    request's decoding evicts part of that prefix. Its cached_tokens (usage, the hit counter) had said the first,
    failed attempt's 40 where the step that admitted it computed all but 8."""
    rng = random.Random(0)
    engine = make_engine(path, num_kv_blocks=32, max_num_batched_tokens=128, max_model_len=128)
    shared = [rng.randrange(250) for _ in range(40)]
    run(engine, [shared], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))   # cached: 10 blocks
    engine.add_request("fill", [rng.randrange(250) for _ in range(80)],
                       SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("late", shared + [rng.randrange(250) for _ in range(12)],
                       SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    hits_before, computed = engine.get_stats().prefix_cache_hits, None
    reported = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "late" and out.finished:
                reported = out.num_cached_tokens
        if computed is None and any(s.request_id == "late" for s in engine.scheduler.running):
            computed = engine.get_stats().last_step_num_tokens   # that step ran it alone (the filler had ended)
    assert computed is not None and 0 < 52 - computed < 40, computed   # the scenario: part of the prefix evicted
    assert reported == 52 - computed
    assert engine.get_stats().prefix_cache_hits - hits_before == reported
    assert_no_leaks(engine)


def test_outputs_identical_with_prefix_caching_on_and_off(path):
    base = prompts_(1, 30, 30, seed=5)[0]
    prompts = [base + p for p in prompts_(8, 1, 9, seed=6)]
    on = run(make_engine(path, enable_prefix_caching=True), prompts)
    off_engine = make_engine(path, enable_prefix_caching=False)
    off = run(off_engine, prompts)
    assert on == off
    assert off_engine.get_stats().prefix_cache_hits == 0


def test_prefix_cache_correct_under_eviction_pressure(path):
    # 24 blocks of 4 tokens: distinct 30-token prefixes keep evicting each other's cached blocks.
    prompts = prompts_(12, 20, 30, seed=9)
    reference = run(make_engine(path, num_kv_blocks=400), prompts)
    engine = make_engine(path, num_kv_blocks=24, max_num_seqs=2)
    twice = prompts + prompts[::-1]
    got = run(engine, twice)
    assert got[:12] == reference and got[12:] == reference[::-1]
    assert engine.get_stats().prefix_cache_hits > 0
    assert_no_leaks(engine)


def test_preemption_with_tiny_pool_gives_same_outputs(path):
    prompts = prompts_(12, 5, 30, seed=11)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    reference = run(make_engine(path, num_kv_blocks=1000), prompts, params)
    # 16 blocks of 4 = 64 tokens for 12 requests of up to 50 tokens each.
    engine = make_engine(path, num_kv_blocks=16, max_num_seqs=12)
    assert run(engine, prompts, params) == reference
    assert engine.get_stats().num_preemptions > 0
    assert_no_leaks(engine)


def test_priority_preempts_latest_lowest_priority_first(path):
    engine = make_engine(path, num_kv_blocks=12, scheduling_policy="priority", max_num_seqs=4)
    prompts = prompts_(4, 8, 8, seed=12)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, priority=[1, 0, 2, 0][i])
    first_finished = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                first_finished.append(out.request_id)
    # The two priority-0 requests are never the ones preempted, so they finish first.
    assert set(first_finished[:2]) == {"1", "3"}
    assert engine.get_stats().num_preemptions > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("batching", ["static", "dynamic"])
def test_static_and_dynamic_batching_give_same_greedy_outputs(path, batching):
    prompts = prompts_(10, 3, 25, seed=13)
    reference = run(make_engine(path), prompts)
    engine = make_engine(path, batching=batching, max_num_seqs=4, dynamic_batch_window_s=0.0)
    assert run(engine, prompts) == reference
    assert_no_leaks(engine)


def test_static_batching_admits_nobody_until_the_batch_is_done(path):
    engine = make_engine(path, batching="static", max_num_seqs=2)
    for i, p in enumerate(prompts_(3, 5, 5, seed=14)):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=4 + 4 * i, ignore_eos=True))
    seen_running = []
    while engine.has_unfinished_requests():
        engine.step()
        seen_running.append(sorted(s.request_id for s in engine.scheduler.running))
    # Request 2 only starts once both of the first batch have finished, even after 0 is done early.
    assert ["1"] in seen_running
    assert all("2" not in r for r in seen_running[: seen_running.index(["1"]) + 1])


def test_n_samples_share_prompt_blocks(path):
    engine = make_engine(path)
    prompt = prompts_(1, 21, 21, seed=15)[0]
    engine.add_request("r", prompt, SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True))
    done = drain(engine)
    out = done["r"]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Siblings reuse the prompt's 5 full blocks (20 tokens) computed by the first sample.
    assert engine.get_stats().prefix_cache_hits == 2 * 20
    assert_no_leaks(engine)


def test_n_samples_share_blocks_even_without_prefix_caching(path):
    engine = make_engine(path, enable_prefix_caching=False)
    prompt = prompts_(1, 21, 21, seed=15)[0]
    engine.add_request("r", prompt, SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    drain(engine)
    assert engine.get_stats().prefix_cache_hits == 20
    engine.add_request("s", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    drain(engine)
    assert engine.get_stats().prefix_cache_hits == 20  # another request sees nothing


def test_seeded_request_same_output_whatever_the_batch(path):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    prompt = prompts_(1, 9, 9, seed=16)[0]
    alone = run(make_engine(path), [prompt], params)[0]
    engine = make_engine(path)
    others = prompts_(10, 3, 30, seed=17)
    for i, p in enumerate(others):
        engine.add_request(f"o{i}", p, SamplingParams(temperature=0.7, max_tokens=i + 3, ignore_eos=True))
    engine.add_request("t", prompt, params)
    assert drain(engine)["t"].outputs[0].token_ids == alone


def test_another_engine_does_not_restart_unseeded_sampling(path):
    """Unseeded rows drew from torch's process-wide generator, which every new engine seeds: a second LLM made
    in the same process restarted the first one's draws, so it repeated its earlier samples."""
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompt = prompts_(1, 9, 9, seed=16)[0]
    alone = make_engine(path)
    first, second = run(alone, [prompt], params)[0], run(alone, [prompt], params)[0]
    assert first != second
    engine = make_engine(path)
    assert run(engine, [prompt], params)[0] == first     # the same seed, the same draws
    make_engine(path)
    torch.manual_seed(0)                                 # nor does the caller's own seeding
    assert run(engine, [prompt], params)[0] == second


@pytest.mark.parametrize("prompt,params,field", [
    ("", SamplingParams(), "prompt"),
    ([], SamplingParams(), "prompt"),
    ([1, 2, 10**6], SamplingParams(), "token id"),
    ([1] * 600, SamplingParams(max_tokens=1), "max_model_len"),
])
def test_bad_input_raises_clear_error_and_leaves_nothing(path, prompt, params, field):
    engine = make_engine(path)
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    assert_no_leaks(engine)


def test_max_tokens_past_max_model_len_ends_there(path):
    """As vLLM's engine does (the server refuses such a request with a 400 before it gets here)."""
    engine = make_engine(path, max_model_len=40)
    engine.add_request("long", [1] * 10, SamplingParams(max_tokens=600, ignore_eos=True))
    out = drain(engine)["long"].outputs[0]
    assert len(out.token_ids) == 30 and out.finish_reason == "length"
    assert_no_leaks(engine)


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(n=0), "n"), (dict(min_p=2), "min_p"), (dict(top_k=-5), "top_k"),
    (dict(presence_penalty=3), "presence_penalty"), (dict(logprobs=99), "logprobs"),
    (dict(temperature=float("nan")), "temperature"), (dict(stop=[""]), "stop"),
    (dict(repetition_penalty=10**400), "repetition_penalty"),  # had failed the whole step, in the sampler
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_values_that_had_failed_the_whole_step_are_taken_or_refused_at_add_request(path):
    """A top_k past int64, a salt of invalid Unicode, a priority that is no integer: each passed add_request and
    then failed the step that carried it, and with it every other request in that step."""
    engine = make_engine(path)
    sampled = dict(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
    engine.add_request("huge-k", [5, 6, 7], SamplingParams(top_k=2**63, **sampled))
    engine.add_request("no-k", [5, 6, 7], SamplingParams(top_k=0, **sampled))
    out = drain(engine)
    assert out["huge-k"].outputs[0].token_ids == out["no-k"].outputs[0].token_ids   # every token kept: no top-k
    for kwargs, field in ((dict(cache_salt="\ud800"), "cache_salt"), (dict(cache_salt=7), "cache_salt"),
                          (dict(priority=1.5), "priority"), (dict(priority="1"), "priority")):
        with pytest.raises(ValueError, match=field):
            engine.add_request("bad", [5, 6, 7], SamplingParams(), **kwargs)
    assert_no_leaks(engine)


def test_abort_frees_blocks_at_once(path):
    engine = make_engine(path)
    for i, p in enumerate(prompts_(4, 10, 30, seed=18)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.block_manager.usage > 0
    engine.abort_request([str(i) for i in range(4)])
    assert_no_leaks(engine)


def test_stop_token_ids_end_the_sequence_with_that_token(path):
    engine = make_engine(path)
    prompt = prompts_(1, 10, 10, seed=19)[0]
    full = run(engine, [prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   stop_token_ids=[full[4]]))
    res = drain(engine)["s"].outputs[0]
    assert res.token_ids == full[: full.index(full[4]) + 1]
    assert res.finish_reason == "stop" and res.stop_reason == full[4]


def test_cache_salt_keeps_prefixes_apart(path):
    engine = make_engine(path)
    prompt = prompts_(1, 30, 30, seed=20)[0]
    engine.add_request("a", prompt, GREEDY, cache_salt="tenant-a")
    drain(engine)
    engine.add_request("b", prompt, GREEDY, cache_salt="tenant-b")
    assert drain(engine)["b"].num_cached_tokens == 0
    engine.add_request("c", prompt, GREEDY, cache_salt="tenant-a")
    assert drain(engine)["c"].num_cached_tokens == 28
