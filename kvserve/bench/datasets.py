"""Benchmark workloads, deterministic by seed, cut from offline text (kvserve/bench/corpus.py).

- random:        input/output lengths drawn uniformly in [L*(1-r), L*(1+r)] (vLLM's random dataset
                 semantics), prompts cut from real text to exactly the drawn token length.
- shared-prefix: a long system prompt shared by every request (or by groups, --num-prefixes) and a
                 short distinct question each -- the workload prefix caching is for.
- chat:          multi-turn conversations of varied turn counts and message lengths, for
                 /v1/chat/completions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvserve.bench.corpus import Corpus, load_corpus
from kvserve.bench.tokenizer import BenchTokenizer

DATASETS = ("random", "shared-prefix", "chat")


@dataclass
class BenchRequest:
    """One request to send. Exactly one of `prompt` (completions) / `messages` (chat) is the payload;
    `prompt` is also set for chat requests (the rendered template) so either endpoint can send it."""

    prompt: str
    prompt_len: int  # tokens as the benchmark's tokenizer counts them (the server's usage wins)
    output_len: int  # max_tokens; with ignore_eos the server generates exactly this many
    messages: list[dict[str, str]] | None = None


@dataclass
class DatasetConfig:
    name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    # random
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    # shared-prefix
    prefix_len: int = 1024
    question_len: int = 32
    num_prefixes: int = 1
    # chat
    max_turns: int = 4
    message_len: int = 64  # mean tokens per earlier message, drawn in [len/2, 3*len/2]


def sample_requests(cfg: DatasetConfig, tokenizer: BenchTokenizer,
                    corpus: Corpus | None = None) -> list[BenchRequest]:
    corpus = corpus or load_corpus()
    rng = random.Random(cfg.seed)  # one stream per dataset: same seed, same requests
    if cfg.name == "random":
        return _random(cfg, tokenizer, corpus, rng)
    if cfg.name == "shared-prefix":
        return _shared_prefix(cfg, tokenizer, corpus, rng)
    if cfg.name == "chat":
        return _chat(cfg, tokenizer, corpus, rng)
    raise ValueError(f"unknown dataset {cfg.name!r}; choose from {', '.join(DATASETS)}")


def cut_text(tokenizer: BenchTokenizer, corpus: Corpus, rng: random.Random, num_tokens: int) -> str:
    """Text from a random place in the corpus that tokenizes to `num_tokens` tokens.

    Decoding a token prefix and re-encoding it can merge differently at the cut, so the length is
    corrected a few times; it ends exact in practice, and within a token or two at worst."""
    if num_tokens <= 0:
        return ""
    start = rng.randrange(len(corpus.lines))
    ids = tokenizer.encode(corpus.passage(start, min_chars=num_tokens * 6 + 64))
    while len(ids) < num_tokens:  # very dense text: take more
        ids = ids + tokenizer.encode("\n" + corpus.passage(start + len(ids), num_tokens * 6))
    target = num_tokens
    text = tokenizer.decode(ids[:target])
    for _ in range(4):
        n = tokenizer.count(text)
        if n == num_tokens:
            break
        target += num_tokens - n
        text = tokenizer.decode(ids[:max(1, target)])
    return text


def _uniform_len(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def _random(cfg: DatasetConfig, tok: BenchTokenizer, corpus: Corpus,
            rng: random.Random) -> list[BenchRequest]:
    out = []
    for _ in range(cfg.num_prompts):
        in_len = _uniform_len(rng, cfg.input_len, cfg.range_ratio)
        out_len = _uniform_len(rng, cfg.output_len, cfg.range_ratio)
        prompt = cut_text(tok, corpus, rng, in_len)
        out.append(BenchRequest(prompt, tok.count(prompt), out_len))
    return out


def _shared_prefix(cfg: DatasetConfig, tok: BenchTokenizer, corpus: Corpus,
                   rng: random.Random) -> list[BenchRequest]:
    prefixes = [
        "You are a scholar of Elizabethan drama. Read the passage and answer the question.\n\n"
        + cut_text(tok, corpus, rng, cfg.prefix_len) for _ in range(max(1, cfg.num_prefixes))]
    out = []
    for i in range(cfg.num_prompts):
        system = prefixes[i % len(prefixes)]
        # The request index makes every question distinct even if two cuts ever coincide.
        question = f"Question {i + 1}: what does this line tell us? " + cut_text(
            tok, corpus, rng, cfg.question_len)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompt = system + "\n\n" + question
        out.append(BenchRequest(prompt, tok.count(prompt), cfg.output_len, messages))
    return out


def _chat(cfg: DatasetConfig, tok: BenchTokenizer, corpus: Corpus,
          rng: random.Random) -> list[BenchRequest]:
    out = []
    for _ in range(cfg.num_prompts):
        turns = rng.randint(1, max(1, cfg.max_turns))
        messages: list[dict[str, str]] = []
        for t in range(turns):
            if t > 0:  # earlier turns carry the assistant's (here: quoted) replies
                messages.append({"role": "assistant",
                                 "content": cut_text(tok, corpus, rng, _half_to_1_5x(rng, cfg.message_len))})
            messages.append({"role": "user",
                             "content": cut_text(tok, corpus, rng, _half_to_1_5x(rng, cfg.message_len))})
        prompt = tok.apply_chat_template(messages)
        out_len = _uniform_len(rng, cfg.output_len, cfg.range_ratio)
        out.append(BenchRequest(prompt, tok.count(prompt), out_len, messages))
    return out


def _half_to_1_5x(rng: random.Random, mean: int) -> int:
    return rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))
