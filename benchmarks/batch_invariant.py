"""What --batch-invariant costs: the time to prefill one long prompt (its first token) with and without it, in
one run. Without it, a prompt chunk of more than 16 tokens past 4096 tokens of context (1024 with AVX2) runs
on torch's SDPA, and where a long prompt is cut into chunks then depends on the rest of the batch; with it,
every row stays on the native kernel (the same bits whatever the batch), which is slower at long contexts.
Shorter prompts never reach SDPA, so they should cost the same either way: the first lengths are the control.

The two engines take turns in rounds (this host's speed drifts over minutes); each round prefills a fresh
random prompt of each length (no prefix-cache hits), the same one in both engines, and checks that both
give the same first token.

    python benchmarks/batch_invariant.py [--lengths 1024 4096 8000] [--rounds 3]   # results/batch_invariant_<isa>.*
"""
from __future__ import annotations

import argparse
import random
import statistics

from common import prefill_seconds, report
from kvserve import LLM
from kvserve.kernels import cpu as cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 8000],
                    help="prompt tokens (below the model's 8192-token context)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024, help="the chunk size (the engine's default)")
    ap.add_argument("--name", default="batch_invariant")
    args = ap.parse_args()
    common = dict(max_num_seqs=4, kv_cache_memory=1 << 30, max_num_batched_tokens=args.max_num_batched_tokens)
    llms = {False: LLM(**common), True: LLM(batch_invariant=True, **common)}
    rng = random.Random(0)
    for llm in llms.values():  # warm-up: first calls pay for allocation and kernel set-up
        prefill_seconds(llm, [rng.randrange(100, 40000) for _ in range(256)])

    results: dict = {"points": []}
    rows = []
    for n in args.lengths:
        seconds: dict[bool, list[float]] = {False: [], True: []}
        same = True
        for k in range(args.rounds):
            prompt = [rng.randrange(100, 40000) for _ in range(n)]
            tokens = {}
            for inv in ((False, True) if k % 2 == 0 else (True, False)):
                s, tokens[inv] = prefill_seconds(llms[inv], prompt)
                seconds[inv].append(s)
            same = same and tokens[False] == tokens[True]
        ratios = [b / x for b, x in zip(seconds[False], seconds[True])]
        point = {"prompt_tokens": n, "seconds_default": seconds[False], "seconds_batch_invariant": seconds[True],
                 "speed_x_default_rounds": ratios, "speed_x_default": statistics.median(ratios),
                 "same_first_token": same}
        results["points"].append(point)
        rows.append(f"| {n} | {statistics.median(seconds[False]):.2f} | {statistics.median(seconds[True]):.2f} | "
                    f"{point['speed_x_default']:.2f}x ({' / '.join(f'{r:.2f}' for r in ratios)}) | "
                    f"{'yes' if same else 'no'} |")
        print(rows[-1], flush=True)

    table = "\n".join(["| prompt tokens | default, median s | --batch-invariant, median s | speed x default (rounds) "
                       "| same first token |", "|---:|---:|---:|---|---|", *rows])
    isa = cpu_kernels.isa() or "none"
    setup = (f"Model: the default SmolLM2-135M-Instruct (dtype auto: {str(llms[False].engine.dtype)[6:]}, quantization "
             f"auto); one request of random prompt tokens at a time, max_tokens 1, chunks of "
             f"{args.max_num_batched_tokens} tokens, prefix caching on but never hit (a fresh prompt each round); "
             f"{args.rounds} rounds, the two engines taking turns. Time to the first token, i.e. the whole prefill.")
    report(args.name, "Prefill time with --batch-invariant", args, setup, table, results, isa=isa,
           script="batch_invariant")


if __name__ == "__main__":
    main()
