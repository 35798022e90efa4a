"""bfloat16 float weights on AMX tiles (kvserve/kernels/cpu/dense_linear_amx.cpp): sums within float32 rounding of a
float64 reference, every row its own bits whatever the other rows of its call, and in the engine the layers that
fit take it while their embedding rows still read back exactly. Runs where the CPU has AMX-BF16 (Intel Sapphire
Rapids and later); elsewhere test_cpu_isa.py checks that asking for it falls back."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.quantization.methods import FloatMethod, amx_pack, amx_rows
from paged_helpers import native_ops

needs_amx = pytest.mark.skipif(not cpu_kernels.cpu_supports("amx"), reason="this CPU has no AMX-BF16")


def test_packing_keeps_every_weight_where_its_rows_read_it() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 96, generator=g).to(torch.bfloat16)
    packed = amx_pack(w)
    assert packed.shape == (3, 3, 16, 16, 2)
    assert torch.equal(packed[1, 2, 5, 7], w[16 + 7, 64 + 10:64 + 12])  # tile 1, k-step 2, pair 5, row 7
    ids = torch.tensor([[0, 47, 16], [5, 5, 31]])
    assert torch.equal(amx_rows(packed, ids), w[ids])


@needs_amx
@pytest.mark.parametrize("N, K", [(960, 576), (576, 1536), (16, 32), (96, 64), (112, 576)])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_matches_float64(N: int, K: int, out_dtype: torch.dtype | None) -> None:
    """Shapes: groups of four weight tiles, and last groups of one to three (96 = 4 + 2 tiles, 112 = 4 + 3)."""
    ops = native_ops("avx512")
    assert ops.amx_bf16_ready()
    g = torch.Generator().manual_seed(N * K)
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    x = torch.randn(3, 11, K, generator=g).to(torch.bfloat16)  # 33 rows: two passes of 16, then one
    y = ops.dense_linear_amx(x, amx_pack(w), out_dtype)
    assert y.shape == (3, 11, N) and y.dtype == (out_dtype or torch.bfloat16)
    want = x.double() @ w.double().T  # the products of bfloat16 values are exact in float32
    tol = 2e-6 if out_dtype == torch.float32 else 8e-3
    assert ((y.double() - want).abs() / want.abs().amax()).max() < tol


@needs_amx
@pytest.mark.parametrize("K", [576, 1536])
def test_each_row_gets_its_own_bits_whatever_the_other_rows(K: int) -> None:
    """Row r of one 70-row call (passes of 16 rows and a last one of 6) equals row r alone and in calls of 2, 3,
    5, 9 and 17 rows: a verification step's rows round as decode rows do."""
    ops = native_ops("avx512")
    g = torch.Generator().manual_seed(K)
    packed = amx_pack(torch.randn(208, K, generator=g).to(torch.bfloat16))  # 13 tiles: 3 groups of 4, and 1
    x = torch.randn(70, K, generator=g).to(torch.bfloat16)
    full = ops.dense_linear_amx(x, packed, torch.float32)
    assert torch.equal(torch.cat([ops.dense_linear_amx(x[i:i + 1], packed, torch.float32) for i in range(70)]), full)
    for size in (2, 3, 5, 9, 17):
        parts = [ops.dense_linear_amx(x[i:i + size], packed, torch.float32) for i in range(0, 70, size)]
        assert torch.equal(torch.cat(parts), full), size
    assert torch.equal(ops.dense_linear_amx(x, packed), full.to(torch.bfloat16))  # bf16 out: the sums rounded once


@needs_amx
def test_refuses_what_it_cannot_take() -> None:
    ops = native_ops("avx512")
    packed = amx_pack(torch.zeros(16, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="in_features 64"):
        ops.dense_linear_amx(torch.zeros(2, 32, dtype=torch.bfloat16), packed)
    with pytest.raises(RuntimeError, match="bfloat16 activations"):
        ops.dense_linear_amx(torch.zeros(2, 64), packed)
    with pytest.raises(RuntimeError, match="packed"):
        ops.dense_linear_amx(torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(16, 64, dtype=torch.bfloat16))
    assert ops.dense_linear_amx(torch.zeros(0, 64, dtype=torch.bfloat16), packed).shape == (0, 16)


@needs_amx
def test_float_layers_take_it_in_the_engine() -> None:
    """The default model unquantized in bfloat16: every linear layer fits AMX's tiles (576, 1536, 49152 are
    multiples of 16 and 32), keeps only its packed weight, and the tied embedding reads its rows from it."""
    if cpu_kernels.requested_isa() not in ("auto", "amx"):
        pytest.skip(f"KVSERVE_CPU_ISA={cpu_kernels.requested_isa()} turns AMX off in this process")
    from kvserve import LLM, SamplingParams

    llm = LLM(quantization="none", dtype="bfloat16")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(getattr(m, "method", None), FloatMethod)]
    assert layers and all(m.amx_weight is not None and m.weight is None for m in layers)
    embed = model.embed_tokens
    ids = torch.tensor([0, 1, 12345, 49151])
    rows = embed.embed(ids)
    assert rows.shape == (4, 576) and rows.dtype == torch.bfloat16
    assert torch.equal(rows, amx_rows(embed.amx_weight, ids))
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
