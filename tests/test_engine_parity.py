"""The whole engine (scheduler, paged KV cache, chunked prefill mixed with decodes, sampler) against
transformers on tiny random models of each architecture: same greedy tokens, same logits."""
import random

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from engine_helpers import drain
from tiny_models import TINY_KV, hf_greedy

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_NEW = 10


def run_engine_staggered(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Half the prompts start at once; the rest join while the first ones decode."""
    outs = {}
    first, later = prompts[: len(prompts) // 2], prompts[len(prompts) // 2:]
    for i, p in enumerate(first):
        engine.add_request(str(i), p, params)
    mixed_steps = 0
    step = 0
    while engine.has_unfinished_requests() or later:
        if step == 3:
            for j, p in enumerate(later, start=len(first)):
                engine.add_request(str(j), p, params)
            later = []
        sched_before = [(s.num_tokens - s.num_computed_tokens) for s in engine.scheduler.running]
        for out in engine.step():
            if out.finished:
                outs[int(out.request_id)] = out
        if 1 in sched_before and any(n > 1 for n in sched_before):
            mixed_steps += 1
        step += 1
    return [outs[i] for i in range(len(prompts))], mixed_steps


@pytest.mark.parametrize("arch", ARCHS)
def test_engine_matches_transformers(arch, tiny_model_dirs):
    path, hf_model = tiny_model_dirs[arch]
    rng = random.Random(1)
    lengths = [3, 17, 9, 30, 5, 22]
    prompts = [[rng.randrange(0, 256) for _ in range(n)] for n in lengths]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4,
                                    max_num_batched_tokens=16, max_num_seqs=8, kv_cache_memory=TINY_KV))
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    outs, mixed_steps = run_engine_staggered(engine, prompts, params)
    assert mixed_steps > 0, "the workload should mix prefill chunks with decodes"

    for prompt, out in zip(prompts, outs):
        ref_tokens, ref_lp = hf_greedy(hf_model, prompt, MAX_NEW)
        comp = out.outputs[0]
        assert comp.token_ids == ref_tokens
        for step, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            assert len(lp) == 3  # the sampled token is the top-1 here
            for t, entry in lp.items():
                assert entry.logprob == pytest.approx(ref_lp[step, t].item(), abs=2e-4)
        # Prefill logits at every prompt position, through the chunked prefill.
        with torch.no_grad():
            full = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
        assert out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos][prompt[pos]]
            assert entry.logprob == pytest.approx(full[pos - 1, prompt[pos]].item(), abs=2e-4)
    assert engine.block_manager.usage == 0.0


def test_batch_invariance_greedy_alone_and_among_32(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama"]
    engine = LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=4, max_num_batched_tokens=64,
                                    kv_cache_memory=TINY_KV))
    rng = random.Random(7)
    target = [rng.randrange(256) for _ in range(11)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine.add_request("alone", target, params)
    alone = drain(engine)["alone"].outputs[0].token_ids
    for i in range(32):
        engine.add_request(f"o{i}", [rng.randrange(256) for _ in range(rng.randint(2, 40))],
                           SamplingParams(temperature=0.8, max_tokens=rng.randint(1, 20), ignore_eos=True))
    engine.add_request("target", target, params)
    crowd = drain(engine)["target"].outputs[0].token_ids
    assert alone == crowd

