"""Batch-1 decode step by KV-cache dtype (--kv-cache-dtype): float32 (what auto gives where the compute dtype is
float32, as on CPUs without native bfloat16), bfloat16 and fp8_e4m3, at a few context lengths. A decode step
reads every cached K and V row once per layer, so a narrower cache is fewer bytes per step; the weights' bytes
do not change. The engines take turns in rounds (this host's speed drifts over minutes), and the greedy tokens
of each are compared with float32's on a chat prompt.

    python benchmarks/kv_cache_dtype.py [--contexts 500 1500 3000] [--rounds 5] [--steps 30]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from common import report
from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels


def decode_ms(llm: LLM, steps: int) -> float:
    engine = llm.engine
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "fp8_e4m3"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[500, 1500, 3000])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30, help="decode steps per engine per round")
    ap.add_argument("--name", default="kv_cache_dtype")
    args = ap.parse_args()
    base = args.dtypes[0]
    llms = {d: LLM(kv_cache_dtype=d, max_num_seqs=4, kv_cache_memory=512 << 20) for d in args.dtypes}
    tok = llms[base].get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Explain how a bicycle stays upright."}])
    params = SamplingParams(temperature=0, max_tokens=64)
    greedy = {d: llm.generate([chat], params, use_tqdm=False)[0].outputs[0].token_ids for d, llm in llms.items()}
    agree = {d: next((i for i, (a, b) in enumerate(zip(t, greedy[base])) if a != b), min(len(t), len(greedy[base])))
             for d, t in greedy.items()}

    rng = random.Random(0)
    results: dict = {"greedy_tokens_equal_to_" + base: {d: greedy[d] == greedy[base] for d in llms},
                     "greedy_tokens_agreeing_before_first_difference": agree, "points": []}
    rows = []
    for ctx in args.contexts:
        prompt = [rng.randrange(100, 40000) for _ in range(ctx)]
        for d, llm in llms.items():
            llm.engine.add_request(f"ctx{ctx}", prompt, SamplingParams(temperature=0, max_tokens=args.rounds * args.steps
                                                                       + 16, ignore_eos=True))
            while not any(s.num_computed_tokens > ctx for s in llm.engine.scheduler.running):  # the prefill
                llm.engine.step()
        ms: dict[str, list[float]] = {d: [] for d in llms}
        for k in range(args.rounds):
            for d in (list(llms) if k % 2 == 0 else list(reversed(llms))):
                ms[d].append(decode_ms(llms[d], args.steps))
        for llm in llms.values():
            llm.engine.abort_request([f"ctx{ctx}"])
        for d in llms:
            ratios = [b / x for b, x in zip(ms[base], ms[d])]
            results["points"].append({"context": ctx, "kv_cache_dtype": d, "step_ms": ms[d],
                                      "speedup_rounds": ratios, "speedup_median": statistics.median(ratios)})
            rows.append(f"| {ctx} | {d} | {statistics.median(ms[d]):.2f} | {statistics.median(ratios):.2f}x "
                        f"({min(ratios):.2f}-{max(ratios):.2f}) |")
        print("\n".join(rows[-len(llms):]), flush=True)

    kv_bytes = {d: llm.engine.runner.kv_caches[0][0].element_size() for d, llm in llms.items()}
    table = "\n".join(["| context tokens | KV cache dtype | decode step, median ms | x " + base + " (rounds) |",
                       "|---:|---|---:|---|", *rows])
    compute = str(llms[base].engine.dtype).removeprefix("torch.")
    setup = (f"Model: the default SmolLM2-135M-Instruct (Q4_1 GGUF, dtype auto: {compute} compute here); one sequence "
             f"of random prompt tokens decoding greedily from each context length; {args.rounds} rounds of "
             f"{args.steps} steps per engine, taking turns. Bytes per cached value: {kv_bytes}. Greedy tokens "
             f"of a chat prompt (64 at most) equal to {base}'s: {results['greedy_tokens_equal_to_' + base]}; "
             f"tokens before the first difference: {agree}.")
    report(args.name, "Decode step by KV-cache dtype", args, setup, table, results, isa=cpu_kernels.isa() or "none")


if __name__ == "__main__":
    main()
