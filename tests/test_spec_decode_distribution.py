"""Speculative sampling keeps the target's distribution: chi-square tests of the joint distribution of the
first four sampled tokens (temperature, top-k, presence penalty, logit_bias) against the exact one computed
from transformers' logits, with drafts that are always wrong, as right as a certain draft can be (the
target's mode), and random in between."""
import random

import pytest
import torch
from scipy.stats import chisquare

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from engine_helpers import assert_no_leaks, drain
from tiny_models import TINY_KV

BANNED = 3            # logit_bias -100: probability zero, so a draft of it is always rejected
TOP_K = 2
TEMPERATURE = 1.5
PRESENCE = 0.8
NUM_TOKENS = 4        # 2**4 outcomes; a decode step verifies up to 2 drafts
SAMPLES = 2400


def target(hf, prompt: list[int], outs: tuple[int, ...]) -> dict[int, float]:
    """The sampler's distribution after prompt + outs, recomputed from transformers' logits."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + list(outs)])).logits[0, -1].double()
    logits[BANNED] -= 100.0
    for t in set(outs):
        logits[t] -= PRESENCE
    logits /= TEMPERATURE
    top = logits.topk(TOP_K)
    probs = torch.softmax(top.values, dim=0)
    return dict(zip(top.indices.tolist(), probs.tolist()))


class TableProposer:
    """Drafts from the exact per-prefix distributions: 'wrong' (the banned token), 'mode' or 'random'."""

    def __init__(self, prompt: list[int], table: dict[tuple[int, ...], dict[int, float]], kind: str) -> None:
        self.prompt, self.table, self.kind = prompt, table, kind
        self.rng = random.Random(0)

    def propose_with_length(self, token_ids: list[int], max_tokens: int, index=None, salt=None
                            ) -> tuple[list[int], int]:
        return self.propose(token_ids, max_tokens), 0  # one draft class

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        outs = tuple(token_ids[len(self.prompt):])
        drafts: list[int] = []
        while len(drafts) < max_tokens:
            if self.kind == "wrong":
                drafts.append(BANNED)
                continue
            dist = self.table[outs]
            tok = max(dist, key=dist.get) if self.kind == "mode" else self.rng.choice(sorted(dist))
            drafts.append(tok)
            outs = outs + (tok,)
        return drafts


@pytest.mark.parametrize("kind", ["wrong", "mode", "random"])
def test_sampled_distribution_is_the_targets(kind, tiny_model_dirs):
    path, hf = tiny_model_dirs["llama"]
    prompt = [random.Random(5).randrange(256) for _ in range(6)]
    table = {(): target(hf, prompt, ())}
    for depth in range(1, NUM_TOKENS):
        for outs in [o for o in table if len(o) == depth - 1]:
            for t in table[outs]:
                table[outs + (t,)] = target(hf, prompt, outs + (t,))
    expected = {}

    def walk(outs: tuple[int, ...], p: float) -> None:
        if len(outs) == NUM_TOKENS:
            expected[outs] = p
            return
        for t, q in table[outs].items():
            walk(outs + (t,), p * q)
    walk((), 1.0)

    engine = LLMEngine(EngineConfig(
        model=str(path), dtype="float32", block_size=4, max_num_seqs=SAMPLES, max_num_batched_tokens=8192,
        kv_cache_memory=TINY_KV,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None,
                            "min_acceptance_rate": 0.0, "adaptive_draft_length": False}))
    engine.speculator.proposer = TableProposer(prompt, table, kind)
    params = SamplingParams(n=SAMPLES // 6, temperature=TEMPERATURE, top_k=TOP_K, presence_penalty=PRESENCE,
                            logit_bias={BANNED: -100.0}, max_tokens=NUM_TOKENS, ignore_eos=True)
    for r in range(6):
        engine.add_request(str(r), prompt, params)
    outs = [tuple(c.token_ids) for o in drain(engine).values() for c in o.outputs]
    assert_no_leaks(engine)
    assert len(outs) == SAMPLES

    observed = {o: 0 for o in expected}
    for o in outs:
        assert o in observed, f"{o} has probability zero under the target"
        observed[o] += 1
    keys = sorted(expected)
    result = chisquare([observed[k] for k in keys], [expected[k] * SAMPLES for k in keys])
    assert result.pvalue > 1e-3, (result, observed, expected)

    s = engine.get_stats()
    assert s.spec_num_draft_tokens >= SAMPLES  # every sample's second step verified drafts
    # A certain draft t is accepted with probability p(t): never the banned token, the mode at least half
    # the time (top-2), a uniform pick of the two exactly half the time.
    first = s.spec_accepted_per_pos[0] / s.spec_num_drafts
    if kind == "wrong":
        assert s.spec_num_accepted_tokens == 0
    elif kind == "mode":
        assert first > 0.55, first
    else:
        assert abs(first - 0.5) < 0.04, first
