"""Gemma 3 from a GGUF file: a random transformers Gemma3ForCausalLM written to GGUF the way llama.cpp's
converter lays it out (gemma3 tensor names, norms stored as 1 + w, a SentencePiece vocabulary with
scores). transformers' own GGUF reader must read the original weights back (checking the writer), then
kvserve's logits from the file must match the original model's. (The real Gemma 3 270M file:
test_gemma3_real.py.)"""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kvserve.models.gemma3 import default_layer_types
from kvserve.models.loader import load_model
from paged_helpers import PagedSeqs, make_backend, make_kv_caches
from test_model_parity import hf_logits

# ---- tiny model written as a llama.cpp converter would ----

_GEMMA3_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
TINY_VOCAB = 320


def tiny_gemma3(seed: int = 0) -> Gemma3ForCausalLM:
    # GGUF leaves out the layer pattern, the local RoPE base and the attention scale: use the values
    # llama.cpp assumes for a Gemma 3 file (every 6th layer global, base 10000, head_dim ** -0.5).
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                              max_position_embeddings=128, sliding_window=8, initializer_range=0.1,
                              layer_types=default_layer_types(6), rope_theta=200_000.0)
    config._attn_implementation = "eager"
    model = Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.3)
    return model


def tiny_sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """Gemma-shaped: control tokens, 256 byte tokens, then pieces scored best-first."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    pieces = ["▁", "a", "b", "c", "▁a", "▁b", "ab", "▁ab", "abc", "▁abc"]
    pieces += [f"▁w{i}" for i in range(TINY_VOCAB - len(specials) - 256 - len(pieces))]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    types = [3] * len(specials) + [6] * 256 + [1] * len(pieces)
    return tokens, scores, types


def write_gemma3_gguf(model: Gemma3ForCausalLM, path: Path) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    tokens, scores, types = tiny_sentencepiece_vocab()
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            continue  # tied
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_GEMMA3_TENSORS[rest]}"
        if gname.endswith("norm.weight"):
            a = a + np.float32(1.0)  # llama.cpp stores Gemma's norms as 1 + w
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_gemma3_gguf_matches_transformers(tmp_path: Path) -> None:
    ref = tiny_gemma3()
    path = tmp_path / "gemma3.gguf"
    write_gemma3_gguf(ref, path)

    # The writer, checked by transformers' reader: the original weights back (norms to float32 rounding).
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=Gemma3ForCausalLM(ref.config))["tensors"]
    want = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}
    assert set(tensors) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(tensors[k].float(), v, atol=1e-6, rtol=0, msg=k)

    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    cfg = loaded.config
    assert cfg.architecture == "gemma3" and cfg.layer_types == ref.config.layer_types and cfg.qk_norm
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (200_000.0, 10_000.0, 32.0)
    assert loaded.tokenizer.encode("ab abc") == [2] + [loaded.tokenizer.backend.token_to_id(t) for t in ("ab", "▁abc")]

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, TINY_VOCAB, (21,), generator=g).tolist()
    backend = make_backend(loaded.model, cfg, 16, 4)
    seqs = PagedSeqs(backend)
    kv = make_kv_caches(backend)
    text = list(prompt)
    chunk = prompt
    for _ in range(3):  # the prompt (longer than the window), then two decode steps
        ids, positions, meta = seqs.batch({0: chunk})
        with torch.no_grad():
            logits = loaded.model.compute_logits(loaded.model(ids, positions, meta, kv))
        torch.testing.assert_close(logits, hf_logits(ref, text)[-len(chunk):], atol=1e-4, rtol=1e-4)
        chunk = [int(logits[-1].argmax())]
        text += chunk
