"""kvserve's Gemma 3 against transformers' Gemma3ForCausalLM (text-only) on tiny random models saved with
save_pretrained and loaded through kvserve's HF-directory loader, in float32.

Each config has a sliding window (8) shorter than the prompts, sliding and global layers with different
RoPE bases, a query_pre_attn_scalar different from head_dim, and random (non-zero) norm weights, so a
missing (1 + w), pre/post norm, q/k norm or window would show. Checked twice: the model's paged forward
step by step (chunked prefill over a cached prefix, mixed with decodes, block size 4), and the whole engine
(scheduler, block manager, sampler) generating greedily."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.kernels import cpu as cpu_kernels
from kvserve.models.gemma3 import FULL, SLIDING
from kvserve.models.hf import read_hf_config
from kvserve.models.loader import load_model
from kvserve.sampling_params import SamplingParams
from engine_helpers import drain
from paged_helpers import PagedSeqs, make_backend, make_kv_caches, require_native_kernel
from triton_helpers import triton_device
from test_model_parity import VOCAB, hf_logits, write_tokenizer
from tiny_models import TINY_KV, hf_greedy

BLOCK_SIZE = 4
WINDOW = 8
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, sliding_window=WINDOW,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

CONFIGS = {
    # head_dim 32: the native attention kernel runs where the CPU has one.
    "tied_softcap": dict(num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=24,
                         final_logit_softcapping=3.0, layer_types=[SLIDING, FULL, SLIDING]),
    # head_dim 48: always the torch attention path; Gemma 3's default 5:1 layer pattern, linear RoPE
    # scaling on the global layer only, an untied LM head.
    "untied_pattern_scaled": dict(num_hidden_layers=6, head_dim=48, query_pre_attn_scalar=40,
                                  tie_word_embeddings=False, rope_parameters={
                                      FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
                                      SLIDING: {"rope_type": "default", "rope_theta": 500.0}}),
}


def build_gemma3(name: str, path: Path, seed: int = 0) -> Gemma3ForCausalLM:
    torch.manual_seed(seed)
    config = Gemma3TextConfig(**COMMON, **CONFIGS[name])
    config._attn_implementation = "eager"
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:  # Gemma's norms scale by (1 + w): default zeros would hide a missing norm
                p.normal_(0.0, 0.3)
    model.generation_config.eos_token_id = None  # tests generate fixed lengths
    model.save_pretrained(path, safe_serialization=True)
    write_tokenizer(path)
    return model


# The Triton backend (slow in the interpreter) on the smaller config: sliding and global layers both.
@pytest.mark.parametrize("name,attention", [(name, attention) for attention in ("native-kernel", "torch")
                                            for name in CONFIGS] + [("tied_softcap", "triton")])
def test_paged_gemma3_matches_transformers(name: str, attention: str, tmp_path: Path, monkeypatch) -> None:
    device = torch.device("cpu")
    if attention == "native-kernel":
        require_native_kernel()
    elif attention == "triton":
        device = triton_device()
    else:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    ref = build_gemma3(name, tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, device)
    model, cfg = loaded.model, loaded.config
    assert cfg.architecture == "gemma3" and cfg.sliding_window == WINDOW
    assert cfg.layer_types == ref.config.layer_types
    assert cfg.tie_word_embeddings == ref.config.tie_word_embeddings

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 11, 21)]
    backend = make_backend(model, cfg, 64, BLOCK_SIZE, kind="triton" if attention == "triton" else "torch",
                           native_kernels=attention == "native-kernel", device=device)
    seqs = PagedSeqs(backend)
    kv = make_kv_caches(backend)

    def step(chunks: dict[int, list[int]]) -> list[torch.Tensor]:
        ids, positions, meta = seqs.batch(chunks)
        with torch.no_grad():
            logits = model.compute_logits(model(ids, positions, meta, kv)).cpu()
        starts = meta.query_start_loc_list
        return [logits[starts[i]:starts[i + 1]] for i in range(len(chunks))]

    def check(got: torch.Tensor, full: list[int]) -> None:
        torch.testing.assert_close(got, hf_logits(ref, full)[-len(got):], atol=1e-4, rtol=1e-4)

    # Two whole prompts and the first chunk of the third; then its rest (over a cached prefix longer than
    # the window) mixed with the others' first decodes; then batched decodes feeding back greedy tokens.
    chunk = 12
    out = step({0: prompts[0], 1: prompts[1], 2: prompts[2][:chunk]})
    for i, full in enumerate([prompts[0], prompts[1], prompts[2][:chunk]]):
        check(out[i], full)
    texts = [list(p) for p in prompts]
    nxt = [int(out[i][-1].argmax()) for i in range(2)]
    texts[0].append(nxt[0])
    texts[1].append(nxt[1])
    out = step({0: [nxt[0]], 1: [nxt[1]], 2: prompts[2][chunk:]})
    for _ in range(6):
        for i in range(3):
            check(out[i], texts[i])
        greedy = [int(o[-1].argmax()) for o in out]
        for i in range(3):
            assert greedy[i] == int(hf_logits(ref, texts[i])[-1].argmax())
            texts[i].append(greedy[i])
        out = step({i: [greedy[i]] for i in range(3)})


@pytest.mark.parametrize("attention_backend", ["auto", "triton"])
def test_engine_generates_what_transformers_generates(attention_backend: str, tmp_path: Path) -> None:
    """Through the engine's runner, which builds the backend's metadata each step."""
    if attention_backend == "triton":
        triton_device()
    ref = build_gemma3("tied_softcap", tmp_path, seed=3)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 17, 9, 26)]
    max_new = 12
    if attention_backend == "triton":  # slow in the interpreter: still chunked prefills, decodes, a window
        prompts, max_new = prompts[1:3], 5
    engine = LLMEngine(EngineConfig(model=str(tmp_path), dtype="float32", block_size=BLOCK_SIZE,
                                    max_num_batched_tokens=16, max_num_seqs=8, kv_cache_memory=TINY_KV,
                                    attention_backend=attention_backend))
    params = SamplingParams(temperature=0, max_tokens=max_new, ignore_eos=True, logprobs=2)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs = drain(engine)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_lp = hf_greedy(ref, prompt, max_new)
        comp = outs[str(i)].outputs[0]
        assert comp.token_ids == ref_tokens
        for step, lp in enumerate(comp.logprobs):
            for t, entry in lp.items():
                assert entry.logprob == pytest.approx(ref_lp[step, t].item(), abs=2e-4)
    assert engine.block_manager.usage == 0.0


def test_transformers_4_config_form_reads_the_same(tmp_path: Path) -> None:
    """Gemma 3 checkpoints saved by transformers 4.x (google/gemma-3-270m's config.json among them) spell the
    RoPE bases and the layer pattern differently; both forms must give the same ModelConfig."""
    build_gemma3("untied_pattern_scaled", tmp_path)
    new = read_hf_config(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    cfg.pop("layer_types")
    cfg.update(rope_theta=rope[FULL]["rope_theta"], rope_local_base_freq=rope[SLIDING]["rope_theta"],
               rope_scaling={"rope_type": "linear", "factor": rope[FULL]["factor"]}, sliding_window_pattern=6)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_hf_config(tmp_path) == new
    assert new.layer_types == [SLIDING] * 5 + [FULL] and new.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert (new.rope_theta, new.rope_local_theta, new.query_pre_attn_scalar) == (50_000.0, 500.0, 40.0)
