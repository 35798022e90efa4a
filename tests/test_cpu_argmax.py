"""The CPU argmax kernel (kvserve/kernels/cpu/argmax.cpp) against torch.argmax(x, -1): the first of equal
maxima (ties across vector lanes and in the tail), rows of -inf, +inf, NaN anywhere (torch returns the first
NaN), widths that leave tails of 0 to 7 values after whole turns of the kernel's chains or after vectors
taken by one chain, rows that sit apart in memory, and the sampler's use of it
(greedy and sampled rows give what they gave with torch's argmax). Every kernel test runs once per ISA
variant this CPU can run (the others skip)."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import ISAS
from kvserve.sampling import sampler as sampler_module
from kvserve.sampling.sampler import Sampler, SamplingInputs, argmax
from kvserve.sampling_params import SamplingParams
from paged_helpers import native_ops

INF, NAN = float("inf"), float("nan")


def rows_with_edge_cases(V: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(12, V, generator=g)
    m = x.abs().max() + 1
    x[1, :] = -INF                                    # all -inf: index 0
    x[2, :] = 3.0                                     # all equal: index 0
    x[3, V // 2] = m
    x[3, V - 1] = m                                   # a tie: the first wins
    x[4, V - 1] = m                                   # the maximum in the tail
    x[5, 0] = NAN
    x[6, V - 1] = NAN                                 # NaN after the maximum: NaN wins
    x[7, V // 3] = NAN
    x[7, 2 * V // 3] = NAN                            # two NaN: the first
    x[8, V // 2] = INF
    x[9, :] = -INF
    x[9, V - 1] = -1e30                               # one finite value among -inf
    x[10, 1::8] = m                                   # ties in every vector's lane 1
    x[11, 7::8] = m                                   # ... and lane 7
    if V >= 64:  # the kernel's four chains take eight values each in turn: a tie between the last chain's
        x[0, 29] = x[0, 37] = m                       # lane and a later lane of the first chain
    return x


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("V", [1, 7, 8, 9, 10, 14, 15, 16, 17, 21, 31, 32, 33, 40, 63, 64, 71, 100, 49152, 262144 + 3])
def test_argmax_rows_matches_torch(isa: str, V: int) -> None:
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(V)
    x = rows_with_edge_cases(V, g) if V >= 9 else torch.randn(5, V, generator=g)
    assert torch.equal(ops.argmax_rows(x), x.argmax(-1))
    wide = torch.randn(x.shape[0], V + 5, generator=g)
    wide[:, :V] = x
    view = wide[:, :V]                                # rows apart in memory
    assert torch.equal(ops.argmax_rows(view), x.argmax(-1))
    assert ops.argmax_rows(x[:0]).shape == (0,)


@pytest.mark.parametrize("isa", ISAS)
def test_argmax_rows_refuses_what_it_cannot_take(isa: str) -> None:
    ops = native_ops(isa)
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(torch.zeros(2, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        ops.argmax_rows(torch.zeros(8, 2).t())
    with pytest.raises(RuntimeError, match="V in"):
        ops.argmax_rows(torch.zeros(2, 0))


def test_sampler_tokens_are_those_of_torch_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler's greedy rows and exponential-race draws with the helper as it runs here (the kernel
    where built) against the same sampler with torch.argmax, from the same seeds."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 49152, generator=g)
    assert torch.equal(argmax(logits), logits.argmax(-1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=5, top_k=50),
              SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=9, top_p=0.9)]

    def sample() -> list[int]:
        gens = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        return Sampler()(logits, SamplingInputs(params, gens, [[1]] * 6, [[]] * 6, [0])).token_ids

    got = sample()
    monkeypatch.setattr(sampler_module, "argmax", lambda x: x.argmax(dim=-1))
    assert got == sample()
    assert [got[i] for i in (0, 2, 4)] == [logits[i].argmax().item() for i in (0, 2, 4)]
