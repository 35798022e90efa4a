"""Helpers for the speculative-decoding tests: a proposer whose draft quality the test sets, and the
invariants a sequence's KV bookkeeping must keep after every step."""
from __future__ import annotations

import random

import pytest

from kvserve.config import EngineConfig
from kvserve.engine.block_hash import block_hashes
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.draft_length import MODEL_CLASS
from tiny_models import TINY_KV


def logprob_tolerance(engine: LLMEngine) -> float:
    """How far a speculative run's logprobs may stray from the non-speculative run's: not at all where kvserve's
    CPU kernels compute every linear layer (quantized or float) and every layer's attention, each rounding a row
    alike whatever the other rows of its step; ~1e-5 where torch's matmuls do (KVSERVE_CPU_ISA=none, attention
    heads the kernel lacks), which choose their blocking by the step's shape."""
    return 0.0 if engine.runner.rows_alike() else 1e-5


class ScriptedProposer:
    """Drafts a known continuation (e.g. non-speculative decoding's output for the same prompt), each draft
    token replaced by a wrong one with probability `wrong`: a draft quality set by the test, from always
    right (0) to always wrong (1), with rejections at every position in between."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], wrong: float, vocab: int = 256,
                 seed: int = 0) -> None:
        self.continuations = continuations
        self.wrong = wrong
        self.vocab = vocab
        self.rng = random.Random(seed)
        self.calls = 0

    def propose_with_length(self, token_ids: list[int], max_tokens: int, index=None, salt=None
                            ) -> tuple[list[int], int]:
        return self.propose(token_ids, max_tokens), 0  # one draft class

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
        self.calls += 1
        for prompt, out in self.continuations.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                return [t if self.rng.random() >= self.wrong else (t + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
                        for t in out[done:done + max_tokens]]
        return []


def every_step_ngram(k: int) -> dict:
    """Prompt lookup drafting k tokens in every step: no batch limit, no pauses, no length rule."""
    return {"method": "ngram", "num_speculative_tokens": k, "disable_by_batch_size": None,
            "min_acceptance_rate": 0.0, "adaptive_draft_length": False}


def scripted(prompt_list, outs, wrong: float) -> ScriptedProposer:
    """A ScriptedProposer drafting each prompt's output in outs (CompletionOutputs, in prompt order)."""
    return ScriptedProposer({tuple(p): o.token_ids for p, o in zip(prompt_list, outs)}, wrong)


def reference_and_drafts(path, prompt_list, params, wrong, **kw):
    """Non-speculative decoding's outputs for the prompts (an engine made with kw), and a ScriptedProposer
    drafting them with each draft token wrong with probability `wrong`."""
    ref = run_waves(make_engine(path, **kw), [[(str(i), p, params) for i, p in enumerate(prompt_list)]])
    outs = [ref[str(i)].outputs[0] for i in range(len(prompt_list))]
    return outs, scripted(prompt_list, outs, wrong)


def on_record(engine: LLMEngine, fn) -> None:
    """Calls fn(seq, num_drafted, num_accepted) for every draft the engine verifies, before its speculator
    records it (seq.spec_state.draft_class still says what drafted it)."""
    record = engine.speculator.record

    def recorded(seq, num_drafted, num_accepted, *tree):
        fn(seq, num_drafted, num_accepted)
        record(seq, num_drafted, num_accepted, *tree)
    engine.speculator.record = recorded


def count_draft_kinds(engine: LLMEngine) -> dict[str, dict[str, int]]:
    """Counts, as the engine runs, the verified drafts of prompt lookup ("lookup") and of the draft model or
    eagle head ("model"): drafts, draft tokens, accepted tokens."""
    kinds = {kind: {"drafts": 0, "tokens": 0, "accepted": 0} for kind in ("lookup", "model")}

    def count(seq, num_drafted, num_accepted):
        c = kinds["model" if seq.spec_state.draft_class <= MODEL_CLASS else "lookup"]
        c["drafts"] += 1
        c["tokens"] += num_drafted
        c["accepted"] += num_accepted
    on_record(engine, count)
    return kinds


def generate_with(llm, speculate: bool, prompts, params):
    """llm.generate with its engine's speculator, or with none (speculate False), from an empty prefix cache:
    (outputs, engine stats before, after)."""
    engine = llm.engine
    spec = engine.speculator
    if not speculate:
        engine.speculator = None
        engine.runner.keep_hidden = False  # an eagle step before this one left it on (each step sets it)
    engine.reset_prefix_cache()
    try:
        before = engine.get_stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        after = engine.get_stats()
    finally:
        engine.speculator = spec
    return outs, before, after


def drafts_by_batch_size(engine: LLMEngine) -> dict[int, list[int]]:
    """As the engine runs: per step, its running sequences' draft lengths (a tree's alternatives included),
    keyed by how many ran."""
    seen: dict[int, list[int]] = {}
    propose = engine.speculator.propose

    def proposed(running):
        propose(running)
        seen.setdefault(len(running), []).extend(len(seq.spec_token_ids) for seq in running)
    engine.speculator.propose = proposed
    return seen


def num_tokens_now(engine: LLMEngine) -> dict[int, int]:
    return {seq.seq_id: seq.num_tokens for seq in engine.scheduler.running}


def check_kv_bookkeeping(engine: LLMEngine, tokens_before: dict[int, int] | None = None) -> None:
    """After a step: a running sequence that gained tokens has all but its last one computed (rejected
    drafts rolled back), its blocks cover its computed tokens and at most the next one (blocks only rejected
    drafts had written went back to the pool), the prefix cache holds only blocks of kept tokens, and every
    block's reference count is the number of sequences holding it. tokens_before: num_tokens_now() before
    the step."""
    bm, bs = engine.block_manager, engine.block_manager.block_size
    refs: dict[int, int] = {}
    for seq in engine.scheduler.running:
        assert seq.num_computed_tokens <= seq.num_tokens - 1
        if tokens_before is not None and seq.num_tokens > tokens_before.get(seq.seq_id, seq.num_tokens):
            assert seq.num_computed_tokens == seq.num_tokens - 1, (seq.num_computed_tokens, seq.num_tokens)
        assert len(seq.block_table) * bs >= seq.num_computed_tokens
        assert len(seq.block_table) <= -(-(seq.num_computed_tokens + 1) // bs)
        committed = seq.num_committed_blocks
        if bm.enable_prefix_caching:
            assert committed == seq.num_computed_tokens // bs
        # Each committed block's digest is the one its kept tokens give (sha256 chain, kvserve/engine/block_hash.py).
        want = block_hashes(seq.token_ids[:committed * bs], bs, seq.cache_salt)
        for i, block_id in enumerate(seq.block_table[:committed]):
            assert bm.blocks[block_id].hash == want[i]
        for block_id in seq.block_table:
            refs[block_id] = refs.get(block_id, 0) + 1
    for block in bm.blocks:
        assert block.ref_count == refs.get(block.block_id, 0)


def abort_mid_speculation(engine: LLMEngine) -> None:
    """Three greedy requests; after a few steps with accepted drafts two are aborted: the bookkeeping holds
    after every step and after the aborts, and once the rest finish no block is left."""
    from engine_helpers import assert_no_leaks, drain
    from kvserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts(5, [9, 14, 6])):
        engine.add_request(str(i), p, params)
    for _ in range(6):
        before = num_tokens_now(engine)
        engine.step()
        check_kv_bookkeeping(engine, before)
    assert engine.get_stats().spec_num_accepted_tokens > 0
    engine.abort_request(["0", "2"])
    check_kv_bookkeeping(engine)
    drain(engine)
    assert_no_leaks(engine)


def make_draft_file(path, vocab_ids: list[int], hidden: int = 64, vocab: int = 260, layers: int = 1,
                    seed: int = 0) -> None:
    """A random draft checkpoint (kvserve/spec_decode/draft_format.py) for a tiny target of this hidden size
    and vocabulary, predicting only vocab_ids. Weights are wide, like tiny_models', so argmaxes have margins."""
    import torch

    from kvserve.spec_decode.draft_format import DraftFileConfig, save_draft
    from kvserve.spec_decode.draft_reference import LAYER_TENSORS

    cfg = DraftFileConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=96, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, vocab_size=vocab, rms_norm_eps=1e-6,
                          rope_theta=10000.0, target="a tiny test model")
    g = torch.Generator().manual_seed(seed)
    shapes = {"self_attn.q_proj": (64, hidden), "self_attn.k_proj": (32, hidden), "self_attn.v_proj": (32, hidden),
              "self_attn.o_proj": (hidden, 64), "mlp.gate_proj": (96, hidden), "mlp.up_proj": (96, hidden),
              "mlp.down_proj": (hidden, 96), "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,)}
    tensors = {}
    for i in range(layers):
        for name in LAYER_TENSORS:
            shape = shapes[name]
            w = (1.0 + 0.1 * torch.randn(shape, generator=g)) if len(shape) == 1 else 0.15 * torch.randn(shape, generator=g)
            tensors[f"model.layers.{i}.{name}.weight"] = w
    tensors["model.norm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=g)
    tensors["lm_head.weight"] = 0.15 * torch.randn(len(vocab_ids), hidden, generator=g)
    tensors["vocab_ids"] = torch.tensor(sorted(vocab_ids), dtype=torch.int64)
    save_draft(path, cfg, tensors)


def make_engine(path, spec=None, **kw) -> LLMEngine:
    """A float32 engine with small blocks and steps, so tiny prompts cross block and chunk boundaries
    (and TINY_KV: no KV pressure unless a test sets num_kv_blocks)."""
    kw = {"dtype": "float32", "block_size": 4, "max_num_batched_tokens": 16, "kv_cache_memory": TINY_KV, **kw}
    return LLMEngine(EngineConfig(model=str(path), speculative_config=spec, **kw))


def run_waves(engine: LLMEngine, waves, check: bool = False, after_step=None) -> dict:
    """Each wave's requests are added once the previous wave has finished; returns outputs by id. With
    check, the KV bookkeeping is verified after every step; after_step(engine), if given,
    runs after every step too; no block may leak."""
    from engine_helpers import assert_no_leaks

    done = {}
    for wave in waves:
        for rid, prompt, params in wave:
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            before = num_tokens_now(engine)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if check:
                check_kv_bookkeeping(engine, before)
            if after_step is not None:
                after_step(engine)
    assert_no_leaks(engine)
    return done


PREEMPTING = dict(num_kv_blocks=20, max_num_seqs=8)  # engine arguments: a pool too small for preempting_wave


def preempting_wave(path, **engine_kw) -> tuple[list, dict]:
    """Four prompts, n = 2, greedy with 2 logprobs: with PREEMPTING, chunked prefills and preemptions. The
    wave, and non-speculative decoding's outputs for it (an engine with engine_kw besides)."""
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    wave = [[(f"a{i}", p, params) for i, p in enumerate(prompts(2, [6, 23, 14, 31]))]]
    return wave, run_waves(make_engine(path, **PREEMPTING, **engine_kw), wave)


def count_alternatives(monkeypatch) -> dict[str, int]:
    """Counts, as the runner verifies: rows of drafts with alternatives (token trees), and those that kept one."""
    from kvserve.worker import model_runner

    counts = {"trees": 0, "kept": 0}
    inner = model_runner.kept_rows

    def counted(sampled, drafts, num_alternatives=0):
        rows = inner(sampled, drafts, num_alternatives)
        if num_alternatives:
            counts["trees"] += 1
            counts["kept"] += rows[-1] != len(rows) - 1
        return rows
    monkeypatch.setattr(model_runner, "kept_rows", counted)
    return counts


def prefix_hit_waves(path) -> tuple[list, dict]:
    """Two waves, greedy with a logprob: four prompts, then prompts that extend the first wave's outputs (so
    the second hits the prefix cache on blocks the first filled, drafts included). The waves, and
    non-speculative decoding's outputs for both."""
    from kvserve.sampling_params import SamplingParams

    ps = prompts(3, [6, 23, 14, 31])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    ref_engine = make_engine(path)
    ref1 = run_waves(ref_engine, [[(f"a{i}", p, params) for i, p in enumerate(ps)]])
    second = [p + ref1[f"a{i}"].outputs[0].token_ids[:18] + [7, 8] for i, p in enumerate(ps)]
    waves = [[(f"a{i}", p, params) for i, p in enumerate(ps)], [(f"b{i}", p, params) for i, p in enumerate(second)]]
    return waves, {**ref1, **run_waves(ref_engine, waves[1:])}


def prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(n)] for n in lengths]


def check_request_acceptance(j: dict, detailed: bool) -> None:
    """One request's `metrics.speculative_decoding` (outputs.SpecDecodeMetrics.to_json) agrees with itself: the
    histograms with the totals, the ratios with the counts, the per-step counts (detailed) with both."""
    steps, drafted, accepted = j["num_spec_steps"], j["num_draft_tokens"], j["num_accepted_draft_tokens"]
    assert steps > 0 and drafted >= steps and 0 <= accepted <= drafted, j
    histogram = j["acceptance_histogram"]
    assert len(histogram) == j["num_spec_tokens"] + 1
    assert sum(histogram) == steps and sum(a * c for a, c in enumerate(histogram)) == accepted
    rows = {int(k): v for k, v in j["acceptance_histogram_by_draft_length"].items()}
    assert all(len(row) == k + 1 for k, row in rows.items())
    assert sum(k * sum(row) for k, row in rows.items()) == drafted
    assert [sum(row[a] for row in rows.values() if a < len(row)) for a in range(len(histogram))] == histogram
    assert j["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert j["draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    if detailed:
        assert len(j["per_step_accepted"]) == len(j["per_step_drafted"]) == steps
        assert sum(j["per_step_accepted"]) == accepted and sum(j["per_step_drafted"]) == drafted
        assert all(a <= d for a, d in zip(j["per_step_accepted"], j["per_step_drafted"]))
    else:
        assert "per_step_accepted" not in j and "per_step_drafted" not in j
