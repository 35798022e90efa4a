"""Routing across replicas on a shared-prefix workload: cache_aware vs least_loaded vs round_robin.

For each policy, a fresh `kvserve serve --models-config` with the default model on 2 replicas (engine
processes, one thread each), then the same request sequence: G groups, each a shared prefix of P tokens
(a passage of the bundled corpus: a long system prompt or document) followed by a short question of its
own; groups drawn at random (Zipf-skewed, fixed seed), C requests in flight (closed loop), each generating
--max-tokens tokens. Each replica's KV cache (--kv-blocks) holds about half the groups' prefixes plus the
running requests, not all of them: a policy that spreads a group over both replicas makes each replica
cache every group, and they evict each other; one that keeps a group on one replica does not.

Reported per policy: TTFT mean/p50/p99 (first streamed token, as the client saw it), end-to-end latency,
throughput (requests/s and output tokens/s over the run), the prefix-cache hit rate (hits / queries over
both replicas, from /metrics), and how the requests split over the replicas.

    python benchmarks/routing.py            # G=8, P=512, 160 requests, C=4: ~15 min on 2 cores
    python benchmarks/routing.py --quick    # G=4, P=256, 32 requests: a few minutes; writes routing_quick.*

The summary ends with the easy -> small table for `model: "auto"` (quality against the share sent to the
large model), read from benchmarks/auto_routing.py's evaluation: that one measures answers, not time.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import git_rev, machine_info, save  # noqa: E402

from kvserve.bench.corpus import BUNDLED_TEXT  # noqa: E402
from kvserve.entrypoints.openai.launcher import RemoteServer  # noqa: E402

POLICIES = ("cache_aware", "least_loaded", "round_robin")
BLOCK = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="Reduced size (validates the script; not a result).")
    p.add_argument("--groups", type=int, default=8, help="Shared prefixes (default: %(default)s)")
    p.add_argument("--prefix-tokens", type=int, default=512, help="Tokens per shared prefix (default: %(default)s)")
    p.add_argument("--requests", type=int, default=160, help="Requests per policy (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4, help="Requests in flight (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="Tokens generated per request (default: %(default)s)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV blocks per replica (default: half the groups' prefixes and one more, plus the requests' "
                        "own blocks)")
    p.add_argument("--zipf", type=float, default=0.6, help="Group popularity skew, 0 = uniform (default: %(default)s)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.quick:
        args.groups, args.prefix_tokens, args.requests = 4, 256, 32
    if args.kv_blocks is None:
        # Half the groups' prefixes and one more, plus each request's own blocks (question and answer; the
        # prefix blocks are shared): what a replica holding half the groups needs, with some slack, and well
        # under what one holding every group needs.
        prefix_blocks = -(-args.prefix_tokens // BLOCK)
        own_blocks = -(-(64 + args.max_tokens) // BLOCK)
        args.kv_blocks = (args.groups // 2 + 1) * prefix_blocks + args.concurrency * own_blocks
    return args


def group_prefixes(tokenize, groups: int, tokens: int) -> list[list[int]]:
    """G distinct passages of the corpus, each cut to exactly `tokens` token ids."""
    text = BUNDLED_TEXT.read_text(encoding="utf-8")
    chunk = len(text) // groups
    out = []
    for g in range(groups):
        ids = tokenize(text[g * chunk:(g + 1) * chunk])
        assert len(ids) >= tokens, "corpus passage too short for --prefix-tokens"
        out.append(ids[:tokens])
    return out


def workload(args: argparse.Namespace, prefixes: list[list[int]], tokenize) -> list[tuple[int, list[int]]]:
    rng = random.Random(args.seed)
    weights = [1.0 / (g + 1) ** args.zipf for g in range(args.groups)]
    requests = []
    for i in range(args.requests):
        g = rng.choices(range(args.groups), weights)[0]
        question = tokenize(f"\n\nQuestion {i}: in one sentence, what happens in the passage above?\nAnswer:")
        requests.append((g, prefixes[g] + question))
    return requests


def metric_totals(base_url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    text = httpx.get(base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("kvserve:prefix_cache_hits_total", "kvserve:prefix_cache_queries_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
            if s.name == "kvserve:prefix_cache_queries_total":
                key = f"queries/{s.labels.get('replica')}"
                out[key] = out.get(key, 0.0) + s.value
    return out


async def run_load(base_url: str, requests: list[tuple[int, list[int]]], concurrency: int,
                   max_tokens: int) -> tuple[list[dict], float]:
    queue: asyncio.Queue = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    results: list[dict] = []

    async def worker(c: httpx.AsyncClient) -> None:
        while not queue.empty():
            g, ids = queue.get_nowait()
            body = {"model": "default", "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            ttft, usage = None, None
            async with c.stream("POST", "/v1/completions", json=body) as resp:
                resp.raise_for_status()
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and ttft is None:
                        ttft = time.perf_counter() - t0
                    if chunk.get("usage"):
                        usage = chunk["usage"]
            results.append({"group": g, "ttft_s": ttft, "e2e_s": time.perf_counter() - t0,
                            "completion_tokens": usage["completion_tokens"],
                            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                            "prompt_tokens": usage["prompt_tokens"]})

    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as c:
        await asyncio.gather(*(worker(c) for _ in range(concurrency)))
    return results, time.perf_counter() - t0


def run_policy(args: argparse.Namespace, policy: str) -> dict:
    config = {"models": [{"name": "default", "model": "smollm2-135m", "data_parallel_size": 2,
                          "engine": {"num_kv_blocks": args.kv_blocks, "max_model_len": 1024,
                                     "max_num_seqs": 16}}],
              "routing": {"policy": policy}, "admission": {"max_waiting": 1024}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(config, f)
    with RemoteServer(["--models-config", f.name, "--log-stats-interval", "30"], startup_timeout_s=900) as server:
        def tokenize(text: str) -> list[int]:
            r = httpx.post(server.base_url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                           timeout=60)
            return r.json()["tokens"]

        prefixes = group_prefixes(tokenize, args.groups, args.prefix_tokens)
        requests = workload(args, prefixes, tokenize)
        before = metric_totals(server.base_url)
        results, wall = asyncio.run(run_load(server.base_url, requests, args.concurrency, args.max_tokens))
        after = metric_totals(server.base_url)
    os.unlink(f.name)
    ttfts = sorted(r["ttft_s"] for r in results)
    queries = after["kvserve:prefix_cache_queries_total"] - before.get("kvserve:prefix_cache_queries_total", 0)
    hits = after["kvserve:prefix_cache_hits_total"] - before.get("kvserve:prefix_cache_hits_total", 0)
    split = {k.split("/")[1]: round((after[k] - before.get(k, 0)) / max(queries, 1), 3)
             for k in sorted(after) if k.startswith("queries/")}
    return {
        "policy": policy,
        "requests": len(results),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "e2e_mean_s": statistics.fmean(r["e2e_s"] for r in results),
        "requests_per_s": len(results) / wall,
        "output_tokens_per_s": sum(r["completion_tokens"] for r in results) / wall,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "prompt_token_share_per_replica": split,
        "wall_s": wall,
    }


def auto_routing_section() -> str:
    """The easy -> small table for `model: "auto"`, from benchmarks/auto_routing.py's committed evaluation (model
    quality on held-out questions, which no timing here changes; re-made by that script)."""
    path = Path(__file__).resolve().parent / "results" / "auto_routing.json"
    if not path.exists():
        return "No auto-routing evaluation found: run `python benchmarks/auto_routing.py`.\n"
    r = json.loads(path.read_text())
    h = r["held_out"]
    lines = [f"## Easy -> small routing (`model: \"auto\"`): quality against cost\n",
             f"From `{r['command']}` (git {r['git']}; results/auto_routing.md has the method): {h['n']} held-out "
             f"questions with reference answers, small = {r['models']['small']}, large = {r['models']['large']}. "
             f"Always-small {h['always_small_acc']:.3f}, always-large {h['always_large_acc']:.3f}; the router's "
             f"accuracy over random routing at the same share to large, mean over shares 0.1-0.9: "
             f"{h['router_mean_gain_over_random']:+.4f} (95% bootstrap interval "
             f"{h['router_gain_over_random_ci95'][0]:+.4f} .. {h['router_gain_over_random_ci95'][1]:+.4f}).\n",
             "| share to large (target) | router's share | router acc | random acc (same share) | oracle acc |",
             "|---:|---:|---:|---:|---:|"]
    lines += [f"| {t['target_share']:.1f} | {t['router_share']:.3f} | {t['router_acc']:.3f} | {t['random_acc']:.3f} | "
              f"{t['oracle_acc']:.3f} |" for t in r["table"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    load_before = os.getloadavg()
    rows = []
    for policy in args.policies:
        print(f"running {policy} ...", flush=True)
        rows.append(run_policy(args, policy))
        print(json.dumps(rows[-1]), flush=True)
    load_after = os.getloadavg()
    header = ("| policy | TTFT mean | TTFT p50 | TTFT p99 | E2E mean | req/s | out tok/s | prefix-cache hit rate "
              "| prompt tokens per replica |\n|---|---|---|---|---|---|---|---|---|\n")
    table = header + "".join(
        f"| {r['policy']} | {r['ttft_mean_s'] * 1000:.0f} ms | {r['ttft_p50_s'] * 1000:.0f} ms | "
        f"{r['ttft_p99_s'] * 1000:.0f} ms | {r['e2e_mean_s'] * 1000:.0f} ms | {r['requests_per_s']:.2f} | "
        f"{r['output_tokens_per_s']:.1f} | {r['prefix_cache_hit_rate'] * 100:.1f}% | "
        f"{' / '.join(f'{v * 100:.0f}%' for v in r['prompt_token_share_per_replica'].values())} |\n" for r in rows)
    by = {r["policy"]: r for r in rows}
    verdict = ""
    if "cache_aware" in by and "round_robin" in by:
        ca, rr = by["cache_aware"], by["round_robin"]
        verdict = (f"\ncache_aware vs round_robin: mean TTFT {rr['ttft_mean_s'] / ca['ttft_mean_s']:.2f}x lower, "
                   f"throughput {ca['requests_per_s'] / rr['requests_per_s']:.2f}x "
                   f"(target: >= 1.5x lower mean TTFT, throughput >= 1.0x).\n")
    print(table + verdict)
    name = "routing_quick" if args.quick else "routing"
    cmd = "python benchmarks/routing.py" + (" --quick" if args.quick else "")
    info = machine_info()
    setup = (f"Model: SmolLM2-135M-Instruct (Q4_1 GGUF), 2 replicas (engine processes, 1 torch thread each), "
             f"{args.kv_blocks} KV blocks of {BLOCK} tokens per replica, prefix caching on. Workload: {args.groups} "
             f"groups x {args.prefix_tokens}-token shared prefix (passages of the bundled Tempest text) + a ~20-token "
             f"question, {args.requests} requests, groups Zipf({args.zipf}), {args.concurrency} in flight (closed "
             f"loop), {args.max_tokens} output tokens each, greedy. Load average before/after: "
             f"{load_before[0]:.1f} / {load_after[0]:.1f} (2 cores{', shared with other work' if load_before[0] > 2.5 else ''}).")
    auto = auto_routing_section()
    print(auto)
    md = (f"# Routing across replicas: cache-aware vs least-loaded vs round-robin\n\nCommand: `{cmd}` "
          f"(git {git_rev()})\n\nMachine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}. {setup}\n\n"
          f"{table}{verdict}\n{auto}")
    save(name, {"args": vars(args), "machine": info, "git": git_rev(), "load_average": [load_before, load_after],
                "results": rows}, md)


if __name__ == "__main__":
    main()
