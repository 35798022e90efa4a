"""Float linears packed for oneDNN (bf16 on CPU, where kvserve's dense kernel is not built) compute what F.linear
computes. Where the kernel runs, float layers take it and pack nothing (tests/test_cpu_dense_linear.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.linear import ColumnLinear, VocabEmbedding, pack_float_weights
from kvserve.layers.quantization import FloatMethod
from kvserve.layers.quantization.methods import can_pack

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(0, dtype=torch.bfloat16)),
                                reason="no oneDNN bf16 on this CPU")

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def without_the_dense_kernel(monkeypatch):
    """The path of a CPU without kvserve's kernels (or KVSERVE_CPU_ISA=none)."""
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)


def float_linear(w: torch.Tensor, cls=ColumnLinear):
    layer = cls(w.shape[1], w.shape[0], FloatMethod(w.dtype, CPU), "w")
    layer.weight_loader(0, w)
    layer.finalize()
    return layer


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(960, 576, generator=g).to(torch.bfloat16)
    layer = float_linear(w)
    assert pack_float_weights(layer) == 1 and layer.packed_weight is not None
    assert layer.weight is None  # the packed copy is the only one (both had been kept: twice the memory)
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    # Both accumulate in float32 and round to bf16 (values here are ~25 in size, so 1e-2 is below one bf16 step;
    # a wrongly laid-out weight would be off by the values themselves).
    torch.testing.assert_close(layer(x).float(), F.linear(x.float(), w.float()), atol=1e-2, rtol=2 ** -7)


def test_tied_embedding_packs_its_head_and_still_embeds_from_the_plain_weight() -> None:
    w = torch.randn(100, 32).to(torch.bfloat16)
    emb = float_linear(w, VocabEmbedding)
    f32 = float_linear(torch.randn(32, 32))
    ids = torch.tensor([3, 17, 99])
    want = F.linear(w[ids].float(), w.float())
    assert pack_float_weights(emb) == 1 and pack_float_weights(f32) == 0
    torch.testing.assert_close(emb.embed(ids), w[ids])
    torch.testing.assert_close(emb(emb.embed(ids)).float(), want, atol=1e-1, rtol=2 ** -7)
