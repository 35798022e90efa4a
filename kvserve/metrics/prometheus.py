"""Prometheus metrics with vLLM's names under the `kvserve:` prefix, so existing dashboards carry over.

Each server owns its CollectorRegistry (no process-global state), so tests can run several servers.
Everything is fed from the engine's step results: gauges and engine counters from EngineStats, request
histograms from each RequestDelta's RequestMetrics (monotonic times, comparable across processes)."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvserve.engine.core_process import StepResult
from kvserve.engine.stats import EngineStats
from kvserve.outputs import RequestDelta

# vLLM's bucket boundaries.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]

PREFIX = "kvserve:"


@dataclass
class _Tracked:
    last_token_time: float | None = None


class ServerMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, lbl = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, lbl, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            # prometheus_client appends "_total" to counter names.
            return Counter(PREFIX + name.removesuffix("_total"), doc, lbl, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, lbl, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the engine's running set.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of requests the engine started.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.num_preemptions = counter("num_preemptions_total", "Preemptions (a request evicted to free KV).")
        self.prefix_cache_queries = counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.engine_restarts = counter("engine_restarts_total",
                                       "Engine processes started to replace one that died (kvserve's own metric).")
        self._request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                        ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive outputs.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                     REQUEST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens processed per engine step.",
                                          ITERATION_TOKEN_BUCKETS)
        self._last_stats = EngineStats()
        self._tracked: dict[str, _Tracked] = {}
        self._spec: _SpecDecodeCounters | None = None  # registered once the engine says it speculates

    # ------------------------------------------------------------ feeding

    def on_step(self, result: StepResult) -> None:
        s, prev = result.stats, self._last_stats
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.kv_cache_usage_perc.set(s.kv_cache_usage)
        # Engine counters are cumulative; Prometheus counters are incremented by the difference.
        for counter, now, before in (
            (self.num_preemptions, s.num_preemptions, prev.num_preemptions),
            (self.prefix_cache_queries, s.prefix_cache_queries, prev.prefix_cache_queries),
            (self.prefix_cache_hits, s.prefix_cache_hits, prev.prefix_cache_hits),
        ):
            if now > before:
                counter.inc(now - before)
        if s.spec_decode_enabled:
            if self._spec is None:
                self._spec = _SpecDecodeCounters(self.registry, self.model_name)
            self._spec.update(s, prev)
        if result.stepped:
            self.iteration_tokens.observe(s.last_step_num_tokens)
        self._last_stats = s
        for out in result.outputs:
            self._on_output(out)

    def _on_output(self, out: RequestDelta) -> None:
        # Token counters count what the engine delivered, output by output, so they equal the sum of the
        # `usage` the server reports (prompt tokens once per request, as in usage.prompt_tokens).
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            tracked = self._tracked[out.request_id] = _Tracked()
            self.prompt_tokens.inc(out.num_prompt_tokens)
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            self.generation_tokens.inc(new_tokens)
        m = out.metrics
        if m is not None and m.last_token_time is not None and new_tokens:
            if tracked.last_token_time is None:
                if m.first_token_time is not None:
                    self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            elif m.last_token_time > tracked.last_token_time:
                self.itl.observe(m.last_token_time - tracked.last_token_time)
            tracked.last_token_time = m.last_token_time
        if out.finished:
            self._on_finished(out)

    def _on_finished(self, out: RequestDelta) -> None:
        self._tracked.pop(out.request_id, None)
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "stop"
        self._request_success.labels(self.model_name, reason).inc()
        m = out.metrics
        if m is None:
            return
        end = m.finished_time or m.last_token_time
        if end is not None:
            self.e2e.observe(max(0.0, end - m.arrival_time))
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            if m.first_token_time is not None:
                self.prefill_time.observe(max(0.0, m.first_token_time - m.first_scheduled_time))
        if m.first_token_time is not None and m.last_token_time is not None:
            self.decode_time.observe(max(0.0, m.last_token_time - m.first_token_time))

    def on_engine_restart(self) -> None:
        """A new engine process counts from zero: engine counters are diffed against its stats from now on."""
        self.engine_restarts.inc()
        self._last_stats = EngineStats()
        self._tracked.clear()

    def on_request_end(self, request_id: str) -> None:
        """An aborted request sends no final output: forget it here."""
        self._tracked.pop(request_id, None)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodeCounters:
    """vLLM's speculative-decoding counters: drafts (one per sequence and step that verified some), draft
    tokens, accepted draft tokens, and accepted draft tokens by position in the draft (label `position`,
    0-based: how often the i-th draft token was accepted)."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        lbl = ["model_name"]
        self.model_name = model_name
        self.num_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Speculative drafts verified.", lbl,
                                  registry=registry).labels(model_name)
        self.num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified.", lbl,
                                        registry=registry).labels(model_name)
        self.num_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           lbl, registry=registry).labels(model_name)
        self.per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted, by position in the draft.", ["model_name", "position"],
                               registry=registry)

    def update(self, s: EngineStats, prev: EngineStats) -> None:
        for counter, now, before in (
            (self.num_drafts, s.spec_num_drafts, prev.spec_num_drafts),
            (self.num_draft_tokens, s.spec_num_draft_tokens, prev.spec_num_draft_tokens),
            (self.num_accepted_tokens, s.spec_num_accepted_tokens, prev.spec_num_accepted_tokens),
        ):
            if now > before:
                counter.inc(now - before)
        for pos, now in enumerate(s.spec_accepted_per_pos):
            before = prev.spec_accepted_per_pos[pos] if pos < len(prev.spec_accepted_per_pos) else 0
            child = self.per_pos.labels(self.model_name, str(pos))  # created at 0 on first sight
            if now > before:
                child.inc(now - before)
