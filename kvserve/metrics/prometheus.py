"""Prometheus metrics with vLLM's names under the `kvserve:` prefix, so existing dashboards carry over.

Each server owns its CollectorRegistry (no process-global state), so tests can run several servers.
Everything is fed from the engine's step results: gauges and engine counters from EngineStats, request
histograms from each RequestDelta's RequestMetrics (monotonic times, comparable across processes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from kvserve.engine.core_process import StepResult
from kvserve.engine.stats import EngineStats
from kvserve.metrics.registry_sample import ENGINE_INFO
from kvserve.outputs import RequestDelta

# vLLM's bucket boundaries.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
# Tokens per request: vLLM's 1-2-5 series (it stops at max_model_len; one family here serves every model).
REQUEST_TOKEN_BUCKETS = [m * 10 ** e for e in range(6) for m in (1, 2, 5)]
N_BUCKETS = [1, 2, 5, 10, 20]

PREFIX = "kvserve:"


@dataclass
class _Tracked:
    last_token_time: float | None = None
    tokens_by_sample: dict[int, int] = field(default_factory=dict)  # generated tokens of each of the n samples


class MetricFamilies:
    """Every metric family of one server, registered once in its registry. Engine series (gauges, engine
    counters, step sizes) are labelled model_name and replica; request series (latencies, tokens, finishes)
    model_name only, so a model's replicas add up in them. Speculative-decoding counters are registered on
    first use (the engine says it speculates)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry()
        per_model, per_replica = ["model_name"], ["model_name", "replica"]

        def counter(name: str, doc: str, labels: list[str]) -> Counter:
            # prometheus_client appends "_total" to counter names.
            return Counter(PREFIX + name.removesuffix("_total"), doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: list[float], labels: list[str] = per_model) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.num_requests_running = Gauge(PREFIX + "num_requests_running", "Requests in the engine's running set.",
                                          per_replica, registry=r)
        self.num_requests_waiting = Gauge(PREFIX + "num_requests_waiting", "Requests waiting to be scheduled.",
                                          per_replica, registry=r)
        self.kv_cache_usage_perc = Gauge(PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
                                         per_replica, registry=r)
        self.gateway_queue_requests = Gauge(
            PREFIX + "gateway_queue_requests", "Requests admitted and waiting in the gateway's queue for a place on "
            "a replica (kvserve's own metric).", per_model, registry=r)
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens of requests the engine started.", per_model)
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.", per_model)
        self.num_preemptions = counter("num_preemptions_total", "Preemptions (a request evicted to free KV).",
                                       per_replica)
        self.prefix_cache_queries = counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                                            per_replica)
        self.prefix_cache_hits = counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.",
                                         per_replica)
        self.engine_restarts = counter("engine_restarts_total",
                                       "Engine processes started to replace one that died (kvserve's own metric).",
                                       per_replica)
        self.request_success = counter("request_success", "Finished requests, by finish reason.",
                                       ["model_name", "finished_reason"])
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between successive outputs.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token.",
                                      REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "First token to last token.",
                                     REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "First scheduled to finish.",
                                        REQUEST_LATENCY_BUCKETS)
        self.request_tpot = histogram("request_time_per_output_token_seconds",
                                      "A request's decode time over its tokens after the first.", ITL_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               REQUEST_TOKEN_BUCKETS)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Tokens each finished request generated (all its samples).",
                                                   REQUEST_TOKEN_BUCKETS)
        self.request_max_generation_tokens = histogram("request_max_num_generation_tokens",
                                                       "The most tokens one sample of a finished request generated.",
                                                       REQUEST_TOKEN_BUCKETS)
        self.request_n = histogram("request_params_n", "Samples (n) of each finished request.", N_BUCKETS)
        self.iteration_tokens = histogram("iteration_tokens_total", "Tokens processed per engine step.",
                                          ITERATION_TOKEN_BUCKETS, per_replica)
        # kvserve:engine_info{model_name, replica, device, cpu_kernels, dtype, quantization, ...} 1: what each
        # engine's figures depend on (kvserve's own; vLLM's cache_config_info is the same idea), set once ready.
        self.engine_info = Info(ENGINE_INFO.removesuffix("_info"), "Each engine's device, CPU kernels, threads, "
                                "weight and KV formats and cache size (kvserve's own metric).", per_replica,
                                registry=r)
        self._spec: _SpecDecodeFamilies | None = None

    def spec_decode(self) -> _SpecDecodeFamilies:
        if self._spec is None:
            self._spec = _SpecDecodeFamilies(self.registry)
        return self._spec

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ServerMetrics:
    """Feeds the families from one engine's step results: one per (model, replica). Several share one
    MetricFamilies (and so one registry) in a server that serves several models or replicas."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *, replica: str = "0",
                 families: MetricFamilies | None = None) -> None:
        self.families = f = families or MetricFamilies(registry)
        self.registry = f.registry
        self.model_name, self.replica = model_name, replica
        engine = (model_name, replica)
        self.num_requests_running = f.num_requests_running.labels(*engine)
        self.num_requests_waiting = f.num_requests_waiting.labels(*engine)
        self.kv_cache_usage_perc = f.kv_cache_usage_perc.labels(*engine)
        self.prompt_tokens = f.prompt_tokens.labels(model_name)
        self.generation_tokens = f.generation_tokens.labels(model_name)
        self.num_preemptions = f.num_preemptions.labels(*engine)
        self.prefix_cache_queries = f.prefix_cache_queries.labels(*engine)
        self.prefix_cache_hits = f.prefix_cache_hits.labels(*engine)
        self.engine_restarts = f.engine_restarts.labels(*engine)
        self._request_success = f.request_success
        self.ttft = f.ttft.labels(model_name)
        self.itl = f.itl.labels(model_name)
        self.e2e = f.e2e.labels(model_name)
        self.queue_time = f.queue_time.labels(model_name)
        self.prefill_time = f.prefill_time.labels(model_name)
        self.decode_time = f.decode_time.labels(model_name)
        self.inference_time = f.inference_time.labels(model_name)
        self.request_tpot = f.request_tpot.labels(model_name)
        self.request_prompt_tokens = f.request_prompt_tokens.labels(model_name)
        self.request_generation_tokens = f.request_generation_tokens.labels(model_name)
        self.request_max_generation_tokens = f.request_max_generation_tokens.labels(model_name)
        self.request_n = f.request_n.labels(model_name)
        self.iteration_tokens = f.iteration_tokens.labels(*engine)
        self.engine_info = f.engine_info.labels(*engine)
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
            self.expect_speculation(0)
            self._spec.update(s, prev)
        if result.stepped:
            self.iteration_tokens.observe(s.last_step_num_tokens)
        self._last_stats = s
        for out in result.outputs:
            self._on_output(out)

    def expect_speculation(self, num_positions: int) -> None:
        """The engine speculates: its counters exist from now on, at 0 (with one per draft position) until
        the first draft, as vLLM's do, so that a dashboard or alert finds them before any traffic."""
        if self._spec is None:
            self._spec = _SpecDecodeCounters(self.families.spec_decode(), self.model_name, self.replica)
        for pos in range(num_positions):
            self._spec.per_pos.labels(*self._spec.engine, str(pos))

    def _on_output(self, out: RequestDelta) -> None:
        # Token counters count what the engine delivered, output by output, so they equal the sum of the
        # `usage` the server reports (prompt tokens once per request, as in usage.prompt_tokens).
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            tracked = self._tracked[out.request_id] = _Tracked()
            self.prompt_tokens.inc(out.num_prompt_tokens)
        for c in out.outputs:
            tracked.tokens_by_sample[c.index] = tracked.tokens_by_sample.get(c.index, 0) + len(c.token_ids)
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
            self._on_finished(out, tracked)

    def _on_finished(self, out: RequestDelta, tracked: _Tracked) -> None:
        self._tracked.pop(out.request_id, None)
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), None) or "stop"
        self._request_success.labels(self.model_name, reason).inc()
        longest = max(tracked.tokens_by_sample.values(), default=0)
        self.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.request_generation_tokens.observe(sum(tracked.tokens_by_sample.values()))
        self.request_max_generation_tokens.observe(longest)
        self.request_n.observe(len(tracked.tokens_by_sample))
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
        if m.first_scheduled_time is not None and end is not None:
            self.inference_time.observe(max(0.0, end - m.first_scheduled_time))
        if m.first_token_time is not None and m.last_token_time is not None:
            decode = max(0.0, m.last_token_time - m.first_token_time)
            self.decode_time.observe(decode)
            if longest > 1:  # as vLLM: the mean gap over the request's tokens after its first (its longest sample)
                self.request_tpot.observe(decode / (longest - 1))

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


class _SpecDecodeFamilies:
    def __init__(self, registry: CollectorRegistry) -> None:
        lbl = ["model_name", "replica"]
        self.num_drafts = Counter(PREFIX + "spec_decode_num_drafts", "Speculative drafts verified.", lbl,
                                  registry=registry)
        self.num_draft_tokens = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens verified.", lbl,
                                        registry=registry)
        self.num_accepted_tokens = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                           lbl, registry=registry)
        self.per_pos = Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                               "Draft tokens accepted, by position in the draft.", [*lbl, "position"],
                               registry=registry)


class _SpecDecodeCounters:
    """vLLM's speculative-decoding counters: drafts (one per sequence and step that verified some), draft
    tokens, accepted draft tokens, and accepted draft tokens by position in the draft (label `position`,
    0-based: how often the i-th draft token was accepted)."""

    def __init__(self, families: _SpecDecodeFamilies, model_name: str, replica: str) -> None:
        self.engine = (model_name, replica)
        self.num_drafts = families.num_drafts.labels(*self.engine)
        self.num_draft_tokens = families.num_draft_tokens.labels(*self.engine)
        self.num_accepted_tokens = families.num_accepted_tokens.labels(*self.engine)
        self.per_pos = families.per_pos

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
            child = self.per_pos.labels(*self.engine, str(pos))  # created at 0 on first sight
            if now > before:
                child.inc(now - before)
