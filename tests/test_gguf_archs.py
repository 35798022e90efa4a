"""GGUF loading for every supported architecture, not just the default model's Llama: a tiny random
Llama (plain, and with Llama-3 RoPE scaling stored as a rope_freqs tensor), Qwen2 and Qwen3 is written
to GGUF the way llama.cpp's converter lays it out (tensor names, metadata keys, Q/K rows permuted for
Llama only; Mistral checkpoints become "llama" GGUFs). transformers' own GGUF reader must read the file
back to the original weights, which checks the writer against an independent implementation; then
kvserve's logits from the GGUF must match transformers' on the original model.
(The default model's test, test_gguf_default.py, covers a quantized Llama GGUF made by llama.cpp.)"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kvserve.models.loader import load_model
from paged_helpers import PagedSeqs, make_backend, make_kv_caches
from test_model_parity import VOCAB, build_hf_model, hf_logits, word_level_tokenizer

_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert-time Q/K permutation (rotary halves interleaved within each head)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model: torch.nn.Module, arch: str, path: Path, pre: str | None = None,
               extra: Callable[[gguf.GGUFWriter], None] | None = None) -> None:
    """extra: writes further metadata keys (after the context length)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    if extra is not None:
        extra(w)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"] if hasattr(cfg, "rope_parameters") else cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(VOCAB)
    # A byte-level BPE vocabulary of the right size: the 256 byte symbols, one merge, then fillers.
    byte_symbols = [chr(c) for c in range(ord("!"), ord("~") + 1)] + [chr(c) for c in range(161, 173)] + \
        [chr(c) for c in range(174, 256)]
    byte_symbols += [chr(256 + i) for i in range(256 - len(byte_symbols))]
    tokens = byte_symbols + ["ab"] + [f"<x{i}>" for i in range(VOCAB - 257)]
    w.add_tokenizer_model("gpt2")
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * VOCAB)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if getattr(model.config, "rope_parameters", {}).get("rope_type") == "llama3":
        # llama.cpp stores Llama-3 RoPE scaling as one divisor per frequency: default / scaled inv_freq,
        # the scaled ones taken from transformers' own rotary module.
        theta = model.config.rope_parameters["rope_theta"]
        default = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        scaled = model.model.rotary_emb.inv_freq.double()
        w.add_tensor("rope_freqs.weight", (default / scaled).float().numpy())
    permuted = arch in ("llama", "mistral")
    for name, t in model.state_dict().items():
        a = t.float().numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            gname = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            gname = f"blk.{layer}.{_LAYER_TENSORS[rest]}"
            if permuted and rest.startswith("self_attn.q_proj"):
                a = permute_qk(a, cfg.num_attention_heads)
            elif permuted and rest.startswith("self_attn.k_proj"):
                a = permute_qk(a, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# llama.cpp writes Mistral checkpoints as "llama" too, so the Llama case covers both.
@pytest.mark.parametrize("name,arch", [("llama_tied", "llama"), ("llama3_rope_untied", "llama"),
                                       ("qwen2_bias_tied", "qwen2"), ("qwen3_qknorm_untied", "qwen3")])
def test_gguf_of_each_architecture_matches_transformers(name: str, arch: str, tmp_path: Path) -> None:
    ref = build_hf_model(name, tmp_path)
    path = tmp_path / "model.gguf"
    write_gguf(ref, arch, path)

    # The writer, checked by transformers' reader (its own un-permutation): the original weights back.
    fresh = type(ref)(ref.config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=fresh)["tensors"]
    want = {k: v for k, v in ref.state_dict().items() if not (k == "lm_head.weight" and ref.config.tie_word_embeddings)}
    assert set(tensors) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(tensors[k].float(), v.float(), atol=0, rtol=0, msg=k)

    loaded = load_model(str(path), torch.float32, torch.device("cpu"))
    cfg = loaded.config
    assert cfg.architecture == arch
    assert (cfg.attention_bias, cfg.qk_norm) == (arch == "qwen2", arch == "qwen3")
    assert cfg.tie_word_embeddings == ref.config.tie_word_embeddings
    assert len(loaded.tokenizer.encode("ab", add_special_tokens=False)) == 1  # the merge was read

    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, VOCAB, (13,), generator=g).tolist()
    backend = make_backend(loaded.model, cfg, 16, 4)
    seqs = PagedSeqs(backend)
    kv = make_kv_caches(backend)
    ids, positions, meta = seqs.batch({0: prompt})
    with torch.no_grad():
        logits = loaded.model.compute_logits(loaded.model(ids, positions, meta, kv))
    torch.testing.assert_close(logits, hf_logits(ref, prompt), atol=1e-4, rtol=1e-4)


def test_tokenizer_option_stands_in_for_a_pre_tokenizer_kvserve_cannot_rebuild(tmp_path: Path) -> None:
    """A GGUF whose tokenizer.ggml.pre kvserve does not know is refused, and the refusal says to pass
    --tokenizer; with it, the file loads with that tokenizer (the model's own is never built)."""
    ref = build_hf_model("llama_tied", tmp_path)
    path = tmp_path / "model.gguf"
    write_gguf(ref, "llama", path, pre="chatglm-bpe")
    with pytest.raises(ValueError, match="tokenizer.ggml.pre 'chatglm-bpe' is not supported.*--tokenizer"):
        load_model(str(path), torch.float32, torch.device("cpu"))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    word_level_tokenizer().save(str(tok_dir / "tokenizer.json"))
    loaded = load_model(str(path), torch.float32, torch.device("cpu"), tokenizer=str(tok_dir))
    assert loaded.tokenizer.encode("v7 v9", add_special_tokens=False) == [7, 9]


@pytest.mark.parametrize("extra, said", [
    # Dropped, the model had run unscaled RoPE at every length (and been offered its extended context).
    (lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)),
     "unsupported rope scaling type 'yarn'"),
    # One part of llama.cpp's gguf-split: it had been "missing 10 weights" (part 1) or "architecture None".
    (lambda w: (w.add_uint16("split.count", 3), w.add_uint16("split.no", 0)),
     "part 1 of a GGUF split in 3 files.*llama-gguf-split --merge"),
])
def test_a_gguf_kvserve_cannot_run_as_written_is_refused_naming_why(tmp_path: Path, extra, said: str) -> None:
    ref = build_hf_model("llama_tied", tmp_path)
    path = tmp_path / "model.gguf"
    write_gguf(ref, "llama", path, extra=extra)
    with pytest.raises(ValueError, match=said):
        load_model(str(path), torch.float32, torch.device("cpu"))


def test_a_gguf_without_the_models_hyperparameters_is_named() -> None:
    """A LoRA adapter's GGUF, say: it had failed with a TypeError on None."""
    from kvserve.models.gguf import gguf_model_config
    meta = {"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
            "tokenizer.ggml.tokens": ["a"]}
    with pytest.raises(ValueError, match="lacks llama.block_count, llama.feed_forward_length"):
        gguf_model_config(meta, {})
