"""What the memory a step touches outside the target model costs the target's own forward and logits.

    python benchmarks/cache_footprint.py            # ~3 min on 2 cores; results/cache_footprint_<isa>.{json,md}

Where the last-level cache is large beside the quantized default model's ~94 MiB of weights (the Xeon hosts'
L3 is 300 MiB, shared with other tenants), the target's decode step runs partly from cache, and whatever else a
step reads (a draft head's weights) can push the target's weights out to memory: a cost of speculative decoding
that a warm microbenchmark of extra rows does not show. Two parts, one process:

1. The LM head alone (28 MiB of q8 weights), 1 and 4 rows: warm (called back to back) and with its weights
   evicted (a 256 MiB buffer written before each call).
2. One engine decoding the chat questions of benchmarks/speculative.py (one at a time, greedy, 128 tokens),
   each request run under every variant in turn (order alternating): before each of its steps nothing, a read
   of a fixed N MiB buffer, or one call of the shipped eagle head's native drafting (eagle-tree-lookup's tree:
   three first choices and a chain of four). Per decode step: the target's forward and logits (medians).
   The same engine throughout, so only what runs between its steps differs.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import report
from speculative import QUESTIONS
from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels

TREE = "[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (1,), (2,)]"
TREE_CONFIG = {"method": "eagle", "num_speculative_tokens": 6, "speculative_token_tree": TREE,
               "prompt_lookup_max": 4, "prompt_lookup_min": 2}


class StepTimes:
    """Per engine step: seconds in the target's forward and logits (wrapped in place), keyed by the step's
    token count; `before` runs ahead of every step, outside the timed parts."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.before = None
        self.steps: dict[int, list[tuple[float, float]]] = {}
        self._now = {"forward": 0.0, "logits": 0.0}
        model = self.engine.runner.model
        model.forward = self._timed(model.forward, "forward")
        model.compute_logits = self._timed(model.compute_logits, "logits")
        step = self.engine._step

        def timed_step():
            if self.before is not None:
                self.before()
            self._now.update(forward=0.0, logits=0.0)
            out = step()
            if self._now["forward"]:
                self.steps.setdefault(self.engine._last_step_tokens, []).append(
                    (self._now["forward"], self._now["logits"]))
            return out
        self.engine._step = timed_step

    def _timed(self, fn, key: str):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._now[key] += time.perf_counter() - t0
        return call

    def take(self) -> dict[int, list[tuple[float, float]]]:
        steps, self.steps = self.steps, {}
        return steps


def medians_ms(steps: list[tuple[float, float]]) -> tuple[float, float]:
    return (statistics.median(f for f, _ in steps) * 1e3, statistics.median(lg for _, lg in steps) * 1e3)


def lm_head_times(llm: LLM, hidden_size: int, rounds: int) -> list[dict]:
    model = llm.engine.runner.model
    evict = torch.empty(256 << 20, dtype=torch.uint8)
    rows = []
    for n in (1, 4):
        hidden = torch.randn(n, hidden_size)
        for cold in (False, True):
            times = []
            for _ in range(rounds):
                if cold:
                    evict.add_(1)
                t0 = time.perf_counter()
                model.compute_logits(hidden)
                times.append(time.perf_counter() - t0)
            rows.append({"rows": n, "weights": "evicted" if cold else "warm",
                         "ms": statistics.median(times) * 1e3})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="passes over the questions in part 2")
    ap.add_argument("--read-mib", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--name", default="cache_footprint")
    args = ap.parse_args()

    common = dict(dtype="auto", quantization="auto", max_num_seqs=1, kv_cache_memory=512 << 20)
    plain = LLM(**common)
    speculator = LLM(**common, speculative_config=TREE_CONFIG).engine.speculator  # for its head alone
    tok = plain.get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
               for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    def run(llm: LLM, prompt: list[int]) -> None:
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)

    head = speculator.draft.model  # the shipped eagle head
    hidden_size = head.config.hidden_size

    # 1. The LM head alone.
    head_rows = lm_head_times(plain, hidden_size, 40)

    # 2. The plain engine, with something read before each step.
    times = StepTimes(plain)
    buffer = torch.randn(max(args.read_mib) << 18)  # float32: 4 bytes a value
    feature = torch.randn(1, hidden_size) * 3
    token = torch.tensor([1000])
    rates = speculator.calibration.chain_rates()
    variants = {"nothing": None}
    for mib in args.read_mib:
        variants[f"read {mib} MiB"] = (lambda n=mib << 18: buffer[:n].sum())
    variants["eagle head's drafting call"] = lambda: head.draft_chains(feature, token, 3, [4], rates, -1e9)
    for p in prompts[:2]:
        run(plain, p)
    times.take()
    per_variant: dict[str, list] = {v: [] for v in variants}
    order = list(variants)
    for r in range(args.rounds):
        for i, p in enumerate(prompts):
            for v in (order if (i + r) % 2 == 0 else order[::-1]):
                times.before = variants[v]
                run(plain, p)
                per_variant[v] += times.take().get(1, [])
    times.before = None
    base = medians_ms(per_variant["nothing"])
    touch_rows = []
    for v, steps in per_variant.items():
        f, lg = medians_ms(steps)
        touch_rows.append({"before_each_step": v, "steps": len(steps), "forward_ms": f, "logits_ms": lg,
                           "added_ms": f + lg - sum(base)})

    lines = ["| LM head alone | rows | weights | ms |", "|---|---:|---|---:|"]
    lines += [f"| | {r['rows']} | {r['weights']} | {r['ms']:.2f} |" for r in head_rows]
    lines += ["", "| plain engine, before each step | decode steps | forward ms | logits ms | added ms |",
              "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['before_each_step']} | {r['steps']} | {r['forward_ms']:.2f} | {r['logits_ms']:.2f} | "
              f"{r['added_ms']:+.2f} |" for r in touch_rows]
    setup = (f"Default model (SmolLM2-135M-Instruct, dtype auto, quantization auto), the {len(QUESTIONS)} chat "
             f"questions of benchmarks/speculative.py, one at a time, greedy, {args.max_tokens} tokens, "
             f"{args.rounds} rounds. Medians per decode step; 'added' is forward + logits against 'nothing' (the "
             "read itself is outside both).")
    report(args.name, "What the memory a step touches outside the target costs its forward and logits", args,
           setup, "\n".join(lines), {"lm_head": head_rows, "before_each_step": touch_rows},
           isa=cpu_kernels.isa())


if __name__ == "__main__":
    main()
