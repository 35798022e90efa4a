"""The engine on an NVIDIA GPU (skipped without CUDA): Triton attention, CUDA graphs for decode and
verification steps, bf16 and float32, against transformers; graphs against eager; preemption and prefix-cache
hits; sampling that
reproduces under a seed; and a decode step that reads nothing back from the GPU before its sampled ids.

The Triton kernels' own tests (test_triton_attention.py, test_cuda_graph_padding.py and the `triton`
cases of the parity tests) run on CUDA there too; on a CPU they run under Triton's interpreter."""
from __future__ import annotations

import copy
import random
import warnings

import pytest
import torch

from engine_helpers import assert_no_leaks, drain
from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.sampling_params import SamplingParams
from tiny_models import TINY_KV, hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

MAX_NEW = 12


def cuda_engine(path, dtype: str, **kw) -> LLMEngine:
    cfg = dict(model=str(path), device="cuda", dtype=dtype, block_size=4, max_num_batched_tokens=16,
               max_num_seqs=8, kv_cache_memory=TINY_KV)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def prompts_with_shared_prefix(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 17, 9, 30, 5, 22)]
    prompts.append(prompts[3][:24] + [rng.randrange(256) for _ in range(4)])  # a prefix-cache hit on 3's blocks
    return prompts


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    """The first prompts together, the last one after they finished (so its prefix is cached)."""
    for i, p in enumerate(prompts[:-1]):
        engine.add_request(str(i), p, params)
    outs = drain(engine)
    engine.add_request(str(len(prompts) - 1), prompts[-1], params)
    outs.update(drain(engine))
    return [outs[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_float32_matches_transformers(arch, tiny_model_dirs) -> None:
    """float32 on the GPU: transformers' greedy tokens (on the CPU) and their logprobs to 2e-4."""
    path, ref = tiny_model_dirs[arch]
    engine = cuda_engine(path, "float32")
    assert engine.runner.attn_backend.name == "triton" and engine.runner.graphs is not None
    prompts = prompts_with_shared_prefix(1)
    outs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2))
    assert outs[-1].num_cached_tokens >= 20
    for prompt, out in zip(prompts, outs):
        tokens, ref_lp = hf_greedy(ref, prompt, MAX_NEW)
        comp = out.outputs[0]
        assert comp.token_ids == tokens
        for step, lp in enumerate(comp.logprobs):
            for t, entry in lp.items():
                assert entry.logprob == pytest.approx(ref_lp[step, t].item(), abs=2e-4)
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(arch, tiny_model_dirs) -> None:
    """bf16 cannot match float32 bit for bit, so the yardstick is transformers' own bf16 on the same GPU:
    over the engine's tokens, the engine's logprob errors against float32 transformers stay within a small
    multiple of transformers-bf16's, and every token it picks is float32's best or within that error of it."""
    path, ref = tiny_model_dirs[arch]
    engine = cuda_engine(path, "bfloat16")
    prompts = prompts_with_shared_prefix(2)
    outs = run(engine, prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0))
    # copies: Module.to converts in place, and the fixture's model serves other tests
    ref32 = copy.deepcopy(ref).to("cuda", torch.float32)
    ref16 = copy.deepcopy(ref).to("cuda", torch.bfloat16)
    ours_err, theirs_err, gaps = [], [], []
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        full = torch.tensor([prompt + comp.token_ids], device="cuda")
        with torch.no_grad():
            lp32 = torch.log_softmax(ref32(full).logits[0].float(), -1)[len(prompt) - 1:-1]
            lp16 = torch.log_softmax(ref16(full).logits[0].float(), -1)[len(prompt) - 1:-1]
        for step, tok in enumerate(comp.token_ids):
            ours = comp.logprobs[step][tok].logprob
            ours_err.append(abs(ours - lp32[step, tok].item()))
            theirs_err.append(abs(lp16[step, tok].item() - lp32[step, tok].item()))
            gaps.append((lp32[step].max() - lp32[step, tok]).item())  # 0 where it is float32's argmax
    ours_mean, theirs_mean = sum(ours_err) / len(ours_err), sum(theirs_err) / len(theirs_err)
    assert ours_mean <= 3 * theirs_mean + 1e-3, (ours_mean, theirs_mean)
    assert max(ours_err) <= 3 * max(theirs_err) + 1e-2, (max(ours_err), max(theirs_err))
    assert max(gaps) <= 2 * max(theirs_err) + 1e-2, (max(gaps), max(theirs_err))
    assert sum(g == 0 for g in gaps) >= 0.8 * len(gaps), gaps
    assert_no_leaks(engine)


def test_cuda_graphs_give_the_eager_steps_tokens(tiny_model_dirs) -> None:
    """The same requests with decode graphs (padded batches) and with --enforce-eager: same tokens, and
    logprobs equal to float32 rounding; the graphs really ran."""
    path, _ = tiny_model_dirs["llama"]
    prompts = prompts_with_shared_prefix(3)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
    graphed = cuda_engine(path, "float32")
    replays = []
    run_graph = graphed.runner.graphs.run
    graphed.runner.graphs.run = lambda inputs, shape, **kw: replays.append(len(inputs.input_ids)) or run_graph(
        inputs, shape, **kw)
    a = run(graphed, prompts, params)
    eager = cuda_engine(path, "float32", enforce_eager=True)
    assert eager.runner.graphs is None
    b = run(eager, prompts, params)
    assert len(replays) > MAX_NEW and any(n not in graphed.runner.graphs.sizes[1] for n in replays)  # padded ones
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for t in lx:
                assert lx[t].logprob == pytest.approx(ly[t].logprob, abs=1e-4)


def test_cuda_graphs_captured_with_the_other_blas_library_give_the_eager_steps_tokens(tiny_model_dirs,
                                                                                      monkeypatch) -> None:
    """Capture tries both BLAS libraries (blas_choice.py); with the other library's graph kept for every shape
    (the timing overruled), decode and verification steps give the eager engine's greedy tokens, and torch's
    preference for eager steps is what it was before."""
    from spec_helpers import every_step_ngram, prompts, run_waves
    from kvserve.worker import blas_choice

    path, _ = tiny_model_dirs["llama"]
    before = torch.backends.cuda.preferred_blas_library()
    libraries = blas_choice.usable_libraries(torch.device("cuda"))
    assert len(libraries) == 2, libraries  # a CUDA build of torch has both
    monkeypatch.setattr(blas_choice, "fastest", lambda ms: 1)
    ps = [p * 3 for p in prompts(3, [5, 7, 4, 6])]  # repeated text, so that prompt lookup finds drafts
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    wave = [[(str(i), p, params) for i, p in enumerate(ps)]]
    got = []
    for eager in (False, True):
        engine = cuda_engine(path, "float32", speculative_config=every_step_ngram(3), enforce_eager=eager)
        assert torch.backends.cuda.preferred_blas_library() == before
        if not eager:
            graphs = engine.runner.graphs
            assert len({w for _, w in graphs.graphs}) == 2 and set(graphs.blas.values()) == {libraries[1]}
        got.append(run_waves(engine, wave, check=True))
        assert engine.get_stats().spec_num_drafts > 0
        if not eager:  # both candidates timed for every shape; the steps counted by the shape they replayed
            assert all(set(ms) == set(libraries) for ms in graphs.blas_ms.values())
            assert set(graphs.replays) <= set(graphs.graphs) and sum(graphs.replays.values()) > 0
    for i in range(len(ps)):
        assert got[0][str(i)].outputs[0].token_ids == got[1][str(i)].outputs[0].token_ids, i


def test_cuda_verification_graphs_give_the_eager_steps_tokens(tiny_model_dirs) -> None:
    """Speculative decoding with drafts right and wrong at every position, with verification graphs (rows
    of 1 to 4 tokens padded to 4, padded batches) and with --enforce-eager: the greedy tokens of an engine
    without speculation; the KV bookkeeping checked after every step; verification graphs really ran, rows
    padded among them; no block leaks."""
    from spec_helpers import every_step_ngram, prompts, reference_and_drafts, run_waves, scripted

    path, _ = tiny_model_dirs["llama"]
    ps = prompts(7, [5, 13, 9, 22, 4])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    wave = [[(str(i), p, params) for i, p in enumerate(ps)]]
    ref, _ = reference_and_drafts(path, ps, params, 0.3, device="cuda", max_num_seqs=8)  # as cuda_engine's
    shapes = []
    for eager in (False, True):
        engine = cuda_engine(path, "float32", speculative_config=every_step_ngram(3), enforce_eager=eager)
        engine.speculator.proposer = scripted(ps, ref, 0.3)
        if not eager:
            run_graph = engine.runner.graphs.run
            engine.runner.graphs.run = lambda inputs, shape, **kw: shapes.append(
                (shape, set(inputs.query_lens))) or run_graph(inputs, shape, **kw)
        got = run_waves(engine, wave, check=True)
        stats = engine.get_stats()
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        for i in range(len(ps)):
            assert got[str(i)].outputs[0].token_ids == ref[i].token_ids, (eager, i)
    assert any(shape[1] == 4 and lens != {4} for shape, lens in shapes)


def test_cuda_suffix_decoding_drafts_earlier_responses(tiny_model_dirs) -> None:
    """Method suffix on the GPU (verification graphs of up to 1 + 8 tokens): a second wave of the same prompts
    drafts the first wave's responses; the greedy tokens of an engine without speculation, the KV bookkeeping
    checked after every step, no block leaks."""
    from spec_helpers import prompts, run_waves

    path, _ = tiny_model_dirs["llama"]
    ps = prompts(7, [5, 13, 9, 22])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    waves = [[(f"{w}{i}", p, params) for i, p in enumerate(ps)] for w in "ab"]
    ref = run_waves(cuda_engine(path, "float32"), waves)
    spec = {"method": "suffix", "num_speculative_tokens": 8, "disable_by_batch_size": None,
            "min_acceptance_rate": 0.0, "adaptive_draft_length": False}
    engine = cuda_engine(path, "float32", speculative_config=spec)
    got = run_waves(engine, waves, check=True)
    for rid, want in ref.items():
        assert got[rid].outputs[0].token_ids == want.outputs[0].token_ids, rid
    # The second wave's 4 x 24 tokens are drafted from the first's responses, 5 to 8 tokens a draft.
    assert engine.get_stats().spec_num_accepted_tokens >= 48


def test_cuda_preemption_keeps_greedy_tokens(tiny_model_dirs) -> None:
    """A KV pool too small for every sequence at once: sequences are preempted and recomputed, and their
    tokens are the ones an unconstrained engine gives; no block leaks."""
    path, _ = tiny_model_dirs["qwen3"]
    rng = random.Random(4)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(10, 30))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = cuda_engine(path, "float32")
    tight = cuda_engine(path, "float32", num_kv_blocks=40)
    for engine in (roomy, tight):
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
    want, got = drain(roomy), drain(tight)
    assert tight.scheduler.num_preemptions > 0
    for i in range(len(prompts)):
        assert got[str(i)].outputs[0].token_ids == want[str(i)].outputs[0].token_ids
    assert_no_leaks(tight)


def sampling_mix(seed: int) -> list[SamplingParams]:
    """Every sampler stage, one row each, seeded so that the draws repeat."""
    base = dict(max_tokens=MAX_NEW, ignore_eos=True)
    return [
        SamplingParams(temperature=0.8, top_p=0.9, seed=seed, **base),
        SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=seed + 1, **base),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2,
                       seed=seed + 2, **base),
        SamplingParams(temperature=1.0, logit_bias={65: 5.0, 66: -100.0}, min_tokens=4, seed=seed + 3, **base),
        SamplingParams(temperature=0, **base),
    ]


def test_cuda_seeded_sampling_repeats_alone_and_in_a_crowd(tiny_model_dirs) -> None:
    path, _ = tiny_model_dirs["llama"]
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(4, 20))] for _ in range(5)]
    engine = cuda_engine(path, "bfloat16")
    for i, (p, sp) in enumerate(zip(prompts, sampling_mix(11))):
        engine.add_request(f"a{i}", p, sp)
    together = drain(engine)
    for i, (p, sp) in enumerate(zip(prompts, sampling_mix(11))):
        engine.add_request(f"b{i}", p, sp)
        for j in range(3):  # unseeded neighbours draw from the shared generator
            engine.add_request(f"n{i}-{j}", p, SamplingParams(temperature=1.0, max_tokens=MAX_NEW, ignore_eos=True))
        alone = drain(engine)
        assert alone[f"b{i}"].outputs[0].token_ids == together[f"a{i}"].outputs[0].token_ids, i
        assert 66 not in alone[f"b{i}"].outputs[0].token_ids or i != 3
    assert_no_leaks(engine)


def test_cuda_decode_step_reads_back_only_the_sampled_ids(tiny_model_dirs) -> None:
    """A pure-decode step (a graph replay) with every sampler stage synchronises with the GPU once: when
    the sampled ids come back. Nothing between scheduling and sampling waits for the GPU."""
    path, _ = tiny_model_dirs["llama"]
    engine = cuda_engine(path, "bfloat16")
    rng = random.Random(6)
    for i, sp in enumerate(sampling_mix(21)):
        engine.add_request(str(i), [rng.randrange(256) for _ in range(6)], sp)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    engine.step()
    replays = []
    run_graph = engine.runner.graphs.run
    engine.runner.graphs.run = lambda inputs, shape, **kw: replays.append(1) or run_graph(inputs, shape, **kw)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert replays == [1]
    assert len(syncs) == 1, syncs
    drain(engine)
    assert_no_leaks(engine)


@pytest.fixture(scope="module")
def trained_head(tiny_model_dirs, tmp_path_factory):
    """A small eagle head trained on the tiny llama's greedy continuations (test_spec_decode_eagle.train_head),
    as a file."""
    from test_spec_decode_eagle import train_head
    from kvserve.spec_decode.eagle_head import save_head

    _, hf = tiny_model_dirs["llama"]
    head, head_path = train_head(hf, 40), tmp_path_factory.mktemp("eagle") / "head.safetensors"
    save_head(head_path, head.cfg, head.state_tensors())
    return head_path


def test_cuda_eagle_seeded_sampling_matches_no_speculation(tiny_model_dirs, trained_head) -> None:
    """An eagle engine's seeded tokens and logprobs equal an engine's without speculation on the GPU too: the
    draft samples with the noise the target will use, and the target takes it from the draft and sets the
    request's CUDA generator to where the kept rows leave it (get_state / set_state)."""
    from spec_helpers import make_engine, prompts
    from test_spec_decode_eagle import check_seeded, run, spec

    path, _ = tiny_model_dirs["llama"]
    ps = prompts(4, [5, 13, 21, 8])
    params = SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                            min_tokens=5, max_tokens=24, seed=11, logprobs=1)
    wave = [[(str(i), p, params) for i, p in enumerate(ps)]]
    ref = run(make_engine(path, device="cuda"), wave)
    engine = make_engine(path, spec(trained_head), device="cuda")
    assert engine.runner.device.type == "cuda"
    check_seeded(run(engine, wave, check=True), ref, engine, len(ps))


def test_cuda_eagle_head_graphs_keep_greedy_tokens(tiny_model_dirs, trained_head) -> None:
    """With the engine's graphs on, the eagle head drafts by replaying graphs of its own (eagle_graphs.py):
    the eagle engine's greedy tokens equal an engine's without speculation, the head's graphs really ran
    (a padded size among them), and a replay gives what the same step run eagerly gives."""
    from spec_helpers import make_engine, prompts
    from test_spec_decode_eagle import run, spec

    path, hf = tiny_model_dirs["llama"]
    ps = prompts(5, [5, 13, 21])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    wave = [[(str(i), p, params) for i, p in enumerate(ps)]]
    ref = run(make_engine(path, device="cuda"), wave)
    engine = make_engine(path, spec(trained_head), device="cuda")
    graphs = engine.speculator.draft.model.graphs
    assert graphs is not None and graphs.graphs
    replays = []
    run_graph = graphs.run
    graphs.run = lambda feature, tokens: replays.append(len(tokens)) or run_graph(feature, tokens)
    got = run(engine, wave, check=True)
    for i in range(len(ps)):
        assert got[str(i)].outputs[0].token_ids == ref[str(i)].outputs[0].token_ids, i
    assert engine.get_stats().spec_num_accepted_tokens > 0
    assert 3 in replays and 3 not in graphs.sizes

    g = torch.Generator(device="cuda").manual_seed(0)
    feature = torch.randn(3, hf.config.hidden_size, device="cuda", generator=g)
    tokens = torch.tensor([6, 23, 14], device="cuda")
    with torch.inference_mode():
        replayed = [out.clone() for out in run_graph(feature, tokens)]
        eager = graphs.forward(4)
    # The graph may hold the other BLAS library's kernels (blas_choice.py): equal up to float32 rounding.
    torch.testing.assert_close(replayed[1], eager[1][:3], rtol=1e-5, atol=1e-5)
    assert torch.equal(replayed[2], graphs.head.vocab_ids[replayed[1].argmax(-1)])
    drain(engine)
    assert_no_leaks(engine)
    # speculative_config's enforce_eager (vLLM's field): the head drafts eagerly, the target keeps its graphs.
    eager = make_engine(path, spec(trained_head, enforce_eager=True), device="cuda")
    assert eager.speculator.draft.model.graphs is None and eager.runner.graphs is not None
    got = run(eager, wave, check=True)
    assert all(got[str(i)].outputs[0].token_ids == ref[str(i)].outputs[0].token_ids for i in range(len(ps)))
