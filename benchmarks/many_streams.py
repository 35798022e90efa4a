"""Thousands of concurrent streaming clients against one `kvserve serve` (issue 11, must-have 1).

N clients (default 2,000) open a streaming completion each, all at once: a short prompt, 16 output tokens
(ignore_eos). Every request must end with its 16 tokens or a clean 429 (when more than --max-waiting
wait); transport errors and 5xx are failures. Meanwhile /health is probed from another process (its p99
must stay under 100 ms) and the resident memory of the server and its engine is sampled. An idle server
on the same stack (serving_probes.ControlServer) is probed the same way throughout: its latency is what
the machine's load alone costs a probe, and is reported next to the real one.

    python benchmarks/many_streams.py                      # 2,000 streams; writes results/many_streams.{json,md}
    python benchmarks/many_streams.py --streams 20 --out /tmp/ms   # a quick check of the script itself

Run it on a quiet machine: the client, the prober and the server share its cores.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).parent))
from serving_probes import ControlServer, HealthProbe, RssSampler, error_lines, percentile, raise_fd_limit  # noqa: E402

from kvserve.entrypoints.openai.launcher import RemoteServer  # noqa: E402

RESULTS = Path(__file__).parent / "results"


async def one_stream(session: aiohttp.ClientSession, url: str, i: int, max_tokens: int) -> tuple[str, float, float]:
    """(outcome, seconds to first token, seconds to end). Outcomes: ok, 429, http_<status>, bad_stream,
    transport_error."""
    body = {"prompt": f"Client {i} says hello. Count with me:", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.7, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = float("nan")
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                await r.read()
                return ("429" if r.status == 429 else f"http_{r.status}"), ttft, time.perf_counter() - t0
            usage, done, error = None, False, False
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    error = True
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                elif ttft != ttft and chunk["choices"] and chunk["choices"][0]["text"]:
                    ttft = time.perf_counter() - t0
            ok = done and not error and usage is not None and usage["completion_tokens"] == max_tokens
            return ("ok" if ok else "bad_stream"), ttft, time.perf_counter() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
        return "transport_error", ttft, time.perf_counter() - t0


async def run_clients(base_url: str, n: int, max_tokens: int, timeout_s: float) -> list[tuple[str, float, float]]:
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # one connection per client, as real clients
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        url = base_url + "/v1/completions"
        return await asyncio.gather(*(one_stream(session, url, i, max_tokens) for i in range(n)))


def _load(avg: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.1f}" for x in avg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-waiting", type=int, default=4096, help="the server's --max-waiting (429 beyond it)")
    p.add_argument("--num-kv-blocks", type=int, default=1024, help="256 running x 2 blocks each, with room to spare")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-request client timeout, seconds")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for many_streams.{json,md}")
    args = p.parse_args(argv)

    fd_limit = raise_fd_limit()
    if fd_limit < args.streams + 256:
        print(f"warning: open-files limit {fd_limit} is low for {args.streams} streams", file=sys.stderr)
    server_args = ["--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
                   "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", "512"]
    control = ControlServer()
    try:
        with RemoteServer(server_args) as server:
            rss = RssSampler(server.proc.pid)
            time.sleep(1.0)
            idle_rss = rss.samples[-1][1]
            probe, control_probe = HealthProbe(server.base_url), HealthProbe(control.base_url)
            load_start = os.getloadavg()
            t0 = time.perf_counter()
            results = asyncio.run(run_clients(server.base_url, args.streams, args.max_tokens, args.timeout))
            duration = time.perf_counter() - t0
            health, health_control = probe.stop(), control_probe.stop()
            samples = rss.stop()
            errors = error_lines(server.output())
    finally:
        control.stop()

    outcomes = Counter(o for o, _, _ in results)
    ok = [r for r in results if r[0] == "ok"]
    peak_rss = max(b for _, b in samples)
    passed = (set(outcomes) <= {"ok", "429"} and health["p99_ms"] < 100 and health["non_200"] == 0 and not errors)
    summary = {
        "streams": args.streams, "max_tokens": args.max_tokens, "server_args": server_args,
        "outcomes": dict(outcomes), "duration_s": round(duration, 1),
        "generated_tokens_per_s": round(len(ok) * args.max_tokens / duration, 1),
        "ttft_s": {"p50": round(percentile([t for _, t, _ in ok], 50), 3),
                   "p99": round(percentile([t for _, t, _ in ok], 99), 3)},
        "e2e_s": {"p50": round(percentile([e for _, _, e in ok], 50), 3),
                  "p99": round(percentile([e for _, _, e in ok], 99), 3)},
        "health": health,
        "health_idle_control_server": health_control,
        "rss_mib": {"idle": round(idle_rss / 2**20, 1), "peak": round(peak_rss / 2**20, 1),
                    "end": round(samples[-1][1] / 2**20, 1)},
        "server_error_lines": errors[:20],
        "passed": passed,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "load_avg_at_start": load_start,
                    "load_avg_at_end": os.getloadavg()},
        "command": " ".join(["python", *sys.argv]),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "many_streams.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [f"# {args.streams} concurrent streams", "",
          f"Command: `{summary['command']}`; server: `kvserve serve {' '.join(server_args)}`.", "",
          "| outcome | count |", "|---|---|", *[f"| {k} | {v} |" for k, v in sorted(outcomes.items())], "",
          f"- duration {summary['duration_s']} s, {summary['generated_tokens_per_s']} generated tok/s",
          f"- TTFT p50 {summary['ttft_s']['p50']} s, p99 {summary['ttft_s']['p99']} s; "
          f"end-to-end p50 {summary['e2e_s']['p50']} s, p99 {summary['e2e_s']['p99']} s",
          f"- /health: {health['probes']} probes, p50 {health['p50_ms']} ms, p99 {health['p99_ms']} ms, "
          f"max {health['max_ms']} ms, non-200 {health['non_200']}",
          f"- /health of an idle server on the same stack, probed meanwhile (the machine's share): "
          f"p50 {health_control['p50_ms']} ms, p99 {health_control['p99_ms']} ms, max {health_control['max_ms']} ms",
          f"- load average (1, 5, 15 min) at the start {_load(load_start)}, at the end {_load(os.getloadavg())} "
          f"on {os.cpu_count()} CPUs",
          f"- server + engine RSS: idle {summary['rss_mib']['idle']} MiB, peak {summary['rss_mib']['peak']} MiB, "
          f"end {summary['rss_mib']['end']} MiB",
          f"- error lines in the server log: {len(errors)}",
          f"- **{'PASS' if passed else 'FAIL'}** (only ok or 429, /health p99 < 100 ms, no error lines)", ""]
    (args.out / "many_streams.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
