"""Paged attention: a native CPU kernel where it applies, else torch's matmuls and SDPA (any device).

Each call first writes the new tokens' K/V into the layer's paged cache, then reads every sequence's
K/V back from the cache through its block table: the cache is the only copy kept between steps.
Gathers made here are transient.

Native kernel (CPU with AVX-512 or AVX2, bfloat16 or float32; kvserve/kernels/cpu): every query token is a
row that reads its sequence's K/V in place; prefills longer than ~1k tokens of context still go to SDPA.

Torch path: the cache is head-major ([Hkv, num_blocks, block_size, D]), so one index_select over whole
(head, block) rows yields [Hkv * B, L, D], contiguous, which batched matmuls read as they are (with the
cache block-major, every matmul first copied the gather into shape: 2-3x slower a layer at batch 64,
benchmarks/results/decode_attention.md). Decode rows (q_len == 1) go through a pair of batched matmuls
per group of similar context lengths, each padded to its group's longest context with a -inf bias.
Prefill / chunked-prefill rows go one SDPA call per sequence with a causal mask offset by the cached
prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.attention_metadata import AttentionMetadata, DecodeGroup, PrefillPlan


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 scale: float | None = None) -> None:
        super().__init__()
        # Mistral-style: the query at position p sees keys p - sliding_window < j <= p.
        self.sliding_window = sliding_window
        assert num_heads % num_kv_heads == 0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale  # Gemma scales by its query_pre_attn_scalar

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        Hkv, num_blocks, block_size, D = k_cache.shape
        kernel = meta.native_kernel and self._kernel_applies(q, k_cache)
        plan = meta.plan(Hkv, num_blocks, self.sliding_window, kernel)
        # Write the new tokens: one row per (head, token) of the cache seen as [Hkv * NB * bs, D].
        k_rows, v_rows = k_cache.view(-1, D), v_cache.view(-1, D)
        k_rows.index_copy_(0, plan.write_idx, k.transpose(0, 1).reshape(-1, D).to(k_cache.dtype))
        v_rows.index_copy_(0, plan.write_idx, v.transpose(0, 1).reshape(-1, D).to(v_cache.dtype))

        q = q.contiguous()
        out = torch.empty_like(q)
        if plan.kernel_rows is not None:
            rows = plan.kernel_rows
            cpu_kernels.ops().paged_attention_(q, out, k_cache, v_cache, rows.token, rows.seq, rows.len,
                                               meta.block_tables, self.scale, self.sliding_window or 0)
        k_blocks, v_blocks = k_cache.view(Hkv * num_blocks, block_size, D), v_cache.view(Hkv * num_blocks, block_size, D)
        for group in plan.decode:
            self._decode(q, out, k_blocks, v_blocks, group)
        for p in plan.prefills:
            self._prefill(q, out, k_blocks, v_blocks, meta, p)
        return out.flatten(1)

    def _kernel_applies(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (q.dtype == k_cache.dtype and self.head_dim in (16, 32, 64, 128)
                and self.num_heads // self.num_kv_heads <= 16 and cpu_kernels.applies(q))

    def _decode(self, q: torch.Tensor, out: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                plan: DecodeGroup) -> None:
        B, L, Hkv, D = len(plan.token_idx), plan.max_len, self.num_kv_heads, self.head_dim
        k = k_blocks.index_select(0, plan.gather_idx).view(Hkv * B, L, D)
        v = v_blocks.index_select(0, plan.gather_idx).view(Hkv * B, L, D)
        # With one query token, the G query heads sharing a KV head become G query rows of that head:
        # GQA without repeating K/V, and no causal mask, only the per-sequence length (in plan.bias).
        group = self.num_heads // Hkv
        qd = q.index_select(0, plan.token_idx).view(B, Hkv, group, D)
        qd = qd.transpose(0, 1).reshape(Hkv * B, group, D).to(k.dtype)
        # Two plain matmuls beat SDPA here: with a handful of query rows per KV head, its CPU kernel ran
        # at ~11 GFLOP/s. Softmax in float32.
        scores = torch.bmm(qd, k.transpose(1, 2)).float().mul_(self.scale).add_(plan.bias)  # [Hkv*B, G, L]
        o = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v)                           # [Hkv*B, G, D]
        o = o.view(Hkv, B, group, D).transpose(0, 1).reshape(B, self.num_heads, D)
        out.index_copy_(0, plan.token_idx, o.to(out.dtype))

    def _prefill(self, q: torch.Tensor, out: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                 meta: AttentionMetadata, plan: PrefillPlan) -> None:
        i = plan.row
        start, end = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        seq_len, Hkv, D = meta.seq_lens_list[i], self.num_kv_heads, self.head_dim
        k = k_blocks.index_select(0, plan.gather_idx).view(1, Hkv, -1, D)[:, :, :seq_len]  # [1, Hkv, S, D]
        v = v_blocks.index_select(0, plan.gather_idx).view(1, Hkv, -1, D)[:, :, :seq_len]
        qi = q[start:end].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, H, q_len, D]
        if plan.mask is None:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=plan.mask, scale=self.scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
