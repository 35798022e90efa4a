"""One decoder family for Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm, explicit head_dim). q/k/v and gate/up are fused into single projections when
weights are loaded (`load_weights` takes Hugging Face tensor names)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvserve.config import ModelConfig
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.attention import PagedAttention
from kvserve.layers.attention_metadata import AttentionMetadata
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        # Qwen2 puts a bias on q/k/v only; Llama/Mistral/Qwen3's attention_bias covers o_proj too.
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias and cfg.architecture != "qwen2")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary  # shared by all layers; owned by the model
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, cfg.sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the add is fused into
        this layer's first norm); None residual: the first layer, x is the embedding."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share embedding and LM head; again after to_empty(), which gives each module its own copy."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-norm hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(positions, x, residual, kv_cache, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up. Every parameter must be set."""
        params = dict(self.named_parameters())
        q_size, kv_size = self.layers[0].self_attn.q_size, self.layers[0].self_attn.kv_size
        inter = self.config.intermediate_size
        # HF name suffix -> (our suffix, row range in the fused tensor)
        fused = {
            "q_proj": ("qkv_proj", 0, q_size),
            "k_proj": ("qkv_proj", q_size, q_size + kv_size),
            "v_proj": ("qkv_proj", q_size + kv_size, q_size + 2 * kv_size),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, 2 * inter),
        }
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                target, lo, hi = fused[parts[-2]]
                pname = ".".join(parts[:-2] + [target, parts[-1]])
                if pname not in params:
                    raise KeyError(f"unexpected weight {name!r}")
                params[pname][lo:hi].copy_(tensor)
                loaded.add(f"{pname}[{lo}:{hi}]")
                continue
            if name not in params:
                raise KeyError(f"unexpected weight {name!r}")
            if params[name].shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}")
            params[name].copy_(tensor)
            loaded.add(name)
        expected = self._expected_weight_keys(fused)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {sorted(missing)[:5]}")

    def _expected_weight_keys(self, fused: dict[str, tuple[str, int, int]]) -> set[str]:
        keys: set[str] = set()
        fused_targets = {t for t, _, _ in fused.values()}
        for pname, _ in self.named_parameters():  # tied lm_head is deduplicated here
            parts = pname.split(".")
            if len(parts) >= 2 and parts[-2] in fused_targets:
                for target, lo, hi in fused.values():
                    if target == parts[-2] and (parts[-1] == "weight" or target == "qkv_proj"):
                        keys.add(f"{pname}[{lo}:{hi}]")
            else:
                keys.add(pname)
        return keys
