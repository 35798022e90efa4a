"""The batched sampler against exact distributions computed independently in numpy (float64)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from kvserve.kernels import cpu as cpu_kernels
from kvserve.sampling import Sampler, SamplingInputs, compute_prompt_logprobs, make_generator
from kvserve.sampling.logits_processors import apply_top_p
from kvserve.sampling_params import SamplingParams

V = 12
EOS = [11]
N_DRAWS = 20_000
LOGITS = np.random.default_rng(0).normal(scale=1.2, size=V).astype(np.float32)
PROMPT = [0, 1, 1, 4]
OUTPUT = [1, 2, 2, 2, 5]


# ---- independent reference ----------------------------------------------------------------------

def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def reference_probs(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int],
                    eos: list[int] = EOS) -> np.ndarray:
    x = logits.astype(np.float64).copy()
    for tok, b in (p.logit_bias or {}).items():
        x[tok] += b
    if len(output) < p.min_tokens:
        for tok in p.stop_token_ids + ([] if p.ignore_eos else eos):
            x[tok] = -np.inf
    seen = set(prompt) | set(output)
    for tok in seen:
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    counts = np.bincount(np.array(output, dtype=np.int64), minlength=len(x)).astype(np.float64)
    x -= p.presence_penalty * (counts > 0) + p.frequency_penalty * counts
    if p.temperature == 0:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    probs = _softmax(x / p.temperature)
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    if p.top_k > 0:
        kth = np.sort(probs)[::-1][p.top_k - 1]
        probs = np.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
    if p.top_p < 1:
        probs = np.where(top_p_keep(probs, p.top_p), probs, 0.0)
        probs /= probs.sum()
    return probs


def top_p_keep(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The smallest most-likely set reaching top_p, plus any token tied with its least likely one."""
    desc = np.sort(probs)[::-1]
    n_keep = int(((np.cumsum(desc) - desc) < top_p).sum())
    return probs >= desc[n_keep - 1]


def _inputs(params: list[SamplingParams], prompt: list[int] = PROMPT, output: list[int] = OUTPUT,
            generators: list[torch.Generator | None] | None = None) -> SamplingInputs:
    n = len(params)
    return SamplingInputs(
        params=params,
        generators=generators if generators is not None else [None] * n,
        prompt_token_ids=[list(prompt) for _ in range(n)],
        output_token_ids=[list(output) for _ in range(n)],
        eos_token_ids=EOS,
    )


def assert_fits(tokens: np.ndarray, expected: np.ndarray) -> None:
    counts = np.bincount(tokens, minlength=len(expected))
    support = expected * len(tokens) > 1e-3  # the rest (masked, or a -100 bias) should never come up
    assert counts[~support].sum() == 0, f"sampled tokens outside the support: {counts[~support]}"
    assert (expected[support] * len(tokens)).min() >= 5, "test setup: expected counts too small for chi-square"
    f_exp = expected[support] / expected[support].sum() * len(tokens)
    pvalue = chisquare(counts[support], f_exp).pvalue
    assert pvalue > 1e-3, (pvalue, counts, f_exp.round(1))


def sample_many(p: SamplingParams, prompt: list[int] = PROMPT, output: list[int] = OUTPUT) -> np.ndarray:
    torch.manual_seed(1234)
    logits = torch.from_numpy(np.tile(LOGITS, (N_DRAWS, 1)))
    return np.array(Sampler()(logits, _inputs([p] * N_DRAWS, prompt, output)).token_ids)


# ---- distributions -------------------------------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.5),
    SamplingParams(temperature=0.9, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.15),
    SamplingParams(temperature=0.8, min_p=0.05, top_k=6, top_p=0.8),
    SamplingParams(temperature=1.0, repetition_penalty=1.6),
    SamplingParams(temperature=1.0, repetition_penalty=0.7),
    SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.3),
    SamplingParams(temperature=1.0, presence_penalty=-0.5, frequency_penalty=-0.2),
    SamplingParams(temperature=1.2, logit_bias={3: 2.0, 7: -100.0, 9: 1.5}),
    SamplingParams(temperature=1.0, logit_bias={0: 1.0}, repetition_penalty=1.3, presence_penalty=0.4,
                   frequency_penalty=0.2, top_p=0.9),
], ids=lambda p: ",".join(f"{k}={v}" for k, v in vars(p).items() if v != getattr(SamplingParams(), k)))
def test_sampled_distribution_matches_reference(params: SamplingParams) -> None:
    expected = reference_probs(LOGITS, params, PROMPT, OUTPUT)
    assert_fits(sample_many(params), expected)


def test_mixed_batch_gives_each_row_its_own_distribution() -> None:
    kinds = [SamplingParams(temperature=0.6), SamplingParams(temperature=1.0, top_k=3),
             SamplingParams(temperature=1.4, top_p=0.5, presence_penalty=1.0),
             SamplingParams(temperature=1.0, min_p=0.2, repetition_penalty=1.5),
             SamplingParams(temperature=0)]
    per_kind = 5000
    params = [kinds[i % len(kinds)] for i in range(per_kind * len(kinds))]  # interleaved rows
    torch.manual_seed(7)
    logits = torch.from_numpy(np.tile(LOGITS, (len(params), 1)))
    tokens = np.array(Sampler()(logits, _inputs(params)).token_ids)
    for k, p in enumerate(kinds):
        expected = reference_probs(LOGITS, p, PROMPT, OUTPUT)
        rows = tokens[k::len(kinds)]
        if p.temperature == 0:
            assert (rows == expected.argmax()).all()
        else:
            assert_fits(rows, expected)


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked: the set closes in the top 256; flat: it doesn't
def test_top_p_on_a_large_vocabulary(scale: float) -> None:
    rng = np.random.default_rng(int(scale * 100))
    logits = (rng.normal(size=(8, 3000)) * scale).astype(np.float32)
    top_ps = [0.05, 0.3, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0]
    x = torch.from_numpy(logits.copy())
    apply_top_p(x, torch.tensor(top_ps))
    for row, p in zip(range(8), top_ps):
        expected = top_p_keep(_softmax(logits[row].astype(np.float64)), p) if p < 1 else np.ones(3000, bool)
        assert np.array_equal(torch.isfinite(x[row]).numpy(), expected), (row, p)


def test_top_p_keeps_at_least_the_most_likely_token() -> None:
    logits = torch.tensor([[5.0, 0.0, 0.0, 0.0]]).repeat(200, 1)
    out = Sampler()(logits, _inputs([SamplingParams(top_p=0.01)] * 200, output=[]))
    assert set(out.token_ids) == {0}


# ---- greedy --------------------------------------------------------------------------------------

def test_greedy_is_argmax_with_ties_to_lowest_id() -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(64, 50)).astype(np.float32)
    logits[5, [7, 20, 33]] = 10.0  # a three-way tie
    out = Sampler()(torch.from_numpy(logits), _inputs([SamplingParams(temperature=0)] * 64, output=[]))
    assert out.token_ids == logits.argmax(axis=1).tolist()
    assert out.token_ids[5] == 7


def test_tiny_temperatures_are_greedy_or_raised_as_vllms() -> None:
    """vLLM's rule: a temperature below 1e-5 is greedy, one below 1e-2 is raised to 1e-2. Sampled as given, 1e-39
    made 1 / T inf (the kernel refused the step, failing every request in it) and 1e-10 never drew the argmax of
    a row whose next logit was a whole unit behind."""
    assert [SamplingParams(temperature=t).temperature for t in (1e-300, 1e-39, 1e-10, 9.9e-6, 1e-5, 5e-3, 0.01, 0.7)] \
        == [0.0, 0.0, 0.0, 0.0, 0.01, 0.01, 0.01, 0.7]
    assert SamplingParams(temperature=1e-39).greedy
    rng = np.random.default_rng(5)
    logits = rng.normal(scale=3.0, size=(6, 4096)).astype(np.float32)
    logits[np.arange(6), [3, 70, 900, 4000, 1, 2]] = logits.max() + 1.0
    params = [SamplingParams(temperature=t) for t in (1e-39, 1e-300, 1e-10, 1e-8, 5e-3, 1.0)]
    out = Sampler()(torch.from_numpy(logits), _inputs(params, output=[]))
    assert out.token_ids[:5] == [3, 70, 900, 4000, 1]  # at 0.01 a lead of one logit is e^100 to one


def test_n_is_bounded_as_in_vllm() -> None:
    # n = 10**30 made the engine build sequences until memory ran out (the server bounds n by max_num_seqs).
    assert SamplingParams(n=16384).n == 16384
    with pytest.raises(ValueError, match="n must be <= 16384"):
        SamplingParams(n=10**30)


def test_parameters_of_the_wrong_type_are_refused_by_name_and_numpy_numbers_taken() -> None:
    """A probe found: logit_bias=[1, 2] raised AttributeError, max_tokens=True generated one token,
    ignore_eos='yes' was taken, seeds past 64 bits wrapped onto others' (the HTTP API refuses them), and numpy
    numbers were refused with messages about a range they were in."""
    for kw, says in [({"logit_bias": [1, 2]}, "logit_bias must map token ids"),
                     ({"max_tokens": True}, "max_tokens must be an integer"), ({"n": True}, "n must be an integer"),
                     ({"seed": False}, "seed must be an integer"), ({"logit_bias": {True: 1}}, "logit_bias keys"),
                     ({"stop_token_ids": [True]}, "stop_token_ids"), ({"ignore_eos": "yes"}, "ignore_eos must be"),
                     ({"skip_special_tokens": None}, "skip_special_tokens must be"),
                     ({"seed": 2**63}, r"seed must be an integer in \[-2\*\*63"), ({"seed": -2**63 - 1}, "seed must")]:
        with pytest.raises(ValueError, match=says):
            SamplingParams(**kw)
    p = SamplingParams(max_tokens=np.int64(5), temperature=np.float32(0.5), seed=np.uint64(2**63 - 1),
                       logprobs=np.int32(2))
    assert (p.max_tokens, p.temperature, p.seed, p.logprobs) == (5, 0.5, 2**63 - 1, 2)
    assert all(type(v) in (int, float) for v in (p.max_tokens, p.temperature, p.seed, p.logprobs))


def test_extreme_valid_parameters_sample_as_their_limits() -> None:
    """Valid values that float32 rounded to ones the sampler refused (1 / T or top_p to zero: the kernel failed
    the whole step): a temperature hotter than 1e30 samples uniformly anyway, and a top_p under the likeliest
    token's probability keeps that token alone."""
    logits = torch.from_numpy(np.tile(LOGITS, (N_DRAWS, 1)))
    hot = Sampler()(logits, _inputs([SamplingParams(temperature=1e300)] * N_DRAWS, output=[]))
    assert_fits(np.array(hot.token_ids), np.full(V, 1 / V))
    narrow = Sampler()(logits[:50], _inputs([SamplingParams(top_p=1e-300, temperature=5.0)] * 50, output=[]))
    assert narrow.token_ids == [int(np.argmax(LOGITS))] * 50


def test_greedy_applies_penalties_first() -> None:
    p = SamplingParams(temperature=0, repetition_penalty=3.0, logit_bias={4: 0.3})
    expected = reference_probs(LOGITS, p, PROMPT, OUTPUT).argmax()
    out = Sampler()(torch.from_numpy(LOGITS[None].copy()), _inputs([p]))
    assert out.token_ids == [expected]


def test_sampler_leaves_caller_logits_untouched() -> None:
    logits = torch.from_numpy(np.tile(LOGITS, (3, 1)))
    before = logits.clone()
    params = [SamplingParams(top_k=2, min_p=0.1, top_p=0.5),
              SamplingParams(temperature=0, repetition_penalty=2.0), SamplingParams(logit_bias={1: 5.0})]
    Sampler()(logits, _inputs(params))
    Sampler()(logits[:1], _inputs(params[:1]))
    assert torch.equal(logits, before)


# ---- seeds ---------------------------------------------------------------------------------------

def _generate(logit_steps: np.ndarray, params: list[SamplingParams], row: int, seeds: list[int | None],
              steps: int) -> list[int]:
    """Run `steps` decode steps over a batch; return row `row`'s tokens."""
    sampler = Sampler()
    gens = [make_generator(s) if s is not None else None for s in seeds]
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(steps):
        inputs = SamplingInputs(params, gens, [[0, 1, 2]] * len(params), [list(o) for o in outputs], EOS)
        toks = sampler(torch.from_numpy(logit_steps[step, : len(params)]), inputs).token_ids
        for o, t in zip(outputs, toks):
            o.append(t)
    return outputs[row]


def test_seeds_that_differ_above_32_bits_draw_differently() -> None:
    """torch's CPU generator keeps a seed's low 32 bits: 1 and 2**32 + 1, 0 and -2**63 drew the same samples."""
    seeds = (1, 2**32 + 1, 0, -2**63, 2**63 - 1, -1, 2**32 - 1)
    draws = {seed: tuple(torch.rand(8, generator=make_generator(seed)).tolist()) for seed in seeds}
    assert len(set(draws.values())) == len(seeds)
    # A seed below 2**32 seeds torch as it is, so earlier seeded outputs stay what they were.
    assert draws[1] == tuple(torch.rand(8, generator=torch.Generator().manual_seed(1)).tolist())


def test_seeded_request_is_reproducible_and_batch_invariant() -> None:
    rng = np.random.default_rng(11)
    steps, vocab, batch = 6, 500, 32
    logit_steps = rng.normal(scale=2.0, size=(steps, batch, vocab)).astype(np.float32)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)

    alone_a = _generate(logit_steps[:, 5:6], [seeded], 0, [42], steps)
    alone_b = _generate(logit_steps[:, 5:6], [seeded], 0, [42], steps)
    assert alone_a == alone_b

    others = [SamplingParams(temperature=float(rng.uniform(0.3, 2.0)), top_k=int(rng.integers(0, 20)),
                             top_p=float(rng.uniform(0.3, 1.0)), min_p=float(rng.uniform(0, 0.2)),
                             repetition_penalty=float(rng.uniform(0.8, 1.5)),
                             presence_penalty=float(rng.uniform(-1, 1)),
                             logit_bias={int(rng.integers(vocab)): 3.0}) for _ in range(batch)]
    others[3] = SamplingParams(temperature=0)
    params = others[:5] + [seeded] + others[6:]
    seeds = [None, 7, None, None, 123, 42] + [None] * (batch - 6)
    torch.manual_seed(0)
    assert _generate(logit_steps, params, 5, seeds, steps) == alone_a
    torch.manual_seed(99)  # a different unseeded draw must not matter either
    assert _generate(logit_steps, params, 5, seeds, steps) == alone_a

    different_seed = _generate(logit_steps[:, 5:6], [seeded], 0, [43], steps)
    assert different_seed != alone_a  # (6 draws from ~50 tokens: a collision is ~impossible)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the torch path tempers every row alike")
@pytest.mark.parametrize("own", ["temperature only", "top_p"])
def test_a_rows_temperature_rounds_alike_whatever_its_batch_mates_filter(own: str) -> None:
    """A row is tempered the same way whatever its batch-mates ask, so that a seeded request's tokens cannot
    depend on them (whom speculative decoding changes: requests advance by several tokens a step). Near-ties
    built on purpose: tokens 0 and 1 score alike in exact arithmetic (exp(x0 / T) / -ln u0 == exp(x1 / T) /
    -ln u1), so rounding alone decides between them; a temperature-only row divided by T before the draw
    (beside a filtered row) and scaled by 1 / T inside it (otherwise) decided differently in some of these."""
    rng = np.random.default_rng(5)
    trials, vocab, temperature = 400, 8, 0.7
    x = rng.normal(size=(trials, vocab)).astype(np.float32)
    x[:, 2:] -= 10.0  # the two tied tokens lead by far
    u = np.full((trials, vocab), 0.01)  # the others also draw large noise
    u[:, 0] = rng.uniform(0.05, 0.95, size=trials)
    u[:, 1] = np.exp(np.exp((x[:, 1].astype(np.float64) - x[:, 0]) / temperature) * np.log(u[:, 0]))
    u = u.astype(np.float32)
    row = SamplingParams(temperature=temperature, top_p=1.0 if own == "temperature only" else 0.999)
    mates = {"alone": None, "beside a plain row": SamplingParams(temperature=1.3),
             "beside top_k": SamplingParams(temperature=1.0, top_k=3),
             "beside top_p and min_p": SamplingParams(temperature=0.5, top_p=0.8, min_p=0.02)}
    picks = {}
    for name, mate in mates.items():
        got = []
        for i in range(trials):
            params = [row] + ([mate] if mate else [])
            logits = torch.from_numpy(np.stack([x[i], x[(i + 1) % trials]][:len(params)]))
            noise = [torch.from_numpy(u[i]), torch.from_numpy(u[(i + 1) % trials])][:len(params)]
            inputs = SamplingInputs(params, [None] * len(params), [[]] * len(params), [[]] * len(params), EOS,
                                    noise=noise)
            got.append(Sampler()(logits, inputs).token_ids[0])
        picks[name] = got
    assert set(picks["alone"]) == {0, 1}  # the ties go both ways
    for name in mates:
        assert picks[name] == picks["alone"], (name, sum(a != b for a, b in zip(picks[name], picks["alone"])))


# ---- min_tokens ----------------------------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_token_ids_until_reached() -> None:
    logits = np.zeros(V, dtype=np.float32)
    logits[[EOS[0], 3]] = 8.0  # EOS and a stop token dominate unless masked
    p = SamplingParams(min_tokens=3, stop_token_ids=[3], temperature=1.0)
    batch = torch.from_numpy(np.tile(logits, (2000, 1)))

    early = Sampler()(batch, _inputs([p] * 2000, output=[5, 6])).token_ids
    assert not {EOS[0], 3} & set(early)
    assert len(set(early)) > 5  # everything else is still possible
    reached = Sampler()(batch, _inputs([p] * 2000, output=[5, 6, 7])).token_ids
    assert {EOS[0], 3} <= set(reached)

    # ignore_eos: EOS cannot end the sequence, so it is an ordinary token; stop ids stay masked.
    ignoring = SamplingParams(min_tokens=3, stop_token_ids=[3], ignore_eos=True)
    toks = Sampler()(batch, _inputs([ignoring] * 2000, output=[])).token_ids
    assert EOS[0] in toks and 3 not in toks
    greedy = SamplingParams(min_tokens=1, temperature=0)
    assert Sampler()(batch[:1], _inputs([greedy], output=[])).token_ids == [3]


def test_min_tokens_reads_the_given_lengths_where_token_lists_are_left_out() -> None:
    # The model runner passes token lists only for penalised rows and the lengths for every row.
    logits = torch.zeros(2, V)
    logits[:, EOS[0]] = 50.0
    greedy = SamplingParams(min_tokens=3, temperature=0)
    inputs = _inputs([greedy, greedy], output=[])
    inputs.num_output_tokens = [2, 3]
    first, second = Sampler()(logits, inputs).token_ids
    assert first != EOS[0] and second == EOS[0]


# ---- logprobs ------------------------------------------------------------------------------------

def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _check_position(entry: dict, ref_row: np.ndarray, chosen: int, k: int) -> None:
    assert next(iter(entry)) == chosen  # the chosen token comes first
    top = np.argsort(-ref_row, kind="stable")[:k]
    assert set(entry) == {chosen} | set(top.tolist())
    for tok, lp in entry.items():
        assert lp.logprob == pytest.approx(ref_row[tok], abs=1e-5)
        assert lp.rank == 1 + int((ref_row > ref_row[tok] + 1e-9).sum())
        assert lp.decoded_token is None


def test_logprobs_are_raw_log_softmax_with_ranks() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(6, 40)).astype(np.float32)
    logits[2, [3, 9]] = 4.0  # tied top tokens share rank 1
    params = [SamplingParams(temperature=0.5, logprobs=5, repetition_penalty=2.0, top_k=3),
              SamplingParams(temperature=0, logprobs=0, logit_bias={0: 50.0}),
              SamplingParams(temperature=1.0, logprobs=3),
              SamplingParams(temperature=1.0),  # no logprobs requested
              SamplingParams(temperature=2.0, logprobs=20),
              SamplingParams(temperature=0, logprobs=1)]
    out = Sampler()(torch.from_numpy(logits), _inputs(params, output=[0, 1]))
    ref = _np_log_softmax(logits)  # before bias/penalties/temperature
    assert out.token_ids[1] == 0  # the bias decided the token, but logprobs stay raw
    assert out.logprobs[3] is None
    for i, p in enumerate(params):
        if p.logprobs is not None:
            _check_position(out.logprobs[i], ref[i], out.token_ids[i], p.logprobs)
    assert out.logprobs[2][3].rank == out.logprobs[2][9].rank == 1
    assert len(out.logprobs[1]) == 1


def test_prompt_logprobs() -> None:
    rng = np.random.default_rng(8)
    logits = rng.normal(size=(7, 30)).astype(np.float32)
    targets = [4, 0, 29, 4, 17, 3, 3]
    got = compute_prompt_logprobs(torch.from_numpy(logits), targets, 2)
    ref = _np_log_softmax(logits)
    assert len(got) == len(targets)
    for entry, row, tok in zip(got, ref, targets):
        _check_position(entry, row, tok, 2)
    assert compute_prompt_logprobs(torch.zeros(0, 30), [], 3) == []
