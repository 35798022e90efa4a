"""Where a speculative step's time goes on open chat at one stream, part by part, beside a step without
speculation: why the issue's chat target (1.3x with a trained draft) sits at the edge on fast CPUs.

Two engines of the default model, one without speculation and one with the mixed-traffic configuration
(`eagle-tree-lookup` in benchmarks/speculative.py: the shipped eagle head's tree behind prompt lookup), answer
speculative.py's chat questions greedily, one request at a time, the engines taking turns request by request
in each round. Each engine's parts are timed by wrapping them in place (perf_counter):

  forward        the target's forward pass (ModelRunner's model.forward)
  logits         the LM head over every row the step computes
  runner rest    the rest of ModelRunner.execute: inputs, attention metadata, verification, sampling
  head           the eagle head's drafting calls (EagleProposer.draft_trees)
  propose rest   the rest of Speculator.propose: lookup, the draft-length rule, tree ranking
  engine rest    the rest of LLMEngine.step: scheduling, appending tokens, acceptance records, outputs

per step, and per generated token (what the ratio is made of). Rows per step are the tokens the forward passes
computed over the steps.

    python benchmarks/spec_step_phases.py            # results/spec_step_phases_<isa>.{json,md}
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict

from common import report
from kvserve import LLM, SamplingParams
from kvserve.kernels import cpu as cpu_kernels
from speculative import make_prompts

TREE = "[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (1,), (2,)]"
SPEC = {"method": "eagle", "num_speculative_tokens": 6, "speculative_token_tree": TREE,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PARTS = ("forward", "logits", "runner rest", "head", "propose rest", "engine rest")


class PhaseTimer:
    """Seconds in each wrapped call of one engine, and the rows its forward passes computed."""

    def __init__(self, llm: LLM) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.rows = 0
        e = llm.engine
        self._wrap(e, "_step", "step")
        self._wrap(e.runner, "execute", "execute")
        self._wrap(e.runner.model, "forward", "forward", count_rows=True)
        self._wrap(e.runner.model, "compute_logits", "logits")
        if e.speculator is not None:
            self._wrap(e.speculator, "propose", "propose")
            self._wrap(e.speculator.draft, "draft_trees", "head")

    def _wrap(self, obj, name: str, key: str, count_rows: bool = False) -> None:
        fn = getattr(obj, name)

        def call(*args, **kwargs):
            if count_rows:
                self.rows += int(args[0].numel())  # the step's input ids: one per row
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t0
        setattr(obj, name, call)

    def parts(self) -> dict[str, float]:
        s = self.seconds
        return {"forward": s["forward"], "logits": s["logits"],
                "runner rest": s["execute"] - s["forward"] - s["logits"], "head": s["head"],
                "propose rest": s["propose"] - s["head"], "engine rest": s["step"] - s["execute"] - s["propose"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="spec_step_phases")
    args = ap.parse_args()

    llms = {"none": LLM(kv_cache_memory=512 << 20), "eagle-tree-lookup": LLM(speculative_config=SPEC,
                                                                             kv_cache_memory=512 << 20)}
    tok = llms["none"].get_tokenizer()
    prompts = [tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
               for conv, _ in make_prompts("chat", args.num_requests, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    outputs: dict[str, list[list[int]]] = {m: [] for m in llms}
    steps = dict.fromkeys(llms, 0)

    def answer(method: str, prompt: list[int], keep: bool) -> None:
        engine = llms[method].engine
        engine.add_request(f"{method}-{time.monotonic_ns()}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and keep:
                    outputs[method].append(out.outputs[0].token_ids)
            steps[method] += keep

    for method in llms:  # warm-up: one answer each, untimed
        answer(method, prompts[0], keep=False)
    timers = {m: PhaseTimer(llm) for m, llm in llms.items()}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):  # request by request, the order alternating
            order = list(llms) if (r + i) % 2 == 0 else list(llms)[::-1]
            for method in order:
                llms[method].engine.reset_prefix_cache()
                answer(method, prompt, keep=True)
    same = outputs["none"] == outputs["eagle-tree-lookup"]
    tokens = sum(len(o) for o in outputs["none"])
    answers = args.rounds * len(prompts)  # each answer's prompt ran in one step (its first token's)
    prompt_rows = args.rounds * sum(len(p) for p in prompts)

    rows = [("| part | none, ms per step | eagle-tree-lookup, ms per step | none, ms per token | "
             "eagle-tree-lookup, ms per token |"), "|---|---:|---:|---:|---:|"]
    results = {}
    for m, t in timers.items():
        parts = t.parts()
        results[m] = {"steps": steps[m], "tokens": tokens, "rows": t.rows,
                      "decode_rows_per_step": (t.rows - prompt_rows) / (steps[m] - answers),
                      "seconds": {p: parts[p] for p in PARTS}, "total_seconds": sum(parts.values())}
    for p in (*PARTS, "total"):
        cells = []
        for per in ("step", "token"):
            for m in llms:
                x = results[m]["total_seconds"] if p == "total" else results[m]["seconds"][p]
                cells.append(f"{1e3 * x / (steps[m] if per == 'step' else tokens):.3f}")
        rows.append(f"| {p} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} |")
    n, s = results["none"], results["eagle-tree-lookup"]
    speedup = n["total_seconds"] / s["total_seconds"]
    summary = (f"\n{tokens} tokens each, {args.rounds} rounds of {args.num_requests} chat questions; steps: none "
               f"{n['steps']}, eagle-tree-lookup {s['steps']} ({tokens / s['steps']:.2f} tokens a step); rows a "
               f"decode step (the prompts' steps left out): none {n['decode_rows_per_step']:.2f}, "
               f"eagle-tree-lookup {s['decode_rows_per_step']:.2f}; time x none: {speedup:.2f}x; the same "
               f"outputs: {'yes' if same else 'NO'}.")
    table = "\n".join(rows) + "\n" + summary
    results["speedup"] = speedup
    results["same_outputs"] = same
    setup = (f"Model: the default SmolLM2-135M-Instruct (dtype auto, quantization auto), greedy, at most "
             f"{args.max_tokens} tokens, one request at a time; eagle-tree-lookup: {SPEC}. Parts as in the "
             f"script's docstring (wrapped with perf_counter, which adds ~1 us a call).")
    report(args.name, "Where a speculative chat step's time goes (one stream)", args, setup, table, results,
           isa=cpu_kernels.isa())


if __name__ == "__main__":
    main()
