"""Soak: 10,000 mixed requests against one `kvserve serve` (issue 11, must-have 3).

Completions and chat, streaming and not, n > 1, logprobs and prompt logprobs, stop strings, priorities,
aborts (a client that gives up on a non-streaming request), disconnects mid-stream, and malformed bodies,
drawn in fixed proportions from a seed and sent by --concurrency workers. Checked:
  - every valid request is answered correctly (status 200, the right number of choices and tokens, usage
    consistent, logprobs where asked, no stop string in the text, streams ending in [DONE]);
  - every invalid one gets a 4xx with OpenAI's error JSON;
  - at the end, with the server idle, no KV block is held (kvserve:kv_cache_usage_perc == 0: blocks kept
    only as evictable prefix cache count as free) and nothing is running or waiting;
  - server + engine RSS after warm-up (the first 10% of requests) against the end;
  - no ERROR or traceback lines in the server log; /health meanwhile (from another process).

    python benchmarks/soak.py                          # 10,000 requests; writes results/soak.{json,md}
    python benchmarks/soak.py --requests 50 --out /tmp/soak   # a quick check of the script itself
    python benchmarks/soak.py --requests 3000 --name soak_spec_eagle_tree \
        --server-args "--speculative-config '{...}' --num-kv-blocks 256"   # the same mix with speculation
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from common import git_rev, machine_info  # noqa: E402
from serving_probes import HealthProbe, RssSampler, error_lines, raise_fd_limit  # noqa: E402

from kvserve.entrypoints.openai.launcher import RemoteServer  # noqa: E402
from kvserve.kernels import cpu as cpu_kernels  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TOPICS = ["the sea", "a lighthouse", "bread", "prime numbers", "a fox", "rain", "trains", "the moon", "tea",
          "an old map", "bees", "a violin"]
SYSTEM = "You are a patient teacher. Answer plainly and briefly. " * 6   # a shared prefix for the cache
MALFORMED: list[tuple[str, str, bytes]] = [
    ("bad JSON", "/v1/completions", b'{"prompt": "x", "max_tokens": '),
    ("unknown role", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}'),
    ("max_tokens 0", "/v1/completions", b'{"prompt": "x", "max_tokens": 0}'),
    ("negative temperature", "/v1/completions", b'{"prompt": "x", "temperature": -1}'),
    ("empty prompt list", "/v1/completions", b'{"prompt": []}'),
    ("messages not a list", "/v1/chat/completions", b'{"messages": "hello"}'),
    ("n 0", "/v1/completions", b'{"prompt": "x", "n": 0}'),
    ("logprobs 50", "/v1/completions", b'{"prompt": "x", "logprobs": 50}'),
    ("empty cache_salt", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "cache_salt": ""}'),
    ("token id out of range", "/v1/completions", b'{"prompt": [1, 999999999]}'),
    ("NaN", "/v1/completions", b'{"prompt": "x", "top_p": NaN}'),
    ("non-UTF-8", "/v1/completions", b'{"prompt": "\\xff\\xfe"}'.replace(b"\\xff\\xfe", b"\xff\xfe")),
    ("min_tokens > max_tokens", "/v1/completions", b'{"prompt": "x", "max_tokens": 2, "min_tokens": 5}'),
    ("content part not text", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}'),
]
# Kind -> weight (out of 100).
# Speculative decoding's counters, reported where the server speculates (--server-args).
SPEC_COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
MIX = {"completion": 18, "completion_stream": 18, "chat": 12, "chat_stream": 12, "stop": 8, "echo_logprobs": 6,
       "shared_prefix": 8, "abort": 6, "disconnect": 6, "malformed": 6}


@dataclass
class Spec:
    kind: str
    path: str
    body: dict | bytes
    expect: dict = field(default_factory=dict)


def make_spec(rng: random.Random, i: int) -> Spec:
    kind = rng.choices(list(MIX), weights=list(MIX.values()))[0]
    topic = rng.choice(TOPICS)
    base = {"temperature": rng.choice([0.0, 0.7, 1.0]), "seed": rng.randrange(2**31), "priority": rng.randrange(4)}
    max_tokens = rng.randint(4, 24)
    if kind in ("completion", "completion_stream"):
        n = rng.choice([1, 1, 2, 3])
        body = {**base, "prompt": f"Request {i}. A short note about {topic}:", "max_tokens": max_tokens, "n": n,
                "ignore_eos": True, "logprobs": rng.choice([None, 0, 2])}
        if kind == "completion_stream":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return Spec(kind, "/v1/completions", body, {"n": n, "tokens": max_tokens})
    if kind in ("chat", "chat_stream", "shared_prefix"):
        n = rng.choice([1, 1, 2])
        messages = [{"role": "user", "content": f"Request {i}: tell me about {topic}."}]
        if kind == "shared_prefix":
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body = {**base, "messages": messages, "max_completion_tokens": max_tokens, "n": n, "ignore_eos": True}
        if kind == "chat":
            body |= {"logprobs": True, "top_logprobs": 2}
        if kind == "chat_stream":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return Spec(kind, "/v1/chat/completions", body, {"n": n, "tokens": max_tokens})
    if kind == "stop":
        body = {**base, "prompt": f"List {topic} facts, one per line:\n1.", "max_tokens": 32,
                "stop": ["\n", "."], "min_tokens": rng.choice([0, 0, 3]), "logprobs": 0}  # tokens, for min_tokens
        return Spec(kind, "/v1/completions", body, {"stop": ["\n", "."]})
    if kind == "echo_logprobs":
        body = {**base, "prompt": f"The story of {topic} begins", "max_tokens": max_tokens, "echo": True,
                "logprobs": 1, "ignore_eos": True}
        return Spec(kind, "/v1/completions", body, {"tokens": max_tokens})
    if kind == "abort":
        body = {**base, "prompt": f"Write at length about {topic}.", "max_tokens": 400, "ignore_eos": True}
        return Spec(kind, "/v1/completions", body, {"give_up_s": rng.uniform(0.1, 1.5)})
    if kind == "disconnect":
        body = {**base, "prompt": f"Write at length about {topic}.", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        return Spec(kind, "/v1/completions", body, {"read_chunks": rng.randint(1, 4)})
    name, path, raw = MALFORMED[rng.randrange(len(MALFORMED))]
    return Spec("malformed", path, raw, {"name": name})


def check(ok: bool, why: str) -> None:
    if not ok:
        raise AssertionError(why)


def check_response(spec: Spec, status: int, body: dict) -> None:
    check(status == 200, f"status {status}: {str(body)[:300]}")
    e, usage, choices = spec.expect, body["usage"], body["choices"]
    if "n" in e:
        check(len(choices) == e["n"], f"{len(choices)} choices, wanted {e['n']}")
        check(usage["completion_tokens"] == e["n"] * e["tokens"], f"usage {usage}")
        check(all(c["finish_reason"] == "length" for c in choices), "finish_reason")
    if spec.kind == "completion" and spec.body.get("logprobs") is not None:
        check(all(len(c["logprobs"]["tokens"]) == e["tokens"] for c in choices), "completion logprobs length")
    if spec.kind == "chat":
        check(all(len(c["logprobs"]["content"]) == e["tokens"] for c in choices), "chat logprobs length")
    if spec.kind == "shared_prefix":
        check(usage["prompt_tokens_details"]["cached_tokens"] >= 0, "cached_tokens")
    if spec.kind == "stop":
        c = choices[0]
        # As in vLLM, a stop string counts only if it ends in text after the first min_tokens tokens.
        head = "".join(c["logprobs"]["tokens"][:spec.body["min_tokens"]])
        if "\ufffd" not in head:  # a token that is part of a UTF-8 character shows as U+FFFD on its own
            check(c["text"].startswith(head), f"text {c['text']!r} does not start with its tokens {head!r}")
        check(not any(s in c["text"][max(0, len(head) - len(s) + 1):] for s in e["stop"]),
              f"stop string after the first {spec.body['min_tokens']} tokens in {c['text']!r}")
        check(c["finish_reason"] in ("stop", "length"), "finish_reason")
        check(usage["completion_tokens"] >= spec.body["min_tokens"], "min_tokens")
    if spec.kind == "echo_logprobs":
        lp = choices[0]["logprobs"]
        check(len(lp["tokens"]) == usage["prompt_tokens"] + e["tokens"], "echo logprobs length")
        check(lp["token_logprobs"][0] is None and all(v is not None for v in lp["token_logprobs"][1:]),
              "echo token_logprobs")
        check(choices[0]["text"].startswith(spec.body["prompt"]), "echo text")


def check_stream(spec: Spec, events: list[str]) -> None:
    check(bool(events) and events[-1] == "[DONE]", f"stream did not end with [DONE]: {events[-2:]}")
    chunks = [json.loads(ev) for ev in events[:-1]]
    check(not any("error" in c for c in chunks), f"error event: {chunks[-1]}")
    usage = chunks[-1].get("usage")
    check(usage is not None and not chunks[-1]["choices"], "no final usage chunk")
    check(usage["completion_tokens"] == spec.expect["n"] * spec.expect["tokens"], f"usage {usage}")
    finished = Counter(ch["index"] for c in chunks for ch in c["choices"] if ch.get("finish_reason"))
    check(sorted(finished) == list(range(spec.expect["n"])) and set(finished.values()) == {1},
          f"finish reasons per choice: {finished}")
    if spec.kind == "chat_stream":
        check(chunks[0]["choices"][0]["delta"].get("role") == "assistant", "no role chunk first")


async def run_one(session: aiohttp.ClientSession, base_url: str, spec: Spec) -> str:
    """'ok' | 'aborted' | 'disconnected' | 'rejected' (the expected 4xx) | 'overloaded' (429); raises on a fault."""
    url = base_url + spec.path
    if spec.kind == "malformed":
        async with session.post(url, data=spec.body, headers={"Content-Type": "application/json"}) as r:
            body = await r.json(content_type=None)
            check(400 <= r.status < 500, f"{spec.expect['name']}: status {r.status}")
            check(set(body["error"]) == {"message", "type", "param", "code"}, f"error shape {body}")
            return "rejected"
    if spec.kind == "abort":
        try:
            async with session.post(url, json=spec.body,
                                    timeout=aiohttp.ClientTimeout(total=spec.expect["give_up_s"])) as r:
                await r.read()
                check(r.status == 200, f"status {r.status}")
                return "ok"  # finished before the client gave up
        except asyncio.TimeoutError:
            return "aborted"
    async with session.post(url, json=spec.body) as r:
        if r.status == 429:
            await r.read()
            return "overloaded"
        if not spec.body.get("stream"):
            check_response(spec, r.status, await r.json(content_type=None))
            return "ok"
        if r.status != 200:
            check(False, f"status {r.status}: {(await r.read())[:300]!r}")
        events = []
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[6:])
                if spec.kind == "disconnect" and len(events) >= spec.expect["read_chunks"]:
                    return "disconnected"  # leaving the block closes the connection mid-stream
        check_stream(spec, events)
        return "ok"


async def run_all(base_url: str, specs: list[Spec], concurrency: int, on_done) -> tuple[Counter, list[str]]:
    outcomes: Counter = Counter()
    failures: list[str] = []
    todo = iter(enumerate(specs))
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker() -> None:
            for i, spec in todo:
                try:
                    outcome = await run_one(session, base_url, spec)
                except Exception as e:  # noqa: BLE001 - every failure is recorded, the soak goes on
                    outcome = "FAILED"
                    failures.append(f"#{i} {spec.kind}: {type(e).__name__}: {e}")
                outcomes[f"{spec.kind}:{outcome}"] += 1
                on_done()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, failures


def metrics(base_url: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(base_url + "/metrics", timeout=30).text):
        for s in fam.samples:
            if "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def wait_idle(base_url: str, timeout_s: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base_url)
        if m["kvserve:num_requests_running"] == 0 and m["kvserve:num_requests_waiting"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for <name>.{json,md}")
    p.add_argument("--name", default="soak")
    p.add_argument("--server-args", default="", help="more `kvserve serve` options (shell words), after the soak's "
                   "own, which they override: a speculative config, a smaller KV pool to force preemptions (one "
                   "option alone: --server-args=--enforce-eager)")
    args = p.parse_args(argv)

    raise_fd_limit()
    rng = random.Random(args.seed)
    specs = [make_spec(rng, i) for i in range(args.requests)]
    server_args = ["--max-num-seqs", "32", "--max-waiting", "512", "--num-kv-blocks", "1024",
                   "--max-model-len", "1024", "--scheduling-policy", "priority", *shlex.split(args.server_args)]
    warmup_at = max(1, args.requests // 10)
    with RemoteServer(server_args) as server:
        rss = RssSampler(server.proc.pid, interval_s=1.0)
        probe = HealthProbe(server.base_url, interval_s=0.2)
        done = 0
        warm: dict[str, float] = {}

        def on_done() -> None:
            nonlocal done
            done += 1
            if done == warmup_at:
                warm["t"], warm["rss"] = time.monotonic() - rss._t0, rss.samples[-1][1]
            if done % 500 == 0:
                print(f"{done}/{args.requests} requests", flush=True)

        t0 = time.perf_counter()
        outcomes, failures = asyncio.run(run_all(server.base_url, specs, args.concurrency, on_done))
        duration = time.perf_counter() - t0
        end = wait_idle(server.base_url)
        time.sleep(2.0)                      # a couple more RSS samples at rest
        health = probe.stop()
        samples = rss.stop()
        errors = error_lines(server.output())

    after_warm = [b for t, b in samples if t >= warm.get("t", 0.0)]
    rss_mib = {"at_warmup": round(warm.get("rss", samples[0][1]) / 2**20, 1),
               "max_after_warmup": round(max(after_warm) / 2**20, 1),
               "end": round(samples[-1][1] / 2**20, 1)}
    kv_leak = end["kvserve:kv_cache_usage_perc"]
    passed = (not failures and kv_leak == 0 and end["kvserve:num_requests_running"] == 0
              and end["kvserve:num_requests_waiting"] == 0 and not errors)
    summary = {
        "requests": args.requests, "concurrency": args.concurrency, "seed": args.seed,
        "server_args": server_args, "duration_s": round(duration, 1),
        "outcomes": dict(sorted(outcomes.items())), "failures": failures[:50], "num_failures": len(failures),
        "end_state": {"kv_cache_usage_perc": kv_leak, "running": end["kvserve:num_requests_running"],
                      "waiting": end["kvserve:num_requests_waiting"],
                      "prefix_cache_hit_tokens": end.get("kvserve:prefix_cache_hits_total", 0),
                      "preemptions": end.get("kvserve:num_preemptions_total", 0),
                      **{k: end[f"kvserve:{k}_total"] for k in SPEC_COUNTERS if f"kvserve:{k}_total" in end}},
        "rss_mib": rss_mib, "health": health, "server_error_lines": errors[:20], "passed": passed,
        "machine": {**machine_info(), "cpu_kernels": cpu_kernels.describe(), "load_avg": os.getloadavg()},
        "git": git_rev(),
        "command": shlex.join(["python", *sys.argv]), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [f"# Soak: {args.requests} mixed requests", "",
          f"Command: `{summary['command']}`; server: `kvserve serve {shlex.join(server_args)}`; "
          f"{args.concurrency} concurrent clients; {summary['duration_s']} s (git {summary['git']}).", "",
          f"Machine: {summary['machine']['cpu']}, {summary['machine']['cores']} cores, CPU kernels "
          f"{summary['machine']['cpu_kernels']}.", "",
          "| request kind: outcome | count |", "|---|---|",
          *[f"| {k} | {v} |" for k, v in summary["outcomes"].items()], "",
          f"- failures (wrong answer, wrong status, transport error): {len(failures)}",
          f"- at the end, idle: KV cache usage {kv_leak} (blocks held beyond the evictable prefix cache), "
          f"running {summary['end_state']['running']:.0f}, waiting {summary['end_state']['waiting']:.0f}",
          f"- preemptions: {summary['end_state']['preemptions']:.0f}"
          + "".join(f", {k.replace('_', ' ')} {summary['end_state'][k]:.0f}" for k in SPEC_COUNTERS
                    if k in summary["end_state"]),
          f"- server + engine RSS: {rss_mib['at_warmup']} MiB after warm-up ({warmup_at} requests), "
          f"max {rss_mib['max_after_warmup']} MiB after it, {rss_mib['end']} MiB at the end",
          f"- /health: p50 {health['p50_ms']} ms, p99 {health['p99_ms']} ms, non-200 {health['non_200']}",
          f"- error lines in the server log: {len(errors)}",
          f"- **{'PASS' if passed else 'FAIL'}**", ""]
    if failures:
        md += ["First failures:", "", *[f"- {f}" for f in failures[:10]], ""]
    (args.out / f"{args.name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
