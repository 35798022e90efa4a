"""The attention layer models call: self.attn(q, k, v) -> [T, H * D], whatever backend runs the step.

It holds what a backend needs to know about one layer (heads, scale, sliding window, float8 scales) and
its index into the KV caches; the backend comes with the step's metadata (kvserve/attention/).
"""
from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.forward_context import get_forward_context


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, layer_idx: int,
                 sliding_window: int | None = None, scale: float | None = None) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        # Mistral-style: the query at position p sees keys p - sliding_window < j <= p.
        self.sliding_window = sliding_window
        self.scale = head_dim ** -0.5 if scale is None else scale  # Gemma scales by its query_pre_attn_scalar
        # A float8 cache holds K / k_scale and V / v_scale: calibrated when the engine starts
        # (kvserve/attention/kv_scales.py), which sets kv_amax for one forward to collect max |K|, max |V|.
        self.k_scale = self.v_scale = 1.0
        self.kv_amax: torch.Tensor | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [T, H, D], k and v: [T, Hkv, D] (views of the fused projection are fine)."""
        if self.kv_amax is not None:
            torch.maximum(self.kv_amax, torch.stack([k.abs().amax(), v.abs().amax()]).float(), out=self.kv_amax)
        ctx = get_forward_context()
        return ctx.meta.backend.forward(self, q, k, v, ctx.kv_caches[self.layer_idx], ctx.meta)


def attention_layers(model: nn.Module) -> list[PagedAttention]:
    """The model's attention layers, in layer order."""
    layers = sorted((m for m in model.modules() if isinstance(m, PagedAttention)), key=lambda m: m.layer_idx)
    assert [m.layer_idx for m in layers] == list(range(len(layers))), "attention layer indices must be 0..L-1"
    return layers
