"""The KV-cache write: each new token's K and V, all heads at once, into its slot of the block-major cache
[num_blocks, block_size, Hkv, D] (one token's heads are one contiguous run there, as they are in k and v)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.attention.backend import FP8_MAX as _FP8_MAX

# A global a compiled kernel reads must be a constexpr (the interpreter reads any global).
FP8_MAX = tl.constexpr(_FP8_MAX)


@triton.jit
def _round_to_e4m3(x):
    """x (float32, within +-448) rounded to nearest-even on e4m3's grid, so that the cast after it is exact.
    Only for Triton's interpreter, whose float8 cast drops the carry when rounding up crosses a power of two
    (1.96 -> 1.0); a GPU's cast rounds correctly by itself."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF                # normals: keep 3 mantissa bits
    normal = bits.to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0                                     # below 2**-6: multiples of 2**-9
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,  # the caches' strides: block, token in block, head (dim: 1)
    k_scale, v_scale,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr, ROUND_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    # slot < 0: a padding row (a captured graph's batch is larger than the step's), nothing to write.
    # (slot broadcast over the tile first: the interpreter rejects a scalar bool in a tensor mask)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (h[:, None] * 0 + slot >= 0)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if FP8:  # the cache holds x / scale, saturated to e4m3's range
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
        if ROUND_FP8:
            k = _round_to_e4m3(k)
            v = _round_to_e4m3(v)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [T, Hkv, D] (any token and head stride, dim contiguous); caches [NB, bs, Hkv, D]."""
    T, Hkv, D = k.shape
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale, v_scale,
        NUM_KV_HEADS=Hkv, HEAD_DIM=D, H_PAD=triton.next_power_of_2(Hkv), D_PAD=triton.next_power_of_2(D),
        BLOCK_SIZE=k_cache.shape[1], FP8=k_cache.dtype == torch.float8_e4m3fn, ROUND_FP8=k.device.type == "cpu",
    )
