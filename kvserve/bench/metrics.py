"""Benchmark metrics, with `vllm bench serve`'s definitions.

Per successful request:
- TTFT  = first text chunk time - send time.
- TPOT  = (E2E latency - TTFT) / (output_tokens - 1), only for requests with > 1 output token.
- ITL   = every gap between consecutive text chunks (a request with n chunks gives n-1 gaps).
- E2EL  = stream closed - send time.
Over the run (duration = first send -> last completion):
- request / output-token / total-token (input + output) throughput = count / duration.
- goodput = successful requests meeting every given SLO (ttft, tpot, e2el in ms) / duration; a
  single-token request has TPOT 0 for this check, as in vLLM.
Distributions are reported as mean, median, std (population) and percentiles with numpy's linear
interpolation, all in milliseconds.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from kvserve.bench.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class Distribution:
    mean: float
    median: float
    std: float
    percentiles: dict[str, float]  # "p90" -> value

    @classmethod
    def of(cls, values_ms: list[float], percentiles: tuple[float, ...]) -> "Distribution":
        if not values_ms:  # nothing measured: zeros, as vLLM prints, rather than NaN
            return cls(0.0, 0.0, 0.0, {_pname(p): 0.0 for p in percentiles})
        a = np.asarray(values_ms, dtype=np.float64)
        return cls(float(a.mean()), float(np.median(a)), float(a.std()),
                   {_pname(p): float(np.percentile(a, p)) for p in percentiles})


def _pname(p: float) -> str:
    return f"p{p:g}"


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # req/s
    output_throughput: float  # output tok/s
    total_token_throughput: float  # (input + output) tok/s
    request_goodput: float | None  # req/s meeting every SLO; None when no SLO was given
    max_concurrent_requests: int  # most requests in flight at once, from the raw timings
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME in {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of ms") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {item!r}: must be >= 0 ms")
    return slos


def output_token_count(r: RequestResult, tokenize: Callable[[str], int] | None) -> int:
    """The server's usage count; where it sent none, or 0 (as vLLM's client, which counts again then), the
    benchmark tokenizer's count of the streamed text."""
    if r.output_tokens:
        return r.output_tokens
    if tokenize is None:
        if r.output_tokens is not None:
            return r.output_tokens
        raise ValueError("the server sent no usage and no tokenizer was given to count output tokens")
    return tokenize(r.generated_text)


def request_tpot(latency: float, ttft: float, output_tokens: int) -> float | None:
    return (latency - ttft) / (output_tokens - 1) if output_tokens > 1 else None


def max_concurrency_seen(results: list[RequestResult]) -> int:
    events = sorted([(r.start_time, 1) for r in results] +
                    [(r.start_time + r.latency, -1) for r in results], key=lambda e: (e[0], e[1]))
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


def calculate_metrics(results: list[RequestResult], duration_s: float,
                      goodput_slos_ms: dict[str, float] | None = None,
                      percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
                      tokenize: Callable[[str], int] | None = None) -> BenchmarkMetrics:
    slos = dict(goodput_slos_ms or {})
    ttfts, tpots, itls, e2els = [], [], [], []
    total_in = total_out = good = completed = 0
    ok = [r for r in results if r.success]
    for r in ok:
        n_out = output_token_count(r, tokenize)
        completed += 1
        total_in += r.prompt_len
        total_out += n_out
        tpot = request_tpot(r.latency, r.ttft, n_out)
        if tpot is not None:
            tpots.append(tpot * 1e3)
        ttfts.append(r.ttft * 1e3)
        e2els.append(r.latency * 1e3)
        itls.extend(g * 1e3 for g in r.itl)
        measured = {"ttft": r.ttft * 1e3, "tpot": (tpot or 0.0) * 1e3, "e2el": r.latency * 1e3}
        if slos and all(measured[k] <= v for k, v in slos.items()):
            good += 1
    d = duration_s if duration_s > 0 else float("inf")
    return BenchmarkMetrics(
        completed=completed,
        failed=len(results) - completed,
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=completed / d,
        output_throughput=total_out / d,
        total_token_throughput=(total_in + total_out) / d,
        request_goodput=(good / d) if slos else None,
        max_concurrent_requests=max_concurrency_seen(ok),
        ttft_ms=Distribution.of(ttfts, percentiles),
        tpot_ms=Distribution.of(tpots, percentiles),
        itl_ms=Distribution.of(itls, percentiles),
        e2el_ms=Distribution.of(e2els, percentiles),
        goodput_slos_ms=slos,
    )
