"""The GPU's elementwise kernels (kvserve/kernels/cuda) against the torch paths they replace in
kvserve/layers: fused residual add + RMSNorm, per-head RMSNorm on strided views, rotary in place on a view
of the fused qkv projection, SiLU-and-mul. On CUDA where present, else under Triton's interpreter.

float32 agrees to rounding. In bfloat16 the two may differ by a unit or two in the last place where each
rounds: the interpreter's float-to-bf16 cast truncates (a GPU's rounds to nearest), and the sums of
squares add in a different order."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triton_helpers import triton_device

DEVICE = triton_device()

from kvserve.kernels.cuda import elementwise as ew  # noqa: E402
from kvserve.layers.rotary import RotaryEmbedding, _apply  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    else:  # a few units in the last place of bf16's 8-bit mantissa: the norm rounds twice
        torch.testing.assert_close(got.float(), want.float(), atol=1e-6, rtol=2 ** -5)


def randn(*shape, dtype) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float32).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 96, 1000])
def test_triton_fused_add_rms_norm(dtype, n) -> None:
    torch.manual_seed(n)
    x, r = randn(7, n, dtype=dtype), randn(7, n, dtype=dtype)
    w = (torch.rand(n) + 0.5).to(DEVICE, dtype)
    s = x + r
    want = w * F.rms_norm(s.float(), (n,), None, 1e-6).to(dtype)
    ew.fused_add_rms_norm_(x, r, w, 1e-6)
    close(r, s)
    close(x, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_rms_norm_of_heads_in_a_strided_view(dtype) -> None:
    """Qwen3's per-head q/k norms read q and k as views of the fused qkv output."""
    torch.manual_seed(1)
    T, H, Hkv, D = 5, 6, 2, 24
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype)
    w = (torch.rand(D) + 0.5).to(DEVICE, dtype)
    for view in (qkv[:, :H * D].view(T, H, D), qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)):
        want = w * F.rms_norm(view.float(), (D,), None, 1e-6).to(dtype)
        got = ew.rms_norm(view, w, 1e-6)
        assert got.is_contiguous() and got.shape == view.shape
        close(got, want)
    x = randn(3, 80, dtype=dtype)  # and plain rows
    close(ew.rms_norm(x, w.new_ones(80), 1e-5), F.rms_norm(x.float(), (80,), None, 1e-5).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [24, 64, 128])
def test_triton_rotary_in_place_on_qk_view(dtype, head_dim) -> None:
    torch.manual_seed(head_dim)
    T, H, Hkv = 6, 4, 2
    rot = RotaryEmbedding(head_dim, 512, 10000.0)
    rot.reset_table(DEVICE)
    positions = torch.tensor([0, 1, 7, 100, 300, 511], device=DEVICE)
    qkv = randn(T, (H + 2 * Hkv) * head_dim, dtype=dtype)
    before = qkv.clone()
    qk = qkv[:, :(H + Hkv) * head_dim].view(T, H + Hkv, head_dim)
    cos, sin = rot.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    want = _apply(qk.clone(), cos, sin)
    ew.rotary_(qk, positions, rot.cos_sin)
    close(qk, want)
    assert torch.equal(qkv[:, (H + Hkv) * head_dim:], before[:, (H + Hkv) * head_dim:])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [48, 1500, 3072])
def test_triton_silu_and_mul(dtype, inter) -> None:
    torch.manual_seed(inter)
    x = randn(3, 2 * inter, dtype=dtype)
    gate, up = x.chunk(2, dim=-1)
    close(ew.silu_and_mul(x), F.silu(gate) * up)


def test_triton_elementwise_kernels_take_empty_batches() -> None:
    x = randn(0, 64, dtype=torch.float32)
    w = torch.ones(64, device=DEVICE)
    ew.fused_add_rms_norm_(x, x.clone(), w, 1e-6)
    assert ew.rms_norm(x, w, 1e-6).shape == (0, 64)
    assert ew.silu_and_mul(x).shape == (0, 32)
