"""Packed oneDNN linears (bf16 on CPU) compute what F.linear computes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvserve.layers.linear import PackedLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(0, dtype=torch.bfloat16)),
                                reason="no oneDNN bf16 on this CPU")


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(576, 960, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(960, 576, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(960, generator=g))
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    want = F.linear(x.float(), lin.weight.float(), None if lin.bias is None else lin.bias.float())
    got = PackedLinear(lin)(x).float()
    # Both accumulate in float32 and round to bf16 (values here are ~25 in size, so 1e-2 is below one bf16 step;
    # a wrongly laid-out weight would be off by the values themselves).
    torch.testing.assert_close(got, want, atol=1e-2, rtol=2 ** -7)
    torch.testing.assert_close(PackedLinear(lin)(x).float(), lin(x).float(), atol=1e-2, rtol=2 ** -7)


def test_pack_linears_swaps_only_bf16_cpu_linears_and_unties_copies() -> None:
    emb = nn.Embedding(100, 32).to(torch.bfloat16)
    model = nn.ModuleDict({"emb": emb, "head": nn.Linear(32, 100, bias=False).to(torch.bfloat16),
                           "f32": nn.Linear(32, 32)})
    model["head"].weight = emb.weight  # tied, as in LMs with tied embeddings
    ids = torch.tensor([3, 17, 99])
    want = model["head"](emb(ids))
    assert pack_linears(model) == 1
    assert isinstance(model["head"], PackedLinear) and isinstance(model["f32"], nn.Linear)
    torch.testing.assert_close(model["head"](emb(ids)).float(), want.float(), atol=1e-2, rtol=2 ** -7)
