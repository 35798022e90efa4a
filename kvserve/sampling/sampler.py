"""Batched sampling: one pass per step over every sequence that samples, with per-row parameters.

Stage order (vLLM's): logit_bias -> min_tokens -> repetition penalty -> presence/frequency penalties
-> [greedy rows: argmax here] -> temperature -> min_p -> top_k -> top_p -> exponential-race draw.
Stages no row needs are skipped, so an all-greedy batch without penalties is one argmax.

min_tokens: while a row has fewer than min_tokens outputs, its stop_token_ids and (unless ignore_eos)
the model's EOS ids are masked to -inf, as vLLM does; with ignore_eos, EOS cannot end the sequence
anyway, so it stays an ordinary token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvserve.kernels import cpu as cpu_kernels
from kvserve.outputs import PositionLogprobs
from kvserve.sampling import logits_processors as lp
from kvserve.sampling.logprobs import gather_logprobs
from kvserve.sampling_params import SamplingParams
from kvserve.utils.device import to_device


@dataclass
class SamplingInputs:
    """One row per sequence that samples this step, in the order of the logits rows."""
    params: list[SamplingParams]
    # A seeded request's own generator (make_generator, on the logits' device), kept across steps.
    generators: list[torch.Generator | None]
    # The token lists are read only for rows whose params penalise (penalises()): other rows may pass empty
    # ones, as the model runner does, when num_output_tokens gives their lengths (min_tokens reads those).
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]          # tokens generated so far (before this step's)
    eos_token_ids: list[int]                   # the model's EOS ids
    # Per row, the uniforms its position draws, where they were drawn already (speculative decoding: the
    # draft drew them from a clone of the request's generator); None, or a None row: drawn here.
    noise: list[Tensor | None] | None = None
    num_output_tokens: list[int] | None = None  # per row; None: len(output_token_ids[row])


def fill_uniform_(out: Tensor, generator: torch.Generator | None) -> Tensor:
    """out.uniform_(generator=generator), torch.rand's numbers: on the CPU in float32, from the CPU kernels'
    vectorised Mersenne Twister (~9x faster for a vocabulary's row; the generator ends in the same state)."""
    if out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous() and cpu_kernels.available():
        cpu_kernels.ops().mt19937_uniform_(out, generator)
        return out
    return out.uniform_(generator=generator)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[PositionLogprobs | None]    # per row; None unless params.logprobs is not None


def argmax(x: Tensor) -> Tensor:
    """x.argmax(-1) of [N, V] rows (the first maximum; a NaN counts as the largest), on the CPU kernel where it
    applies: torch's took ~75 us per 49k-token row on two AVX2 cores, ~1% of a batch-1 decode step."""
    if x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and cpu_kernels.applies(x):
        return cpu_kernels.ops().argmax_rows(x)
    return x.argmax(dim=-1)


def race_applies(logits: Tensor) -> bool:
    """Whether race_sample's kernel takes these logits: float32 [N, V] rows, contiguous, on the CPU."""
    return (logits.dim() == 2 and logits.dtype == torch.float32 and logits.stride(1) == 1
            and cpu_kernels.applies(logits))


def race_sample(logits: Tensor, inv_temp: Tensor, uniform: Tensor) -> Tensor:
    """Each row's draw from softmax(logits * inv_temp): argmax p / -log(uniform), the exponential race, in the
    CPU kernel's two passes (kvserve/kernels/cpu/argmax.cpp)."""
    return cpu_kernels.ops().race_sample_rows(logits, inv_temp.float().contiguous(), uniform.contiguous())


def penalises(p: SamplingParams) -> bool:
    """Whether a row's repetition, presence or frequency penalty reads its prompt and output tokens."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def reads_token_ids(p: SamplingParams) -> bool:
    """Whether a stage names tokens by id (logit_bias, min_tokens' stop ids, the penalties over prompt and
    output tokens): the stages that need every row over the full vocabulary."""
    return bool(p.logit_bias or p.min_tokens > 0 or p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
                or p.frequency_penalty != 0.0)


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The per-request generator for a seeded request (create once, pass every step)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed if g.device.type != "cpu" else cpu_seed(seed))
    return g


def cpu_seed(seed: int) -> int:
    """The seed for torch's CPU generator, whose Mersenne Twister keeps only a seed's low 32 bits: seeds that
    differ above them (1 and 2**32 + 1, 0 and -2**63) drew the same samples. A seed below 2**32 is kept as it
    is (so are its samples); a larger one (or a negative one, as torch reads it: modulo 2**64) is mixed down to
    32 bits (splitmix64's finaliser), so that its high bits count."""
    u = seed % (1 << 64)
    if u < (1 << 32):
        return u
    u = ((u ^ (u >> 30)) * 0xBF58476D1CE4E5B9) % (1 << 64)
    u = ((u ^ (u >> 27)) * 0x94D049BB133111EB) % (1 << 64)
    return (u ^ (u >> 31)) & 0xFFFFFFFF


class Sampler:
    def __init__(self, generator: torch.Generator | None = None) -> None:
        # Unseeded rows' noise: the engine's own generator, so that another engine in the process (or the
        # caller's torch.manual_seed) does not restart this one's draws; None: torch's default generator.
        self.generator = generator

    def __call__(self, logits: Tensor, inputs: SamplingInputs) -> SamplerOutput:
        params = inputs.params
        n = logits.shape[0]
        assert n == len(params) == len(inputs.generators) == len(inputs.output_token_ids)
        raw = logits.float()  # never modified in place below: logprobs are taken from it at the end

        processed = self._apply_penalties(raw, inputs)
        greedy = [p.temperature == 0.0 for p in params]
        if all(greedy):
            token_ids = argmax(processed)  # first maximum: ties go to the lowest id
        else:
            token_ids = self._sample(processed, inputs, greedy)

        # Logprobs describe the model's own distribution, before any processing (vLLM's default).
        logprobs: list[PositionLogprobs | None] = [None] * n
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if rows:
            idx = to_device(rows, raw.device)
            gathered = gather_logprobs(torch.log_softmax(raw[idx], dim=-1), token_ids[idx],
                                       [params[i].logprobs or 0 for i in rows])
            for i, entry in zip(rows, gathered):
                logprobs[i] = entry
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)

    def _apply_penalties(self, logits: Tensor, inputs: SamplingInputs) -> Tensor:
        """Returns a copy of logits when any stage applies (the caller's tensor stays untouched)."""
        params = inputs.params
        if not any(map(reads_token_ids, params)):
            return logits
        logits = logits.clone()
        if any(p.logit_bias for p in params):
            lp.apply_logit_bias(logits, params)

        lengths = inputs.num_output_tokens or [len(out) for out in inputs.output_token_ids]
        banned = [
            (p.stop_token_ids + ([] if p.ignore_eos else inputs.eos_token_ids))
            if length < p.min_tokens else []
            for p, length in zip(params, lengths)
        ]
        if any(banned):
            lp.apply_token_mask(logits, banned)

        rows = [i for i, p in enumerate(params) if penalises(p)]
        if rows:
            # Only the penalised rows pay for the [rows, V] count tensors; where every row is, no gather and scatter.
            every = len(rows) == len(params)
            idx = None if every else to_device(rows, logits.device)
            sub = logits if every else logits[idx]
            lp.apply_penalties(
                sub,
                [inputs.prompt_token_ids[i] for i in rows],
                [inputs.output_token_ids[i] for i in rows],
                self._per_row([params[i].repetition_penalty for i in rows], logits),
                self._per_row([params[i].presence_penalty for i in rows], logits),
                self._per_row([params[i].frequency_penalty for i in rows], logits),
                use_repetition=any(params[i].repetition_penalty != 1.0 for i in rows),
                use_counts=any(params[i].presence_penalty != 0.0 or params[i].frequency_penalty != 0.0 for i in rows),
            )
            if not every:
                logits[idx] = sub
        return logits

    def _sample(self, logits: Tensor, inputs: SamplingInputs, greedy: list[bool]) -> Tensor:
        params = inputs.params
        greedy_ids = argmax(logits) if any(greedy) else None
        rand_rows = [i for i, g in enumerate(greedy) if not g]
        all_random = len(rand_rows) == len(params)
        idx = to_device(rand_rows, logits.device)
        sub = logits if all_random else logits[idx]  # indexing copies
        sub_params = [params[i] for i in rand_rows]

        temps = [p.temperature for p in sub_params]
        generators = [inputs.generators[i] for i in rand_rows]
        given = [inputs.noise[i] for i in rand_rows] if inputs.noise is not None else None
        native = race_applies(sub)
        filtered = [p.min_p > 0.0 or p.top_k > 0 or p.top_p < 1.0 for p in sub_params]
        if native:
            # Each row is tempered as it would be alone, whatever its batch-mates ask, so that a seeded request's
            # tokens never depend on them: a row without filters by the kernel as it reads the logits (x * 1/T,
            # no tempered copy), a filtered one divided by T before its filters, then drawn at 1. (Dividing every
            # row whenever one was filtered rounded near-ties differently: tests/test_sampler.py.)
            if any(filtered):
                rows = [i for i, f in enumerate(filtered) if f]
                if len(rows) == len(sub_params):
                    sub = self._tempered_and_filtered(sub, sub_params, owned=not all_random)
                else:
                    at = to_device(rows, sub.device)
                    part = self._tempered_and_filtered(sub[at], [sub_params[i] for i in rows], owned=True)
                    sub = sub.clone() if all_random else sub  # all_random: sub is the caller's tensor
                    sub[at] = part
            inv_temp = self._per_row([1.0 if f else 1.0 / t for f, t in zip(filtered, temps)], sub)
            sampled = race_sample(sub, inv_temp, self._uniforms(sub, generators, given))
        else:
            sub = self._tempered_and_filtered(sub, sub_params, owned=not all_random)
            # -log(U) is Exp(1) (several times cheaper than exponential_ on a CPU); U < 1, so the noise
            # is > 0 (no 0/0 = NaN, which would win the argmax); U = 0 gives inf: that token just loses.
            uniform = self._uniforms(sub, generators, given)
            sampled = argmax(torch.softmax(sub, dim=-1) / uniform.log_().neg_())

        if greedy_ids is None:
            return sampled
        return greedy_ids.index_copy(0, idx, sampled)

    def _tempered_and_filtered(self, logits: Tensor, params: list[SamplingParams], owned: bool) -> Tensor:
        """Each row divided by its temperature, then its min_p, top_k and top_p applied (rows without one are
        left as they are). owned: logits is this call's own copy, which the stages may change in place;
        otherwise they work on a copy (the caller's tensor stays untouched)."""
        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            logits = logits / self._per_row(temps, logits).unsqueeze(1)
        elif not owned:
            logits = logits.clone()
        if any(p.min_p > 0.0 for p in params):
            lp.apply_min_p(logits, self._per_row([p.min_p for p in params], logits))
        if any(p.top_k > 0 for p in params):
            top_k = [p.top_k for p in params]
            lp.apply_top_k(logits, to_device(top_k, logits.device), max_k=max(k if k > 0 else 1 for k in top_k))
        if any(p.top_p < 1.0 for p in params):
            lp.apply_top_p(logits, self._per_row([p.top_p for p in params], logits),
                           rows=[i for i, p in enumerate(params) if p.top_p < 1.0])
        return logits

    def _uniforms(self, like: Tensor, generators: list[torch.Generator | None],
                  given: list[Tensor | None] | None = None) -> Tensor:
        """The uniforms of the exponential race (argmax p / -log U draws from p), a row per row of like.

        Rows with given uniforms use them. Seeded rows draw their own row from their own generator, so their
        tokens do not depend on the rest of the batch; unseeded rows share one draw from the default
        generator (the engine's), made for them only: a vocabulary's uniforms take ~0.2-0.4 ms on a CPU, and a draw for
        every row that seeded rows then overwrote doubled a seeded row's sampling time."""
        given = given if given is not None else [None] * len(generators)
        unseeded = [i for i, (g, u) in enumerate(zip(generators, given)) if g is None and u is None]
        uniform = torch.empty_like(like)
        if len(unseeded) == len(generators):
            fill_uniform_(uniform, self.generator)
        else:
            if unseeded:
                uniform[to_device(unseeded, like.device)] = fill_uniform_(
                    torch.empty(len(unseeded), like.shape[1], device=like.device, dtype=like.dtype), self.generator)
            for i, (g, u) in enumerate(zip(generators, given)):
                if u is not None:
                    uniform[i] = u
                elif g is not None:
                    fill_uniform_(uniform[i], g)  # a row of a contiguous tensor: drawn in place
        return uniform

    @staticmethod
    def draw_uniform(generator: torch.Generator, vocab: int, device: torch.device, dtype: torch.dtype) -> Tensor:
        """One seeded row's uniforms (one position's draw; speculative decoding replays these to rewind)."""
        return fill_uniform_(torch.empty(vocab, device=device, dtype=dtype), generator)

    @staticmethod
    def _per_row(values: list[float], like: Tensor) -> Tensor:
        return to_device(values, like.device, like.dtype)
