"""The torch backend: native CPU kernels where they apply, else torch's matmuls and SDPA (any device).

Each call first writes the new tokens' K/V into the layer's paged cache, then reads every sequence's
K/V back from the cache through its block table: the cache is the only copy kept between steps.
Gathers made here are transient.

Native kernel (CPU with AVX-512 or AVX2, bfloat16 or float32; kvserve/kernels/cpu): every query token is a
row that reads its sequence's K/V in place; prefills longer than 4k tokens of context (1k with AVX2) still
go to SDPA.

Torch path (the reference, and the fallback on any device): the cache is head-major
([Hkv, num_blocks, block_size, D]), so one index_select over whole (head, block) rows yields
[Hkv * B, L, D], contiguous, which batched matmuls read as they are (with the cache block-major, every
matmul first copied the gather into shape: 2-3x slower a layer at batch 64,
benchmarks/results/decode_attention_avx512.md). Decode rows (q_len == 1) go through a pair of batched
matmuls per group of similar context lengths, each padded to its group's longest context with a -inf bias.
Prefill / chunked-prefill rows go one SDPA call per sequence with a causal mask offset by the cached
prefix.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.backend import (FP8, FP8_MAX, AttentionBackend, AttentionMetadata, KVCache, StepBatch,
                                       as_bytes)
from kvserve.attention.torch_plan import AttentionPlan, DecodeGroup, PrefillPlan, build_plan
from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.attention import PagedAttention

logger = logging.getLogger(__name__)

PlanKey = tuple[int | None, bool]  # (sliding window, native kernel)


@dataclass
class TorchMetadata(AttentionMetadata):
    plans: dict[PlanKey, AttentionPlan]  # one per kind of layer the model has


class TorchPagedBackend(AttentionBackend):
    name = "torch"
    supports_tree_drafts = True

    def __init__(self, *args, native_kernels: bool = True, batch_invariant: bool = False, **kwargs) -> None:
        """native_kernels=False: the torch path only (the reference the kernels are tested against).
        batch_invariant: every row on the native kernel at any context (EngineConfig.batch_invariant)."""
        super().__init__(*args, **kwargs)
        self.native_kernels = native_kernels
        self.batch_invariant = batch_invariant
        self._kernel = {layer.layer_idx: native_kernels and self._kernel_applies(layer) for layer in self.layers}
        if batch_invariant and not all(self._kernel.values()):
            logger.warning("batch_invariant: %d of %d attention layers cannot run on the native kernel (none built "
                           "for this CPU, or a geometry it lacks): their long prompt chunks still depend on the batch",
                           sum(not k for k in self._kernel.values()), len(self._kernel))
        self._plan_keys = sorted({self._plan_key(layer) for layer in self.layers}, key=repr)

    def rows_alike(self) -> bool:
        """The native kernel computes each row alone; torch's batched matmuls and SDPA round by shape."""
        return all(self._kernel.values())

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        spec = self.kv_spec
        return (spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)

    def build_metadata(self, batch: StepBatch) -> TorchMetadata:
        Hkv = self.kv_spec.num_kv_heads
        plans = {key: build_plan(batch, Hkv, self.num_blocks, key[0], key[1], self.batch_invariant)
                 for key in self._plan_keys}
        return TorchMetadata(batch, self, plans)

    def kernel_only_plan(self, meta: AttentionMetadata) -> AttentionPlan | None:
        """This step's plan if every layer shares it and all its rows run on the native kernel (what
        a native decoder stack needs: kvserve/models/native_stack.py), else None."""
        if len(self._plan_keys) != 1 or not self._plan_keys[0][1]:
            return None
        assert isinstance(meta, TorchMetadata)
        plan = meta.plans[self._plan_keys[0]]
        return plan if plan.kernel_rows is not None and not plan.decode and not plan.prefills else None

    def copy_slots(self, kv_caches: list[KVCache], src: list[int], dst: list[int]) -> None:
        if self.device.type == "cpu" and cpu_kernels.available() and hasattr(cpu_kernels.ops(), "copy_slots_"):
            cpu_kernels.ops().copy_slots_([k for k, _ in kv_caches], [v for _, v in kv_caches], src, dst)
            return
        Hkv, D = self.kv_spec.num_kv_heads, self.kv_spec.head_dim
        src_t = torch.tensor(src, device=self.device)
        dst_t = torch.tensor(dst, device=self.device)
        for cache in (c for pair in kv_caches for c in pair):
            rows = as_bytes(cache).view(Hkv, -1, D)
            rows[:, dst_t] = rows[:, src_t]

    def _plan_key(self, layer: PagedAttention) -> PlanKey:
        return layer.sliding_window, self._kernel[layer.layer_idx]

    def _kernel_applies(self, layer: PagedAttention) -> bool:
        """Decided once per layer: the kernel's head sizes, GQA groups and dtypes, on a CPU that built it."""
        return (self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32)
                and self.kv_spec.dtype in (torch.float32, torch.bfloat16, FP8) and layer.head_dim in (16, 32, 64, 128, 256)
                and layer.num_heads // layer.num_kv_heads <= 16 and cpu_kernels.available())

    def forward(self, layer: PagedAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        assert isinstance(meta, TorchMetadata)
        k_cache, v_cache = kv_cache
        Hkv, num_blocks, block_size, D = k_cache.shape
        kernel = self._kernel[layer.layer_idx]
        plan = meta.plans[self._plan_key(layer)]
        k_scale, v_scale = (layer.k_scale, layer.v_scale) if k_cache.dtype == FP8 else (1.0, 1.0)
        if kernel:
            cpu_kernels.ops().cache_kv_(k, v, k_cache, v_cache, meta.batch.slot_mapping, k_scale, v_scale)
        else:  # one row per (head, token) of the cache seen as [Hkv * NB * bs, D]
            for x, cache, sc in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
                as_bytes(cache.view(-1, D)).index_copy_(0, plan.write_idx, as_bytes(_to_cache(x, sc, cache.dtype)))

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if plan.kernel_rows is not None:
            if q.stride(2) != 1 or q.stride(1) != D:  # the kernel reads heads at any token stride, no other
                q = q.contiguous()
            rows = plan.kernel_rows
            cpu_kernels.ops().paged_attention_(q, out, k_cache, v_cache, rows.token, rows.seq, rows.len,
                                               meta.batch.block_tables, layer.scale, layer.sliding_window or 0,
                                               k_scale, v_scale, rows.last)
        k_blocks, v_blocks = k_cache.view(Hkv * num_blocks, block_size, D), v_cache.view(Hkv * num_blocks, block_size, D)
        for group in plan.decode:
            _decode(layer, q, out, k_blocks, v_blocks, group)
        for p in plan.prefills:
            _prefill(layer, q, out, k_blocks, v_blocks, meta.batch, p)
        return out.flatten(1)


def _to_cache(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """[T, Hkv, D] -> [Hkv * T, D] rows in the cache's dtype (float8: x / scale, saturated)."""
    rows = x.transpose(0, 1).reshape(-1, x.shape[-1])
    if dtype == FP8:
        return (rows.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(dtype)
    return rows.to(dtype)


def _gather(blocks: torch.Tensor, idx: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows -> a copy to compute with: in dtype, the queries' (a bfloat16 cache under float32
    compute), or float8's float32 times the scale."""
    if blocks.dtype != FP8:
        return blocks.index_select(0, idx).to(dtype)
    return as_bytes(blocks).index_select(0, idx).view(FP8).float() * scale


def _decode(layer: PagedAttention, q: torch.Tensor, out: torch.Tensor, k_blocks: torch.Tensor,
            v_blocks: torch.Tensor, plan: DecodeGroup) -> None:
    B, L, Hkv, D = len(plan.token_idx), plan.max_len, layer.num_kv_heads, layer.head_dim
    k = _gather(k_blocks, plan.gather_idx, layer.k_scale, q.dtype).view(Hkv * B, L, D)
    v = _gather(v_blocks, plan.gather_idx, layer.v_scale, q.dtype).view(Hkv * B, L, D)
    # With one query token, the G query heads sharing a KV head become G query rows of that head:
    # GQA without repeating K/V, and no causal mask, only the per-sequence length (in plan.bias).
    group = layer.num_heads // Hkv
    qd = q.index_select(0, plan.token_idx).view(B, Hkv, group, D)
    qd = qd.transpose(0, 1).reshape(Hkv * B, group, D).to(k.dtype)
    # Two plain matmuls beat SDPA here: with a handful of query rows per KV head, its CPU kernel ran
    # at ~11 GFLOP/s. Softmax in float32.
    scores = torch.bmm(qd, k.transpose(1, 2)).float().mul_(layer.scale).add_(plan.bias)  # [Hkv*B, G, L]
    o = torch.bmm(torch.softmax(scores, dim=-1).to(v.dtype), v)                            # [Hkv*B, G, D]
    o = o.view(Hkv, B, group, D).transpose(0, 1).reshape(B, layer.num_heads, D)
    out.index_copy_(0, plan.token_idx, o.to(out.dtype))


def _prefill(layer: PagedAttention, q: torch.Tensor, out: torch.Tensor, k_blocks: torch.Tensor,
             v_blocks: torch.Tensor, batch: StepBatch, plan: PrefillPlan) -> None:
    i = plan.row
    start, end = batch.query_start_loc_list[i], batch.query_start_loc_list[i + 1]
    seq_len, Hkv, D = batch.seq_lens_list[i], layer.num_kv_heads, layer.head_dim
    # On a CPU in float32 whatever the activations: torch's CPU flash attention ran 1.5-1.6x as fast in
    # float32 as in bfloat16 (Intel Xeon with AVX-512 BF16, and with AVX2; benchmarks/README.md, session 37).
    dtype = torch.float32 if q.device.type == "cpu" else q.dtype
    k = _gather(k_blocks, plan.gather_idx, layer.k_scale, dtype)
    v = _gather(v_blocks, plan.gather_idx, layer.v_scale, dtype)
    k = k.view(1, Hkv, -1, D)[:, :, :seq_len]  # [1, Hkv, S, D]
    v = v.view(1, Hkv, -1, D)[:, :, :seq_len]
    qi = q[start:end].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, H, q_len, D]
    if plan.mask is None:
        o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=layer.scale, enable_gqa=True)
    else:
        o = F.scaled_dot_product_attention(qi, k, v, attn_mask=plan.mask, scale=layer.scale, enable_gqa=True)
    out[start:end] = o[0].transpose(0, 1).to(out.dtype)
