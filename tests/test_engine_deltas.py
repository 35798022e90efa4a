"""What crosses the engine boundary each step is only what is new (DESIGN.md §1): the message the engine
process sends does not grow with the output's length, and the deltas add up to the full answer."""
from __future__ import annotations

import statistics

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.core_process import EngineCore, StepResult, encoder, from_engine_decoder
from kvserve.outputs import RequestOutputAccumulator
from kvserve.sampling_params import SamplingParams

LENGTH = 320


@pytest.fixture(scope="module")
def core() -> EngineCore:
    return EngineCore(EngineConfig(max_model_len=1024, num_threads=1))


def run_to_end(core: EngineCore, params: SamplingParams, prompt: list[int]) -> list[bytes]:
    """Every StepResult the engine loop would send for one request, encoded exactly as it is sent."""
    errors: list = []
    core.handle(_add("r", prompt, params), errors)
    frames = []
    while core.has_work():
        outputs = core.step(errors)
        frames.append(encoder.encode(StepResult(outputs, errors, core.stats(), core.num_added, 0.0, True)))
    assert not errors
    return frames


def _add(rid: str, prompt: list[int], params: SamplingParams):
    from kvserve.engine.core_process import AddRequest
    return AddRequest(rid, prompt, params)


def test_step_messages_do_not_grow_with_output_length(core):
    tok = core.engine.tokenizer
    prompt = tok.encode("Write a long story about a lighthouse keeper.")
    params = SamplingParams(n=2, max_tokens=LENGTH, ignore_eos=True, temperature=0.8, seed=1, logprobs=5,
                            prompt_logprobs=2)
    frames = run_to_end(core, params, prompt)
    results = [from_engine_decoder.decode(f) for f in frames]
    deltas = [d for r in results for d in r.outputs]

    # The prompt's logprobs travel once, in the first delta; nothing else from the prompt ever does.
    assert deltas[0].prompt_logprobs is not None and len(deltas[0].prompt_logprobs) == len(prompt)
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    # Each step carries one new token (and its logprobs) per sample that moved, never the earlier ones.
    assert all(len(c.token_ids) == 1 and len(c.logprobs) == 1 for d in deltas for c in d.outputs)

    sizes = [len(f) for f in frames[2:]]   # after the prefill and the second sample's first step
    early, late = statistics.mean(sizes[:50]), statistics.mean(sizes[-50:])
    assert late < 1.3 * early, (early, late)          # cumulative messages would be ~LENGTH/50 times larger
    assert max(sizes) < 3 * statistics.median(sizes)

    # The deltas add up to the whole answer, as the server assembles it for a non-streaming response.
    acc = RequestOutputAccumulator("r", None, prompt, 2, with_logprobs=True)
    for d in deltas:
        out = acc.add(d)
    assert out.finished and all(len(c.token_ids) == LENGTH == len(c.logprobs) for c in out.outputs)
    for c in out.outputs:
        assert c.text == tok.decode(c.token_ids)
        assert all(c.token_ids[k] in c.logprobs[k] for k in range(LENGTH))
    assert out.prompt_logprobs == deltas[0].prompt_logprobs
