"""Speculative decoding against random mixes of request parameters, on the default model as a user gets it
(its 4-bit projections): every method's output equals the same engine's without speculation, token for
token, with the same text, finish and stop reasons and logprobs (bit for bit where the CPU kernels run), under
preemptions and chunked prefill.

The hand-picked cases of test_spec_decode_engine.py check each feature; this draws combinations of them
(greedy and seeded sampling with every logits stage, stop strings and ids with min_tokens, max_tokens 1 and
2, n up to 3, logprobs and prompt logprobs) from a fixed seed, so a failure names a reproducible case.
"""
import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels
from spec_helpers import generate_with

PROMPTS = ["Repeat this list: red, green, blue, red, green, blue, yellow. Again: red, green,",
           "Write a short poem about the sea.", "The capital of France is",
           "def fib(n):\n    if n < 2:\n        return n\n", "Explain what a hash map is in two sentences.",
           "List three fruits:", "Once upon a time", "Translate to French: good morning, my friend."]
# Drafting in every step and for every request; eagle drafts two tokens, so its head also drafts from its
# own predicted feature.
ALWAYS = {"disable_by_batch_size": None, "min_acceptance_rate": 0.0, "adaptive_draft_length": False}
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "draft": {"method": "draft", "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 2},
    "eagle-lookup": {"method": "eagle", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    # The rounds ask the same prompts again: drafts from earlier responses, cut by stops inside them.
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}
ROUNDS = 12


def random_case(rng: random.Random) -> tuple[SamplingParams, list[str]]:
    greedy = rng.random() < 0.35
    kw = dict(max_tokens=rng.choice([1, 2, 5, 17, 40]), temperature=0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.5]),
              n=1 if greedy else rng.choice([1, 1, 2, 3]), ignore_eos=rng.random() < 0.5,
              seed=None if greedy and rng.random() < 0.5 else rng.randrange(1000))  # sampling must be seeded to compare
    if not greedy:
        if rng.random() < 0.5:
            kw["top_k"] = rng.choice([1, 5, 50])
        if rng.random() < 0.5:
            kw["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.3:
            kw["min_p"] = rng.choice([0.05, 0.2])
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([0.9, 1.1, 1.3])
    if rng.random() < 0.3:
        kw["presence_penalty"] = rng.choice([-0.5, 0.5, 1.5])
    if rng.random() < 0.3:
        kw["frequency_penalty"] = rng.choice([0.3, 1.0])
    if rng.random() < 0.3:
        kw["logit_bias"] = {rng.randrange(49152): rng.choice([-100.0, -5.0, 5.0, 100.0]) for _ in range(3)}
    if rng.random() < 0.3:
        kw["stop"] = [rng.choice([",", " the", "\n", "blue", "."])]
        kw["include_stop_str_in_output"] = rng.random() < 0.5
    if rng.random() < 0.3:
        kw["stop_token_ids"] = [rng.randrange(49152), 28]  # 28: ","
    if rng.random() < 0.3:
        kw["min_tokens"] = min(kw["max_tokens"], rng.choice([1, 3, 10]))
    if rng.random() < 0.4:
        kw["logprobs"] = rng.choice([0, 1, 5])
    if rng.random() < 0.2:
        kw["prompt_logprobs"] = rng.choice([0, 2])
    return SamplingParams(**kw), rng.sample(PROMPTS, rng.choice([1, 3, 5]))


def assert_same_logprobs(got, want, tol: float) -> None:
    assert (got is None) == (want is None)
    for g, w in zip(got or [], want or []):
        assert (g is None) == (w is None)
        if g is not None:
            assert list(g) == list(w)
            for t in g:
                assert g[t].logprob == pytest.approx(w[t].logprob, abs=tol, rel=0) and g[t].rank == w[t].rank


@pytest.mark.parametrize("method", list(METHODS))
def test_random_request_parameters_give_the_non_speculative_output(method):
    # 12 blocks of 16 tokens cannot hold five requests of up to three sequences: preemptions.
    llm = LLM(dtype="float32", block_size=16, max_num_batched_tokens=96, num_kv_blocks=12,
              speculative_config={**METHODS[method], **ALWAYS})
    # Logprobs are equal where kvserve's CPU kernels run: a row's logits there do not depend on the other rows
    # of its step. On the torch path (CUDA, KVSERVE_CPU_ISA=none) a multi-row matmul may round differently from
    # a one-row one (~1e-5 measured with the kernels off).
    exact = llm.engine.runner.device.type == "cpu" and cpu_kernels.available()
    tol = 0.0 if exact else 1e-4
    for r in range(ROUNDS):
        params, prompts = random_case(random.Random(r))
        want, _, _ = generate_with(llm, False, prompts, params)
        got, _, _ = generate_with(llm, True, prompts, params)
        for g, w in zip(got, want):
            assert_same_logprobs(g.prompt_logprobs, w.prompt_logprobs, tol)
            assert len(g.outputs) == len(w.outputs) == params.n
            for go, wo in zip(g.outputs, w.outputs):
                assert (go.token_ids, go.text, go.finish_reason, go.stop_reason) == \
                       (wo.token_ids, wo.text, wo.finish_reason, wo.stop_reason), (r, params, g.prompt)
                assert_same_logprobs(go.logprobs, wo.logprobs, tol)
    s = llm.engine.get_stats()
    assert s.num_preemptions > 0
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
