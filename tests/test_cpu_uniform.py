"""The CPU kernels' uniforms (kvserve/kernels/cpu/uniform.cpp) against torch.rand: the same floats from the
same generator, and the generator left where torch.rand leaves it, from every point of the Mersenne
Twister's 624-word cycle. Every kernel test runs once per ISA variant this CPU can run (the others skip)."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import ISAS
from kvserve.sampling.sampler import Sampler, fill_uniform_
from paged_helpers import native_ops


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("seed", [0, 2**40 + 3])
@pytest.mark.parametrize("drawn_before", [0, 1, 623, 624, 1000])
@pytest.mark.parametrize("n", [1, 9, 624, 625, 1249, 49152])
def test_uniforms_equal_torch_rand(isa, seed, drawn_before, n):
    ops = native_ops(isa)
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for g in (ours, theirs):
        torch.rand(drawn_before, generator=g)
    out = torch.full((n,), -1.0)
    ops.mt19937_uniform_(out, ours)
    assert torch.equal(out, torch.rand(n, generator=theirs))
    assert torch.equal(ours.get_state(), theirs.get_state())
    # Either generator goes on with the same stream, through torch or the kernel.
    assert torch.equal(torch.rand(700, generator=ours), torch.rand(700, generator=theirs))


@pytest.mark.parametrize("isa", ISAS)
def test_default_generator_and_rows(isa):
    ops = native_ops(isa)
    torch.manual_seed(11)
    expected = torch.rand(3, 1000)
    torch.manual_seed(11)
    got = torch.empty(3, 1000)
    ops.mt19937_uniform_(got, None)
    assert torch.equal(got, expected)
    torch.manual_seed(11)
    torch.rand(3, 1000)
    state = torch.get_rng_state()
    torch.manual_seed(11)
    ops.mt19937_uniform_(torch.empty(3000), None)
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("isa", ISAS)
def test_bad_tensors_are_refused(isa):
    ops = native_ops(isa)
    for bad in (torch.empty(4, dtype=torch.float64), torch.empty(4, 2).t(), torch.empty(4, dtype=torch.bfloat16)):
        with pytest.raises(RuntimeError, match="contiguous float32"):
            ops.mt19937_uniform_(bad, None)


@pytest.mark.parametrize("kernels", [True, False])
def test_the_samplers_draws_are_torch_rands(kernels, monkeypatch):
    """What the sampler calls, with the kernels or without: torch.rand's numbers, seeded and unseeded."""
    from kvserve.kernels import cpu as cpu_kernels

    if kernels and not cpu_kernels.available():
        pytest.skip("no CPU kernels here")
    if not kernels:
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(Sampler.draw_uniform(g1, 49152, torch.device("cpu"), torch.float32),
                       torch.rand(49152, generator=g2))
    torch.manual_seed(9)
    a = fill_uniform_(torch.empty(2, 300), None)
    torch.manual_seed(9)
    assert torch.equal(a, torch.rand(2, 300))
    rows = torch.empty(3, 300)
    g1.manual_seed(6)
    g2.manual_seed(6)
    fill_uniform_(rows[1], g1)  # a row in place, as the sampler draws a seeded row
    assert torch.equal(rows[1], torch.rand(300, generator=g2))
