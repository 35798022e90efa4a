"""The dense linear kernel for float weights (kvserve/kernels/cpu/dense_linear.cpp): x @ W^T against float64,
for float32 and bfloat16 weights and activations, widths that leave tails of K; every row's bits the same
alone, in a verification step's few rows, in a prompt chunk's many (across the kernel's panels), or as a
strided view; the same bits from the AVX-512 and AVX2 variants; and float layers on it in the engine. Every
kernel test runs once per ISA variant this CPU can run (the others skip)."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import ISAS
from kvserve.layers.quantization.methods import FloatMethod
from paged_helpers import native_ops

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("x_dtype", DTYPES)
@pytest.mark.parametrize("N, K", [(960, 576), (576, 1536), (37, 23), (5, 7), (19, 300), (64, 16)])
def test_matches_float64(isa: str, w_dtype: torch.dtype, x_dtype: torch.dtype, N: int, K: int) -> None:
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g).to(w_dtype)
    x = torch.randn(2, 7, K, generator=g).to(x_dtype)
    y = ops.dense_linear(x, w)
    assert y.shape == (2, 7, N) and y.dtype == x_dtype
    want = x.double() @ w.double().T
    # float32 sums of K products: a few ulps of the largest; bfloat16 output: its rounding (2^-8 relative).
    tol = 2e-6 if x_dtype == torch.float32 else 8e-3
    assert ((y.double() - want).abs() / want.abs().amax()).max() < tol


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("w_dtype", DTYPES)
@pytest.mark.parametrize("K", [576, 1536, 100])
def test_each_row_gets_its_own_bits_whatever_the_other_rows(isa: str, w_dtype: torch.dtype, K: int) -> None:
    """Row r of one 150-row call (several of the kernel's panels, tiles of 4 and their remainders) equals row r
    computed alone, in calls of 2, 3, 5 and 9 rows (verification steps), and read through a strided view."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(K)
    w = torch.randn(200, K, generator=g).to(w_dtype)
    wide = torch.randn(150, K + 8, generator=g).to(w_dtype)
    x = wide[:, 3:3 + K]  # rows apart in memory
    full = ops.dense_linear(x.contiguous(), w)
    assert torch.equal(ops.dense_linear(x, w), full)
    assert torch.equal(ops.dense_linear(x.t().contiguous().t(), w), full)  # a permuted view, dense in memory
    alone = torch.cat([ops.dense_linear(x[i:i + 1], w) for i in range(len(x))])
    assert torch.equal(alone, full)
    for size in (2, 3, 5, 9):
        assert torch.equal(torch.cat([ops.dense_linear(x[i:i + size], w) for i in range(0, len(x), size)]), full)


def test_avx512_and_avx2_give_the_same_bits() -> None:
    """Both variants sum each output's products in the same order (AVX2 takes each block's lanes 0-7, then
    8-15, in two passes), so a model's outputs do not depend on which of them a machine runs."""
    wide, narrow = native_ops("avx512"), native_ops("avx2")
    g = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for M, N, K in ((1, 300, 576), (5, 96, 1536), (70, 33, 100)):
            w, x = torch.randn(N, K, generator=g).to(dtype), torch.randn(M, K, generator=g).to(dtype)
            assert torch.equal(wide.dense_linear(x, w), narrow.dense_linear(x, w))


@pytest.mark.parametrize("isa", ISAS)
def test_float32_output_is_the_sum_before_its_rounding(isa: str) -> None:
    """out_dtype float32 (an LM head's logits) gives the float32 sums that a bfloat16 output rounds once."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(300, 576, generator=g).to(torch.bfloat16), torch.randn(9, 576, generator=g).to(torch.bfloat16)
    y32 = ops.dense_linear(x, w, torch.float32)
    assert y32.dtype == torch.float32 and not torch.equal(y32, y32.to(torch.bfloat16).float())
    assert torch.equal(y32.to(torch.bfloat16), ops.dense_linear(x, w))
    assert torch.equal(ops.dense_linear(x.float(), w, torch.bfloat16), ops.dense_linear(x, w))


@pytest.mark.parametrize("isa", ISAS)
def test_refuses_what_it_cannot_take(isa: str) -> None:
    ops = native_ops(isa)
    with pytest.raises(RuntimeError, match="does not match in_features"):
        ops.dense_linear(torch.zeros(2, 8), torch.zeros(4, 16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.dense_linear(torch.zeros(2, 8, dtype=torch.float16), torch.zeros(4, 8, dtype=torch.float16))
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.dense_linear(torch.zeros(2, 8), torch.zeros(8, 4).t())
    with pytest.raises(RuntimeError, match="float32 or bfloat16 output"):
        ops.dense_linear(torch.zeros(2, 8), torch.zeros(4, 8), torch.float16)
    assert ops.dense_linear(torch.zeros(0, 8), torch.zeros(4, 8)).shape == (0, 4)


def test_float_layers_run_on_it_in_the_engine() -> None:
    """An unquantized model's linear layers (the default model with --quantization none) take the kernel on a CPU
    that has it, and keep no oneDNN copy of their weights."""
    from kvserve import LLM
    from kvserve.kernels import cpu as cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("no CPU kernels built here")
    model = LLM(quantization="none", dtype="bfloat16").engine.runner.model
    methods = [m.method for m in model.modules() if isinstance(getattr(m, "method", None), FloatMethod)]
    assert methods and all(m.use_kernel for m in methods)
    assert all(getattr(m, "packed_weight", None) is None for m in model.modules())

