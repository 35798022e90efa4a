"""Gemma 3 (text): Llama's decoder with these differences, each from transformers' Gemma3ForCausalLM:

- layers alternate sliding-window and global attention (`layer_types`); each kind has its own RoPE base
  (`rope_local_theta` for sliding layers, `rope_theta` and any `rope_scaling` for global ones);
- scores are scaled by query_pre_attn_scalar ** -0.5, and q and k get a per-head RMSNorm before RoPE;
- RMSNorm scales by (1 + weight), in float32 (GemmaRMSNorm), and wraps both sublayers on each side:
  x + post_norm(attn(pre_norm(x))), then the same around the MLP;
- the MLP is GeGLU with tanh-approximated GELU;
- embeddings are multiplied by sqrt(hidden_size) (rounded to the compute dtype, as transformers does);
- final logits are optionally soft-capped: cap * tanh(logits / cap).
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvserve.attention.backend import AttentionMetadata, KVCache
from kvserve.config import ModelConfig
from kvserve.layers.activation import GeluTanhAndMul
from kvserve.layers.attention import PagedAttention
from kvserve.layers.linear import ColumnLinear, LinearBase, QKVLinear, RowLinear, VocabEmbedding
from kvserve.models.llama import MLP, run_decoder_layers
from kvserve.layers.norm import GemmaRMSNorm
from kvserve.layers.quantization import QuantConfig
from kvserve.layers.quantization.methods import Loaded
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.weight_loading import linear_layers, load_named_weights

SLIDING, FULL = "sliding_attention", "full_attention"


def default_layer_types(num_layers: int, pattern: int = 6) -> list[str]:
    """Every `pattern`-th layer global, the rest sliding (Gemma 3's 5:1; what llama.cpp assumes for GGUF)."""
    return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)]


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool, rotary: RotaryEmbedding, quant: QuantConfig,
                 prefix: str, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_names = [f"{prefix}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.q_size, self.kv_size, cfg.attention_bias,
                                  quant.method(qkv_names), prefix)
        o_name = f"{prefix}.o_proj.weight"
        self.o_proj = RowLinear(self.q_size, cfg.hidden_size, cfg.attention_bias, quant.method([o_name]), o_name)
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary  # this layer kind's RoPE, owned by the model
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx,
                                   cfg.sliding_window if sliding else None, scale=scalar ** -0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """out_rows: the rows whose output is wanted (all by default); every row's K/V goes to the cache."""
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v)
        return self.o_proj(out if out_rows is None else out[out_rows])


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool, rotary: RotaryEmbedding, quant: QuantConfig,
                 prefix: str, layer_idx: int) -> None:
        super().__init__()
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, sliding, rotary, quant, f"{prefix}.self_attn", layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = MLP(cfg, quant, f"{prefix}.mlp", act=GeluTanhAndMul())
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's (post-normed) output, not yet added to the residual stream; None
        residual: the first layer, x is the scaled embedding. out_rows: only those rows after the attention
        (a last layer whose step samples a few rows)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(positions, x, out_rows))
        x, residual = self.pre_feedforward_layernorm(x, residual if out_rows is None else residual[out_rows])
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig | None = None) -> None:
        super().__init__()
        quant = quant or QuantConfig()
        self.config = cfg
        layer_types = cfg.layer_types or default_layer_types(cfg.num_hidden_layers)
        if len(layer_types) != cfg.num_hidden_layers or not set(layer_types) <= {SLIDING, FULL}:
            raise ValueError(f"layer_types must give {SLIDING!r} or {FULL!r} for each of the "
                             f"{cfg.num_hidden_layers} layers, got {layer_types}")
        embed = "model.embed_tokens.weight"
        self.embed_tokens = VocabEmbedding(cfg.hidden_size, cfg.vocab_size, quant.method([embed], output_layer=True),
                                           embed)
        self.embed_scale = cfg.hidden_size ** 0.5
        self.rotary_global = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                             cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.rope_local_theta or cfg.rope_theta)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, kind == SLIDING, self.rotary_local if kind == SLIDING else self.rotary_global,
                               quant, f"model.layers.{i}", i)
            for i, kind in enumerate(layer_types))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # No native decoder stack covers Gemma's layers (its norms, q/k norms, GELU): run_decoder_layers runs
        # them one by one.
        self.native_stack = None
        self.lm_head: LinearBase = self.embed_tokens if cfg.tie_word_embeddings else ColumnLinear(
            cfg.hidden_size, cfg.vocab_size, quant.method(["lm_head.weight"], output_layer=True), "lm_head.weight")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[KVCache], out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final-norm hidden states [T, hidden] (of the rows out_rows, where given)."""
        x = self.embed_tokens.embed(input_ids)
        x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
        assert len(kv_caches) == len(self.layers)
        x, residual = run_decoder_layers(self, x, positions, meta, kv_caches, out_rows)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        logits = self.lm_head(hidden, out_dtype=torch.float32)
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def linear_layers(self) -> list[LinearBase]:
        return linear_layers(self)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        load_named_weights(self, weights, self.config.tie_word_embeddings)
