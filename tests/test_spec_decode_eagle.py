"""Speculative decoding with an eagle head (method "eagle") on a tiny transformers-built target.

Three heads: two trained here for a few seconds on the target's own greedy continuations of the tests'
prompts, 40 tokens of them ("right": every greedy draft right, so any stale input to the head would show
as a rejection) or 10 ("partial"), and one that can only propose a banned token ("wrong"). The outputs must be those of
non-speculative decoding: greedy token for token with logprobs, seeded sampling token for token, unseeded
sampling in distribution; with chunked prefill, preemptions, prefix-cache hits, n > 1 and aborts. The
head's input is checked against transformers' own hidden states after every step. Token trees (alternatives
to the first draft token, each in a row of its own) too: the same outputs, by the kernel and by the torch path.
"""
import ast
import dataclasses
import json
from collections import Counter

import pytest
import torch
from safetensors.torch import save_file

from kvserve.config import EngineConfig
from kvserve.engine.sequence import Sequence
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quantization.methods import BlockMethod
from kvserve.models.default import default_model_path
from kvserve.models.loader import load_model
from kvserve.sampling import sampler as sampler_module
from kvserve.sampling.sampler import Sampler, SamplingInputs, make_generator
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.confidence import FIRST, KINDS, Calibration, calibration_path
from kvserve.spec_decode.draft_format import DraftFileConfig
from kvserve.spec_decode.draft_proposer import clone_generator
from kvserve.spec_decode.draft_reference import DraftReference
from kvserve.spec_decode.eagle_head import (NATIVE_MAX_CHOICES, EagleHead, EagleHeadConfig, EagleHeadReference,
                                            head_quantization, load_eagle_head, read_head, save_head)
from kvserve.spec_decode.eagle_proposer import EagleProposer
from kvserve.spec_decode.draft_length import MODEL_CLASS
from kvserve.spec_decode.state import spec_state
from kvserve.spec_decode.suffix import CORPUS_CLASS, SuffixProposer
from engine_helpers import assert_no_leaks
from spec_helpers import (PREEMPTING, abort_mid_speculation, check_request_acceptance, count_alternatives,
                          count_draft_kinds, drafts_by_batch_size, make_draft_file, make_engine, on_record,
                          preempting_wave, prefix_hit_waves, prompts, run_waves)
from test_spec_decode_distribution import BANNED
from test_spec_decode_draft import assert_same, sampled_acceptance_and_chisquare

K = 3
CPU = torch.device("cpu")


def spec(head, **kw) -> dict:
    return {"method": "eagle", "num_speculative_tokens": K, "model": str(head), "disable_by_batch_size": None,
            "min_acceptance_rate": 0.0, "adaptive_draft_length": False, **kw}


def random_head(hf, vocab_ids: list[int], seed: int = 0, inter: int = 96) -> EagleHeadReference:
    d = hf.config.hidden_size
    cfg = EagleHeadConfig(hidden_size=d, intermediate_size=inter, vocab_size=hf.config.vocab_size,
                          rms_norm_eps=1e-6, target="a tiny test model")
    g = torch.Generator().manual_seed(seed)
    vocab = torch.tensor(sorted(vocab_ids))
    tensors = {"fc.weight": 0.15 * torch.randn(d, 2 * d, generator=g),
               "mlp_norm.weight": 1 + 0.1 * torch.randn(d, generator=g),
               "mlp.gate_proj.weight": 0.15 * torch.randn(inter, d, generator=g),
               "mlp.up_proj.weight": 0.15 * torch.randn(inter, d, generator=g),
               "mlp.down_proj.weight": 0.15 * torch.randn(d, inter, generator=g),
               "norm.weight": 1 + 0.1 * torch.randn(d, generator=g),
               "lm_head.weight": hf.model.embed_tokens.weight.detach()[vocab].clone(), "vocab_ids": vocab}
    return EagleHeadReference(cfg, hf.model.embed_tokens.weight.detach(), tensors)


# The prompts of the tests below. A random tiny target's continuations are noise that no head could
# generalise to, so the trained heads learn these prompts' greedy continuations.
PROMPTS = [(2, [6, 23, 14, 31]), (3, [6, 23, 14, 31]), (4, [5, 13, 21, 8]), (5, [6]), (5, [9, 14, 6])]


def train_head(hf, num_tokens: int, steps: int = 300) -> EagleHeadReference:
    """The target's greedy continuations, its hidden states and choices along them; the head learns to
    draft them (EagleHeadReference.training_loss, as benchmarks/train_eagle.py does)."""
    head = random_head(hf, list(range(hf.config.vocab_size)), seed=1, inter=256)
    data = []
    with torch.no_grad():
        for p in [p for seed, lengths in PROMPTS for p in prompts(seed, lengths)]:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=num_tokens, do_sample=False,
                              min_new_tokens=num_tokens, pad_token_id=0)
            out = hf(ids, output_hidden_states=True)
            data.append((ids[0], out.logits[0].argmax(-1), out.hidden_states[-1][0]))
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    # Ops this small run faster on one thread than on two under CI's OMP_WAIT_POLICY=PASSIVE: both heads
    # took ~175 s on 2 AVX2 cores with this file run alone, ~60 s on one thread (in the whole suite an
    # earlier in-process engine with num_threads=1 had left torch on one thread).
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            loss = sum(head.training_loss(ids, labels, feats, unroll=3, feature_weight=0.5)
                       for ids, labels, feats in data)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return head


@pytest.fixture(scope="module")
def heads(tiny_model_dirs, tmp_path_factory) -> dict:
    _, hf = tiny_model_dirs["llama"]
    root = tmp_path_factory.mktemp("eagle")
    out = {}
    for kind, head in (("right", train_head(hf, 40)), ("partial", train_head(hf, 10)),
                       ("wrong", random_head(hf, [BANNED]))):
        out[kind] = root / f"{kind}.safetensors"
        save_head(out[kind], head.cfg, head.state_tensors())
    return out


def test_a_loaded_head_keeps_its_weights_when_its_file_is_rewritten(tiny_model_dirs, heads, tmp_path):
    """safetensors maps the file: a tensor kept as read (vocab_ids, no copy on the CPU) would follow the
    file, so a head copied over the one a running engine loaded (a retrained head put in place) would
    silently draft through the new file's vocabulary. Seen once: the engine's head then drafted nothing."""
    path, _ = tiny_model_dirs["llama"]
    target_model = load_model(str(path), torch.float32, CPU)
    file = tmp_path / "head.safetensors"
    file.write_bytes(heads["right"].read_bytes())
    head = load_eagle_head(str(file), target_model, torch.float32, CPU, quantization="none")
    feature = torch.randn(5, head.config.hidden_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([6, 23, 14, 31, 5])
    with torch.no_grad():
        before = head.full_vocab_logits(head.head_logits_step(feature, tokens)[1])
        vocab_before = head.vocab_ids.clone()
        # The same head with its vocabulary rotated: a file of the same size, so no page of the mapping
        # goes past its end.
        cfg, tensors, _ = read_head(file)
        tensors = {k: v.clone() for k, v in tensors.items()}
        tensors["vocab_ids"] = tensors["vocab_ids"].roll(1)
        save_head(tmp_path / "other.safetensors", cfg, tensors)
        other = (tmp_path / "other.safetensors").read_bytes()
        assert len(other) == file.stat().st_size
        with open(file, "r+b") as f:  # in place, as cp does: the same inode, so the same mapping
            f.write(other)
        assert torch.equal(head.vocab_ids, vocab_before)
        assert torch.equal(head.full_vocab_logits(head.head_logits_step(feature, tokens)[1]), before)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels on this machine")
@pytest.mark.parametrize("dtype,quantization", [(torch.float32, "int8"), (torch.float32, "int4"),
                                                (torch.float32, "none"), (torch.bfloat16, "none")])
def test_native_greedy_step_matches_the_layers_bit_for_bit(tiny_model_dirs, tmp_path, dtype, quantization):
    """The head's greedy drafting step as one native call (kernels/cpu/eagle_head.cpp) gives the features
    and tokens of its layers called one by one from Python, over two drafting steps: quantized heads, and
    float ones (an unquantized engine's) on dense_linear or, in bfloat16 where the CPU has AMX-BF16, its tiles."""
    path, hf = tiny_model_dirs["llama"]
    target_model = load_model(str(path), dtype, CPU)
    ref = random_head(hf, list(range(256)), seed=3, inter=128)  # shapes the tiled kernels take
    file = tmp_path / "head.safetensors"
    save_head(file, ref.cfg, ref.state_tensors())
    head = load_eagle_head(str(file), target_model, dtype, CPU, quantization=quantization)
    assert head.native_weights is not None
    if quantization == "none":
        on_amx = dtype == torch.bfloat16 and cpu_kernels.amx()
        assert [w.dim() for w in head.native_weights if w is not None and w.dim() > 1] == [5 if on_amx else 2] * 4
    feature = torch.randn(5, ref.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([6, 23, 14, 31, 5])
    with torch.no_grad():
        for _ in range(2):
            got_feature, got_tokens = head.greedy_step(feature, tokens)
            logits_feature, logits = head.head_logits_step(feature, tokens)
            feature, normed = head.step(feature, tokens)
            tokens = head.greedy_tokens(normed)
            assert torch.equal(got_feature, feature) and torch.equal(got_tokens, tokens)
            assert torch.equal(logits_feature, feature) and torch.equal(logits, head.lm_head(normed).float())
    assert len(set(tokens.tolist())) > 1


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels on this machine")
@pytest.mark.parametrize("quantization", ["int8", "int4", "none"])
def test_native_top_step_is_a_softmax_and_top_k_of_the_heads_logits(tiny_model_dirs, tmp_path, quantization):
    """What a greedy tree is drafted from and sized by, in one native call: the head's k likeliest tokens (as
    full-vocabulary ids) and their probabilities, those of a softmax and top-k over its logits."""
    path, hf = tiny_model_dirs["llama"]
    target_model = load_model(str(path), torch.float32, CPU)
    ref = random_head(hf, list(range(0, 256, 2)), seed=3, inter=128)  # ids that differ from their rows
    file = tmp_path / "head.safetensors"
    save_head(file, ref.cfg, ref.state_tensors())
    head = load_eagle_head(str(file), target_model, torch.float32, CPU, quantization=quantization)
    assert head.native_weights is not None  # top_step below is the native call
    feature = torch.randn(5, ref.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([6, 23, 14, 31, 5])
    with torch.no_grad():
        for k in (1, 3):
            got_feature, got_tokens, got_probs = head.top_step(feature, tokens, k)
            want_feature, logits = head.head_logits_step(feature, tokens)
            probs, rows = logits.softmax(dim=-1).topk(k, dim=-1)
            assert torch.equal(got_feature, want_feature)
            assert torch.equal(got_tokens, head.vocab_ids[rows])
            assert torch.allclose(got_probs, probs, rtol=1e-5, atol=1e-7)
        assert torch.all(got_probs[:, :-1] >= got_probs[:, 1:]) and torch.all(got_probs.sum(-1) <= 1 + 1e-6)
        with pytest.raises(RuntimeError, match="k must be"):
            head.top_step(feature, tokens, 0)


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_native_draft_chains_draw_the_trees_of_the_stepwise_loop(dtype, quantization):
    """A greedy request's tree in one native call (EagleHead.draft_chains): the same tokens, probabilities and
    chain lengths as top_step called a step at a time from Python, with chains stopped by their depth and by
    their calibrated gain at every length, and without a calibration (only depths stop them). On the default
    model and its shipped head, quantized as the engine runs them or both unquantized: the call embeds the
    drafted tokens itself, from the target's embedding in a tiled layout, or its float rows (in bfloat16 where
    the CPU has AMX-BF16, from its tiles); the tiny models' 260-token vocabularies do not fit the tiles."""
    target_model = load_model(default_model_path(), dtype, CPU, quantization=quantization)
    head = load_eagle_head(None, target_model, dtype, CPU, head_quantization(quantization, CPU))
    assert head.native_embedding is not None
    if quantization == "none":
        on_amx = dtype == torch.bfloat16 and cpu_kernels.amx()
        assert head.native_embedding[0].dim() == (5 if on_amx else 2) and head.native_embedding[1] is None
    proposer = EagleProposer(head, CPU, eos_token_ids=[0])
    rows = 12
    gen = torch.Generator().manual_seed(1)
    depths = torch.randint(1, 6, (rows,), generator=gen).tolist()
    seqs = []
    for i in range(rows):
        seq = Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[4, 7, 5 + 3 * i], num_prompt_tokens=2,
                       params=SamplingParams(temperature=0.0))
        spec_state(seq).feature = 3 * torch.randn(head.config.hidden_size, generator=gen)
        seqs.append(seq)
    feature = torch.stack([seq.spec_state.feature for seq in seqs])
    tokens = torch.tensor([seq.token_ids[-1] for seq in seqs])
    cal = Calibration()
    cal.rate = [torch.rand(10, generator=gen, dtype=torch.float64).tolist() for _ in range(3)]
    lengths = set()
    for k in (1, 4):
        for calibration, min_gain in ((cal, 0.3), (cal, 0.05), (None, 0.4)):
            rates = calibration.chain_rates() if calibration is not None else [1.0, 1.0]
            assert head.draft_chains(feature, tokens, k, depths, rates, min_gain) is not None  # the native call
            got = proposer.draft_trees(seqs, depths, k - 1, calibration, min_gain)
            assert got == proposer._draft_trees_stepwise(feature, tokens, depths, k, calibration, min_gain)
            assert all(len(d.chain) <= depth and len(d.alternatives) == k - 1 for d, depth in zip(got, depths))
            if calibration is None:
                assert [len(d.chain) for d in got] == depths
            else:  # stopped by the gain where it fell below min_gain, else by the depth
                for d, depth in zip(got, depths):
                    gains = calibration.chain_gains(d.chain_probs)
                    assert all(g >= min_gain for g in gains[:-1])
                    assert gains[-1] < min_gain or len(d.chain) == depth
                    lengths.add((len(d.chain), len(d.chain) == depth))
    assert {(1, False), (2, False), (2, True)} <= lengths, lengths
    # Wider than the native top-k picks (NATIVE_MAX_CHOICES choices): the first step through torch's softmax and
    # topk, the chain natively, and the same tree as the widest native one where they overlap (this raised in the
    # kernel before, on every step that drafted such a tree). Equal logits (bfloat16 has many) may come in
    # either order, and a tie at the narrower tree's last choice may be cut either way.
    n = NATIVE_MAX_CHOICES
    assert head.draft_chains(feature, tokens, n + 1, depths, cal.chain_rates(), 0.3) is None
    wide, native = (proposer.draft_trees(seqs, depths, k - 1, cal, 0.3) for k in (n + 1, n))
    for w, d in zip(wide, native):
        assert (w.chain, len(w.alternatives)) == (d.chain, n)
        assert w.chain_probs == pytest.approx(d.chain_probs, rel=1e-5)
        got = dict(zip(w.alternatives, w.alternative_probs))
        for token, prob in zip(d.alternatives, d.alternative_probs):
            assert got.get(token, prob) == pytest.approx(prob, rel=1e-5, abs=1e-7)
            assert token in got or prob == pytest.approx(d.alternative_probs[-1], rel=1e-5)


def test_the_engine_keeps_the_heads_weights_in_4_bits(tiny_model_dirs, heads):
    """A drafting step reads the head's weights from memory (eagle_head.head_quantization): 4-bit blocks, its
    LM head's too; floats where the engine runs unquantized."""
    path, _ = tiny_model_dirs["llama"]
    head = make_engine(path, spec(heads["right"])).speculator.draft.model
    formats = [getattr(layer.method, "source", None)
               for layer in (head.fc, head.mlp.gate_up_proj, head.mlp.down_proj, head.lm_head)]
    assert formats == ["int4"] * 4
    head = make_engine(path, spec(heads["right"]), quantization="none").speculator.draft.model
    assert not any(isinstance(layer.method, BlockMethod) for layer in (head.fc, head.lm_head))
    # speculative_config's quantization (vLLM's field) sets the head's format itself; "auto" keeps its floats.
    for given, want in (("int8", ["int8"] * 4), ("int4", ["int4"] * 4), ("auto", [None] * 4), ("none", [None] * 4)):
        head = make_engine(path, spec(heads["right"], quantization=given)).speculator.draft.model
        assert [getattr(layer.method, "source", None)
                for layer in (head.fc, head.mlp.gate_up_proj, head.mlp.down_proj, head.lm_head)] == want, given


def test_a_batch_size_schedule_counts_a_trees_alternatives(tiny_model_dirs, heads):
    """vLLM's num_speculative_tokens_per_batch_size with a token tree, whole trees (no draft-length rule): k counts
    the chain and its alternatives together, and the schedule alone sets where the head drafts (its default
    limit of one sequence gives way), so two sequences draft one token each; the output is unchanged."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(4, [5, 13, 21])  # prompts the heads learned (PROMPTS)
    waves = [[(str(i), p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
              for i, (p, n) in enumerate(zip(ps, (8, 16, 30)))]]
    given = {"method": "eagle", "model": str(heads["right"]), "num_speculative_tokens": 3,
             "speculative_token_tree": "[(0,), (1,), (2,)]", "adaptive_draft_length": False,
             "min_acceptance_rate": 0.0, "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 2, 1], [3, 8, 0]]}
    engine = make_engine(path, given)
    seen = drafts_by_batch_size(engine)
    ref, got = run_waves(make_engine(path), waves), run_waves(engine, waves, check=True)
    assert all(got[str(i)].outputs[0].token_ids == ref[str(i)].outputs[0].token_ids for i in range(len(ps)))
    assert max(seen[1]) == 3 and max(seen[2]) == 1 and not any(seen[3])


def test_without_a_method_a_heads_file_makes_an_eagle_engine(tiny_model_dirs, heads):
    """vLLM's rule, model alone: a head's file runs method "eagle", with its greedy output unchanged."""
    from kvserve.spec_decode.eagle_proposer import EagleProposer

    path, _ = tiny_model_dirs["llama"]
    given = {k: v for k, v in spec(heads["right"]).items() if k != "method"}
    engine = make_engine(path, given)
    assert engine.config.speculative_config.method == "eagle" and isinstance(engine.speculator.draft, EagleProposer)
    ps = prompts(4, [5, 13])  # prompts the heads learned (PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    waves = [[(str(i), p, params) for i, p in enumerate(ps)]]
    ref, got = run_waves(make_engine(path), waves), run_waves(engine, waves, check=True)
    assert all(got[str(i)].outputs[0].token_ids == ref[str(i)].outputs[0].token_ids for i in range(len(ps)))
    assert engine.get_stats().spec_num_accepted_tokens > 0


def test_head_graph_step_over_padded_rows_is_the_heads_step(tiny_model_dirs, tmp_path):
    """What a head graph records (eagle_graphs.HeadGraphs: the buffers' rows padded to a captured size, the
    padding left from an earlier, larger load) gives the real rows the features, logits and greedy tokens
    of the head's own step over them alone; rows beyond the largest size are left to the eager step."""
    from kvserve.spec_decode.eagle_graphs import HeadGraphs

    path, hf = tiny_model_dirs["llama"]
    target_model = load_model(str(path), torch.float32, CPU)
    ref = random_head(hf, list(range(1, hf.config.vocab_size, 2)), seed=3, inter=128)
    file = tmp_path / "head.safetensors"
    save_head(file, ref.cfg, ref.state_tensors())
    head = load_eagle_head(str(file), target_model, torch.float32, CPU, quantization="none")
    graphs = HeadGraphs(head, max_rows=5)
    assert graphs.sizes == [1, 2, 4, 5]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        assert graphs.load(torch.randn(5, ref.cfg.hidden_size, generator=g), torch.tensor([3, 9, 1, 30, 2])) == 5
        feature, tokens = torch.randn(3, ref.cfg.hidden_size, generator=g), torch.tensor([6, 23, 14])
        assert graphs.load(feature, tokens) == 4
        got = graphs.forward(4)
        want_feature, normed = head.step(feature, tokens)
        want_logits = head.lm_head(normed).float()
        torch.testing.assert_close(got[0][:3], want_feature, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[1][:3], want_logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[2][:3], head.vocab_ids[want_logits.argmax(-1)])
        assert len(set(got[2][:3].tolist())) > 1
        assert graphs.load(torch.randn(6, ref.cfg.hidden_size), torch.arange(6)) is None


@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_sampled_drafts_over_the_heads_vocabulary_are_the_full_vocabularys(tiny_model_dirs, tmp_path, quantization):
    """A sampled draft is drawn over the head's own vocabulary, with the target's noise at those tokens
    (EagleProposer._draft_tokens): the same tokens as the full vocabulary (the head's logits, -inf
    elsewhere) with the same noise gives, for each stage; the noise kept for the target's row is the full
    row the request's generator draws. Stages that name tokens by id take the full vocabulary."""
    path, hf = tiny_model_dirs["llama"]
    target_model = load_model(str(path), torch.float32, CPU)
    vocab = hf.config.vocab_size
    ref = random_head(hf, list(range(1, vocab, 3)), seed=3, inter=128)
    file = tmp_path / "head.safetensors"
    save_head(file, ref.cfg, ref.state_tensors())
    head = load_eagle_head(str(file), target_model, torch.float32, CPU, quantization=quantization)
    proposer = EagleProposer(head, CPU, eos_token_ids=[0])
    rows = 24
    feature = torch.randn(rows, ref.cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, logits = head.head_logits_step(feature, torch.arange(rows) + 5)
    stages = [SamplingParams(temperature=0.8), SamplingParams(temperature=1.5, top_k=7),
              SamplingParams(temperature=1.2, top_p=0.7), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=1.0, presence_penalty=1.5, logit_bias={4: 2.0})]
    for params in stages:
        # Every fourth row greedy, as a batch mixing greedy and sampled requests drafts.
        greedy = [i % 4 == 0 for i in range(rows)]
        seqs = [Sequence(seq_id=i, request_id=str(i), index=0, token_ids=[4, 7, 4 + i], num_prompt_tokens=2,
                         params=SamplingParams(temperature=0.0) if greedy[i] else params,
                         generator=make_generator(100 + i)) for i in range(rows)]
        generators = {seq.seq_id: clone_generator(seq.generator) for seq in seqs if not greedy[seq.seq_id]}
        drafts = {seq.seq_id: [] for seq in seqs}
        got = proposer._draft_tokens(logits, seqs, greedy, drafts, generators).tolist()

        noise = [seq.spec_state.draft_noise[0] if not greedy[i] else None for i, seq in enumerate(seqs)]
        for seq, u in zip(seqs, noise):
            if u is not None:
                assert torch.equal(u, Sampler.draw_uniform(clone_generator(seq.generator), vocab, CPU, torch.float32))
        full = head.full_vocab_logits(logits)
        want = Sampler()(full, SamplingInputs([seq.params for seq in seqs], [None] * rows,
                                              [seq.prompt_token_ids for seq in seqs], [[4 + i] for i in range(rows)],
                                              [0], noise)).token_ids
        assert got == want, params
        assert set(got) <= set(head.vocab_ids.tolist()) and len(set(got)) > 3, got


def run(engine, waves, check: bool = False) -> dict:
    return run_waves(engine, waves, check)


def assert_acceptance(engine, expect: str) -> None:
    """expect: "none", "all", or "some" (both accepted and rejected drafts, at several positions)."""
    s = engine.get_stats()
    assert s.spec_num_drafts > 0
    if expect == "none":
        assert s.spec_num_accepted_tokens == 0
    elif expect == "all":
        assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    else:
        assert 0.05 * s.spec_num_draft_tokens < s.spec_num_accepted_tokens < s.spec_num_draft_tokens
        assert s.spec_accepted_per_pos[1] > 0


def test_eagle_head_matches_the_reference(tiny_model_dirs, heads):
    """kvserve's EagleHead (the engine's layers) gives the plain torch head's features and logits, -inf
    outside vocab_ids."""
    path, hf = tiny_model_dirs["llama"]
    target_model = load_model(str(path), torch.float32, CPU)
    head = load_eagle_head(str(heads["right"]), target_model, torch.float32, CPU, quantization="none")
    assert isinstance(head, EagleHead)
    cfg, tensors, _ = read_head(heads["right"])
    ref = EagleHeadReference(cfg, hf.model.embed_tokens.weight.detach(), tensors)
    g = torch.Generator().manual_seed(0)
    feature = torch.randn(5, cfg.hidden_size, generator=g)
    tokens = torch.randint(0, 260, (5,), generator=g)
    with torch.no_grad():
        want_f = ref.step(feature, tokens)
        want = torch.full((5, 260), float("-inf"))
        want[:, tensors["vocab_ids"]] = ref.logits(want_f)
        got_f, got_normed = head.step(feature, tokens)
        torch.testing.assert_close(got_f, want_f, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.full_vocab_logits(head.head_logits_step(feature, tokens)[1]), want,
                                   atol=1e-4, rtol=1e-4)
        assert torch.equal(head.greedy_tokens(got_normed), tensors["vocab_ids"][ref.logits(want_f).argmax(-1)])


def check_head_inputs(engine, hf) -> int:
    """After a step: every running sequence that may draft holds transformers' final hidden state at the
    position that produced its last token. How many were checked."""
    checked = 0
    for seq in engine.scheduler.running:
        if engine.speculator.draft.can_draft(seq, 1):
            with torch.no_grad():
                want = hf(torch.tensor([seq.token_ids[:-1]]), output_hidden_states=True).hidden_states[-1][0, -1]
            torch.testing.assert_close(seq.spec_state.feature, want, atol=1e-4, rtol=1e-4)
            checked += 1
    return checked


def test_head_reads_the_targets_hidden_state_of_the_last_token(tiny_model_dirs, heads):
    """After every step (prefill chunks, accepted runs, preemptions), a sequence that may draft holds
    transformers' final hidden state at the position that produced its last token."""
    path, hf = tiny_model_dirs["llama"]
    engine = make_engine(path, spec(heads["right"]), num_kv_blocks=20, max_num_seqs=8)
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(prompts(2, [6, 23, 14, 31])):
        engine.add_request(str(i), p, params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        checked += check_head_inputs(engine, hf)
    assert checked > 50
    assert engine.get_stats().num_preemptions > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("limit", [{"disable_by_batch_size": 2},
                                   {"num_speculative_tokens_per_batch_size": [[1, 2, K], [3, 64, 0]]}],
                         ids=["disable_by_batch_size", "schedule"])
def test_hidden_states_only_where_the_head_may_draft(limit, tiny_model_dirs, heads):
    """With disable_by_batch_size 2, or a batch-size schedule whose k is 0 from 3 sequences on, steps of more
    running sequences hand the head no hidden states, steps of 2 or fewer do. Every draft is accepted (none read
    a stale state: a sequence without a fresh one does not draft), and the greedy tokens are non-speculative
    decoding's."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(2, [6, 23, 14, 31])
    wave = [[(str(i), p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=1))
             for i, (p, m) in enumerate(zip(ps, [4, 8, 30, 30]))]]
    ref = run(make_engine(path), wave)
    given = spec(heads["right"], **limit)
    if "disable_by_batch_size" not in limit:
        del given["disable_by_batch_size"]  # the schedule alone says where the head drafts
    engine = make_engine(path, given)
    seen = []  # per step: running sequences, hidden states kept
    execute = engine.runner.execute

    def spy(sched):
        seen.append((len(engine.scheduler.running), engine.runner.keep_hidden))
        return execute(sched)
    engine.runner.execute = spy
    assert_same(run(engine, wave, check=True), ref, engine)
    assert any(n > 2 for n, _ in seen) and any(n <= 2 for n, _ in seen)
    assert all(keep == (n <= 2) for n, keep in seen)
    assert_acceptance(engine, "all")


@pytest.mark.parametrize("kind, kv_cache_dtype", [("right", "auto"), ("partial", "auto"), ("wrong", "auto"),
                                                  ("partial", "fp8_e4m3")])
def test_greedy_identical_with_preemption_and_n(kind, kv_cache_dtype, tiny_model_dirs, heads):
    """Chunked prefills, n = 2, and a pool too small for the batch: the non-speculative tokens and logprobs.
    With a float8 KV cache, only the target's scales are calibrated: the head keeps no K/V (an engine with
    both failed to start, taking the head for a draft model)."""
    path, _ = tiny_model_dirs["llama"]
    wave, ref = preempting_wave(path, kv_cache_dtype=kv_cache_dtype)
    engine = make_engine(path, spec(heads[kind]), kv_cache_dtype=kv_cache_dtype, **PREEMPTING)
    assert_same(run(engine, wave, check=True), ref, engine)
    assert engine.get_stats().num_preemptions > 0
    assert_acceptance(engine, {"right": "all", "partial": "some", "wrong": "none"}[kind])


def test_greedy_identical_with_prefix_hits(tiny_model_dirs, heads):
    """A second wave whose prompts extend the first wave's outputs (prefix-cache hits on drafted blocks):
    the non-speculative output."""
    path, _ = tiny_model_dirs["llama"]
    waves, ref = prefix_hit_waves(path)
    engine = make_engine(path, spec(heads["right"]))
    got = run(engine, waves, check=True)
    assert_same(got, ref, engine)
    assert all(got[f"b{i}"].num_cached_tokens > len(prompt) for i, (_, prompt, _) in enumerate(waves[0]))
    assert_acceptance(engine, "some")  # the second wave's continuations after [7, 8] are new to the head


def test_prompt_lookup_in_front_of_the_head(tiny_model_dirs, heads):
    """Lookup drafts where the last token occurred before, the head elsewhere, in the same steps: greedy
    tokens and logprobs are non-speculative decoding's (n = 2, chunked prefills, preemptions), and after a
    step with lookup drafts the head still reads transformers' hidden state of the last token."""
    path, hf = tiny_model_dirs["llama"]
    wave, ref = preempting_wave(path)
    engine = make_engine(path, spec(heads["partial"], prompt_lookup_min=1, prompt_lookup_max=2), **PREEMPTING)
    lookup = engine.speculator.proposer  # matches whitespace and follows re-indentation as method ngram's does
    assert lookup.token_classes is not None and lookup.indents is not None
    kinds = count_draft_kinds(engine)
    checks: list[int] = []  # sequences whose head input was checked, per step
    got = run_waves(engine, wave, check=True, after_step=lambda e: checks.append(check_head_inputs(e, hf)))
    assert_same(got, ref, engine)
    checked = sum(checks)
    assert kinds["lookup"]["drafts"] > 10 and kinds["model"]["drafts"] > 10 and checked > 50, (kinds, checked)
    assert engine.get_stats().num_preemptions > 0
    assert_acceptance(engine, "some")


@pytest.mark.parametrize("tree", [None, "[(0,), (0, 0), (1,), (2,)]"], ids=["chain", "tree"])
def test_suffix_decoding_in_front_of_the_head(tree, tiny_model_dirs, heads):
    """enable_suffix_decoding: a wave, then the same prompts again beside prompts the head knows less of. Earlier
    responses draft the repeats, the head the others, in the same steps; greedy tokens and logprobs are
    non-speculative decoding's (n = 2, chunked prefills, preemptions), the head still reads transformers'
    hidden state of the last token after steps with text drafts, and the corpus holds every finished response."""
    path, hf = tiny_model_dirs["llama"]
    params = SamplingParams(n=2, temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    first = prompts(2, [6, 23, 14, 31])
    waves = [[(f"a{i}", p, params) for i, p in enumerate(first)],
             [(f"b{i}", p, params) for i, p in enumerate(first[:2])]
             + [(f"c{i}", p, params) for i, p in enumerate(prompts(4, [5, 13]))]]
    ref = run_waves(make_engine(path, **PREEMPTING), waves)
    cfg = (tree_spec(heads["partial"], tree, enable_suffix_decoding=True) if tree
           else spec(heads["partial"], enable_suffix_decoding=True))
    engine = make_engine(path, cfg, **PREEMPTING)
    proposer = engine.speculator.proposer
    assert isinstance(proposer, SuffixProposer) and proposer.own.token_classes is not None
    kinds = Counter()  # (draft kind, wave): drafts, then their accepted tokens, then their tokens

    def count(seq, num_drafted, num_accepted):
        c = seq.spec_state.draft_class
        kind = "corpus" if c >= CORPUS_CLASS else "own" if c > MODEL_CLASS else "model"
        kinds[kind, seq.request_id[0]] += 1
        kinds[kind, seq.request_id[0], "accepted"] += num_accepted
        kinds[kind, seq.request_id[0], "tokens"] += num_drafted
    on_record(engine, count)
    checks: list[int] = []
    got = run_waves(engine, waves, check=True, after_step=lambda e: checks.append(check_head_inputs(e, hf)))
    assert_same(got, ref, engine)
    assert engine.get_stats().num_preemptions > 0 and sum(checks) > 50
    # The first wave's responses draft its repeats, right (and a sample of n = 2 its sibling's, where that finished
    # first); the head drafts every wave.
    assert kinds["corpus", "b"] > 4, kinds
    assert kinds["corpus", "b", "accepted"] > 0.8 * kinds["corpus", "b", "tokens"], kinds
    assert kinds["model", "a"] > 10 and kinds["model", "c"] > 5, kinds
    corpus = proposer.corpus
    assert len(corpus) == 2 * len(got) and corpus.num_tokens == sum(
        len(prompt[-24:]) + 24 for wave in waves for _, prompt, _ in wave for _ in range(2))


def test_seeded_sampling_identical_to_non_speculative(tiny_model_dirs, heads):
    """Every logits stage, n = 2: the same tokens as without speculation (the head samples with the noise
    the target will use), with and without prompt lookup or suffix decoding in front of it."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(4, [5, 13, 21, 8])
    params = SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                            presence_penalty=0.5, frequency_penalty=0.3, logit_bias={5: 3.0, 9: -2.0},
                            min_tokens=5, stop_token_ids=[7], max_tokens=24, seed=11, logprobs=1)
    ref = run(make_engine(path), [[(str(i), p, params) for i, p in enumerate(ps)]])
    for lookup in ({}, {"prompt_lookup_min": 1, "prompt_lookup_max": 2}):
        engine = make_engine(path, spec(heads["right"], **lookup))
        kinds = count_draft_kinds(engine)
        got = run(engine, [[(str(i), p, params) for i, p in enumerate(ps)]], check=True)
        assert (kinds["lookup"]["drafts"] > 0) == bool(lookup) and kinds["model"]["drafts"] > 0, kinds
        check_seeded(got, ref, engine, len(ps))
    # Suffix decoding in front of the head: a second wave of the same seeded requests drafts the first's samples.
    engine = make_engine(path, spec(heads["right"], enable_suffix_decoding=True))
    kinds = count_draft_kinds(engine)
    got = run(engine, [[(f"{w}{i}", p, params) for i, p in enumerate(ps)] for w in "ab"], check=True)
    assert kinds["lookup"]["accepted"] > 10 and kinds["model"]["drafts"] > 0, kinds
    for w in "ab":
        check_seeded({str(i): got[f"{w}{i}"] for i in range(len(ps))}, ref, engine, len(ps))


def test_a_drafted_positions_noise_is_drawn_once(tiny_model_dirs, heads, monkeypatch):
    """A vocabulary's uniforms cost ~0.2-0.4 ms to draw on a CPU. The head draws a seeded request's noise for
    its drafted positions; the target's sampler reuses it and draws only the row after the drafts, and
    moving the generator back past rejected rows draws nothing: one draw per step inside the runner."""
    path, _ = tiny_model_dirs["llama"]
    engine = make_engine(path, spec(heads["right"]))
    draws: list[int] = []  # per runner step
    in_runner = [False]
    fill = sampler_module.fill_uniform_  # every draw of uniforms, the head's and the sampler's

    def counted(out, generator):
        if in_runner[0]:
            draws[-1] += 1
        return fill(out, generator)

    def execute(sched, inner=engine.runner.execute):
        draws.append(0)
        in_runner[0] = True
        try:
            return inner(sched)
        finally:
            in_runner[0] = False
    monkeypatch.setattr(sampler_module, "fill_uniform_", counted)
    engine.runner.execute = execute
    params = SamplingParams(temperature=0.9, max_tokens=24, ignore_eos=True, seed=5)
    run(engine, [[("0", prompts(7, [9])[0], params)]])
    s = engine.get_stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens  # drafts, some rejected
    assert max(draws) == 1, draws


def check_seeded(got: dict, ref: dict, engine, num_prompts: int) -> None:
    for i in range(num_prompts):
        for e, g in zip(ref[str(i)].outputs, got[str(i)].outputs):
            assert g.token_ids == e.token_ids
            assert [list(lp) for lp in g.logprobs] == [list(lp) for lp in e.logprobs]
    s = engine.get_stats()
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens


@pytest.mark.parametrize("kind", ["wrong", "right"])
def test_unseeded_sampled_distribution_is_the_targets(kind, tiny_model_dirs, heads):
    """Chi-square test of the joint distribution of the first four tokens against the exact one from
    transformers' logits, with a head that only knows the banned token and with the one trained on greedy
    continuations."""
    path, hf = tiny_model_dirs["llama"]
    engine = make_engine(path, spec(heads[kind]), max_num_seqs=1800, max_num_batched_tokens=8192)
    rate = sampled_acceptance_and_chisquare(engine, hf)
    assert rate == 0 if kind == "wrong" else 0.05 < rate < 0.95, rate


def test_abort_mid_speculation_frees_everything(tiny_model_dirs, heads):
    path, _ = tiny_model_dirs["llama"]
    engine = make_engine(path, spec(heads["right"]))
    abort_mid_speculation(engine)


def test_a_fusing_heads_features_are_the_targets_layers(tiny_model_dirs):
    """train_eagle.py --fuse-layers: DraftReference.hidden with taps gives the final feature as without them,
    then each tapped layer's output as transformers computes it, RMS-normalised. A fusing head starts from
    the final feature alone (fuse.weight [I, 0]): the same loss as a head without."""
    _, hf = tiny_model_dirs["mistral"]  # plain rope, as DraftReference's
    c, d = hf.config, hf.config.hidden_size
    cfg = DraftFileConfig(num_hidden_layers=c.num_hidden_layers, hidden_size=d, intermediate_size=c.intermediate_size,
                          num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                          head_dim=d // c.num_attention_heads, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
                          rope_theta=c.rope_parameters["rope_theta"], target="a tiny test model")
    tensors = {k: v.detach() for k, v in hf.state_dict().items() if k.startswith(("model.layers.", "model.norm."))}
    target = DraftReference(cfg, hf.model.embed_tokens.weight.detach(),
                            {**tensors, "vocab_ids": torch.arange(c.vocab_size), "lm_head.weight": hf.lm_head.weight})
    ids = torch.tensor(prompts(3, [20]))
    with torch.no_grad():
        want = hf(ids, output_hidden_states=True).hidden_states  # [embedding, layer 0, ..., final after norm]
        got = target.hidden(ids, (0,))
    assert got.shape == (1, 20, 2 * d)
    torch.testing.assert_close(got[..., :d], want[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[..., :d], target.hidden(ids).detach())
    layer0 = want[1] * torch.rsqrt(want[1].pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)
    torch.testing.assert_close(got[..., d:], layer0, atol=1e-5, rtol=1e-5)

    head = random_head(hf, list(range(c.vocab_size)))
    fused_cfg = EagleHeadConfig(**{**dataclasses.asdict(head.cfg), "fuse_layers": [0]})
    fuse = torch.cat([torch.eye(d), torch.zeros(d, d)], 1)
    fused = EagleHeadReference(fused_cfg, head.embedding, {**head.state_tensors(), "fuse.weight": fuse})
    labels = torch.randint(0, c.vocab_size, (20,), generator=torch.Generator().manual_seed(0))

    def loss(h: EagleHeadReference, features: torch.Tensor) -> float:
        return h.training_loss(ids[0], labels, features, unroll=2, feature_weight=0.5).item()

    assert loss(fused, got[0]) == pytest.approx(loss(head, got[0, :, :d]), rel=1e-6)
    with torch.no_grad():  # and it reads the tapped layer
        fused.p("fuse.weight")[:, d:] = torch.randn(d, d, generator=torch.Generator().manual_seed(1))
    assert loss(fused, got[0]) != pytest.approx(loss(head, got[0, :, :d]), rel=1e-3)


def test_bad_heads_are_refused_clearly(tiny_model_dirs, heads, tmp_path):
    path, hf = tiny_model_dirs["llama"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_engine(path, spec(tmp_path / "nope.safetensors"))
    draft = tmp_path / "draft.safetensors"
    make_draft_file(draft, [1, 2])
    with pytest.raises(ValueError, match="not a kvserve eagle head"):
        make_engine(path, spec(draft))
    wide = tmp_path / "wide.safetensors"
    head = random_head(hf, [1, 2])
    head.cfg.vocab_size = 300
    save_head(wide, head.cfg, head.state_tensors())
    with pytest.raises(ValueError, match="vocabulary 300"):
        make_engine(path, spec(wide))
    for n, ids in enumerate(([1, hf.config.vocab_size], [2, 2], [-1, 3])):  # would fail only when drafted
        damaged = tmp_path / f"damaged{n}.safetensors"
        head = random_head(hf, [1, 2])
        save_head(damaged, head.cfg, {**head.state_tensors(), "vocab_ids": torch.tensor(ids)})
        with pytest.raises(ValueError, match="vocab_ids must be distinct token ids below"):
            make_engine(path, spec(damaged))
    fused = tmp_path / "fused.safetensors"
    head = random_head(hf, [1, 2])
    head.cfg.fuse_layers = [0]
    save_head(fused, head.cfg, {**head.state_tensors(), "fuse.weight": torch.zeros(head.cfg.hidden_size,
                                                                                  2 * head.cfg.hidden_size)})
    with pytest.raises(ValueError, match=r"fuses target layers \[0\]"):
        make_engine(path, spec(fused))
    attending = tmp_path / "attending.safetensors"
    head = attention_head(hf)
    save_head(attending, head.cfg, head.state_tensors())
    with pytest.raises(ValueError, match="attention layer"):
        make_engine(path, spec(attending))
    # Damaged heads are named, whatever deep in the loader trips on them (these raised KeyError or TypeError
    # with a traceback and no word of which file).
    head = random_head(hf, [1, 2])
    tensors, cfg = head.state_tensors(), dataclasses.asdict(head.cfg)
    for name, t, c in (("no_fc", {k: v for k, v in tensors.items() if k != "fc.weight"}, cfg),
                       ("no_eps", tensors, {k: v for k, v in cfg.items() if k != "rms_norm_eps"})):
        save_file({k: v.contiguous() for k, v in t.items()}, str(tmp_path / f"{name}.safetensors"),
                  metadata={"kvserve_eagle": json.dumps(c), "training": "{}"})
        with pytest.raises(ValueError, match=rf"eagle head '.*{name}.safetensors' is damaged or incomplete \("):
            make_engine(path, spec(tmp_path / f"{name}.safetensors"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "text_field.safetensors"),
              metadata={"kvserve_eagle": json.dumps({**cfg, "vocab_size": "260"}), "training": "{}"})
    with pytest.raises(ValueError, match="vocab_size should be int, got '260'"):
        make_engine(path, spec(tmp_path / "text_field.safetensors"))
    float_ids = tmp_path / "float_ids.safetensors"
    save_head(float_ids, head.cfg, {**tensors, "vocab_ids": torch.tensor([1.0, 2.0])})
    with pytest.raises(ValueError, match="vocab_ids must be distinct token ids below 260, as integers"):
        make_engine(path, spec(float_ids))
    # A head given to method draft says which method takes it.
    with pytest.raises(ValueError, match="is an eagle head: method 'eagle' takes it"):
        make_engine(path, {**spec(heads["right"]), "method": "draft"})
    # No model: the shipped head is the default model's, and this target is not.
    with pytest.raises((ValueError, FileNotFoundError), match="model"):
        make_engine(path, {"method": "eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="applies only to methods 'draft' and 'eagle'"):
        EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "model": str(path)})


def attention_head(hf, seed: int = 2) -> EagleHeadReference:
    """random_head with a causal self-attention layer (train_eagle.py --attention): 4 query, 2 KV heads."""
    head = random_head(hf, list(range(hf.config.vocab_size)), seed=seed)
    d, g = head.cfg.hidden_size, torch.Generator().manual_seed(seed)
    cfg = dataclasses.replace(head.cfg, num_attention_heads=4, num_key_value_heads=2, head_dim=d // 4,
                              rope_theta=10000.0)
    attn = {"attn_norm.weight": 1 + 0.1 * torch.randn(d, generator=g),
            "self_attn.q_proj.weight": 0.3 * torch.randn(d, d, generator=g),
            "self_attn.k_proj.weight": 0.3 * torch.randn(d // 2, d, generator=g),
            "self_attn.v_proj.weight": 0.3 * torch.randn(d // 2, d, generator=g),
            "self_attn.o_proj.weight": 0.3 * torch.randn(d, d, generator=g)}
    return EagleHeadReference(cfg, head.embedding, {**head.state_tensors(), **attn})


def test_an_attending_heads_unrolled_drafts_see_only_what_drafting_would(tiny_model_dirs):
    """unrolled() computes every chain of a sequence at once under one mask; here each chain is drafted on
    its own, as a drafting sequence would: a cache of the head's entries for positions 0..t from the
    target's features, then its own entries, one drafted token at a time (transformers' attention)."""
    _, hf = tiny_model_dirs["llama"]
    head = attention_head(hf)
    ids = torch.tensor(prompts(4, [24])[0])
    with torch.no_grad():
        feats = hf(ids[None], output_hidden_states=True).hidden_states[-1][0]
        chains = head.unrolled(feats, ids, 3)
        assert [x.shape[0] for x in chains] == [23, 22, 21]
        entries = head.input_entries(feats[:-1], ids[1:])
        for t in (0, 1, 9, 20):
            _, keys, values = head.attention_qkv(entries[:t + 1], torch.arange(1, t + 2))
            x = entries[t]
            for j in range(1, 4):
                if t + j >= len(ids):
                    break
                q, k, v = head.attention_qkv(x[None], torch.tensor([t + j]))
                if j > 1:
                    keys, values = torch.cat([keys, k]), torch.cat([values, v])
                a = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                                                     values.transpose(0, 1))
                x = x + torch.nn.functional.linear(a.reshape(-1), head.p("self_attn.o_proj.weight"))
                f = head.mlp_block(x)
                torch.testing.assert_close(chains[j - 1][t], f, atol=1e-4, rtol=1e-4)
                if t + j + 1 < len(ids):
                    x = head.input_entries(f, ids[t + j + 1])
    # Without attention, unrolled() is step() applied chain by chain.
    plain = random_head(hf, list(range(hf.config.vocab_size)))
    with torch.no_grad():
        f, want = feats[:-1], []
        for j in range(1, 4):
            f = plain.step(f, ids[j:])
            want.append(f)
            f = f[:-1]
        for got, w in zip(plain.unrolled(feats, ids, 3), want):
            torch.testing.assert_close(got, w)


def test_soft_labels_are_the_targets_distribution(tiny_model_dirs):
    """training_loss(soft_weight=1) scores the head against the target's distribution read off its features:
    with a very sharp target LM head that is its argmax, so the loss equals the hard-label loss with the
    argmax as labels; at soft_weight 0.5 it is halfway between two losses that differ."""
    _, hf = tiny_model_dirs["llama"]
    head = random_head(hf, list(range(hf.config.vocab_size)))
    ids = torch.tensor(prompts(5, [16])[0])
    with torch.no_grad():
        feats = hf(ids[None], output_hidden_states=True).hidden_states[-1][0]
        lm_head = hf.lm_head.weight.detach()
        argmax = (feats @ lm_head.T).argmax(-1)
        other = torch.randint(0, hf.config.vocab_size, (16,), generator=torch.Generator().manual_seed(3))

        def loss(labels: torch.Tensor, soft: float, scale: float = 1.0) -> float:
            return head.training_loss(ids, labels, feats, 2, 0.5, soft, scale * lm_head).item()
        assert loss(other, 1.0, 1e4) == pytest.approx(loss(argmax, 0.0), rel=1e-5)
        assert loss(other, 0.0) != pytest.approx(loss(argmax, 0.0), rel=1e-3)
        assert loss(other, 0.5, 1e4) == pytest.approx((loss(other, 0.0) + loss(argmax, 0.0)) / 2, rel=1e-5)


TREE = "[(0,), (1,), (2,)]"
CHAIN_AND_ALTERNATIVES = "[(0,), (0, 0), (1,), (2,)]"
# 17 choices at the first step: more than the head's native top-k takes (NATIVE_MAX_CHOICES).
WIDE_TREE = "[(0,), " + ", ".join(f"({i},)" for i in range(1, NATIVE_MAX_CHOICES + 1)) + "]"


def tree_spec(head, tree: str = TREE, **kw) -> dict:
    return spec(head, num_speculative_tokens=len(ast.literal_eval(tree)), speculative_token_tree=tree, **kw)


def second_choice_first(engine, monkeypatch) -> None:
    """Make the head draft its second choice (at every step: a chain stops at its first token, then always
    rejected) and offer its first as an alternative: with the head that drafts every continuation right,
    alternatives are then what gets kept."""
    head = engine.speculator.draft.model
    head.native_weights = None  # top_step through head_logits_step, the logits this changes (not one native call)
    inner = head.head_logits_step

    def swapped(feature, tokens):
        feature, logits = inner(feature, tokens)
        rows = torch.arange(logits.shape[0])
        top = logits.topk(2, dim=-1).indices
        logits = logits.clone()
        logits[rows, top[:, 0]], logits[rows, top[:, 1]] = logits[rows, top[:, 1]], logits[rows, top[:, 0]].clone()
        return feature, logits
    monkeypatch.setattr(head, "head_logits_step", swapped)


@pytest.mark.parametrize("kind, tree, kv_cache_dtype, kernels", [
    ("swapped", TREE, "auto", True), ("swapped", CHAIN_AND_ALTERNATIVES, "auto", True),
    ("swapped", TREE, "fp8_e4m3", True), ("swapped", TREE, "auto", False), ("partial", TREE, "auto", True),
    ("wrong", TREE, "auto", True)],
    ids=["tree", "chain_and_alternatives", "tree_fp8", "tree_torch_path", "tree_partial_head", "tree_wrong_head"])
def test_tree_drafts_greedy_identical_with_preemption_and_n(kind, tree, kv_cache_dtype, kernels, tiny_model_dirs,
                                                            heads, monkeypatch):
    """Alternatives to the first draft token, each at its position and stored past the chain: chunked prefills,
    n = 2, preemptions, the non-speculative tokens and logprobs, on the native kernel and on the torch path
    (masks); kept alternatives have their K/V moved to their position, which every later token reads
    ("swapped": the right head with its first two choices swapped, so alternatives are kept most of the time).
    The head that knows one token has no alternatives to offer (its vocabulary is one token): it drafts a chain."""
    path, _ = tiny_model_dirs["llama"]
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    wave, ref = preempting_wave(path, kv_cache_dtype=kv_cache_dtype)
    counts = count_alternatives(monkeypatch)
    engine = make_engine(path, tree_spec(heads["right" if kind == "swapped" else kind], tree),
                         kv_cache_dtype=kv_cache_dtype, **PREEMPTING)
    if kind == "swapped":
        second_choice_first(engine, monkeypatch)
    assert_same(run(engine, wave, check=True), ref, engine)
    assert engine.get_stats().num_preemptions > 0
    if kind == "wrong":
        assert counts["trees"] == 0
        assert_acceptance(engine, "none")
    elif kind == "swapped":  # with a float8 cache the target strays further from what the head learnt
        assert counts["kept"] > counts["trees"] / (10 if kv_cache_dtype == "fp8_e4m3" else 2), counts
    else:
        assert counts["trees"] > 0


def test_a_tree_of_sixteen_alternatives_greedy_identical_with_preemption_and_n(tiny_model_dirs, heads, monkeypatch):
    """A tree as wide as the head's native top-k allows and past it (its chain token and 16 alternatives, 17 rows
    at one position; the tiny heads draft through torch, the default model's natively: see
    test_native_draft_chains_draw_the_trees_of_the_stepwise_loop): the non-speculative outputs, with chunked
    prefills, n = 2 and preemptions."""
    path, _ = tiny_model_dirs["llama"]
    wide = dict(PREEMPTING, max_num_batched_tokens=32)  # a tree of 17 nodes needs more than 16 tokens a step
    wave, ref = preempting_wave(path, max_num_batched_tokens=32)
    counts = count_alternatives(monkeypatch)
    engine = make_engine(path, tree_spec(heads["partial"], WIDE_TREE), **wide)
    assert engine.speculator.num_alternatives == NATIVE_MAX_CHOICES
    assert_same(run(engine, wave, check=True), ref, engine)
    assert engine.get_stats().num_preemptions > 0
    assert counts["trees"] > 0 and counts["kept"] > 0, counts


def test_tree_drafts_identical_with_prefix_hits(tiny_model_dirs, heads, monkeypatch):
    """Blocks holding kept alternatives (their K/V moved) are committed to the prefix cache and read by a second
    wave: the non-speculative output."""
    path, _ = tiny_model_dirs["llama"]
    waves, ref = prefix_hit_waves(path)
    counts = count_alternatives(monkeypatch)
    engine = make_engine(path, tree_spec(heads["right"]))
    second_choice_first(engine, monkeypatch)
    got = run(engine, waves, check=True)
    assert_same(got, ref, engine)
    assert all(got[f"b{i}"].num_cached_tokens > len(prompt) for i, (_, prompt, _) in enumerate(waves[0]))
    assert counts["kept"] > 0, counts


def test_tree_drafts_leave_sampled_requests_a_chain(tiny_model_dirs, heads, monkeypatch):
    """A sampled request's draft is drawn with the target's noise, one token a position: it gets no alternatives,
    and seeded, it emits what non-speculative decoding does, greedy requests beside it taking trees."""
    path, _ = tiny_model_dirs["llama"]
    ps = prompts(4, [5, 13, 21, 8])
    sampled = SamplingParams(n=2, temperature=0.9, top_k=20, max_tokens=24, seed=11, logprobs=1, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    wave = [[(str(i), p, sampled) for i, p in enumerate(ps)] + [(f"g{i}", p, greedy) for i, p in enumerate(ps)]]
    ref = run(make_engine(path), wave)
    counts = count_alternatives(monkeypatch)
    alternatives_of: dict[str, int] = {}  # request id -> alternatives it was given
    engine = make_engine(path, tree_spec(heads["right"]))
    second_choice_first(engine, monkeypatch)
    execute = engine.runner.execute

    def watched(sched):
        for seq, _ in sched.scheduled:
            rid = seq.request_id
            alternatives_of[rid] = alternatives_of.get(rid, 0) + sched.spec_alternatives.get(seq.seq_id, 0)
        return execute(sched)
    engine.runner.execute = watched
    got = run(engine, wave, check=True)
    check_seeded(got, ref, engine, len(ps))
    assert_same(got, {k: v for k, v in ref.items() if k.startswith("g")}, engine)
    assert all(alternatives_of[str(i)] == 0 for i in range(len(ps)))
    assert all(alternatives_of[f"g{i}"] > 0 for i in range(len(ps))) and counts["kept"] > 0, counts


def test_tree_drafts_count_every_token_and_keep_requests_drafting(tiny_model_dirs, heads, monkeypatch):
    """The counters count every draft token verified (alternatives too), as vLLM's; a kept alternative counts as
    the first position accepted, and as an accepted draft for the request's own acceptance: with its first
    token always wrong and an alternative nearly always kept, no request is paused (min_acceptance_rate over
    the last 4 drafts; counted against the chain alone, each would pause after its fourth draft)."""
    path, _ = tiny_model_dirs["llama"]
    counts = count_alternatives(monkeypatch)
    engine = make_engine(path, tree_spec(heads["right"], min_acceptance_rate=0.5, acceptance_window=4))
    second_choice_first(engine, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    run(engine, [[(str(i), p, params) for i, p in enumerate(prompts(3, [6, 23, 14, 31]))]])
    s = engine.get_stats()
    assert s.spec_num_draft_tokens == 3 * s.spec_num_drafts  # one chain token and two alternatives each
    assert len(s.spec_accepted_per_pos) == 1 and s.spec_accepted_per_pos[0] == s.spec_num_accepted_tokens
    assert s.spec_num_accepted_tokens >= counts["kept"] > 0.9 * s.spec_num_drafts, (s, counts)
    # Two tokens a step from the first decode on: 11 drafts a request, none skipped by a pause.
    assert s.spec_num_drafts >= 4 * 11, s


def test_tree_drafts_stop_at_max_model_len(tiny_model_dirs, heads, monkeypatch):
    """Trees up to the context limit: a step's rows, the alternatives stored past the chain included, never
    reach past max_model_len, yet a tree two tokens from it still carries an alternative beside its one chain
    token (the step's last slot is then the limit's last); the output is the non-speculative one, ended by the
    length limit."""
    path, _ = tiny_model_dirs["llama"]
    limit = 37
    ps = prompts(7, [9, 14, 11, 20, 16, 6])
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    waves = [[(str(i), p, params) for i, p in enumerate(ps)]]
    ref = run(make_engine(path, max_model_len=limit), waves)
    engine = make_engine(path, tree_spec(heads["right"], CHAIN_AND_ALTERNATIVES), max_model_len=limit)
    second_choice_first(engine, monkeypatch)
    ends: list[tuple[int, int]] = []  # per verified tree row: (its last slot + 1, its alternatives)
    execute = engine.runner.execute

    def recorded(sched):
        ends.extend((seq.num_computed_tokens + n, sched.spec_alternatives.get(seq.seq_id, 0))
                    for seq, n in sched.scheduled)
        return execute(sched)
    monkeypatch.setattr(engine.runner, "execute", recorded)
    got = run(engine, waves, check=True)
    for i, p in enumerate(ps):
        out = got[str(i)].outputs[0]
        assert out.token_ids == ref[str(i)].outputs[0].token_ids and len(p) + len(out.token_ids) == limit
        assert out.finish_reason == "length"
    assert max(end for end, _ in ends) <= limit
    assert any(end == limit and alternatives for end, alternatives in ends), ends


def test_tree_drafts_greedy_identical_on_the_triton_backend(tiny_model_dirs, heads, monkeypatch):
    """The GPU's attention backend (Triton, run here in its interpreter) takes tree rows too: a Triton engine's
    non-speculative tokens and logprobs with chunked prefills, n = 2 and preemptions, kept alternatives' K/V moved
    to their position (copy_slots) and read by every later token."""
    path, _ = tiny_model_dirs["llama"]
    wave, ref = preempting_wave(path, attention_backend="triton")
    counts = count_alternatives(monkeypatch)
    engine = make_engine(path, tree_spec(heads["right"]), attention_backend="triton", **PREEMPTING)
    assert engine.runner.attn_backend.name == "triton"
    second_choice_first(engine, monkeypatch)
    assert_same(run(engine, wave, check=True), ref, engine)
    assert engine.get_stats().num_preemptions > 0
    assert counts["kept"] > counts["trees"] / 2, counts


def test_abort_mid_tree_speculation_frees_everything(tiny_model_dirs, heads, monkeypatch):
    path, _ = tiny_model_dirs["llama"]
    counts = count_alternatives(monkeypatch)
    engine = make_engine(path, tree_spec(heads["right"]))
    second_choice_first(engine, monkeypatch)
    abort_mid_speculation(engine)
    assert counts["kept"] > 0


def modelled_step_times(engine, row_ms: float, draft_ms: float = 0.05) -> None:
    """The step and drafting times the draft-length rule reads, of a modelled machine without real time's noise:
    1 ms a step and row_ms for each token beyond the first, every size known from the start (a size not yet
    timed is estimated from its neighbours and tried, and which ones a run meets first depends on real time),
    and draft_ms for each token the head drafts. Real drafting time made the rule's choices depend on the
    host: with 1 ms more a drafted token, as a slow host's torch path takes, the head torn between two tokens
    had no alternative kept."""
    observe = engine.speculator.observe_step
    seconds = lambda n: 1e-3 + row_ms * 1e-3 * (n - 1)  # noqa: E731
    for n in range(1, 129):
        engine.speculator.length.times.observe(n, seconds(n))
    engine.speculator.observe_step = lambda n, _seconds: observe(n, seconds(n))
    length = engine.speculator.length
    observe_drafting = length.observe_drafting
    length.observe_drafting = lambda _seconds, depth: observe_drafting(depth * draft_ms * 1e-3, depth)


def head_unsure(engine, monkeypatch, how: str) -> None:
    """"split": the head torn between its two first choices (equal logits, the wrong one first after an odd
    token, so the target's token is often its alternative); "blind": no idea at all (every logit 0)."""
    head = engine.speculator.draft.model
    head.native_weights = None  # top_step through head_logits_step, the logits this changes (not one native call)
    inner = head.head_logits_step

    def unsure(feature, tokens):
        feature, logits = inner(feature, tokens)
        if how == "blind":
            return feature, torch.zeros_like(logits)
        rows = torch.arange(logits.shape[0])
        top = logits.topk(2, dim=-1).indices
        odd = tokens % 2 == 1
        first, second = torch.where(odd, top[:, 1], top[:, 0]), torch.where(odd, top[:, 0], top[:, 1])
        logits = logits.clone()
        high = logits[rows, top[:, 0]]
        logits[rows, first], logits[rows, second] = high + 1e-3, high
        return feature, logits
    monkeypatch.setattr(head, "head_logits_step", unsure)


@pytest.mark.parametrize("kind, tree, kernels", [
    ("right", CHAIN_AND_ALTERNATIVES, True), ("right", None, True), ("split", CHAIN_AND_ALTERNATIVES, True),
    ("split", CHAIN_AND_ALTERNATIVES, False), ("blind", CHAIN_AND_ALTERNATIVES, True)],
    ids=["sure", "sure_chain", "unsure", "unsure_torch_path", "blind"])
def test_trees_sized_by_confidence_greedy_identical_with_preemption_and_n(kind, tree, kernels, tiny_model_dirs,
                                                                          heads, monkeypatch):
    """With the draft-length rule (as a user gets a tree, or a chain of k > 1), the head drafts a greedy
    request's tree before the schedule and the step keeps the rows its confidence says pay: the
    non-speculative output, with chunked prefills, n = 2 and preemptions, whatever the head's confidence. A
    sure head drafts chains of two or more; one torn between two tokens gets both as rows, and its alternative
    is kept (its K/V moved); one with no idea drafts nothing."""
    path, _ = tiny_model_dirs["llama"]
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    wave, ref = preempting_wave(path)
    counts = count_alternatives(monkeypatch)
    config = (tree_spec(heads["right"], tree, adaptive_draft_length=True) if tree
              else spec(heads["right"], adaptive_draft_length=True))  # a chain of K
    engine = make_engine(path, config, **PREEMPTING)
    modelled_step_times(engine, 0.02)
    if kind != "right":
        head_unsure(engine, monkeypatch, kind)
    length, rule_saw = engine.speculator.length, []  # what the rule is told of each kept alternative
    record = length.record

    def told(num_drafted, num_accepted, draft_class=0, kept_alternative=False):
        if kept_alternative:
            rule_saw.append(num_accepted)
        record(num_drafted, num_accepted, draft_class, kept_alternative)
    monkeypatch.setattr(length, "record", told)
    assert_same(run(engine, wave, check=True), ref, engine)
    s = engine.get_stats()
    assert s.num_preemptions > 0
    if kind == "right":
        assert s.spec_accepted_per_pos[1] > 0.5 * s.spec_num_drafts > 0, s
    elif kind == "split":
        assert counts["kept"] > 0.2 * counts["trees"] > 0, counts
        assert rule_saw and set(rule_saw) == {1}  # a kept alternative is one accepted token, as the engine counts
    else:
        assert s.spec_num_drafts == 0, s
        # It still drafts, unverified, and the target's tokens teach the engine how far to trust it: its first
        # choice at a probability near 0 (where trust starts at 0.05) is never right.
        assert engine.speculator.calibration.rate[FIRST][0] < 0.01


def test_a_sure_heads_trees_carry_no_alternatives_where_rows_cost(tiny_model_dirs, heads):
    """Rows a fifth of a step: the head sure of its tokens (and right) drafts its chain, and its next choices, at
    a probability near 0, are not worth a row."""
    path, _ = tiny_model_dirs["llama"]
    engine = make_engine(path, tree_spec(heads["right"], CHAIN_AND_ALTERNATIVES, adaptive_draft_length=True))
    modelled_step_times(engine, 0.2)
    rows = []
    execute = engine.runner.execute

    def watched(sched):
        rows.extend((len(d), sched.spec_alternatives.get(i, 0)) for i, d in sched.spec_token_ids.items())
        return execute(sched)
    engine.runner.execute = watched
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    run(engine, [[(str(i), p, params) for i, p in enumerate(prompts(2, [6, 23]))]], check=True)
    assert len(rows) > 20 and all(alternatives == 0 for _, alternatives in rows), rows
    assert sum(n == 2 for n, _ in rows) > 0.8 * len(rows), rows


@pytest.mark.parametrize("trust", [0.0, 1.0])
def test_the_table_beside_a_head_sets_how_far_a_fresh_engine_trusts_it(tiny_model_dirs, heads, tmp_path, trust):
    """NAME.calibration.json beside a head file (confidence.read_calibration) is where a fresh engine's trust in
    the head's rows starts, whatever the head's own probabilities: with rows at 30% of a step, at 0 it keeps
    none of the head's rows for a whole short request (each outcome moves the rate 1/32 of the way to the
    target's, and it takes a dozen right ones to pass 30%), at 1 it keeps them from the first step that may
    draft. The head drafts this prompt's tokens right, so only the table tells the two apart."""
    path, _ = tiny_model_dirs["llama"]
    head = tmp_path / "head.safetensors"
    head.write_bytes(heads["right"].read_bytes())
    table = {"first": [trust] * 10, "alternative": [0.5] * 10, "next": [trust] * 10}
    calibration_path(head).write_text(json.dumps(table))
    engine = make_engine(path, spec(head, adaptive_draft_length=True))
    assert engine.speculator.calibration.rate == [table[kind] for kind in KINDS]
    modelled_step_times(engine, 0.3)
    drafts = []
    execute = engine.runner.execute

    def watched(sched):
        drafts.append(sum(len(d) for d in sched.spec_token_ids.values()))
        return execute(sched)
    engine.runner.execute = watched
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    run(engine, [[("0", prompts(2, [6])[0], params)]], check=True)  # a prompt the head was trained on
    if trust:
        assert engine.get_stats().spec_num_accepted_tokens >= 4 and drafts[1] > 0, drafts
    else:
        assert sum(drafts) == 0, drafts
        assert 0 < sum(engine.speculator.calibration.rate[FIRST]) < 0.5, engine.speculator.calibration.rate


def test_a_broken_calibration_table_is_refused_by_name(tiny_model_dirs, heads, tmp_path):
    path, _ = tiny_model_dirs["llama"]
    head = tmp_path / "head.safetensors"
    head.write_bytes(heads["right"].read_bytes())
    for text in ("{", json.dumps({"first": [0.5] * 10, "next": [0.5] * 10}),
                 json.dumps({kind: [0.5] * 9 for kind in KINDS}), json.dumps({kind: [1.5] * 10 for kind in KINDS}),
                 json.dumps({kind: [float("nan")] * 10 for kind in KINDS}),
                 json.dumps({kind: "0123456789" for kind in KINDS}), json.dumps({kind: [True] * 10 for kind in KINDS})):
        calibration_path(head).write_text(text)
        with pytest.raises(ValueError, match="head.calibration.json"):
            make_engine(path, spec(head, adaptive_draft_length=True))


@pytest.mark.parametrize("level", ["summary", "detailed"])
def test_per_request_acceptance_adds_up_to_the_counters(level, tiny_model_dirs, heads):
    """vLLM's per-request acceptance figures (per_request_spec_decode_metrics): over requests of one sequence,
    through preemptions and trees whose alternatives count as drafts, they sum to the engine's counters; each
    agrees with itself; a request of n = 2 and an engine not asked for them get none."""
    path, _ = tiny_model_dirs["llama"]
    tree = tree_spec(heads["partial"], CHAIN_AND_ALTERNATIVES)
    engine = make_engine(path, tree, per_request_spec_decode_metrics=level, **PREEMPTING)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    done = run(engine, [[(str(i), p, params) for i, p in enumerate(prompts(2, [6, 23, 14, 31]))]], check=True)
    s = engine.get_stats()
    assert engine.scheduler.num_preemptions > 0 and 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens, s
    figures = [done[r].spec_decode_metrics.to_json() for r in sorted(done)]
    for j in figures:
        check_request_acceptance(j, level == "detailed")
        assert j["num_spec_tokens"] == 4
    assert sum(j["num_spec_steps"] for j in figures) == s.spec_num_drafts
    assert sum(j["num_draft_tokens"] for j in figures) == s.spec_num_draft_tokens
    assert sum(j["num_accepted_draft_tokens"] for j in figures) == s.spec_num_accepted_tokens
    pair = run(engine, [[("pair", prompts(2, [6])[0], dataclasses.replace(params, n=2))]])
    assert pair["pair"].spec_decode_metrics is None
    plain = run(make_engine(path, tree), [[("0", prompts(2, [6])[0], params)]])
    assert plain["0"].spec_decode_metrics is None
