"""The CPU argmax kernel (kvserve/kernels/cpu/argmax.cpp) against torch.argmax(x, -1): the first of equal
maxima (ties across vector lanes and in the tail), rows of -inf, +inf, NaN anywhere (torch returns the first
NaN), widths that leave tails of 0 to 7 values after whole turns of the kernel's chains or after vectors
taken by one chain, rows that sit apart in memory, and the sampler's use of it
(greedy and sampled rows give what they gave with torch's argmax). Then the sampler's race kernel
(race_sample_rows) against torch's softmax / -log(U) / argmax, and its draws against the distribution.
Every kernel test runs once per ISA variant this CPU can run (the others skip)."""
from __future__ import annotations

import pytest
import torch

from kvserve.kernels.cpu import ISAS
from kvserve.sampling import logits_processors
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
    monkeypatch.setattr(sampler_module, "race_applies", lambda x: False)  # torch's softmax, -log U, argmax
    monkeypatch.setattr(logits_processors, "stage_kernels_apply", lambda x: False)  # and top_k's, top_p's sorts
    assert got == sample()
    assert [got[i] for i in (0, 2, 4)] == [logits[i].argmax().item() for i in (0, 2, 4)]


def torch_race(x: torch.Tensor, inv_temp: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The sampler's draw as torch computes it: argmax(softmax(x * inv_temp) / -log(u))."""
    return ((x * inv_temp[:, None]).softmax(-1) / -u.log()).argmax(-1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("V", [1, 5, 17, 2047, 2048, 2049, 49152])
def test_race_sample_rows_draws_what_torch_draws(isa: str, V: int) -> None:
    """The race kernel against torch's softmax / -log(U) / argmax on the same uniforms: random rows at several
    temperatures, rows masked to a few tokens by -inf, a zero uniform at the likeliest token (infinite noise:
    it loses), and widths around the kernel's 2048-value chunks. Rows of NaN or all -inf give 0, as torch's
    argmax of their NaN probabilities does."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(V)
    x = torch.randn(10, V, generator=g) * 4
    u = torch.rand(10, V, generator=g)
    inv_temp = torch.tensor([1.0, 1 / 0.7, 1 / 0.3, 1 / 1.5, 1.0, 1.0, 1.0, 1 / 0.9, 1.0, 2.0])
    if V > 3:
        x[4, 3:] = -INF                                   # top-k's mask: three tokens left
        x[5, ::2] = -INF
        u[6, x[6].argmax()] = 0.0                         # the likeliest token draws infinite noise
        x[7, V // 2] = 40.0                               # one token far ahead: nearly always it
    got = ops.race_sample_rows(x, inv_temp, u)
    assert torch.equal(got, torch_race(x, inv_temp, u))
    if V > 3:
        assert got[4].item() < 3 and got[5].item() % 2 == 1
    bad = x[:2].clone()
    bad[0, V // 2] = NAN
    bad[1, :] = -INF
    assert ops.race_sample_rows(bad, inv_temp[:2], u[:2]).tolist() == [0, 0]


@pytest.mark.parametrize("isa", ISAS)
def test_race_sample_rows_draws_from_the_tempered_softmax(isa: str) -> None:
    """Chi-square of 40,000 draws (fresh uniforms each) from a 6-token row at temperature 0.5 against
    softmax(x / 0.5); a masked seventh token is never drawn. Fixed seed: the statistic is 5.9 here; the
    test fails above 22.5 (p = 0.001 with 5 degrees of freedom)."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(0)
    x = torch.tensor([[1.0, 0.5, 0.0, -0.5, -1.0, 0.2, -INF]])
    n = 40_000
    rows = x.expand(n, -1).contiguous()
    got = ops.race_sample_rows(rows, torch.full((n,), 2.0), torch.rand(n, 7, generator=g))
    counts = torch.bincount(got, minlength=7).double()
    assert counts[6] == 0
    expected = (x[0, :6] * 2).softmax(-1).double() * n
    chi2 = ((counts[:6] - expected) ** 2 / expected).sum().item()
    assert chi2 < 22.5, (chi2, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("isa", ISAS)
def test_race_sample_rows_refuses_what_it_cannot_take(isa: str) -> None:
    ops = native_ops(isa)
    x, u, t = torch.zeros(2, 8), torch.rand(2, 8), torch.ones(2)
    with pytest.raises(RuntimeError, match="float32"):
        ops.race_sample_rows(x.bfloat16(), t, u)
    with pytest.raises(RuntimeError, match="uniform"):
        ops.race_sample_rows(x, t, u[:, :4])
    with pytest.raises(RuntimeError, match="inv_temp"):
        ops.race_sample_rows(x, torch.tensor([1.0, 0.0]), u)
    with pytest.raises(RuntimeError, match="inv_temp"):
        ops.race_sample_rows(x, torch.ones(3), u)


def torch_top_p(logits: torch.Tensor, top_p: torch.Tensor, rows: list[int], monkeypatch: pytest.MonkeyPatch):
    """apply_top_p with the kernels turned off: its topk and sort path."""
    out = logits.clone()
    with monkeypatch.context() as m:
        m.setattr(logits_processors, "stage_kernels_apply", lambda t: False)
        logits_processors.apply_top_p(out, top_p, rows=rows)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("V", [1, 17, 1000, 49152])
def test_top_p_mask_cuts_where_the_sort_cuts(isa: str, V: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The top-p kernel against apply_top_p's torch path, bit for bit, on the same probabilities: peaked rows
    (closed by the first cut), flat ones (down to sorting every value), a row of exact boundary masses
    (0.5, 0.3, 0.2 at top_p 0.8), ties at the threshold, rows left alone; then NaN and all -inf rows."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(V)
    x = torch.cat([torch.randn(4, V, generator=g) * 8, torch.randn(4, V, generator=g) * 0.5,
                   torch.randn(4, V, generator=g) * 3])
    if V >= 17:
        x[8, :] = -INF
        x[8, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
        x[9, 5:9] = x[9].max() + 1                     # four tied likeliest tokens
    for top_p in (0.05, 0.5, 0.8, 0.9, 0.95, 0.999):
        p = torch.full((x.shape[0],), top_p)
        rows = [r for r in range(x.shape[0]) if r != 1]   # row 1 is left alone
        want = torch_top_p(x, p, rows, monkeypatch)
        got = x.clone()
        ops.top_p_mask_(got, torch.softmax(got, dim=-1), p, rows)
        assert torch.equal(got, want), top_p
        assert torch.equal(got[1], x[1])
        if V >= 17 and top_p == 0.8:  # the mass before 0.2 is 0.8, not < 0.8: 0.5 and 0.3 stay
            assert torch.isfinite(got[8]).sum() == 2
        if V >= 17:
            assert torch.isfinite(got[9]).sum() >= 4      # ties with the last kept token stay
    # A row with a NaN, and one all -inf (softmax gives NaN): both paths mask nothing (torch's path raised on
    # them before: its count of kept tokens was 0).
    bad = x[:2].clone()
    bad[0, V // 2] = NAN
    bad[1, :] = -INF
    out = bad.clone()
    ops.top_p_mask_(out, torch.softmax(out, dim=-1), torch.full((2,), 0.9), [0, 1])
    assert torch.equal(out.nan_to_num(7.0), bad.nan_to_num(7.0))
    out = torch_top_p(bad, torch.full((2,), 0.9), [0, 1], monkeypatch)
    assert torch.equal(out.nan_to_num(7.0), bad.nan_to_num(7.0))


@pytest.mark.parametrize("isa", ISAS)
def test_top_p_mask_refuses_what_it_cannot_take(isa: str) -> None:
    ops = native_ops(isa)
    x = torch.zeros(2, 8)
    probs = torch.softmax(x, -1)
    with pytest.raises(RuntimeError, match="float32"):
        ops.top_p_mask_(x.double(), probs, torch.ones(2), [0])
    with pytest.raises(RuntimeError, match="out of range"):
        ops.top_p_mask_(x, probs, torch.full((2,), 0.5), [2])
    with pytest.raises(RuntimeError, match=r"\(0, 1\]"):
        ops.top_p_mask_(x, probs, torch.zeros(2), [0])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("V", [1, 17, 1000, 49152])
def test_top_k_mask_keeps_what_topk_keeps(isa: str, V: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The top-k kernel against apply_top_k's torch path (topk), bit for bit: peaked and flat rows, k from 1 to
    past the vocabulary, 0 (the row left alone), ties at the k-th value (all kept), rows with -inf (top-p or a
    ban before), all -inf; a NaN row is left alone."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(V)
    x = torch.cat([torch.randn(3, V, generator=g) * 8, torch.randn(3, V, generator=g) * 0.3])
    if V >= 17:
        x[1, 2:12] = x[1].max() + 1                   # ten tied likeliest tokens
        x[2, ::3] = -INF
        x[5, :] = -INF
        x[5, 4] = 0.0
    for ks in ([1] * 6, [5, 0, 3, 50, 7, 2], [V, V + 10, 49, 500, 1, 3]):
        k = torch.tensor(ks)
        want = x.clone()
        with monkeypatch.context() as m:
            m.setattr(logits_processors, "stage_kernels_apply", lambda t: False)
            logits_processors.apply_top_k(want, k, max_k=max(ks))
        got = x.clone()
        ops.top_k_mask_(got, k)
        assert torch.equal(got, want), ks
    if V >= 17:  # k = 3 inside ten ties keeps all ten
        got = x.clone()
        ops.top_k_mask_(got, torch.tensor([0, 3, 0, 0, 0, 0]))
        assert torch.isfinite(got[1]).sum() == 10
    bad = x[:1].clone()
    bad[0, V // 2] = NAN
    out = bad.clone()
    ops.top_k_mask_(out, torch.tensor([5]))
    assert torch.equal(out.nan_to_num(7.0), bad.nan_to_num(7.0))
    with pytest.raises(RuntimeError, match=">= 0"):
        ops.top_k_mask_(x.clone(), torch.full((x.shape[0],), -1))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("V", [5, 1000, 49152])
def test_penalties_kernel_equals_the_count_tensors(isa: str, V: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """apply_penalties in the kernel (each row's own tokens) against its torch path (count tensors over the
    vocabulary), bit for bit: repetition alone, presence and frequency alone, all three; tokens repeated in the
    prompt and the output, ids past the vocabulary (ignored), empty prompts and outputs, negative, -inf and
    NaN logits at penalised tokens, a row with neutral parameters."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(V)
    x = torch.randn(5, V, generator=g) * 4
    x[0, 0], x[0, 1], x[1, 2] = -INF, NAN, 0.0
    prompts = [[0, 1, 2, 2, 3, V + 7], [], [1] * 50 + list(range(min(V, 300))), [4 % V, 4 % V], [2]]
    outputs = [[1, 1, 2, V + 2], [2, 3, 3, 3], [], [0, 0, 0, 0, 0, 1], [3, 3]]
    rep = torch.tensor([1.3, 1.1, 0.8, 1.0, 1.2])
    pres = torch.tensor([0.5, 0.0, -0.25, 0.3, 0.0])
    freq = torch.tensor([0.2, 0.7, 0.1, 0.0, 0.0])
    for use_repetition, use_counts in ((True, False), (False, True), (True, True)):
        want = x.clone()
        with monkeypatch.context() as m:
            m.setattr(logits_processors, "stage_kernels_apply", lambda t: False)
            logits_processors.apply_penalties(want, prompts, outputs, rep, pres, freq, use_repetition, use_counts)
        got = x.clone()
        with monkeypatch.context() as m:
            m.setattr(logits_processors.cpu_kernels, "ops", lambda: ops)  # this ISA's variant
            logits_processors.apply_penalties(got, prompts, outputs, rep, pres, freq, use_repetition, use_counts)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), (use_repetition, use_counts)
        assert not torch.equal(got, x) or not use_repetition
    with pytest.raises(RuntimeError, match="offsets"):
        ops.apply_penalties_(x[:1].clone(), torch.tensor([1]), torch.tensor([0, 2]), torch.tensor([1]),
                             torch.tensor([0, 1]), rep[:1], pres[:1], freq[:1], True, True)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("V", [1, 17, 49152])
def test_min_p_mask_cuts_where_the_torch_path_cuts(isa: str, V: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The min-p kernel against apply_min_p's torch path, bit for bit: peaked and flat rows, min_p from 0 to 1
    (1 keeps the likeliest and its ties), a token exactly at the threshold (kept), rows with -inf; a NaN row and
    an all -inf row are left alone."""
    ops = native_ops(isa)
    g = torch.Generator().manual_seed(V)
    x = torch.cat([torch.randn(3, V, generator=g) * 6, torch.randn(3, V, generator=g) * 0.3])
    if V >= 17:
        x[1, :4] = torch.tensor([0.5, 0.25, 0.125, 0.125]).log()  # 0.25 is exactly half the likeliest
        x[1, 4:] = -INF
        x[2, 3:9] = x[2].max() + 2                      # six tied likeliest tokens
        x[4, ::2] = -INF
    for mp in (0.0, 0.05, 0.5, 0.9, 1.0):
        p = torch.full((x.shape[0],), mp)
        want = x.clone()
        with monkeypatch.context() as m:
            m.setattr(logits_processors, "stage_kernels_apply", lambda t: False)
            logits_processors.apply_min_p(want, p)
        got = x.clone()
        ops.min_p_mask_(got, torch.softmax(got, dim=-1), p)
        assert torch.equal(got, want), mp
        if V >= 17 and mp == 0.5:
            assert torch.isfinite(got[1]).sum() == 2 and torch.isfinite(got[2]).sum() >= 6
    bad = x[:2].clone()
    bad[0, V // 2] = NAN
    bad[1, :] = -INF
    out = bad.clone()
    ops.min_p_mask_(out, torch.softmax(out, dim=-1), torch.full((2,), 0.1))
    assert torch.equal(out.nan_to_num(7.0), bad.nan_to_num(7.0))
