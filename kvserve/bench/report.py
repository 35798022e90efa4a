"""The printed result table, laid out like `vllm bench serve`'s so numbers read across tools."""

from __future__ import annotations

from kvserve.bench.metrics import BenchmarkMetrics, Distribution
from kvserve.bench.server_info import describe_engine
from kvserve.bench.spec_decode import SpecDecodeStats

_W = 50


def _line(name: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{name:<40}{value:<10}"


def _section(title: str) -> str:
    return title.center(_W, "-")


def _dist(short: str, d: Distribution) -> list[str]:
    rows = [_line(f"Mean {short} (ms):", d.mean), _line(f"Median {short} (ms):", d.median),
            _line(f"Std {short} (ms):", d.std)]
    rows += [_line(f"{p.upper()} {short} (ms):", v) for p, v in d.percentiles.items() if p != "p50"]
    return rows


def _pct(x: float | None) -> float | str:
    return "n/a" if x is None else 100 * x


def _spec_decode(s: SpecDecodeStats) -> list[str]:
    rows = [_section("Speculative Decoding"),
            _line("Acceptance rate (%):", _pct(s.acceptance_rate)),
            _line("Acceptance length:", "n/a" if s.acceptance_length is None else s.acceptance_length),
            _line("Drafts:", s.drafts), _line("Draft tokens:", s.draft_tokens),
            _line("Accepted tokens:", s.accepted_tokens)]
    if s.acceptance_by_position:
        rows.append("Acceptance by draft position (%):")
        rows += [_line(f"  Position {i}:", _pct(x)) for i, x in enumerate(s.acceptance_by_position)]
    return rows


def format_table(m: BenchmarkMetrics, request_rate: float, burstiness: float,
                 max_concurrency: int | None, label: str = "", spec: SpecDecodeStats | None = None,
                 server: list[dict[str, str]] | None = None) -> str:
    rows = [" Serving Benchmark Result ".center(_W, "=")]
    if label:
        rows.append(_line("Run:", label))
    # What the figures were measured on, where the server says (kvserve's engine_info): one line per engine.
    rows += [f"Server engine{f' {i}' if len(server) > 1 else ''}: {describe_engine(e)}"
             for i, e in enumerate(server or [])]
    rows += [
        _line("Traffic request rate:", "inf" if request_rate == float("inf") else f"{request_rate:g}"),
        _line("Burstiness factor:", f"{burstiness:g}"),
        _line("Maximum request concurrency:", max_concurrency if max_concurrency else "unlimited"),
        _line("Successful requests:", m.completed),
        _line("Failed requests:", m.failed),
        _line("Benchmark duration (s):", m.duration_s),
        _line("Total input tokens:", m.total_input_tokens),
        _line("Total generated tokens:", m.total_output_tokens),
        _line("Request throughput (req/s):", m.request_throughput),
    ]
    if m.request_goodput is not None:
        slos = " ".join(f"{k}<={v:g}ms" for k, v in m.goodput_slos_ms.items())
        rows.append(_line("Request goodput (req/s):", m.request_goodput))
        rows.append(_line("  goodput SLOs:", slos))
    rows += [
        _line("Output token throughput (tok/s):", m.output_throughput),
        _line("Total token throughput (tok/s):", m.total_token_throughput),
        _line("Max concurrent requests seen:", m.max_concurrent_requests),
        _section("Time to First Token"), *_dist("TTFT", m.ttft_ms),
        _section("Time per Output Token (excl. 1st token)"), *_dist("TPOT", m.tpot_ms),
        _section("Inter-token Latency"), *_dist("ITL", m.itl_ms),
        _section("End-to-end Latency"), *_dist("E2EL", m.e2el_ms),
        *(_spec_decode(spec) if spec is not None else []),
        "=" * _W,
    ]
    return "\n".join(rows)
