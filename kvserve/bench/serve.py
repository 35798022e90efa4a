"""`kvserve bench serve`: send a dataset to an OpenAI-compatible server at a given arrival process
and concurrency, then report latency/throughput metrics (kvserve/bench/metrics.py)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm.asyncio import tqdm

from kvserve.bench.arrivals import arrival_offsets
from kvserve.bench.client import (EndpointConfig, RequestResult, make_session, request_headers, send_request,
                                  sent_max_tokens)
from kvserve.bench.corpus import load_corpus
from kvserve.bench.datasets import BenchRequest, DatasetConfig, cut_text, sample_requests
from kvserve.bench.metrics import (DEFAULT_PERCENTILES, BenchmarkMetrics, calculate_metrics,
                                   output_token_count)
from kvserve.bench.metrics_page import MetricsUnavailable
from kvserve.bench.spec_decode import SpecCounters, SpecDecodeStats, settled_spec_counters
from kvserve.bench.server_info import first_listed_model, read_engine_info
from kvserve.bench.tokenizer import BenchTokenizer
from kvserve.utils.cpuinfo import cpu_flags, cpu_model_name

# The vector extensions a CPU's figures depend on (which kernels it can run), of its /proc/cpuinfo flags.
ISA_FLAGS = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                       "amx_bf16", "amx_int8", "amx_tile"})


@dataclass
class ServeConfig:
    endpoint: EndpointConfig
    dataset: DatasetConfig
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    percentiles: tuple[float, ...] = DEFAULT_PERCENTILES
    tokenizer: str | None = None  # path; None = the default model's
    test_request: bool = True
    disable_tqdm: bool = False
    save_text: bool = False
    label: str = ""  # names this run in sweeps and plots
    tags: dict[str, object] = field(default_factory=dict)  # e.g. the sweep point


@dataclass
class BenchResult:
    config: ServeConfig
    metrics: BenchmarkMetrics
    results: list[RequestResult]
    requests: list[BenchRequest]
    bench_start: float  # perf_counter() at the first send; raw start times are relative to it
    date: str
    spec_decode: SpecDecodeStats | None = None  # the server's, over the run; None if it does not speculate
    server: list[dict[str, str]] = field(default_factory=list)  # its engines' kvserve:engine_info labels

    def to_json(self) -> dict:
        cfg = asdict(self.config)
        cfg["request_rate"] = _json_float(self.config.request_rate)
        raw = []
        for req, r in zip(self.requests, self.results):
            item = {
                "success": r.success, "error": r.error,
                "prompt_len": r.prompt_len, "max_tokens": sent_max_tokens(self.config.endpoint, req),
                "output_tokens": r.output_tokens,
                "usage_reported": r.usage_reported,
                "start_s": r.start_time - self.bench_start,
                "ttft_s": r.ttft, "latency_s": r.latency, "itl_s": r.itl,
            }
            if self.config.save_text:
                item["generated_text"] = r.generated_text
            raw.append(item)
        return {"date": self.date, "label": self.config.label, "machine": machine_info(), "server": self.server,
                "corpus": load_corpus().name, "config": cfg, "metrics": self.metrics.to_dict(),
                "spec_decode": asdict(self.spec_decode) if self.spec_decode else None, "requests": raw}

    def save(self, path: str | Path) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1))


def machine_info() -> dict[str, object]:
    """Where the client ran (the servers under test run here too in our comparisons; a kvserve server's own
    account of its engines is BenchResult.server)."""
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu_model_name(), "cpu_count": os.cpu_count(),
            "cpu_isa": sorted((cpu_flags() or frozenset()) & ISA_FLAGS)}


def _json_float(x: float) -> float | str:
    return "inf" if x == float("inf") else x


def warmup_request(tokenizer: BenchTokenizer, seed: int, endpoint: str) -> BenchRequest:
    """A short request unlike any in the dataset, so it primes no cache the measured ones use."""
    text = cut_text(tokenizer, load_corpus(), random.Random(f"warmup-{seed}"), 32)
    msgs = [{"role": "user", "content": text}] if endpoint == "chat" else None
    return BenchRequest(text, tokenizer.count(text), 4, msgs)


async def run_benchmark(cfg: ServeConfig, tokenizer: BenchTokenizer,
                        requests: list[BenchRequest] | None = None) -> BenchResult:
    if requests is None:
        requests = sample_requests(cfg.dataset, tokenizer)
    if cfg.endpoint.ignore_eos_via == "logit-bias" and not cfg.endpoint.banned_token_ids:
        # Every special token: EOS and any other end-of-generation marker the server stops on.
        cfg.endpoint.banned_token_ids = list(tokenizer.tokenizer.all_special_ids)
    offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.dataset.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    async with make_session() as session:
        if cfg.endpoint.model is None:
            cfg.endpoint.model = await first_listed_model(session, cfg.endpoint.base_url, request_headers())
        if cfg.test_request:
            probe = await send_request(session, cfg.endpoint,
                                       warmup_request(tokenizer, cfg.dataset.seed, cfg.endpoint.endpoint))
            if not probe.success:
                raise RuntimeError(f"test request to {cfg.endpoint.url} failed: {probe.error}")

        base_url, model = cfg.endpoint.base_url, cfg.endpoint.model
        server = await read_engine_info(session, base_url, model, request_headers())
        try:  # none yet: nothing drafted yet (kvserve registers them at its first draft)
            spec_before = await settled_spec_counters(session, base_url, model, request_headers()) or SpecCounters()
        except MetricsUnavailable:  # no /metrics: no speculative-decoding section
            spec_before = None
        pbar = None if cfg.disable_tqdm else tqdm(total=len(requests), desc=cfg.label or "requests")

        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                r = await send_request(session, cfg.endpoint, req)
            else:
                async with sem:  # the request's clock starts once it holds a slot
                    r = await send_request(session, cfg.endpoint, req)
            if pbar is not None:
                pbar.update(1)
            return r

        tasks: list[asyncio.Task[RequestResult]] = []
        bench_start = time.perf_counter()
        for req, due in zip(requests, offsets):
            delay = bench_start + due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - bench_start
        if pbar is not None:
            pbar.close()
        spec_after = None
        if spec_before is not None:
            with contextlib.suppress(MetricsUnavailable):
                spec_after = await settled_spec_counters(session, base_url, model, request_headers())

    for r in results:  # servers without usage: count the streamed text (vLLM's fallback)
        if r.success and r.output_tokens is None:
            r.output_tokens = output_token_count(r, tokenizer.count)
    metrics = calculate_metrics(results, duration, cfg.goodput_slos_ms, cfg.percentiles,
                                tokenize=tokenizer.count)
    spec = (SpecDecodeStats.between(spec_before, spec_after)
            if spec_before is not None and spec_after is not None else None)
    return BenchResult(cfg, metrics, results, requests, bench_start,
                       dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), spec, server)
