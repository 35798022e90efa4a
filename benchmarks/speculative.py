"""Speculative decoding on the default model: output tok/s and TPOT with and without each method, at several
concurrencies, on three workloads, with the acceptance rate per draft position.

    python benchmarks/speculative.py                                   # the full run (long on 2 cores)
    python benchmarks/speculative.py --concurrency 1 --num-requests 2 --repeat-max-tokens 8 --workloads repeat   # smoke

Workloads (prompts cut from offline text, chat template applied, greedy unless --temperature):
  repeat     copy a given text: a Shakespeare passage or a piece of kvserve's own source code (a copy may
             emit its text's token count + 8 tokens: --repeat-max-tokens)
  summarise  summarise a given passage
  chat       open questions, nothing to copy from
  rollouts   the chat questions, each asked --rollouts times in a row (RL rollouts, best-of-n, self-consistency:
             with --temperature, each request has a seed of its own, --seed + its number, so the samples differ)
Methods: none; none-control (a second engine without speculation: its ratio to `none` is this host's
noise between identical engines, the yardstick for every other ratio); ngram (the adaptive defaults: each
step carries only the draft tokens that this engine's measured step times say pay, none above
disable_by_batch_size running sequences, per-request pauses on low acceptance); ngram-fixed (the same,
but every step drafts all k tokens: adaptive_draft_length false);
ngram-always (all k tokens in every step, no batch limit, no pauses: to find the crossover batch size);
ngram-unlimited (the adaptive defaults without the batch limit: what the per-step draft length alone does);
ngram-plain (ngram with tokens matched only as themselves, no whitespace classes: kvserve/spec_decode/ngram.py);
ngram-one-class (ngram with one acceptance record for all drafts, not one per match length: draft_length.py);
ngram-one-length (ngram with one draft length for every sequence of a step, not one per sequence);
ngram-long (ngram with num_speculative_tokens and prompt_lookup_max --ngram-long-k, for copies);
ngram-no-indents, ngram-long-no-indents (those without moving a draft's indentation with the copy's: ngram.Indents);
eagle-lookup-plain (eagle-lookup's prompt lookup without whitespace classes and indentation, as before session 35);
draft, draft-fixed, draft-always, the same with the draft model (--draft-model, default: the draft shipped
for the default model, k = --draft-k); draft-b (and its variants), a second draft (--draft-b-model) side by
side with the first; eagle, eagle-fixed, eagle-always, eagle-unlimited, the same with the eagle head
(--eagle-model, default: the shipped head, k = --eagle-k); eagle-lookup, the head with prompt lookup in
front of it (lookup --prompt-lookup-min..max drafts where the last tokens occurred before, the head
elsewhere; k = --eagle-lookup-k for both); eagle-lookup-long, the head behind ngram-long's lookup (k and
prompt_lookup_max --ngram-long-k); eagle-b, eagle with a second head (--eagle-b-model, e.g. an
earlier one) for two heads side by side in one run, and eagle-b-fixed, eagle-b-always; eagle-tree, the head
with alternatives to its first draft token (--eagle-tree, vLLM's speculative_token_tree), and its variants;
eagle-tree2, a second tree beside it (--eagle-tree2); eagle-tree-lookup, prompt lookup in front of a tree
(--eagle-tree-lookup, whose chain also bounds lookup's drafts; lookup --prompt-lookup-min..max);
eagle-tree-suffix, the same tree behind suffix decoding (enable_suffix_decoding: the sequence's own text and
earlier responses, as method suffix drafts, bounded by the tree's chain); eagle-suffix-long, the head behind
suffix decoding with k = --ngram-long-k.
suffix (vLLM's method "suffix", kvserve/spec_decode/suffix.py: the sequence's own text and the responses of the
requests the engine finished before, up to --suffix-k tokens; every round starts from an empty corpus, after the
warm-up, so that no round drafts the answers of a round before: a request's prompt and seed recur only across
rounds); suffix-own (the same with suffix_decoding_max_cached_requests 0: the sequence's own text alone);
suffix-finished and eagle-suffix-long-finished (those drafting from finished responses only, not from those of
the other running sequences, as before session 59).
<method>-dense-probes (ngram, ngram-long, draft, eagle, eagle-lookup, eagle-tree-lookup): the method probing one
draft token more every PROBE_EVERY-th decision wherever that length is estimated at half the best rate or more,
the draft-length rule before session 41 (now its probes are spaced to cost PROBE_COST: draft_length.py).

Each (workload, concurrency) runs a closed loop: `concurrency` requests in flight, a new one added when one
finishes, until --num-requests (at least `concurrency`) are done; --rounds times, the methods taking turns,
and the table gives medians over the rounds. At one stream the turns are by request (--take-turns): each
request runs on every engine before the next, so the compared times are seconds apart, not a run apart. At
more streams every method's closed loop runs at once, the engines taking turns step by step, each loop's
clock counting only its own engine's steps (before session 32 they took turns run by run, and a run of 32
streams moved by up to 15% between identical engines). TPOT per request is (last token time - first token
time) / (output tokens - 1), a token's time being when the step that made it returned; the table gives the
median, and "decode x none" the ratio of the token-weighted means (all requests' tokens after their first over
the time from their first token to their last), which weighs requests by length as output tok/s does but
leaves out the prefill that speculation cannot shorten ("first token", the median wait from a request's
arrival to its first token).
"same" says whether every output equals that of `none`, greedy or (with --temperature) sampled with one seed
for every request, or one per request for rollouts (it must; a "no" is a bug). "steps" and
"rejected rows" (draft tokens the target computed and rejected) say how much forward work a run did beside
`none`'s, and "outside the model" the run's time per step outside the target's forward passes and logits
(scheduling, drafting, verification, sampling, Python): a method with `none`'s steps, no rejected rows and
`none`'s time outside the model did what `none` did, and its ratio to `none` is this host's noise (see
none-control).
"""
from __future__ import annotations

import argparse
import ast
import math
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path

import torch
from common import BLAS_CHOICES, report, use_blas
from kvserve import LLM, SamplingParams
from kvserve.bench.corpus import load_corpus
from kvserve.kernels import cpu as cpu_kernels
from kvserve.spec_decode import draft_length
from kvserve.spec_decode.draft_length import DraftLength
from kvserve.spec_decode.ngram import NgramProposer
from kvserve.spec_decode.suffix import SuffixProposer

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What makes a good cup of tea?", "Explain how a bicycle stays upright.", "Why is the sky blue?",
    "Give me three tips for learning a new language.", "What is the difference between weather and climate?",
    "How do vaccines work?", "Describe a pleasant walk in autumn.", "What should I pack for a weekend trip?",
    "Why do cats purr?", "How does a refrigerator keep food cold?", "What is a prime number?",
    "Suggest a name for a small bakery.", "How do plants make food?", "What is the tallest mountain?",
    "Write a short poem about rain.", "What are the benefits of sleep?",
]
# The code the copies repeat: three of kvserve's own files as they were at git 811af10 (session 27's grid),
# frozen here, since the files themselves change and a copy workload that changes with them is not the same
# workload from one run to the next (session 28 edited block_manager.py: 4 fewer tokens a copy).
CODE_FILES = [f"benchmarks/data/copy_sources/{name}.txt" for name in ("block_manager.py", "logits_processors.py",
                                                                      "request.py")]


def make_prompts(workload: str, n: int, seed: int, rollouts: int = 1) -> list[tuple[list[dict], str | None]]:
    """n conversations of the workload, each with the text it asks to copy (None unless "repeat"); "rollouts":
    each chat question `rollouts` times in a row."""
    rng = random.Random(seed)
    corpus = load_corpus() if workload in ("repeat", "summarise") else None
    convs = []
    for i in range(n):
        if workload == "repeat":
            if i % 2:
                lines = (ROOT / CODE_FILES[i // 2 % len(CODE_FILES)]).read_text().splitlines()
                start = rng.randrange(max(1, len(lines) - 20))
                text, what = "\n".join(lines[start:start + 20]), "Python code"
            else:
                text, what = corpus.passage(rng.randrange(len(corpus.lines)), 500), "text"
            content = f"Repeat the following {what} exactly, with no comment:\n\n{text}"
            convs.append(([{"role": "user", "content": content}], text))
            continue
        elif workload == "summarise":
            content = ("Summarise the following passage in a few sentences:\n\n"
                       + corpus.passage(rng.randrange(len(corpus.lines)), 900))
        else:
            content = QUESTIONS[(i // rollouts if workload == "rollouts" else i) % len(QUESTIONS)]
        convs.append(([{"role": "user", "content": content}], None))
    return convs


# Methods whose prompt lookup goes without some of its parts (ngram.NgramProposer's attributes): what each
# part was measured against.
LOOKUP_WITHOUT = {"ngram-plain": ("token_classes",), "ngram-no-indents": ("indents",),
                  "ngram-long-no-indents": ("indents",), "eagle-lookup-plain": ("token_classes", "indents")}


DENSE_PROBES = "-dense-probes"  # a method's variant that probes the next length every PROBE_EVERY-th decision
# A method's variant whose draft classes learn their acceptance at the moving average's weight from their first
# draft on (draft_length.PRIOR_OUTCOMES large enough), the rule before session 57.
SLOW_CLASSES = "-slow-classes"


def method_config(method: str, args) -> dict | None:
    method = method.removesuffix(DENSE_PROBES).removesuffix(SLOW_CLASSES)
    if method in ("none", "none-control"):
        return None
    if method.startswith("draft-b"):
        cfg = {"method": "draft", "num_speculative_tokens": args.draft_k, "model": args.draft_b_model}
    elif method.startswith("draft"):
        cfg = {"method": "draft", "num_speculative_tokens": args.draft_k, "model": args.draft_model}
    elif method.startswith("eagle-lookup-long"):
        cfg = {"method": "eagle", "num_speculative_tokens": args.ngram_long_k, "model": args.eagle_model,
               "prompt_lookup_max": args.ngram_long_k, "prompt_lookup_min": args.prompt_lookup_min}
    elif method.startswith("eagle-lookup"):
        cfg = {"method": "eagle", "num_speculative_tokens": args.eagle_lookup_k, "model": args.eagle_model,
               "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    elif method.startswith("eagle-suffix-long"):
        cfg = {"method": "eagle", "num_speculative_tokens": args.ngram_long_k, "model": args.eagle_model,
               "enable_suffix_decoding": True}
    elif method.startswith("eagle-tree"):
        behind = method in ("eagle-tree-lookup", "eagle-tree-suffix")  # the tree behind lookup or suffix decoding
        tree = (args.eagle_tree2 if method.startswith("eagle-tree2") else args.eagle_tree_lookup if behind
                else args.eagle_tree)
        cfg = {"method": "eagle", "num_speculative_tokens": len(ast.literal_eval(tree)),
               "speculative_token_tree": tree, "model": args.eagle_model}
        if method == "eagle-tree-lookup":  # lookup in front of the tree, as eagle-lookup puts it before a chain
            cfg.update(prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min)
        elif method == "eagle-tree-suffix":  # suffix decoding there instead
            cfg.update(enable_suffix_decoding=True)
    elif method.startswith("eagle-b"):
        cfg = {"method": "eagle", "num_speculative_tokens": args.eagle_k, "model": args.eagle_b_model}
    elif method.startswith("eagle"):
        cfg = {"method": "eagle", "num_speculative_tokens": args.eagle_k, "model": args.eagle_model}
    elif method.startswith("suffix"):
        cfg = {"method": "suffix", "num_speculative_tokens": args.suffix_k}
        if method.startswith("suffix-own"):
            cfg["suffix_decoding_max_cached_requests"] = 0
    elif method.startswith("ngram-long"):
        cfg = {"method": "ngram", "num_speculative_tokens": args.ngram_long_k,
               "prompt_lookup_max": args.ngram_long_k, "prompt_lookup_min": args.prompt_lookup_min}
    else:
        cfg = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
               "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    if method.endswith("-always"):
        cfg.update(disable_by_batch_size=None, min_acceptance_rate=0.0, adaptive_draft_length=False)
    elif method.endswith("-fixed"):
        cfg.update(adaptive_draft_length=False)
    elif method.endswith("-unlimited"):
        cfg.update(disable_by_batch_size=None)
    return cfg


class TargetTimer:
    """Seconds the engine spends in the target model's forward passes and logits (wrapped in place), so that
    a run's time outside them (scheduling, drafting, verification, sampling, Python) can be told apart.
    On the CPU only: a GPU's forward returns before its work is done, and a graph replay calls neither."""

    def __init__(self, llm: LLM) -> None:
        self.seconds = 0.0
        self.enabled = llm.engine.device.type == "cpu"
        if self.enabled:
            model = llm.engine.runner.model
            model.forward = self._timed(model.forward)
            model.compute_logits = self._timed(model.compute_logits)

    def _timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return call


def graph_replays(llm: LLM) -> Counter | None:
    """On CUDA, the steps each captured graph shape has run so far; None without graphs."""
    graphs = llm.engine.runner.graphs
    return None if graphs is None else Counter(graphs.replays)


def graph_steps(llm: LLM, before: Counter) -> dict:
    """The target's graph replays by shape ("sequences x tokens") since `before`, all rounds together (eager
    steps and the eagle head's graphs not counted), with the BLAS library each shape's graph kept and each
    candidate's replay ms at capture: which choices a run's speed rested on (JSON only)."""
    graphs = llm.engine.runner.graphs
    return {f"{s}x{w}": {"replays_all_rounds": n - before[(s, w)], "blas": graphs.blas[(s, w)],
                         "capture_ms": graphs.blas_ms[(s, w)]}
            for (s, w), n in sorted(graphs.replays.items()) if n > before[(s, w)]}


def closed_loop(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], concurrency: int,
                timer: TargetTimer, fresh_cache: bool = True):
    """A closed loop of the requests, `concurrency` in flight: a generator that yields after every engine step
    and returns the run's figures. Its clock counts only the time spent inside it, so that several loops can
    take turns step by step (run_steps_in_turns) and each still times its own engine alone; a token's time is
    when the step that made it returned (as a client receives it)."""
    engine = llm.engine
    if fresh_cache:
        engine.reset_prefix_cache()
    before = engine.get_stats()
    in_model = timer.seconds
    pending = list(enumerate(prompts))
    in_flight: set[str] = set()
    outputs = {}
    clock = 0.0
    added: dict[str, float] = {}
    first_token: dict[str, float] = {}
    last_token: dict[str, float] = {}
    while pending or in_flight:
        t0 = time.perf_counter()
        while pending and len(in_flight) < concurrency:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params[i])
            in_flight.add(f"r{i}")
            added[f"r{i}"] = clock
        step_outputs = engine.step()
        now = clock + time.perf_counter() - t0
        for out in step_outputs:
            if any(out.new_token_ids):
                first_token.setdefault(out.request_id, now)
                last_token[out.request_id] = now
            if out.finished:
                in_flight.discard(out.request_id)
                outputs[int(out.request_id[1:])] = out
        clock += time.perf_counter() - t0
        yield
    in_model = timer.seconds - in_model
    after = engine.get_stats()
    steps = after.num_steps - before.num_steps
    tokens = [len(outputs[i].outputs[0].token_ids) for i in range(len(prompts))]
    tpots = [(last_token[f"r{i}"] - first_token[f"r{i}"]) / (n - 1) for i, n in enumerate(tokens) if n > 1]
    decode_seconds = sum(last_token[f"r{i}"] - first_token[f"r{i}"] for i in range(len(prompts)))
    drafts = after.spec_num_drafts - before.spec_num_drafts
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    per_pos = [a - (before.spec_accepted_per_pos[j] if j < len(before.spec_accepted_per_pos) else 0)
               for j, a in enumerate(after.spec_accepted_per_pos)]
    return {
        "seconds": clock, "output_tokens": sum(tokens), "num_requests": len(prompts),
        "steps": steps, "rejected_rows": drafted - accepted,
        "outside_model_ms_per_step": 1000 * (clock - in_model) / max(1, steps) if timer.enabled else None,
        "output_tok_s": sum(tokens) / clock,
        "tpot_median_ms": 1000 * statistics.median(tpots) if tpots else None,
        "decode_seconds": decode_seconds, "decode_tokens": sum(tokens) - len(tokens),
        **acceptance_fields(drafts, drafted, accepted, per_pos),
        "token_ids": [outputs[i].outputs[0].token_ids for i in range(len(prompts))],
        "tpots_ms": [1000 * t for t in tpots],
        "ttfts_ms": [1000 * (first_token[f"r{i}"] - added[f"r{i}"]) for i in range(len(prompts))],
    }


def run_closed_loop(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], concurrency: int,
                    timer: TargetTimer, fresh_cache: bool = True) -> dict:
    """One closed loop on its own, start to end."""
    loop = closed_loop(llm, prompts, params, concurrency, timer, fresh_cache)
    while True:
        try:
            next(loop)
        except StopIteration as done:
            return done.value


def run_steps_in_turns(llms: dict[str, LLM], order: list[str], prompts: list[list[int]],
                       params: list[SamplingParams], concurrency: int,
                       timers: dict[str, TargetTimer]) -> dict[str, dict]:
    """Every method's closed loop at once, the engines taking turns step by step, so that this host's drift,
    which moves a run's speed by up to 15% from one run to the next at 32 streams, falls on every engine
    alike; each loop's clock counts only its own steps. The order is shuffled every turn, not rotated: a
    rotation keeps each engine behind the same neighbour, whose step leaves the caches as it leaves them."""
    loops = {m: closed_loop(llms[m], prompts, params, concurrency, timers[m]) for m in order}
    results: dict[str, dict] = {}
    shuffle = random.Random(len(prompts) * 1000 + concurrency).shuffle
    while loops:
        turn = list(loops)
        shuffle(turn)
        for m in turn:
            try:
                next(loops[m])
            except StopIteration as done:
                results[m] = done.value
                del loops[m]
    return results


def forget_responses(llms: dict[str, LLM]) -> None:
    """Empties suffix decoding's corpus of earlier responses in every engine that keeps one: a round must not draft
    the answers a round before gave to the same requests."""
    for llm in llms.values():
        proposer = getattr(llm.engine.speculator, "proposer", None)
        if isinstance(proposer, SuffixProposer):
            proposer.corpus.clear()


def rotated(order: list[str], k: int) -> list[str]:
    """order starting at its k-th entry (mod its length): who goes first changes from turn to turn."""
    return order[k % len(order):] + order[:k % len(order)]


def run_in_turns(llms: dict[str, LLM], order: list[str], prompts: list[list[int]], params: list[SamplingParams],
                 timers: dict[str, TargetTimer]) -> dict[str, dict]:
    """One stream, the methods taking turns request by request (the order rotated each request), so that
    their times for a request are taken seconds apart instead of a whole run apart; per method, the run's
    figures as run_closed_loop gives them. Each engine keeps its prefix cache across its requests, as in one
    closed loop."""
    parts: dict[str, list[dict]] = {m: [] for m in order}
    for i in range(len(prompts)):
        for m in rotated(order, i):
            parts[m].append(run_closed_loop(llms[m], prompts[i:i + 1], params[i:i + 1], 1, timers[m], i == 0))
    return {m: merged_run(runs) for m, runs in parts.items()}


def merged_run(parts: list[dict]) -> dict:
    """One run's figures from its requests' one-request runs."""
    seconds, steps = sum(p["seconds"] for p in parts), sum(p["steps"] for p in parts)
    tokens = sum(p["output_tokens"] for p in parts)
    outside = [p["outside_model_ms_per_step"] for p in parts]
    tpots = [t for p in parts for t in p["tpots_ms"]]
    return {
        "seconds": seconds, "output_tokens": tokens, "num_requests": sum(p["num_requests"] for p in parts),
        "steps": steps, "rejected_rows": sum(p["rejected_rows"] for p in parts),
        "outside_model_ms_per_step": (None if None in outside
                                      else sum(o * p["steps"] for o, p in zip(outside, parts)) / max(1, steps)),
        "output_tok_s": tokens / seconds,
        "tpot_median_ms": statistics.median(tpots) if tpots else None,
        "decode_seconds": sum(p["decode_seconds"] for p in parts),
        "decode_tokens": sum(p["decode_tokens"] for p in parts),
        **pooled_acceptance(parts),
        "token_ids": [t for p in parts for t in p["token_ids"]],
        "tpots_ms": tpots,
        "ttfts_ms": [t for p in parts for t in p["ttfts_ms"]],
    }


def max_tokens(copied: str | None, tok, args) -> int:
    """--max-tokens, except for a copy under --repeat-max-tokens text: its text's token count + 8, what a
    client asking for a copy (or an edit) of a text would allow. The default model does not always stop
    after the text: given 512 tokens, 5 of the 8 copies ran on to the limit, repeating themselves, which
    is easy for prompt lookup and not what a copy is."""
    if copied is None or args.repeat_max_tokens != "text":
        return args.max_tokens if copied is None else int(args.repeat_max_tokens)
    return len(tok.encode(copied, add_special_tokens=False)) + 8


class OneClassProposer:
    """Prompt lookup whose drafts all count as one class (draft_length.py), whatever their match length."""

    def __init__(self, proposer: NgramProposer) -> None:
        self.proposer = proposer

    def propose_with_length(self, token_ids: list[int], max_tokens: int, index=None, salt=None
                            ) -> tuple[list[int], int]:
        return self.proposer.propose_with_length(token_ids, max_tokens, index, salt)[0], 0


class OneLengthDraftLength(DraftLength):
    """The rule before lengths per sequence: one length d for the step, each sequence keeping min(d, its
    drafts), d the rate's best."""

    def choose(self, num_tokens: int, drafts: list[tuple[int, float, int]], num_seqs: int | None = None
               ) -> list[int]:
        if not self.times.measured(num_tokens):
            return [0] * len(drafts)
        expected = []  # [r][m]: sequence r's expected accepted tokens among its first m drafts
        for avail, scale, draft_class in drafts:
            q, e = self.acceptance_by_position(draft_class), [0.0]
            for i in range(avail):
                e.append(e[-1] + min(1.0, q[i] * scale))
            expected.append(e)
        most = max(avail for avail, _, _ in drafts)
        rates = [num_tokens / self.times.estimate(num_tokens)]
        for d in range(1, most + 1):
            rows = num_tokens + sum(min(d, avail) for avail, _, _ in drafts)
            tokens = num_tokens + sum(e[min(d, len(e) - 1)] for e in expected)
            rates.append(tokens / (self.times.estimate(rows) + d * self.draft_seconds))
        best = self.best_or_probe(rates)
        return [min(best, avail) for avail, _, _ in drafts]


def acceptance_fields(drafts: int, drafted: int, accepted: int, per_pos: list[float]) -> dict:
    """A run's acceptance columns from its counts: drafts, their draft tokens, the accepted ones, and per
    position the drafts whose first i + 1 tokens were accepted."""
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "acceptance_per_position": [a / drafts for a in per_pos] if drafts else []}


def pooled_acceptance(runs: list[dict]) -> dict:
    """Acceptance over all rounds' drafts together (each round drafts differently: the draft lengths follow
    measured step times)."""
    per_pos = [0.0] * max([len(x["acceptance_per_position"]) for x in runs] + [0])
    for x in runs:
        for j, rate in enumerate(x["acceptance_per_position"]):
            per_pos[j] += rate * x["drafts"]
    return acceptance_fields(sum(x["drafts"] for x in runs), sum(x["draft_tokens"] for x in runs),
                             sum(x["accepted_tokens"] for x in runs), per_pos)


def by_position(rates: list[float]) -> str:
    """Acceptance by draft position for the table; a long draft's positions that round to 0% after the fourth
    are summed up in one entry (suffix drafts up to 32 tokens)."""
    keep = len(rates)
    while keep > 4 and round(100 * rates[keep - 1]) == 0:
        keep -= 1
    shown = [f"{100 * a:.0f}%" for a in rates[:keep]]
    return " / ".join(shown + ([f"0% at {keep + 1}-{len(rates)}"] if keep < len(rates) else []))


def write_report(args, results: dict, device: torch.device, load_before: tuple[float, float, float]) -> None:
    """The table and results/<name>.{json,md} for the workloads measured so far (written after each one, so
    that a run cut short, as on a GPU lease, keeps what it finished)."""
    lines = ["| workload | concurrency | method | output tokens per request | output tok/s | x none | "
             "x none per round | TPOT median ms | TPOT x none | decode x none | first token median ms | steps | "
             "rejected rows | "
             "outside the model, ms per step | acceptance rate | mean acceptance length | acceptance by position | "
             "same |",
             "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for workload, by_c in results.items():
        for c, by_m in by_c.items():
            for method, r in by_m.items():
                same = "yes" if r["same"] else "no"
                if args.temperature > 0:
                    same += " (seeded)"  # every request has its seed: speculation must not change a token
                rate = "" if r["acceptance_rate"] is None else f"{100 * r['acceptance_rate']:.1f}%"
                length = "" if r["mean_acceptance_length"] is None else f"{r['mean_acceptance_length']:.2f}"
                pos = by_position(r["acceptance_per_position"])
                tpot = "" if r["tpot_median_ms"] is None else f"{r['tpot_median_ms']:.1f}"
                tpot_x = "" if r.get("tpot_x_none") is None else f"{r['tpot_x_none']:.2f}"
                decode_x = "" if r.get("decode_x_none") is None else f"{r['decode_x_none']:.2f}"
                ttft = "" if r.get("ttft_median_ms") is None else f"{r['ttft_median_ms']:.0f}"
                outside = "n/a" if r["outside_model_ms_per_step"] is None else f"{r['outside_model_ms_per_step']:.2f}"
                per_round = " / ".join(f"{x:.2f}" for x in r["x_none_rounds"])
                lines.append(f"| {workload} | {c} | {method} | {r['output_tokens'] / r['num_requests']:.0f} | "
                             f"{r['output_tok_s']:.1f} | {r['x_none']:.2f} | "
                             f"{per_round} | {tpot} | {tpot_x} | {decode_x} | {ttft} | {r['steps']:g} | "
                             f"{r['rejected_rows']:g} | "
                             f"{outside} | {rate} | {length} | "
                             f"{pos} | {same} |")
    per_request = ("token_ids", "tpots_ms", "ttfts_ms")
    saved = {w: {c: {m: {k: v for k, v in r.items() if k not in per_request} for m, r in by_m.items()}
                 for c, by_m in by_c.items()} for w, by_c in results.items()}
    ngram = f"n-gram k={args.num_speculative_tokens}, lookup {args.prompt_lookup_min}..{args.prompt_lookup_max}"
    if any(m.startswith("ngram-long") for m in args.methods):
        ngram += f" (ngram-long: k={args.ngram_long_k}, lookup {args.prompt_lookup_min}..{args.ngram_long_k})"
    setup = (f"Model: the default SmolLM2-135M-Instruct (dtype {args.dtype}, quantization {args.quantization}); "
             f"{ngram}; "
             f"draft k={args.draft_k} ({args.draft_model or 'the shipped draft'}); "
             f"eagle k={args.eagle_k} ({args.eagle_model or 'the shipped head'}"
             + (f"; eagle-lookup k={args.eagle_lookup_k}"
                if any(m.startswith("eagle-lookup") and not m.startswith("eagle-lookup-long") for m in args.methods)
                else "")
             + (f"; eagle-lookup-long k={args.ngram_long_k}, lookup {args.prompt_lookup_min}..{args.ngram_long_k}"
                if "eagle-lookup-long" in args.methods else "")
             + (f"; eagle-tree-lookup {args.eagle_tree_lookup}" if "eagle-tree-lookup" in args.methods else "")
             + (f"; eagle-tree-suffix {args.eagle_tree_lookup} behind suffix decoding (vLLM's suffix_decoding_* "
                f"defaults)" if "eagle-tree-suffix" in args.methods else "")
             + (f"; eagle-suffix-long k={args.ngram_long_k} behind suffix decoding"
                if "eagle-suffix-long" in args.methods else "")
             + (f"; eagle-b: {args.eagle_b_model}" if any(m.startswith("eagle-b") for m in args.methods) else "")
             + (f"; draft-b: {args.draft_b_model}" if any(m.startswith("draft-b") for m in args.methods) else "")
             + "); "
             + (f"suffix k={args.suffix_k} (vLLM's other suffix_decoding_* defaults; each round from an empty "
                f"corpus); " if any(m.startswith("suffix") for m in args.methods) else "")
             + (f"rollouts: {args.rollouts} requests per question, seeds --seed + request number; "
                if "rollouts" in args.workloads else "")
             + f"at most {args.max_tokens} output tokens per request ("
             + ("a copy's text's token count + 8 for repeat" if args.repeat_max_tokens == "text"
                else f"{args.repeat_max_tokens} for repeat")
             + f"), temperature {args.temperature}; closed loop, "
             f"max(concurrency, {args.num_requests}) requests per run, {args.rounds} rounds"
             + {"step": ", at one stream taking turns request by request, at more streams step by step",
                "request": ", at one stream taking turns request by request, at more run by run",
                "run": ", taking turns run by run"}[args.take_turns]
             + " (medians; "
             "\"x none\" is the median of the per-round ratios of output tok/s, \"TPOT x none\" of none's median "
             "TPOT to the method's (decode alone, without the first token's wait), \"decode x none\" the same for "
             "the mean TPOT weighted by tokens (every request's tokens after its first over the time between its "
             "first and last, all requests together); \"first token\" is the wait from a request's arrival to its "
             "first token, over all rounds' requests; acceptance counts every round's drafts). "
             "Load average (1 min) "
             f"{load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (above the core count the "
             "machine was shared and the figures are noisy).")
    if device.type == "cuda":
        setup = (f"GPU: {torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA graphs for decode and "
                 f"verification steps; \"outside the model\" is not measured on a GPU). {setup}")
    else:
        setup = f"CPU kernels: {cpu_kernels.describe().replace('none', 'none (torch paths)').upper()}. {setup}"
    report(args.name, "Speculative decoding", args, setup, "\n".join(lines), saved, script="speculative")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=["repeat", "summarise", "chat"],
                    choices=["repeat", "summarise", "chat", "rollouts"])
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 32])
    ap.add_argument("--methods", nargs="+", default=["none", "ngram", "ngram-fixed", "eagle", "eagle-fixed"],
                    choices=["none", "none-control", "ngram-plain", "ngram-one-class", "ngram-one-length",
                             "ngram-long", "ngram-no-indents", "ngram-long-no-indents", "eagle-lookup",
                             "eagle-lookup-plain", "eagle-lookup-long", "eagle-tree-lookup", "eagle-tree-suffix",
                             "eagle-suffix-long", "eagle-suffix-long-finished", "suffix-finished",
                             *(m + v for m in ("ngram", "draft", "draft-b", "eagle", "eagle-b", "eagle-tree",
                                               "eagle-tree2", "suffix", "suffix-own")
                               for v in ("", "-fixed", "-always", "-unlimited")),
                             *(m + DENSE_PROBES for m in ("ngram", "ngram-long", "draft", "eagle", "eagle-lookup",
                                                          "eagle-tree-lookup")),
                             *(m + SLOW_CLASSES for m in ("ngram", "ngram-long", "eagle-tree-lookup",
                                                          "eagle-suffix-long", "suffix"))])
    ap.add_argument("--num-requests", type=int, default=8, help="per run; at least the concurrency")
    ap.add_argument("--max-tokens", type=int, default=128, help="per request of summarise and chat")
    ap.add_argument("--repeat-max-tokens", default="text",
                    help='per copy: "text" (its text\'s token count + 8: a whole copy) or a number')
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)
    ap.add_argument("--ngram-long-k", type=int, default=8,
                    help="num_speculative_tokens and prompt_lookup_max of method ngram-long")
    ap.add_argument("--rollouts", type=int, default=4, help="workload rollouts: requests per question")
    ap.add_argument("--suffix-k", type=int, default=32,
                    help="num_speculative_tokens of the suffix methods (vLLM suggests 32: the most a draft may hold)")
    ap.add_argument("--draft-k", type=int, default=3, help="num_speculative_tokens of the draft methods")
    ap.add_argument("--draft-model", default=None, help="the draft methods' model (default: the shipped draft)")
    ap.add_argument("--eagle-k", type=int, default=1, help="num_speculative_tokens of the eagle methods")
    ap.add_argument("--eagle-lookup-k", type=int, default=4, help="num_speculative_tokens of eagle-lookup")
    ap.add_argument("--eagle-tree", default="[(0,), (0, 0), (1,), (2,)]",
                    help="speculative_token_tree of the eagle-tree methods (num_speculative_tokens: its nodes)")
    ap.add_argument("--eagle-tree2", default="[(0,), (1,), (2,)]",
                    help="speculative_token_tree of the eagle-tree2 methods: a second tree beside --eagle-tree")
    ap.add_argument("--eagle-tree-lookup", default="[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (1,), (2,)]",
                    help="speculative_token_tree of eagle-tree-lookup: its chain of 4 lets lookup draft 4 tokens")
    ap.add_argument("--eagle-model", default=None, help="the eagle methods' head (default: the shipped head)")
    ap.add_argument("--eagle-b-model", default=None, help="method eagle-b's head (required with eagle-b*)")
    ap.add_argument("--draft-b-model", default=None, help="method draft-b's model (required with draft-b*)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--blas", choices=BLAS_CHOICES, default="choose", help="on a GPU: the step graphs' BLAS library "
                    "(common.use_blas)")
    ap.add_argument("--probe-run", type=int, default=None,
                    help="draft_length.PROBE_RUN for every engine of the run: decisions a probe lasts (default: the "
                         "engine's)")
    ap.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes of KV per engine (all live at once)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="runs of every method at each point, taking turns; the table gives medians")
    ap.add_argument("--take-turns", choices=["step", "request", "run"], default="step",
                    help="how the methods take turns within a round: step (at one stream request by request, at "
                         "more streams step by step, every engine's closed loop running at once); request (at "
                         "one stream request by request, at more run by run, the default before session 32); "
                         "run (run by run everywhere)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="speculative", help="results/<name>.json and .md")
    args = ap.parse_args()
    if any(m.startswith("eagle-b") for m in args.methods) and args.eagle_b_model is None:
        # Without it eagle-b ran the shipped head, the same as eagle, and its rows only looked like a comparison.
        ap.error("methods eagle-b* compare a second head: pass it with --eagle-b-model")
    if any(m.startswith("draft-b") for m in args.methods) and args.draft_b_model is None:
        ap.error("methods draft-b* compare a second draft: pass it with --draft-b-model")
    if "none" not in args.methods:
        args.methods = ["none", *args.methods]  # the baseline every ratio is taken against

    use_blas(args.blas)
    if args.probe_run is not None:
        draft_length.PROBE_RUN = args.probe_run
    results: dict = {}
    load_before = os.getloadavg()
    # Every method's engine lives for the whole run and the methods take turns at each point: this host's
    # memory bandwidth drifts by up to 2x over minutes, and method after method (the order before) had put
    # that drift into the ratios (an engine that never drafted measured 1.15-1.18x `none`).
    llms = {method: LLM(dtype=args.dtype, quantization=args.quantization, num_threads=args.num_threads,
                        speculative_config=method_config(method, args), max_num_seqs=max(args.concurrency),
                        kv_cache_memory=args.kv_cache_memory)
            for method in args.methods}
    for method, parts in LOOKUP_WITHOUT.items():
        if method in llms:
            for part in parts:
                setattr(llms[method].engine.speculator.proposer, part, None)
    for method, llm in llms.items():
        if method.endswith(SLOW_CLASSES):
            llm.engine.speculator.length.prior_outcomes = round(1 / draft_length.POSITION_WEIGHT) - 1
        if method.endswith(DENSE_PROBES):
            llm.engine.speculator.length.probe_cost = math.inf
    if "ngram-one-class" in llms:
        speculator = llms["ngram-one-class"].engine.speculator
        speculator.proposer = OneClassProposer(speculator.proposer)
    for method in ("suffix-finished", "eagle-suffix-long-finished"):
        if method in llms:  # other running sequences' responses never searched
            llms[method].engine.speculator.proposer.set_running = lambda running: None
    if "ngram-one-length" in llms:
        speculator = llms["ngram-one-length"].engine.speculator
        speculator.length = OneLengthDraftLength(speculator.length.max_length)
    timers = {method: TargetTimer(llm) for method, llm in llms.items()}
    device = llms["none"].engine.device
    tok = llms["none"].get_tokenizer()
    for workload in args.workloads:
        for c in args.concurrency:
            n = max(c, args.num_requests)
            convs = make_prompts(workload, n, args.seed, args.rollouts)
            prompts = [tok.encode(tok.apply_chat_template(conv), add_special_tokens=False) for conv, _ in convs]
            # One seed for every request, except rollouts: there a question's samples must differ.
            params = [SamplingParams(temperature=args.temperature, max_tokens=max_tokens(text, tok, args),
                                     seed=(args.seed + (i if workload == "rollouts" else 0)
                                           if args.temperature > 0 else None))
                      for i, (_, text) in enumerate(convs)]
            for method, llm in llms.items():
                run_closed_loop(llm, prompts[:1], params[:1], 1, timers[method])  # warm-up
            # Rounds: every method once per round, the order rotated each round; a method's ratio to `none`
            # is taken within a round, then the median over rounds (a point's single run at 32 had moved
            # +-15% between identical engines).
            rounds: dict[str, list[dict]] = {m: [] for m in llms}
            replays_before = {m: graph_replays(llm) for m, llm in llms.items()}
            for k in range(args.rounds):
                forget_responses(llms)
                order = rotated(list(llms), k)
                if c == 1 and args.take_turns in ("request", "step"):
                    in_turns = run_in_turns(llms, order, prompts, params, timers)
                elif c > 1 and args.take_turns == "step":
                    in_turns = run_steps_in_turns(llms, order, prompts, params, c, timers)
                else:
                    in_turns = {}
                for method in order:
                    r = in_turns.get(method) or run_closed_loop(llms[method], prompts, params, c, timers[method])
                    rounds[method].append(r)
                    print(f"{workload:9s} c={c:<3d} round {k} {method:13s} {r['output_tok_s']:7.1f} tok/s "
                          f"TPOT {r['tpot_median_ms'] or 0:6.1f} ms  acceptance {r['acceptance_rate']}", flush=True)
            for method, runs in rounds.items():
                r = dict(runs[0])
                r["output_tok_s_rounds"] = [x["output_tok_s"] for x in runs]
                r["output_tok_s"] = statistics.median(r["output_tok_s_rounds"])
                r["x_none_rounds"] = [x["output_tok_s"] / b["output_tok_s"] for x, b in zip(runs, rounds["none"])]
                r["x_none"] = statistics.median(r["x_none_rounds"])
                tpots = [x["tpot_median_ms"] for x in runs if x["tpot_median_ms"] is not None]
                r["tpot_median_ms"] = statistics.median(tpots) if tpots else None
                # Decode alone (the first token's wait, the prefill, is the same with or without drafts).
                tpot_ratios = [b["tpot_median_ms"] / x["tpot_median_ms"] for x, b in zip(runs, rounds["none"])
                               if x["tpot_median_ms"] and b["tpot_median_ms"]]
                r["tpot_x_none"] = statistics.median(tpot_ratios) if tpot_ratios else None
                # Decode alone weighted by tokens: every token after a request's first, over the time between its
                # first and last token. A copy that drafts well and one that drafts nothing count by their length,
                # as in output tok/s, where the median TPOT counts them alike.
                mean_tpot = [1000 * x["decode_seconds"] / x["decode_tokens"] for x in runs if x["decode_tokens"]]
                r["tpot_mean_ms"] = statistics.median(mean_tpot) if mean_tpot else None
                decode_ratios = [(b["decode_seconds"] / b["decode_tokens"]) / (x["decode_seconds"] / x["decode_tokens"])
                                 for x, b in zip(runs, rounds["none"]) if x["decode_seconds"] and b["decode_tokens"]]
                r["decode_x_none"] = statistics.median(decode_ratios) if decode_ratios else None
                r["ttft_median_ms"] = statistics.median(t for x in runs for t in x["ttfts_ms"])
                r["steps"] = statistics.median(x["steps"] for x in runs)
                r["rejected_rows"] = statistics.median(x["rejected_rows"] for x in runs)
                outside = [x["outside_model_ms_per_step"] for x in runs if x["outside_model_ms_per_step"] is not None]
                r["outside_model_ms_per_step"] = statistics.median(outside) if outside else None
                r["same"] = all(x["token_ids"] == b["token_ids"] for x, b in zip(runs, rounds["none"]))
                r.update(pooled_acceptance(runs))
                if replays_before[method] is not None:
                    r["graph_steps"] = graph_steps(llms[method], replays_before[method])
                results.setdefault(workload, {}).setdefault(str(c), {})[method] = r
        write_report(args, results, device, load_before)


if __name__ == "__main__":
    main()
