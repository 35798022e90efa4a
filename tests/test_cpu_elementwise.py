"""kvserve's fused CPU elementwise kernels (kvserve/kernels/cpu/elementwise.cpp) against transformers'
own modules for the same math: LlamaRMSNorm after a residual add, Gemma3RMSNorm (with and without the add,
on strided per-head views), apply_rotary_pos_emb, SiLU * up.
In bfloat16 the kernels round where transformers' code rounds, so nearly every element is bit-equal
and the rest differ by one rounding step; in float32 they agree to float32 precision. Every test runs once per ISA variant this CPU can run (the
others skip)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from kvserve.layers.rotary import RotaryEmbedding
from kvserve.kernels.cpu import ISAS
from paged_helpers import native_ops


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
        assert (got == want).float().mean() > 0.98  # same rounding points: almost all bit-equal
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 576), (37, 64), (5, 100), (3, 28)])  # 100, 28: tails of 4 and 12
def test_fused_add_rms_norm(isa, dtype, rows, n) -> None:
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(rows * n)
    x, residual = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(2))
    ref = LlamaRMSNorm(n, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, generator=g) * 0.3 + 1)
    want_residual = x + residual
    want = ref(want_residual)
    ops.fused_add_rms_norm_(x, residual, ref.weight.detach(), 1e-5)
    assert torch.equal(residual, want_residual)  # the add is one rounding either way
    assert_matches(x, want.detach())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 640), (9, 256), (5, 100)])  # Gemma 3 270M's hidden size and head dim
def test_gemma_rms_norm(isa, dtype, rows, n) -> None:
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(rows + n)
    ref = Gemma3RMSNorm(n, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(n, generator=g) * 0.3)  # the offset from a scale of 1
    w = ref.weight.detach()
    x, residual = (torch.randn(rows, n, generator=g).to(dtype) for _ in range(2))
    assert_matches(ops.gemma_rms_norm(x, None, w, 1e-6), ref(x).detach())
    want_residual = x + residual
    got = ops.gemma_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, want_residual)  # updated in place, one rounding
    assert_matches(got, ref(want_residual).detach())
    # Per-head norms read q and k as [T, H, n] views of the fused projection: strided tokens.
    qkv = torch.randn(3, 5 * n, generator=g).to(dtype)
    q = qkv[:, n:4 * n].view(3, 3, n)
    got = ops.gemma_rms_norm(q, None, w, 1e-6)
    assert got.is_contiguous() and got.shape == q.shape
    assert_matches(got, ref(q).detach())


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 16, 128])
def test_rotary_in_place_on_strided_heads(isa, dtype, D) -> None:
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(D)
    T, H, Hkv = 9, 6, 2
    # q and k as views into one fused projection output, as the model hands them over.
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype)
    q = qkv[:, : H * D].view(T, H, D)
    k = qkv[:, H * D : (H + Hkv) * D].view(T, Hkv, D)
    v_before = qkv[:, (H + Hkv) * D :].clone()
    positions = torch.tensor([0, 1, 2, 7, 100, 3, 4095, 5, 6])
    rotary = RotaryEmbedding(D, 4096, 10000.0)
    cos, sin = rotary.cos_sin[positions].chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]  # HF's [1, T, D] layout
    want_q, want_k = apply_rotary_pos_emb(q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], cos, sin)
    ops.rotary_(q, positions, rotary.cos_sin)
    ops.rotary_(k, positions, rotary.cos_sin)
    assert_matches(q, want_q[0].transpose(0, 1).to(dtype))
    assert_matches(k, want_k[0].transpose(0, 1).to(dtype))
    assert torch.equal(qkv[:, (H + Hkv) * D :], v_before)  # v untouched
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rotary_(q, torch.full((T,), 4096), rotary.cos_sin)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 1536), (33, 40), (2, 60)])
def test_silu_and_mul(isa, dtype, rows, n) -> None:
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(rows, 2 * n, generator=g) * 4).to(dtype)  # wide range: both tails of the sigmoid
    gate, up = x.chunk(2, dim=-1)
    assert_matches(ops.silu_and_mul(x), F.silu(gate) * up)
