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

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """float8 as its bytes: torch's CPU index_copy_ / index_select have no float8 kernels."""
    return x.view(torch.uint8) if x.dtype == FP8 else x


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
        # A float8 cache holds K / k_scale and V / v_scale. 1.0, as vLLM uses without calibration: e4m3 spans
        # +-448 with 3 mantissa bits, and these models' K/V stay well inside that range.
        self.k_scale = self.v_scale = 1.0

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
        k_scale, v_scale = (self.k_scale, self.v_scale) if k_cache.dtype == FP8 else (1.0, 1.0)
        if kernel:
            cpu_kernels.ops().cache_kv_(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        else:  # one row per (head, token) of the cache seen as [Hkv * NB * bs, D]
            for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
                _bytes(cache.view(-1, D)).index_copy_(0, plan.write_idx, _bytes(self._to_cache(x, sc, cache.dtype)))

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.kernel_rows is not None:
            rows = plan.kernel_rows
            cpu_kernels.ops().paged_attention_(q, out, k_cache, v_cache, rows.token, rows.seq, rows.len,
                                               meta.block_tables, self.scale, self.sliding_window or 0,
                                               k_scale, v_scale)
        k_blocks, v_blocks = k_cache.view(Hkv * num_blocks, block_size, D), v_cache.view(Hkv * num_blocks, block_size, D)
        for group in plan.decode:
            self._decode(q, out, k_blocks, v_blocks, group)
        for p in plan.prefills:
            self._prefill(q, out, k_blocks, v_blocks, meta, p)
        return out.flatten(1)

    @staticmethod
    def _to_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """[T, Hkv, D] -> [Hkv * T, D] rows in the cache's dtype (float8: x / scale, saturated)."""
        rows = x.transpose(0, 1).reshape(-1, x.shape[-1])
        if dtype == FP8:
            return (rows.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)
        return rows.to(dtype)

    @staticmethod
    def _gather(blocks: torch.Tensor, idx: torch.Tensor, scale: float) -> torch.Tensor:
        """Cache rows -> a copy to compute with (float8: float32 times the scale)."""
        if blocks.dtype != FP8:
            return blocks.index_select(0, idx)
        return _bytes(blocks).index_select(0, idx).view(FP8).float() * scale

    def _kernel_applies(self, q: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return (k_cache.dtype in (q.dtype, FP8) and self.head_dim in (16, 32, 64, 128) and q.stride(2) == 1
                and q.stride(1) == self.head_dim and self.num_heads // self.num_kv_heads <= 16
                and cpu_kernels.applies(q))

    def _decode(self, q: torch.Tensor, out: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                plan: DecodeGroup) -> None:
        B, L, Hkv, D = len(plan.token_idx), plan.max_len, self.num_kv_heads, self.head_dim
        k = self._gather(k_blocks, plan.gather_idx, self.k_scale).view(Hkv * B, L, D)
        v = self._gather(v_blocks, plan.gather_idx, self.v_scale).view(Hkv * B, L, D)
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
        k = self._gather(k_blocks, plan.gather_idx, self.k_scale)
        v = self._gather(v_blocks, plan.gather_idx, self.v_scale)
        k = k.view(1, Hkv, -1, D)[:, :, :seq_len]  # [1, Hkv, S, D]
        v = v.view(1, Hkv, -1, D)[:, :, :seq_len]
        qi = q[start:end].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, H, q_len, D]
        if plan.mask is None:
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=plan.mask, scale=self.scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1).to(out.dtype)
