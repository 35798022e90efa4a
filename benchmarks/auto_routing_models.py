"""Runs both models of the auto route on the routing tasks, greedy, and caches each answer with its score.

The two models differ in kind, so each gets the question in the form it was trained for, with the same eight
worked examples (questions the task set never asks):
- small, SmolLM2-135M-Instruct: its own chat template, a system line asking for the bare answer, and the
  examples as earlier user/assistant turns; it stops at its end-of-turn token.
- large, Gemma 3 270M (base, no chat template): plain text "Q: ...\nA: ..." pairs, then "Q: {question}\nA:";
  it stops at the first newline. This is the completion-style template kvserve chooses for a base model.
The cache is one JSON line per (model, question), so a rerun only runs what is missing; answers are scored
when read (benchmarks/auto_routing.py), so a change to the scorer needs no model run.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence

from auto_routing_tasks import Task

EXAMPLES = [("What is the largest planet in the solar system?", "Jupiter"),
            ("What is 15 + 7?", "22"),
            ("Repeat this line exactly: The quick brown fox jumps over the lazy dog.",
             "The quick brown fox jumps over the lazy dog."),
            ("What is the opposite of \"inside\"?", "outside"),
            ("Write the word \"cat\" in capital letters.", "CAT"),
            ("What number comes next: 2, 4, 6, ?", "8"),
            ("What is the plural of \"wolf\"?", "wolves"),
            ("How many days are in a week?", "7")]
SYSTEM = "Answer with only the answer, no explanation."
PRESETS = {"small": "smollm2-135m", "large": "gemma3-270m"}
MAX_TOKENS = 40


def small_messages(question: str) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": SYSTEM}]
    for q, a in EXAMPLES:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return msgs + [{"role": "user", "content": question}]


def large_prompt(question: str) -> str:
    shots = "".join(f"Q: {q}\nA: {a}\n\n" for q, a in EXAMPLES)
    return f"{shots}Q: {question}\nA:"


def load_cache(path: str) -> dict[tuple[str, str], dict]:
    rows: dict[tuple[str, str], dict] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                rows[(r["model"], r["question"])] = r
    return rows


def run_model(which: str, tasks: Sequence[Task], cache_path: str, batch: int = 32) -> None:
    """Answer every task not yet in the cache with model `which` ("small" or "large"), appending to it."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    done = load_cache(cache_path)
    todo = [t for t in tasks if (which, t.question) not in done]
    if not todo:
        return
    llm = LLM(PRESETS[which])
    for i in range(0, len(todo), batch):
        chunk = todo[i:i + batch]
        if which == "small":
            sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
            outs = llm.chat([small_messages(t.question) for t in chunk], sp, use_tqdm=False)
        else:
            sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0, stop=["\n"])
            outs = llm.generate([large_prompt(t.question) for t in chunk], sp, use_tqdm=False)
        with open(cache_path, "a", encoding="utf-8") as f:
            for t, o in zip(chunk, outs):
                c = o.outputs[0]
                lps = [next(iter(p.values())).logprob for p in (c.logprobs or [])]
                f.write(json.dumps({
                    "model": which, "family": t.family, "question": t.question, "reference": t.answer,
                    "text": c.text, "num_tokens": len(c.token_ids),
                    # the answer's confidence: mean and first-token log-probability (for the cascade baseline)
                    "mean_logprob": sum(lps) / len(lps) if lps else -math.inf,
                    "first_logprob": lps[0] if lps else -math.inf,
                }) + "\n")
        print(f"{which}: {min(i + batch, len(todo))}/{len(todo)}", flush=True)


def prompt_text(which: str, question: str, tokenizer) -> str:
    """The exact text each model is given: the small model's chat template applied, the large one's Q/A text."""
    if which == "small":
        return tokenizer.apply_chat_template(small_messages(question), add_generation_prompt=True)
    return large_prompt(question)


def run_likelihood(which: str, tasks: Sequence[Task], cache_path: str, batch: int = 8) -> None:
    """log P(reference | prompt) under model `which`, from prompt logprobs of prompt + reference: a second,
    continuous measure of quality (exp of it is the chance of sampling exactly the reference at temperature 1).
    The prompt's tokens are its own encoding; the reference's are what the joint encoding adds after them.
    Small batches: the engine keeps logits for every prompt position, and Gemma's vocabulary is 262k wide
    (32 prompts of ~200 tokens would be 6.7 GB of them)."""
    from kvserve.entrypoints.llm import LLM
    from kvserve.sampling_params import SamplingParams

    done = load_cache(cache_path)
    todo = [t for t in tasks if (which, t.question) not in done]
    if not todo:
        return
    llm = LLM(PRESETS[which])
    tok = llm.get_tokenizer()
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for i in range(0, len(todo), batch):
        chunk = todo[i:i + batch]
        ids, starts = [], []
        for t in chunk:
            text = prompt_text(which, t.question, tok)
            special = which == "large"    # Gemma's BOS; SmolLM2's template carries its own markers
            p = tok.encode(text, add_special_tokens=special)
            full = tok.encode(text + " " + t.answer if which == "large" else text + t.answer,
                              add_special_tokens=special)
            n = 0   # where the joint encoding stops agreeing with the prompt's own
            while n < min(len(p), len(full)) and p[n] == full[n]:
                n += 1
            ids.append(full)
            starts.append(n)
        outs = llm.generate(ids, sp, use_tqdm=False)
        with open(cache_path, "a", encoding="utf-8") as f:
            for t, o, n in zip(chunk, outs, starts):
                lps = o.prompt_logprobs or []
                ref = [lps[j][o.prompt_token_ids[j]].logprob for j in range(n, len(o.prompt_token_ids))]
                f.write(json.dumps({"model": which, "question": t.question, "ref_logprob": sum(ref),
                                    "ref_tokens": len(ref)}) + "\n")
        print(f"{which} likelihood: {min(i + batch, len(todo))}/{len(todo)}", flush=True)
