"""Sampled decoding with the sampler's uniforms from torch's CPU generator (Tensor.uniform_, what torch.rand
runs) against the CPU kernels' Mersenne Twister (kvserve/kernels/cpu/uniform.cpp: the same numbers, so the same
tokens), side by side in one process.

A sampled row draws one uniform per vocabulary entry each step (the exponential race). Two measurements:
the sampler alone, one call on a step's logits (the model's 49,152-token vocabulary, temperature only), the
two ways alternating call by call; and whole engines decoding, the two ways taking turns run by run, each
run starting from the same seeds (medians over the rounds; whether every run's tokens were the same both ways).

    python benchmarks/sampling_noise.py            # results/sampling_noise_<isa>.{json,md}
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import report
from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels
from kvserve.sampling import sampler as sampler_module
from kvserve.sampling.sampler import Sampler, SamplingInputs, make_generator

PROMPTS = ["Why is the sky blue?", "How do plants make food?", "Write a short poem about rain.",
           "What should I pack for a weekend trip?", "Explain how a bicycle stays upright.",
           "Suggest a name for a small bakery.", "What is a prime number?", "Why do cats purr?"]


def torch_uniform_(out: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return out.uniform_(generator=generator)


def sampler_alone(ways: dict, batch: int, seeded: bool, temperature: float, calls: int) -> dict[str, float]:
    """Median ms of one Sampler call on [batch, vocab] logits, each way, the ways alternating call by call."""
    vocab = 49152
    logits = 3 * torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch))
    params = [SamplingParams(temperature=temperature, seed=i if seeded else None) for i in range(batch)]
    inputs = SamplingInputs(params=params, generators=[make_generator(i) if seeded else None for i in range(batch)],
                            prompt_token_ids=[[1]] * batch, output_token_ids=[[]] * batch, eos_token_ids=[2])
    sampler, times = Sampler(), {w: [] for w in ways}
    for k in range(calls):
        for w in (list(ways) if k % 2 == 0 else list(ways)[::-1]):
            sampler_module.fill_uniform_ = ways[w]
            t0 = time.perf_counter()
            sampler(logits, inputs)
            times[w].append(time.perf_counter() - t0)
    sampler_module.fill_uniform_ = ways["kernel"]
    return {w: 1000 * statistics.median(t) for w, t in times.items()}


def run(llm: LLM, concurrency: int, params: list[SamplingParams], prompts: list[str]) -> dict:
    """A closed loop at `concurrency` over the prompts; output tokens per second and every request's tokens."""
    engine = llm.engine
    engine.reset_prefix_cache()
    torch.manual_seed(0)  # unseeded rows draw from the default generator: the same draws both ways
    pending, in_flight, tokens = list(range(len(prompts))), set(), {}
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params[i])
            in_flight.add(str(i))
        for out in engine.step():
            if out.finished:
                in_flight.discard(out.request_id)
                tokens[int(out.request_id)] = out.outputs[0].token_ids
    seconds = time.perf_counter() - t0
    return {"tok_s": sum(map(len, tokens.values())) / seconds, "tokens": [tokens[i] for i in range(len(prompts))]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--num-requests", type=int, default=8, help="per run, at least the concurrency")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sampler-calls", type=int, default=300, help="calls of the sampler alone, each way")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("sampling_noise.py compares with the CPU kernels' uniforms, and none are built here")

    ways = {"torch": torch_uniform_, "kernel": sampler_module.fill_uniform_}
    results, alone, lines = {"sampler_alone": {}}, [], []
    for batch in args.concurrency:
        for seeded in (False, True):
            ms = sampler_alone(ways, batch, seeded, args.temperature, args.sampler_calls)
            results["sampler_alone"][f"b{batch}_{'seeded' if seeded else 'unseeded'}"] = ms
            alone.append(f"| {batch} | {'yes' if seeded else 'no'} | {ms['torch']:.3f} | {ms['kernel']:.3f} | "
                         f"{ms['torch'] - ms['kernel']:.3f} |")
            print(alone[-1], flush=True)

    llm = LLM(max_num_seqs=max(args.concurrency))
    for c in args.concurrency:
        n = max(c, args.num_requests)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        for seeded in (False, True):
            params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True,
                                     seed=1000 + i if seeded else None) for i in range(n)]
            runs: dict[str, list[dict]] = {w: [] for w in ways}
            run(llm, c, params, prompts)  # warm-up
            for k in range(args.rounds):
                for w in (list(ways) if k % 2 == 0 else list(ways)[::-1]):
                    sampler_module.fill_uniform_ = ways[w]
                    runs[w].append(run(llm, c, params, prompts))
            sampler_module.fill_uniform_ = ways["kernel"]
            tok_s = {w: statistics.median(r["tok_s"] for r in rs) for w, rs in runs.items()}
            ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(runs["torch"], runs["kernel"])]
            same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["torch"], runs["kernel"]))
            key = f"c{c}_{'seeded' if seeded else 'unseeded'}"
            results[key] = {"concurrency": c, "seeded": seeded, "tok_s": tok_s, "ratio_rounds": ratios,
                            "ratio": statistics.median(ratios), "same_tokens": same}
            lines.append(f"| {c} | {'yes' if seeded else 'no'} | {tok_s['torch']:.1f} | {tok_s['kernel']:.1f} | "
                         f"{statistics.median(ratios):.2f} ({' / '.join(f'{x:.2f}' for x in ratios)}) | "
                         f"{'yes' if same else 'NO'} |")
            print(lines[-1], flush=True)
    table = "\n".join(["The sampler alone (median of the calls):", "",
                       "| rows | seeded | torch ms | kernel ms | saved ms a step |", "|---:|---|---:|---:|---:|",
                       *alone, "", "Engines decoding:", "",
                       "| concurrency | seeded | torch tok/s | kernel tok/s | kernel x torch (rounds) | same tokens |",
                       "|---:|---|---:|---:|---|---|", *lines])
    setup = (f"Model: the default SmolLM2-135M-Instruct (its Q4_1 file); {args.num_requests} chat questions per run "
             f"(or the concurrency, if more), {args.max_tokens} output tokens each (ignore_eos), temperature "
             f"{args.temperature}, no top-k/top-p; closed loop; {args.rounds} rounds, the two ways alternating "
             "which goes first; medians. Seeded: each request its own generator; unseeded: the default generator, "
             "seeded before each run.")
    report("sampling_noise", "Sampling noise: torch's generator against the kernels' uniforms", args, setup, table,
           results, isa=cpu_kernels.isa(), script="sampling_noise")


if __name__ == "__main__":
    main()
