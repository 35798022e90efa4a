"""One decoder family for Llama (incl. Llama-3 RoPE scaling), Mistral, Qwen2 (q/k/v bias) and Qwen3
(per-head q/k RMSNorm, explicit head_dim). q/k/v and gate/up are fused into single projections when
weights are loaded (`load_weights` takes Hugging Face tensor names, each routed to its layer's shard)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvserve.attention.backend import AttentionMetadata, KVCache
from kvserve.attention.forward_context import forward_context
from kvserve.config import ModelConfig
from kvserve.layers.activation import SiluAndMul
from kvserve.layers.attention import PagedAttention
from kvserve.layers.linear import ColumnLinear, LinearBase, MergedColumnLinear, QKVLinear, RowLinear, VocabEmbedding
from kvserve.layers.quantization import QuantConfig
from kvserve.layers.quantization.methods import Loaded
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding
from kvserve.models.native_stack import NativeDecoderStack
from kvserve.models.weight_loading import linear_layers, load_named_weights


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, quant: QuantConfig, prefix: str,
                 layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        qkv_names = [f"{prefix}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.q_size, self.kv_size, cfg.attention_bias,
                                  quant.method(qkv_names), prefix)
        # Qwen2 puts a bias on q/k/v only; Llama/Mistral/Qwen3's attention_bias covers o_proj too.
        o_name = f"{prefix}.o_proj.weight"
        self.o_proj = RowLinear(self.q_size, cfg.hidden_size, cfg.attention_bias and cfg.architecture != "qwen2",
                                quant.method([o_name]), o_name)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary  # shared by all layers; owned by the model
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, layer_idx, cfg.sliding_window)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """out_rows: the rows whose output is wanted (all by default); every row's K/V goes to the cache."""
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        # Views of the fused projection, no copies: the kernels read heads at any token stride.
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k, v = q.view(T, H, D), k.view(T, Hkv, D), v.view(T, Hkv, D)
        if self.qk_norm:
            q, k = self.rotary(positions, self.q_norm(q), self.k_norm(k))
        else:  # q's and k's heads sit side by side: one rotation pass over both
            self.rotary.rotate_(positions, qkv[:, :self.q_size + self.kv_size].view(T, H + Hkv, D))
        out = self.attn(q, k, v)
        return self.o_proj(out if out_rows is None else out[out_rows])


class MLP(nn.Module):
    """down(act(gate) * up) over a fused gate/up projection; act is SiLU (Llama family) or tanh-GELU (Gemma)."""

    def __init__(self, cfg: ModelConfig, quant: QuantConfig, prefix: str, act: nn.Module | None = None) -> None:
        super().__init__()
        names = [f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]
        self.gate_up_proj = MergedColumnLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, quant.method(names), names)
        down = f"{prefix}.down_proj.weight"
        self.down_proj = RowLinear(cfg.intermediate_size, cfg.hidden_size, False, quant.method([down]), down)
        self.act = act if act is not None else SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, quant: QuantConfig, prefix: str,
                 layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, quant, f"{prefix}.self_attn", layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, quant, f"{prefix}.mlp")

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                out_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the add is fused into
        this layer's first norm); None residual: the first layer, x is the embedding. out_rows: only those rows
        after the attention (a last layer whose step samples a few rows)."""
        if residual is None:
            # The first layer too adds to a (zero) residual: its norm then runs the same code as the native
            # decoder stack's (kvserve/models/native_stack.py), so the two paths agree bit for bit; the
            # quantized layers' 8-bit activations would turn a last-bit difference into visible ones.
            residual = torch.zeros_like(x)
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, out_rows)
        x, residual = self.post_attention_layernorm(x, residual if out_rows is None else residual[out_rows])
        return self.mlp(x), residual


def run_decoder_layers(model: nn.Module, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                       kv_caches: list[KVCache], out_rows: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """model.layers over the embedded x: in one native call where model.native_stack covers the step, else
    one by one. (last layer's output, residual stream), of the rows out_rows (ascending) where given."""
    native = (model.native_stack(x, positions, meta, kv_caches, out_rows) if model.native_stack is not None
              else None)
    if native is not None:
        return native
    residual = None
    last = len(model.layers) - 1
    with forward_context(meta, kv_caches):  # where each layer's self.attn finds its cache and the step's plan
        for i, layer in enumerate(model.layers):
            x, residual = layer(positions, x, residual, out_rows if i == last else None)
    return x, residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, quant: QuantConfig | None = None) -> None:
        super().__init__()
        quant = quant or QuantConfig()
        self.config = cfg
        embed = "model.embed_tokens.weight"
        self.embed_tokens = VocabEmbedding(cfg.hidden_size, cfg.vocab_size, quant.method([embed], output_layer=True),
                                           embed)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary, quant, f"model.layers.{i}", i)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # A tied LM head is the embedding itself, in whatever format the embedding is stored.
        self.lm_head: LinearBase = self.embed_tokens if cfg.tie_word_embeddings else ColumnLinear(
            cfg.hidden_size, cfg.vocab_size, quant.method(["lm_head.weight"], output_layer=True), "lm_head.weight")
        # The decoder layers in one native call where it covers this model, set once the weights are in
        # (kvserve/models/native_stack.py); None: the layers below run one by one.
        self.native_stack: NativeDecoderStack | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final-norm hidden states [T, hidden]; with out_rows ([K] ascending
        row indices: the rows whose logits the step needs), [K, hidden]: the last layer's o projection and MLP
        (in the native stack its attention too) run for those rows alone."""
        assert len(kv_caches) == len(self.layers)
        x, residual = run_decoder_layers(self, self.embed_tokens.embed(input_ids), positions, meta, kv_caches,
                                         out_rows)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return self.lm_head(hidden, out_dtype=torch.float32)

    def linear_layers(self) -> list[LinearBase]:
        return linear_layers(self)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Loaded]]) -> None:
        """Route Hugging Face-named tensors to their layers (linear shards through each layer's checked
        weight_loader), then finalize every linear layer. Every weight must be present."""
        load_named_weights(self, weights, self.config.tie_word_embeddings)
        self.native_stack = NativeDecoderStack.build(self)
