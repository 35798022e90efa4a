"""The kernels behind kvserve.kernels.cuda (see there for why). Each op mirrors a torch path in
kvserve/layers, rounding where that path rounds:
- RMSNorm (Llama's): float32 normalisation, rounded to x's dtype, then times the weight in that dtype;
- the residual add: x + residual in x's dtype (rounded) before the norm;
- rotary: float32 rotation of each head's halves, rounded once;
- SiLU-and-mul: silu(gate) rounded, then times up, rounded."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _normed(x, eps, N: tl.constexpr):
    """x / rms(x) over the last dim of float32 rows (masked-out columns hold 0)."""
    ms = tl.sum(x * x, axis=1, keep_dims=True) / N
    return x * tl.rsqrt(ms + eps)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, stride_x, stride_r, eps, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)[None, :]
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(r_ptr.dtype.element_ty)
    tl.store(r_ptr + row * stride_r + cols, s, mask=mask)
    y = _normed(s.to(tl.float32), eps, N).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * stride_x + cols, (y * w).to(x_ptr.dtype.element_ty), mask=mask)


def fused_add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual <- x + residual; x <- RMSNorm(residual). Rows of [T, N], last dim contiguous."""
    N = x.shape[-1]
    x2, r2 = x.view(-1, N), residual.view(-1, N)
    assert x2.stride(1) == 1 and r2.stride(1) == 1 and weight.is_contiguous()
    if x2.shape[0]:
        _fused_add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, x2.stride(0), r2.stride(0), eps, N=N,
                                                   BLOCK=triton.next_power_of_2(N))


@triton.jit
def _rms_norm_kernel(x_ptr, out_ptr, w_ptr, stride_t, stride_h, eps, HEADS: tl.constexpr, H_PAD: tl.constexpr,
                     N: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (h < HEADS) & (cols < N)
    x = tl.load(x_ptr + t * stride_t + h * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normed(x, eps, N).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * HEADS + h) * N + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [T, N] or [T, heads, N] (any token and head stride: the per-head q/k
    norms read views of the fused qkv projection); returns a new contiguous tensor."""
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    T, H, N = x3.shape
    assert x3.stride(2) == 1 and weight.is_contiguous()
    out = torch.empty((T, H, N), dtype=x.dtype, device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x3, out, weight, x3.stride(0), x3.stride(1), eps, HEADS=H,
                               H_PAD=triton.next_power_of_2(H), N=N, BLOCK=triton.next_power_of_2(N))
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_sin_ptr, stride_t, stride_h, stride_p, HEADS: tl.constexpr,
                   H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)[:, None]
    j = tl.arange(0, HALF_PAD)[None, :]
    mask = (h < HEADS) & (j < HALF)
    cos = tl.load(cos_sin_ptr + pos * stride_p + j, mask=j < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * stride_p + HALF + j, mask=j < HALF, other=0.0)
    base = x_ptr + t * stride_t + h * stride_h + j
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """In place on x [T, heads, D] (dim contiguous, any token and head stride), rotate-half layout;
    cos_sin: [max_position, D] float32, cos in the first half, sin in the second."""
    T, H, D = x.shape
    assert x.stride(2) == 1 and cos_sin.stride(1) == 1 and D % 2 == 0
    if T:
        _rotary_kernel[(T,)](x, positions, cos_sin, x.stride(0), x.stride(1), cos_sin.stride(0), HEADS=H,
                             H_PAD=triton.next_power_of_2(H), HALF=D // 2, HALF_PAD=triton.next_power_of_2(D // 2))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, I: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_x + I + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * I + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    I = x.shape[-1] // 2
    x2 = x.view(-1, 2 * I)
    assert x2.stride(1) == 1
    out = torch.empty((x2.shape[0], I), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(I))
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(I, block))](x2, out, x2.stride(0), I=I, BLOCK=block)
    return out.view(*x.shape[:-1], I)
