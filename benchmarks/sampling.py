"""What the sampler costs a step: its CPU kernels (kvserve/kernels/cpu/argmax.cpp: race_sample_rows, the
exponential race argmax softmax(x / T) / -log U in two passes over a row; top_p_mask_ and top_k_mask_, the
cuts found among the few values that can be in the set; min_p_mask_; apply_penalties_, on each row's own
tokens) against torch's ops (divide, softmax, log, negate, divide, argmax; topk, and a sort for top-p; an amax
and a masked fill for min-p; count tensors over the vocabulary for the penalties), side by side in one run.

Rows are a step's sampled rows: 1 for one stream decoding, 2-9 for a speculative verification of 1-8
drafts, 32 for a batch. They are the default model's own logits (49,152 a row), taken while it answers the
chat workload's questions at temperature 0.7, so top-p sees a model's peaked rows. The sampler runs as the
engine calls it (uniforms drawn, the stages the parameters need), so the figures are a step's sampling time.
The two paths take turns within each of --rounds rounds; the table gives each one's fastest round.

With --engines, then whole engines: one engine of the default model decodes --max-tokens tokens for each of
8 chat questions (or the concurrency, if more) in a closed loop at each --concurrency, sampled at temperature
0.7 alone, with top_p 0.9 and with a repetition penalty of 1.1, the kernels turned on and off in turn each
round (sampling_noise.py's loop).

    python benchmarks/sampling.py                 # results/sampling_<isa>.{json,md}
    python benchmarks/sampling.py --engines --name sampling_engines
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import torch

from common import report
from kvserve import LLM
from kvserve.kernels import cpu as cpu_kernels
from kvserve.sampling import logits_processors
from kvserve.sampling import sampler as sampler_module
from kvserve.sampling.sampler import Sampler, SamplingInputs
from kvserve.sampling_params import SamplingParams

VOCAB = 49152  # SmolLM2's
SETTINGS = {"T 1.0": {"temperature": 1.0}, "T 0.7": {"temperature": 0.7},
            "T 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
            "T 0.7, top_p 0.95": {"temperature": 0.7, "top_p": 0.95},
            "T 0.7, top_k 50": {"temperature": 0.7, "top_k": 50},
            "T 0.7, min_p 0.05": {"temperature": 0.7, "min_p": 0.05},
            "T 0.7, repetition 1.1": {"temperature": 0.7, "repetition_penalty": 1.1},
            "T 0.7, presence 0.5, frequency 0.3": {"temperature": 0.7, "presence_penalty": 0.5,
                                                   "frequency_penalty": 0.3}}
PROMPT_TOKENS, OUTPUT_TOKENS = 300, 128  # each row's, for the penalties (random ids, drawn once)


class Recorder:
    """Wraps the engine's sampler, keeping a copy of every logits row it is given."""

    def __init__(self, sampler) -> None:
        self.sampler, self.rows = sampler, []

    def __call__(self, logits, inputs):
        self.rows.append(logits.float().clone())
        return self.sampler(logits, inputs)


def model_logits(n: int) -> torch.Tensor:
    """n rows of the default model's logits: the steps of its answers to chat questions at temperature 0.7."""
    from speculative import make_prompts

    llm = LLM()
    recorder = Recorder(llm.engine.runner.sampler)
    llm.engine.runner.sampler = recorder
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template(conv) for conv, _ in make_prompts("chat", 4, 0)]
    llm.generate(prompts, SamplingParams(temperature=0.7, max_tokens=n, seed=0), use_tqdm=False)
    rows = torch.cat(recorder.rows)
    if rows.shape[0] < n:
        raise SystemExit(f"the model gave {rows.shape[0]} rows, fewer than {n}")
    return rows[:n].contiguous()


def timed(fn, repeat: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def kernels_off():
    """The sampler's race and cut kernels turned off (torch's ops instead); the argmax and uniform kernels stay."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(sampler_module, "race_applies", lambda x: False))
    stack.enter_context(mock.patch.object(logits_processors, "stage_kernels_apply", lambda x: False))
    return stack


def engines(args) -> tuple[list[str], dict]:
    """Whole engines decoding, the kernels on and off in turn: (table lines, results)."""
    from sampling_noise import PROMPTS
    from sampling_noise import run as closed_loop

    llm = LLM(max_num_seqs=max(args.concurrency))
    lines = ["| parameters | concurrency | torch's ops tok/s | kernels tok/s | kernels x torch (rounds) "
             "| same tokens |", "|---|---:|---:|---:|---|---|"]
    results = {}
    for setting in ("T 0.7", "T 0.7, top_p 0.9", "T 0.7, repetition 1.1"):
        for c in args.concurrency:
            n = max(c, 8)
            prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
            params = [SamplingParams(**SETTINGS[setting], max_tokens=args.max_tokens, ignore_eos=True)] * n
            closed_loop(llm, c, params, prompts)  # warm-up
            runs: dict[str, list[dict]] = {"torch": [], "kernels": []}
            for k in range(args.rounds):
                for way in (("kernels", "torch") if k % 2 == 0 else ("torch", "kernels")):
                    with kernels_off() if way == "torch" else contextlib.nullcontext():
                        runs[way].append(closed_loop(llm, c, params, prompts))
            tok_s = {w: statistics.median(r["tok_s"] for r in rs) for w, rs in runs.items()}
            ratios = [b["tok_s"] / a["tok_s"] for a, b in zip(runs["torch"], runs["kernels"])]
            same = all(a["tokens"] == b["tokens"] for a, b in zip(runs["torch"], runs["kernels"]))
            lines.append(f"| {setting} | {c} | {tok_s['torch']:.1f} | {tok_s['kernels']:.1f} | "
                         f"{statistics.median(ratios):.2f} ({' / '.join(f'{x:.2f}' for x in ratios)}) | "
                         f"{'yes' if same else 'no'} |")
            print(lines[-1], flush=True)
            results[f"{setting} / c{c}"] = {"tok_s": tok_s, "ratio_rounds": ratios,
                                            "ratio": statistics.median(ratios), "same_tokens": same}
    return lines, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 2, 5, 9, 32])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=30, help="calls per timing")
    ap.add_argument("--name", default="sampling")
    ap.add_argument("--engines", action="store_true", help="then whole engines, the kernels on and off in turn")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32], help="with --engines")
    ap.add_argument("--max-tokens", type=int, default=64, help="with --engines: per request (ignore_eos)")
    args = ap.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("sampling.py compares the CPU kernel with torch's ops, and no kernel is built here")

    sampler = Sampler()
    rows = model_logits(max(args.rows))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (PROMPT_TOKENS,), generator=g).tolist()
    output = torch.randint(0, VOCAB, (OUTPUT_TOKENS,), generator=g).tolist()
    cases = {}
    for setting, kw in SETTINGS.items():
        for n in args.rows:
            logits = rows[:n].clone()
            inputs = SamplingInputs([SamplingParams(**kw)] * n, [None] * n, [prompt] * n, [output] * n, [2])
            cases[(setting, n)] = (logits, inputs)

    def run(case):
        return lambda: sampler(*case)

    times: dict[tuple, dict[str, list[float]]] = {key: {"kernel": [], "torch": []} for key in cases}
    with torch.inference_mode():
        for k in range(args.rounds):
            for key, case in cases.items():
                times[key]["kernel"].append(timed(run(case), args.repeat))
                with kernels_off():
                    times[key]["torch"].append(timed(run(case), args.repeat))
            print(f"round {k} done", flush=True)

    lines = ["| parameters | rows | torch's ops, us | kernel, us | x faster | kernel, us a row |",
             "|---|---:|---:|---:|---:|---:|"]
    results = {}
    for (setting, n), t in times.items():
        best = {path: min(v) for path, v in t.items()}
        lines.append(f"| {setting} | {n} | {1e6 * best['torch']:.0f} | {1e6 * best['kernel']:.0f} | "
                     f"{best['torch'] / best['kernel']:.2f} | {1e6 * best['kernel'] / n:.0f} |")
        results[f"{setting} / {n}"] = {"best_s": best, "all_s": t}
    table = "\n".join(lines)
    if args.engines:
        engine_lines, results["engines"] = engines(args)
        table += ("\n\nEngines decoding (the default model, one engine, a closed loop; medians of the rounds):\n\n"
                  + "\n".join(engine_lines))
    setup = (f"The sampler (kvserve/sampling/sampler.py) on rows of the default model's {VOCAB} logits (its answers "
             "to 4 chat questions at temperature 0.7), unseeded (one draw of uniforms for the step), each row with "
             f"a {PROMPT_TOKENS}-token prompt and {OUTPUT_TOKENS} output tokens (random ids) for the penalties, "
             "fastest of "
             f"{args.rounds} rounds of {args.repeat} calls, the two paths taking turns. 'torch's ops' is the "
             "same sampler with the five kernels turned off (race_applies and stage_kernels_apply False); the "
             "argmax and uniform kernels run in both.")
    if args.engines:
        setup += (f" Engines: one engine of the default model (dtype and quantization auto), sampling_noise.py's 8 "
                  f"chat questions (or as many as the concurrency) in a closed loop, {args.max_tokens} output "
                  "tokens each (ignore_eos), unseeded (the default generator seeded before each run, so both ways "
                  f"draw the same uniforms); {args.rounds} rounds, the two ways alternating which goes first.")
    report(args.name, "The sampler's kernels against torch's ops", args, setup, table, results,
           isa=cpu_kernels.isa(), script="sampling")


if __name__ == "__main__":
    main()
