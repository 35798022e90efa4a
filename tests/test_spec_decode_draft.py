"""Speculative decoding with a draft model (method "draft") on tiny transformers-built targets.

Three drafts: the target itself (every draft right: any stale K/V in the draft's pool would show as a
rejection), a random draft checkpoint (mostly wrong) and another random model of the same tokenizer. The
outputs must be those of non-speculative decoding: greedy token for token, seeded sampling token for
token, unseeded sampling in distribution; with chunked prefill, preemptions, prefix-cache hits, n > 1 and
aborts."""
import copy
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from scipy.stats import chisquare

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.sequence import Sequence
from kvserve.kernels import cpu as cpu_kernels
from kvserve.models.kv_cache import kv_cache_spec
from kvserve.models.loader import load_model
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.draft_format import read_draft
from kvserve.spec_decode.draft_model import DraftLM, load_draft
from kvserve.spec_decode.draft_proposer import DraftProposer
from kvserve.spec_decode.speculator import Speculator
from kvserve.spec_decode.state import spec_state
from kvserve.spec_decode.draft_reference import DraftReference
from engine_helpers import assert_no_leaks, drain
from spec_helpers import (PREEMPTING, abort_mid_speculation, count_draft_kinds, logprob_tolerance, make_draft_file,
                          make_engine, preempting_wave, prefix_hit_waves, prompts, run_waves)
from test_spec_decode_distribution import BANNED, NUM_TOKENS, PRESENCE, TEMPERATURE, TOP_K, target

K = 3
CPU = torch.device("cpu")


def spec(model, **kw) -> dict:
    return {"method": "draft", "num_speculative_tokens": K, "model": str(model), "disable_by_batch_size": None,
            "min_acceptance_rate": 0.0, "adaptive_draft_length": False, **kw}


def run(engine: LLMEngine, waves, check: bool = False) -> dict:
    return run_waves(engine, waves, check)




@pytest.fixture(scope="module")
def drafts(tiny_model_dirs, tmp_path_factory) -> dict:
    """Draft paths for the llama target, by kind: itself, a random draft checkpoint, another random model,
    and the target with noise added to its weights (right part of the time)."""
    root = tmp_path_factory.mktemp("draft")
    ckpt = root / "draft.safetensors"
    make_draft_file(ckpt, list(range(0, 260, 2)) + [257], seed=1)
    path, hf = tiny_model_dirs["llama"]
    noisy = copy.deepcopy(hf)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    noisy.save_pretrained(root / "noisy")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(path / name, root / "noisy" / name)
    return {"self": path, "checkpoint": ckpt, "other": tiny_model_dirs["qwen3"][0], "noisy": root / "noisy"}


def test_draft_checkpoint_forward_matches_the_reference(tiny_model_dirs, drafts):
    """kvserve's DraftLM over its paged cache (a prefill, a decode, a chunk) gives the logits of the plain
    torch forward the trainer uses, -inf outside vocab_ids."""
    path, hf = tiny_model_dirs["llama"]
    target_model = load_model(str(path), torch.float32, CPU)
    draft = load_draft(str(drafts["checkpoint"]), target_model, torch.float32, CPU, quantization="none")
    assert isinstance(draft, DraftLM)
    cfg, tensors, _ = read_draft(drafts["checkpoint"])
    ref = DraftReference(cfg, hf.model.embed_tokens.weight.detach(), tensors)
    tokens = prompts(0, [15])[0]
    want = torch.full((15, 260), float("-inf"))
    want[:, tensors["vocab_ids"]] = ref(torch.tensor([tokens]))[0].detach()

    runner = DraftProposer(draft, kv_cache_spec(draft.config, 4, torch.float32), 8, CPU, [257])
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=tokens, num_prompt_tokens=15, params=SamplingParams())
    seq.block_table = [5, 2, 7, 0]
    for start, end in ((0, 10), (10, 11), (11, 15)):
        got = runner._forward([(seq, start, tokens[start:end])])[0]
        torch.testing.assert_close(got, want[end - 1], atol=1e-4, rtol=1e-4)


def test_speculative_configs_quantization_sets_the_drafts_weight_format(tiny_model_dirs, drafts):
    """vLLM's quantization field: a draft checkpoint in int8 by default on a CPU, in the format given otherwise
    ("auto": the file's floats); a Hugging Face draft loaded with it in place of the engine's. And without a
    method, a draft's path makes method "draft" (vLLM's rule)."""
    from kvserve.spec_decode.draft_proposer import DraftProposer

    path, _ = tiny_model_dirs["llama"]

    def formats(engine) -> set:
        layers = [m for m in engine.speculator.draft.model.modules() if hasattr(m, "method")]
        return {getattr(m.method, "source", None) for m in layers}
    assert formats(make_engine(path, spec(drafts["checkpoint"]))) == {"int8"}
    for given, want in (("int4", {"int4"}), ("auto", {None}), ("none", {None})):
        assert formats(make_engine(path, spec(drafts["checkpoint"], quantization=given))) == want, given
    assert formats(make_engine(path, spec(drafts["noisy"], quantization="int8"))) == {"int8"}
    assert formats(make_engine(path, spec(drafts["noisy"]))) == {None}  # as the float32 target: floats
    given = {k: v for k, v in spec(drafts["checkpoint"]).items() if k != "method"}
    engine = make_engine(path, given)
    assert engine.config.speculative_config.method == "draft" and isinstance(engine.speculator.draft, DraftProposer)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels on this machine")
def test_a_quantized_draft_checkpoint_runs_its_layers_in_one_native_call(tiny_model_dirs, drafts):
    """As the target's: with int8 weights (what a draft checkpoint gets on a CPU) the draft's layers run in
    one native call, which gives the layers' own logits bit for bit (a prefill, a decode, a chunk)."""
    path, _ = tiny_model_dirs["llama"]
    target_model = load_model(str(path), torch.float32, CPU)
    draft = load_draft(str(drafts["checkpoint"]), target_model, torch.float32, CPU, quantization="auto")
    stack = draft.native_stack
    assert stack is not None
    tokens = prompts(0, [15])[0]
    seq = Sequence(seq_id=0, request_id="r", index=0, token_ids=tokens, num_prompt_tokens=15, params=SamplingParams())
    seq.block_table = [5, 2, 7, 0]
    native_calls = []

    def counting(*args):
        out = stack(*args)
        native_calls.append(out is not None)
        return out

    def logits() -> list[torch.Tensor]:
        runner = DraftProposer(draft, kv_cache_spec(draft.config, 4, torch.float32), 8, CPU, [257])
        return [runner._forward([(seq, start, tokens[start:end])]) for start, end in ((0, 10), (10, 11), (11, 15))]

    draft.native_stack = counting
    native = logits()
    assert native_calls == [True] * 3
    draft.native_stack = None
    assert all(torch.equal(a, b) for a, b in zip(native, logits()))


def assert_same(got: dict, ref: dict, engine: LLMEngine) -> None:
    for rid, r in ref.items():
        for o, e in zip(got[rid].outputs, r.outputs):
            assert o.token_ids == e.token_ids, rid
            for lp, rlp in zip(o.logprobs, e.logprobs):
                assert lp.keys() == rlp.keys()
                for t in lp:
                    assert lp[t].logprob == pytest.approx(rlp[t].logprob, abs=logprob_tolerance(engine), rel=0)


def assert_acceptance(engine: LLMEngine, kind: str) -> None:
    s = engine.get_stats()
    assert s.spec_num_drafts > 0
    if kind == "self":  # any stale K/V in the draft's pool would show as a rejection
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    else:
        assert s.spec_num_accepted_tokens < 0.5 * s.spec_num_draft_tokens


@pytest.mark.parametrize("kind, kv_cache_dtype", [("self", "auto"), ("checkpoint", "auto"), ("other", "auto"),
                                                  ("checkpoint", "fp8_e4m3")])
def test_greedy_identical_with_preemption_and_n(kind, kv_cache_dtype, tiny_model_dirs, drafts):
    """Chunked prefills, n = 2, and a pool too small for the batch: the non-speculative tokens and logprobs.
    With a float8 KV cache, the draft model's pool is float8 too, its scales calibrated for it at start."""
    path, _ = tiny_model_dirs["llama"]
    wave, ref = preempting_wave(path, kv_cache_dtype=kv_cache_dtype)
    engine = make_engine(path, spec(drafts[kind]), kv_cache_dtype=kv_cache_dtype, **PREEMPTING)
    assert_same(run(engine, wave, check=True), ref, engine)
    assert engine.get_stats().num_preemptions > 0
    assert_acceptance(engine, kind)


def test_prompt_lookup_in_front_of_the_draft(tiny_model_dirs, drafts):
    """Lookup drafts where the last token occurred before, the draft model elsewhere, in the same steps
    (n = 2, chunked prefills, preemptions): the non-speculative tokens and logprobs. The target as its own
    draft stays right every time, so its cache caught up on the tokens that lookup drafted."""
    path, _ = tiny_model_dirs["llama"]
    wave, ref = preempting_wave(path)
    engine = make_engine(path, spec(drafts["self"], prompt_lookup_min=1, prompt_lookup_max=2), **PREEMPTING)
    kinds = count_draft_kinds(engine)
    assert_same(run(engine, wave, check=True), ref, engine)
    assert engine.get_stats().num_preemptions > 0
    model, lookup = kinds["model"], kinds["lookup"]
    assert model["drafts"] > 10 and model["accepted"] == model["tokens"], kinds
    # Few prompts repeat a token; and in this tight pool drafts get only the blocks nobody else needs.
    assert lookup["drafts"] >= 5 and 0 < lookup["accepted"] < lookup["tokens"], kinds


def test_suffix_decoding_in_front_of_the_draft(tiny_model_dirs, drafts):
    """enable_suffix_decoding: a wave, then two of its prompts again, drafted from the first wave's responses,
    the draft model drafting the rest in the same steps (n = 2, chunked prefills, preemptions): the
    non-speculative tokens and logprobs. The target as its own draft stays right every time, so its cache
    caught up on the tokens that suffix decoding drafted."""
    path, _ = tiny_model_dirs["llama"]
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    first = prompts(2, [6, 23, 14, 31])
    waves = [[(f"a{i}", p, params) for i, p in enumerate(first)],
             [(f"b{i}", p, params) for i, p in enumerate(first[:2])]]
    ref = run_waves(make_engine(path, **PREEMPTING), waves)
    engine = make_engine(path, spec(drafts["self"], enable_suffix_decoding=True), **PREEMPTING)
    kinds = count_draft_kinds(engine)
    assert_same(run_waves(engine, waves, check=True), ref, engine)
    assert engine.get_stats().num_preemptions > 0
    model, text = kinds["model"], kinds["lookup"]
    assert model["drafts"] > 10 and model["accepted"] == model["tokens"], kinds
    assert text["drafts"] > 4 and text["accepted"] > 0.8 * text["tokens"], kinds


@pytest.mark.parametrize("kind", ["self", "checkpoint"])
def test_greedy_identical_with_prefix_hits_on_drafted_blocks(kind, tiny_model_dirs, drafts):
    """A second wave whose prompts extend the first wave's outputs: prefix-cache hits on blocks that drafts
    filled (the draft recomputes its own K/V for them), the non-speculative output."""
    path, _ = tiny_model_dirs["llama"]
    waves, ref = prefix_hit_waves(path)
    engine = make_engine(path, spec(drafts[kind]))
    got = run(engine, waves, check=True)
    assert_same(got, ref, engine)
    assert all(got[f"b{i}"].num_cached_tokens > len(prompt) for i, (_, prompt, _) in enumerate(waves[0]))
    assert_acceptance(engine, kind)


@pytest.mark.parametrize("kind", ["self", "other"])
def test_seeded_sampling_identical_to_non_speculative(kind, tiny_model_dirs, drafts):
    """Every logits stage, n = 2: the same tokens as without speculation (the draft samples with the noise
    the target will use, and the target emits only its own samples). The target as its own draft is then
    right every time, in sampling as in greedy."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(4, [5, 13, 21, 8])
    params = SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 3.0, 9: -2.0},
                            min_tokens=5, stop_token_ids=[7], max_tokens=24, seed=11, logprobs=1)
    ref = run(make_engine(path), [[(str(i), p, params) for i, p in enumerate(ps)]])
    engine = make_engine(path, spec(drafts[kind]))
    got = run(engine, [[(str(i), p, params) for i, p in enumerate(ps)]], check=True)
    for i in range(len(ps)):
        for e, g in zip(ref[str(i)].outputs, got[str(i)].outputs):
            assert g.token_ids == e.token_ids
            assert [list(lp) for lp in g.logprobs] == [list(lp) for lp in e.logprobs]
    s = engine.get_stats()
    if kind == "self":
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens > 0
    else:
        assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens


@pytest.mark.parametrize("kind", ["wrong", "right", "between"])
def test_unseeded_sampled_distribution_is_the_targets(kind, tiny_model_dirs, drafts, tmp_path):
    """Chi-square test of the joint distribution of the first four tokens (temperature, top-k, presence
    penalty, logit_bias) against the exact one from transformers' logits, with a draft that only knows the
    banned token (always wrong), the target itself (always right) and the target with noisy weights."""
    path, hf = tiny_model_dirs["llama"]
    if kind == "wrong":
        draft = tmp_path / "banned.safetensors"
        make_draft_file(draft, [BANNED])
    else:
        draft = drafts["self" if kind == "right" else "noisy"]
    engine = make_engine(path, spec(draft), max_num_seqs=1800, max_num_batched_tokens=8192)
    rate = sampled_acceptance_and_chisquare(engine, hf)
    assert {"wrong": rate == 0, "right": rate == 1, "between": 0.05 < rate < 0.95}[kind], rate


def sampled_acceptance_and_chisquare(engine, hf, samples: int = 1800) -> float:
    """Samples the first NUM_TOKENS tokens of one prompt `samples` times (temperature, top-k, presence
    penalty, logit_bias) and chi-square-tests their joint distribution against the exact one from
    transformers' logits; returns the acceptance rate of the drafts."""
    prompt = prompts(5, [6])[0]
    expected: dict[tuple[int, ...], float] = {}

    def walk(outs: tuple[int, ...], p: float) -> None:
        if len(outs) == NUM_TOKENS:
            expected[outs] = p
            return
        for t, q in target(hf, prompt, outs).items():
            walk(outs + (t,), p * q)
    walk((), 1.0)

    params = SamplingParams(n=samples // 6, temperature=TEMPERATURE, top_k=TOP_K, presence_penalty=PRESENCE,
                            logit_bias={BANNED: -100.0}, max_tokens=NUM_TOKENS, ignore_eos=True)
    for r in range(6):
        engine.add_request(str(r), prompt, params)
    outs = [tuple(c.token_ids) for o in drain(engine).values() for c in o.outputs]
    assert_no_leaks(engine)
    observed = {o: 0 for o in expected}
    for o in outs:
        assert o in observed, f"{o} has probability zero under the target"
        observed[o] += 1
    keys = sorted(expected)
    result = chisquare([observed[k] for k in keys], [expected[k] * samples for k in keys])
    assert result.pvalue > 1e-3, (result, observed, expected)
    s = engine.get_stats()
    assert s.spec_num_draft_tokens >= samples
    return s.spec_num_accepted_tokens / s.spec_num_draft_tokens


def test_a_backlog_longer_than_a_step_is_caught_up_in_chunks(tiny_model_dirs, drafts, monkeypatch):
    """Prompts longer than max_num_batched_tokens (16 here): the draft runs what it has not seen in passes of at
    most that many tokens, a chunk a step, not the whole prompt in the first decode step's pass, while a short
    prompt beside them drafts; then every request drafts, and the target as its own draft is right every time
    (a chunk skipped or run at the wrong positions would show as a rejection); the output is the
    non-speculative one."""
    path, _ = tiny_model_dirs["llama"]
    passes: list[int] = []
    events: list[tuple[int, str]] = []  # (engine step, "draft" or "catch-up")
    drafted: dict[str, int] = {}        # request id -> draft tokens verified
    forward, fill, catch_up = DraftProposer._forward, DraftProposer.fill, DraftProposer.catch_up
    record = Speculator.record
    engine = None

    def counted(self, rows, **kw):
        passes.append(sum(len(tokens) for _, _, tokens in rows))
        return forward(self, rows, **kw)

    def filled(self, sched, to_draft):
        events.append((engine._num_steps, "draft"))
        return fill(self, sched, to_draft)

    def caught_up(self, chunks):
        events.append((engine._num_steps, "catch-up"))
        return catch_up(self, chunks)

    def recorded(self, seq, num_drafted, *args):
        drafted[seq.request_id] = drafted.get(seq.request_id, 0) + num_drafted
        return record(self, seq, num_drafted, *args)

    monkeypatch.setattr(DraftProposer, "_forward", counted)
    monkeypatch.setattr(DraftProposer, "fill", filled)
    monkeypatch.setattr(DraftProposer, "catch_up", caught_up)
    monkeypatch.setattr(Speculator, "record", recorded)
    ps = prompts(6, [70, 9, 45])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    wave = [[(str(i), p, params) for i, p in enumerate(ps)]]
    ref = run(make_engine(path), wave)
    engine = make_engine(path, spec(drafts["self"]))
    got = run(engine, wave, check=True)
    for i in range(len(ps)):
        assert got[str(i)].outputs[0].token_ids == ref[str(i)].outputs[0].token_ids
    s = engine.get_stats()
    assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens > 0
    assert max(passes) <= 16, passes
    assert all(drafted.get(str(i), 0) > 0 for i in range(len(ps))), drafted  # the long prompts caught up
    steps = {kind: {step for step, k in events if k == kind} for kind in ("draft", "catch-up")}
    assert steps["draft"] & steps["catch-up"], events  # the short prompt drafted while a long one caught up


def test_drafting_sequences_leave_at_least_half_the_budget_to_backlogs(tiny_model_dirs, drafts):
    """Three decoding sequences whose drafts need 4 unseen tokens each, and one whose draft has seen nothing of
    its 40-token prompt, at a budget of 16 tokens a step: the drafting sequences take at most 8, and the backlog
    gets at least the other 8 in its own pass (taking the budget first, the drafters had left it 4)."""
    path, _ = tiny_model_dirs["llama"]
    engine = make_engine(path, spec(drafts["self"]), max_num_seqs=8)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, p in enumerate(prompts(8, [5, 5, 5, 40])):
        engine.add_request(str(i), p, params)
    def decoding(seq) -> bool:
        return seq.prefill_done and seq.num_tokens - seq.num_computed_tokens == 1

    while len(engine.scheduler.running) < 4 or not all(map(decoding, engine.scheduler.running)):
        engine.step()
    seqs = {seq.request_id: seq for seq in engine.scheduler.running}
    assert len(seqs) == 4
    for rid in "012":
        spec_state(seqs[rid]).draft_computed = seqs[rid].num_tokens - 4
    spec_state(seqs["3"]).draft_computed = 0
    passes: list[int] = []
    forward = engine.speculator.draft._forward

    def counted(rows, **kw):
        passes.append(sum(len(tokens) for _, _, tokens in rows))
        return forward(rows, **kw)

    engine.speculator.draft._forward = counted
    engine.step()
    assert spec_state(seqs["3"]).draft_computed >= 8, passes
    assert passes and max(passes) <= 16, passes


def test_abort_mid_speculation_frees_everything(tiny_model_dirs, drafts):
    path, _ = tiny_model_dirs["llama"]
    engine = make_engine(path, spec(drafts["self"]))
    abort_mid_speculation(engine)


def test_bad_draft_models_are_refused_clearly(tiny_model_dirs, tmp_path):
    path, _ = tiny_model_dirs["llama"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_engine(path, spec(tmp_path / "nope"))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ValueError, match="neither a Hugging Face directory"):
        make_engine(path, spec(tmp_path / "notes.txt"))
    wide = tmp_path / "wide.safetensors"
    make_draft_file(wide, [1, 2], vocab=300)
    with pytest.raises(ValueError, match="vocabulary 300"):
        make_engine(path, spec(wide))
    damaged = tmp_path / "damaged.safetensors"
    make_draft_file(damaged, [1, 2, 260])  # an id past the vocabulary would fail only when drafted
    with pytest.raises(ValueError, match="vocab_ids must be distinct token ids below 260"):
        make_engine(path, spec(damaged))
    # Damaged files are named, whatever deep in the loader trips on them (these raised KeyError, TypeError,
    # IndexError, an AssertionError and safetensors' own error, with a traceback and no word of which file).
    good = tmp_path / "good.safetensors"
    make_draft_file(good, [1, 2])
    tensors, meta = load_file(good), safe_open(str(good), "pt").metadata()
    cfg = json.loads(meta["kvserve_draft"])
    broken = {"no_vocab_ids": ({k: v for k, v in tensors.items() if k != "vocab_ids"}, cfg),
              "no_head_dim": (tensors, {k: v for k, v in cfg.items() if k != "head_dim"}),
              "no_layers": ({k: v for k, v in tensors.items() if "layers" not in k}, {**cfg, "num_hidden_layers": 0}),
              "odd_heads": (tensors, {**cfg, "num_attention_heads": 3})}
    for name, (t, c) in broken.items():
        save_file(t, str(tmp_path / f"{name}.safetensors"), metadata={**meta, "kvserve_draft": json.dumps(c)})
        with pytest.raises(ValueError, match=rf"draft '.*{name}.safetensors' is damaged or incomplete \("):
            make_engine(path, spec(tmp_path / f"{name}.safetensors"))
    save_file(tensors, str(tmp_path / "text_field.safetensors"),
              metadata={**meta, "kvserve_draft": json.dumps({**cfg, "hidden_size": "64"})})
    with pytest.raises(ValueError, match="hidden_size should be int, got '64'"):
        make_engine(path, spec(tmp_path / "text_field.safetensors"))
    truncated = tmp_path / "truncated"
    shutil.copytree(path, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"speculative_config: .*truncated/model.safetensors is not a readable "
                                         r"safetensors file"):
        make_engine(path, spec(truncated))
    # Same merges and pre-tokeniser, two ids swapped: the probe text encodes alike (it holds neither letter), but
    # every drafted 'Q' would be read by the target as 'Z'.
    swapped = tmp_path / "swapped"
    shutil.copytree(path, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["Q"], vocab["Z"] = vocab["Z"], vocab["Q"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=r"names 2 token id\(s\) differently from the target, e\.g\. \d+ "
                                         r"\('Z' against 'Q'\)"):
        make_engine(path, spec(swapped))
    # No model: the shipped draft is the default model's, and this target is not.
    with pytest.raises((ValueError, FileNotFoundError), match="model"):
        make_engine(path, {"method": "draft", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="applies only to methods 'draft' and 'eagle'"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "model": str(path)})


def test_a_draft_with_a_shorter_context_stops_drafting_at_its_end(tiny_model_dirs, tmp_path):
    """A Hugging Face draft of 32 positions for a target of 512 (the target itself, its config cut): it drafts
    while its positions fit, then the target decodes alone, with the non-speculative output; before, the
    draft's forward pass failed at position 32 and took the step, every request in it, down."""
    import json

    path, _ = tiny_model_dirs["llama"]
    short = tmp_path / "short"
    shutil.copytree(path, short)
    cfg = json.loads((short / "config.json").read_text())
    cfg["max_position_embeddings"] = 32
    (short / "config.json").write_text(json.dumps(cfg))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ps = prompts(8, [20, 9])
    wave = [[(str(i), p, params) for i, p in enumerate(ps)]]
    ref = run(make_engine(path), wave)
    engine = make_engine(path, spec(short))
    assert engine.speculator.draft.max_positions == 32
    got = run(engine, wave, check=True)
    for i in range(len(ps)):
        assert got[str(i)].outputs[0].token_ids == ref[str(i)].outputs[0].token_ids
    assert engine.get_stats().spec_num_accepted_tokens > 0  # the draft is the target: right while it drafts
