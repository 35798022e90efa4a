"""A prompt's prefill with the last layer run for the sampled rows alone, against every row, in one engine.

A prefill step samples one row per prompt that it finishes, and a chunk that does not finish its prompt
samples none. Every layer's K and V are needed for every row, but the last layer's o projection and MLP
(and on the native decoder stack its attention too) only for the sampled rows, so the model skips them for
the rest (the runner passes it out_rows). The other arm (runner.sampled_rows_only False) has the model
compute every row and keeps the sampled ones afterwards, as before. Both arms take turns on the same fresh
prompt (prefix caching off), and the first tokens must agree.

    python benchmarks/prefill_last_layer.py [--lengths 64 256 1024 4096]   # results/prefill_last_layer_<isa>.*
    python benchmarks/prefill_last_layer.py --model gemma3-270m --name prefill_last_layer_gemma3   # the layers
"""
from __future__ import annotations

import argparse
import random
import statistics

from common import add_prefill_options, prefill_engine, prefill_seconds, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a model name or path (default: the default model)")
    add_prefill_options(ap, [64, 256, 1024, 4096], 7, "prefill_last_layer")
    args = ap.parse_args()
    llm, isa = prefill_engine(args, args.model)
    model = llm.engine.runner.model
    native = getattr(model, "native_stack", None) is not None
    rng = random.Random(0)
    prefill_seconds(llm, [rng.randrange(100, 40000) for _ in range(256)])  # warm-up

    results: dict = {"points": []}
    rows = []
    for n in args.lengths:
        seconds: dict[str, list[float]] = {"sampled rows": [], "every row": []}
        for k in range(args.rounds):
            prompt = [rng.randrange(100, 40000) for _ in range(n)]
            tokens = []
            for arm in (("sampled rows", "every row") if k % 2 == 0 else ("every row", "sampled rows")):
                llm.engine.runner.sampled_rows_only = arm == "sampled rows"
                s, token = prefill_seconds(llm, prompt)
                seconds[arm].append(s)
                tokens.append(token)
            assert tokens[0] == tokens[1], f"the arms disagree on a {n}-token prompt's first token: {tokens}"
        llm.engine.runner.sampled_rows_only = True
        new, old = statistics.median(seconds["sampled rows"]), statistics.median(seconds["every row"])
        results["points"].append({"prompt_tokens": n, "seconds": seconds, "median_s": {"sampled rows": new,
                                                                                     "every row": old}})
        rows.append(f"| {n} | {1000 * old:.1f} | {1000 * new:.1f} | {old / new:.3f}x |")
        print(rows[-1], flush=True)

    table = "\n".join(["| prompt tokens | every row, median ms | sampled rows, median ms | speed-up |",
                       "|---:|---:|---:|---:|", *rows])
    name = args.model or "the default SmolLM2-135M-Instruct"
    setup = (f"Model: {name} (dtype auto: {str(llm.engine.dtype)[6:]}, quantization auto), {len(model.layers)} "
             f"layers, {'the native decoder stack' if native else 'its layers one by one'}; one request of random "
             f"prompt tokens at a time, max_tokens 1, chunks of {args.max_num_batched_tokens} tokens, prefix caching "
             f"off; {args.rounds} rounds, the two arms taking turns on the same prompt (first tokens equal in every "
             f"round). Time to the first token (the whole prefill). 'every row': the last layer's o projection and "
             f"MLP (on the native stack its attention too) for every prompt token, the model keeping the sampled row "
             f"after; 'sampled rows': for the sampled row alone (none in a chunk that does not finish its prompt).")
    report(args.name, "Prefill with the last layer for the sampled rows alone", args, setup, table, results,
           isa=isa, script="prefill_last_layer")


if __name__ == "__main__":
    main()
