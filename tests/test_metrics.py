"""ServerMetrics and the stats log line, fed step results built by hand (the server tests check them against
the real engine over HTTP)."""
from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.engine.core_process import StepResult
from kvserve.engine.stats import EngineStats
from kvserve.metrics.prometheus import MetricFamilies, ServerMetrics
from kvserve.metrics.stat_logger import _busy, format_stats_line, log_stats_periodically
from kvserve.outputs import CompletionDelta, RequestDelta, RequestMetrics

EXPECTED = {
    "gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"],
    "counter": ["prompt_tokens", "generation_tokens", "request_success", "num_preemptions",
                "prefix_cache_queries", "prefix_cache_hits", "engine_restarts"],
    "histogram": ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                  "request_inference_time_seconds", "request_time_per_output_token_seconds", "request_prompt_tokens",
                  "request_generation_tokens", "request_max_num_generation_tokens", "request_params_n",
                  "iteration_tokens_total"],
}


def samples(m: ServerMetrics) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if "le" not in s.labels:
                extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("model_name", "replica"))
                out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def output(rid: str, step: int, n_new: int, finished: bool, t0: float = 100.0) -> RequestDelta:
    m = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.5, first_token_time=t0 + 1.0,
                       last_token_time=t0 + 1.0 + 0.1 * step, finished_time=(t0 + 1.0 + 0.1 * step) if finished else None)
    c = CompletionDelta(0, [7] * n_new, "x", finish_reason="length" if finished else None)
    return RequestDelta(rid, [c], finished, num_prompt_tokens=4, metrics=m)


def test_names_types_and_labels():
    m = ServerMetrics("my-model")
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    for kind, names in EXPECTED.items():
        for name in names:
            fam = fams.get("kvserve:" + name)
            assert fam is not None and fam.type == kind, name
    ttft = [s for s in fams["kvserve:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert ttft[0].labels == {"model_name": "my-model", "le": "0.001"}
    # Engine series are per replica; request series per model (a model's replicas add up in them).
    assert fams["kvserve:num_requests_running"].samples[0].labels == {"model_name": "my-model", "replica": "0"}
    assert fams["kvserve:prefix_cache_hits"].samples[0].labels == {"model_name": "my-model", "replica": "0"}


def test_replicas_of_several_models_share_one_registry():
    families = MetricFamilies()
    a0, a1 = (ServerMetrics("a", replica=str(i), families=families) for i in range(2))
    b0 = ServerMetrics("b", families=families)
    a0.on_step(StepResult([output("r", 0, 1, True)], [], EngineStats(num_running=2, prefix_cache_hits=3), 1, 0.01,
                          True))
    a1.on_step(StepResult([output("s", 0, 1, True)], [], EngineStats(num_running=5), 1, 0.01, True))
    b0.on_step(StepResult([], [], EngineStats(num_running=1), 0, 0.01, True))
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for f in text_string_to_metric_families(families.render().decode()) for s in f.samples}
    assert got[("kvserve:num_requests_running", (("model_name", "a"), ("replica", "0")))] == 2
    assert got[("kvserve:num_requests_running", (("model_name", "a"), ("replica", "1")))] == 5
    assert got[("kvserve:num_requests_running", (("model_name", "b"), ("replica", "0")))] == 1
    assert got[("kvserve:prefix_cache_hits_total", (("model_name", "a"), ("replica", "0")))] == 3
    assert got[("kvserve:time_to_first_token_seconds_count", (("model_name", "a"),))] == 2   # both replicas'
    assert got[("kvserve:time_to_first_token_seconds_count", (("model_name", "b"),))] == 0


def test_request_histograms_and_token_counters():
    m = ServerMetrics("m")
    stats = EngineStats(num_running=1, kv_cache_usage=0.25, num_preemptions=2, prefix_cache_queries=10,
                        prefix_cache_hits=4, last_step_num_tokens=4)
    m.on_step(StepResult([output("a", 0, 1, False)], [], stats, 1, 0.01, True))
    for step in (1, 2):
        m.on_step(StepResult([output("a", step, 1, step == 2)], [], EngineStats(last_step_num_tokens=1), 1, 0.01,
                             True))
    s = samples(m)
    assert s["kvserve:time_to_first_token_seconds_count"] == 1
    assert abs(s["kvserve:time_to_first_token_seconds_sum"] - 1.0) < 1e-9
    assert s["kvserve:inter_token_latency_seconds_count"] == 2
    assert s["kvserve:e2e_request_latency_seconds_count"] == 1
    assert abs(s["kvserve:e2e_request_latency_seconds_sum"] - 1.2) < 1e-9
    assert abs(s["kvserve:request_queue_time_seconds_sum"] - 0.5) < 1e-9
    assert abs(s["kvserve:request_prefill_time_seconds_sum"] - 0.5) < 1e-9
    assert abs(s["kvserve:request_decode_time_seconds_sum"] - 0.2) < 1e-9
    assert abs(s["kvserve:request_inference_time_seconds_sum"] - 0.7) < 1e-9
    assert abs(s["kvserve:request_time_per_output_token_seconds_sum"] - 0.1) < 1e-9  # 0.2 s over 2 tokens after the first
    assert s["kvserve:request_prompt_tokens_sum"] == 4 and s["kvserve:request_generation_tokens_sum"] == 3
    assert s["kvserve:request_params_n_sum"] == 1
    assert s["kvserve:prompt_tokens_total"] == 4      # once per request
    assert s["kvserve:generation_tokens_total"] == 3
    assert s["kvserve:request_success_total{finished_reason=length}"] == 1
    assert s["kvserve:iteration_tokens_total_count"] == 3
    # engine counters are cumulative; a later, lower snapshot never makes a Prometheus counter go down
    assert s["kvserve:num_preemptions_total"] == 2 and s["kvserve:prefix_cache_hits_total"] == 4
    assert s["kvserve:num_requests_running"] == 0 and s["kvserve:kv_cache_usage_perc"] == 0


def test_a_request_of_several_samples_is_one_observation():
    """n = 2: its tokens add up in request_generation_tokens, its longest sample is the max, and its mean gap is
    over that sample's tokens (as vLLM's, whose samples end together in this test)."""
    m = ServerMetrics("m")
    t = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.5, last_token_time=0.5)
    m.on_step(StepResult([RequestDelta("a", [CompletionDelta(0, [1], "x"), CompletionDelta(1, [2], "y")], False,
                                       num_prompt_tokens=6, metrics=t)], [], EngineStats(), 1, 0.01, True))
    end = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, first_token_time=0.5, last_token_time=1.5,
                         finished_time=1.5)
    m.on_step(StepResult([RequestDelta("a", [CompletionDelta(0, [3, 4, 5, 6], "z", finish_reason="length"),
                                             CompletionDelta(1, [7], "w", finish_reason="stop")], True,
                                       num_prompt_tokens=6, metrics=end)], [], EngineStats(), 1, 0.01, True))
    s = samples(m)
    assert s["kvserve:request_generation_tokens_sum"] == 7 and s["kvserve:request_generation_tokens_count"] == 1
    assert s["kvserve:request_max_num_generation_tokens_sum"] == 5
    assert s["kvserve:request_params_n_sum"] == 2
    assert abs(s["kvserve:request_time_per_output_token_seconds_sum"] - 0.25) < 1e-9  # 1.0 s over 4 tokens


def test_aborted_request_is_forgotten():
    m = ServerMetrics("m")
    m.on_step(StepResult([output("a", 0, 1, False)], [], EngineStats(), 1, 0.01, True))
    m.on_request_end("a")
    assert not m._tracked  # noqa: SLF001


def test_registries_are_independent():
    a, b = ServerMetrics("a"), ServerMetrics("b")
    a.on_step(StepResult([output("r", 0, 1, True)], [], EngineStats(), 1, 0.01, True))
    assert samples(a)["kvserve:generation_tokens_total"] == 1
    assert samples(b)["kvserve:generation_tokens_total"] == 0


def test_stats_line():
    before = EngineStats(num_prompt_tokens=100, num_generation_tokens=50, prefix_cache_queries=100,
                         prefix_cache_hits=20)
    now = EngineStats(num_running=3, num_waiting=2, kv_cache_usage=0.125, num_prompt_tokens=600,
                      num_generation_tokens=150, prefix_cache_queries=200, prefix_cache_hits=70)
    line = format_stats_line(now, before, 5.0)
    assert "prompt throughput: 100.0 tokens/s" in line and "generation throughput: 20.0 tokens/s" in line
    assert "Running: 3 reqs" in line and "Waiting: 2 reqs" in line
    assert "KV cache usage: 12.5%" in line and "Prefix cache hit rate: 50.0%" in line
    assert _busy(now, before) and not _busy(EngineStats(), EngineStats())


def test_speculative_decoding_counters_with_vllm_names():
    m = ServerMetrics("m")
    assert not any("spec_decode" in k for k in samples(m))  # absent while the engine does not speculate
    m.on_step(StepResult([], [], EngineStats(), 0, 0.0, False))
    assert not any("spec_decode" in k for k in samples(m))
    m.expect_speculation(4)  # the server knows from the engine's config: the counters show from the start
    s = samples(m)
    assert s["kvserve:spec_decode_num_drafts_total"] == 0 and s["kvserve:spec_decode_num_accepted_tokens_total"] == 0
    assert [s[f"kvserve:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(4)] == [0] * 4
    first = EngineStats(spec_decode_enabled=True, spec_num_drafts=2, spec_num_draft_tokens=7,
                        spec_num_accepted_tokens=4, spec_accepted_per_pos=[2, 1, 1, 0])
    m.on_step(StepResult([], [], first, 0, 0.01, True))
    later = EngineStats(spec_decode_enabled=True, spec_num_drafts=5, spec_num_draft_tokens=17,
                        spec_num_accepted_tokens=9, spec_accepted_per_pos=[4, 3, 1, 1])
    m.on_step(StepResult([], [], later, 0, 0.01, True))
    s = samples(m)
    assert s["kvserve:spec_decode_num_drafts_total"] == 5
    assert s["kvserve:spec_decode_num_draft_tokens_total"] == 17
    assert s["kvserve:spec_decode_num_accepted_tokens_total"] == 9
    assert [s[f"kvserve:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] for i in range(4)] == \
           [4, 3, 1, 1]


def test_stats_line_shows_draft_acceptance():
    before = EngineStats(spec_decode_enabled=True, spec_num_drafts=10, spec_num_draft_tokens=40,
                         spec_num_accepted_tokens=10, spec_accepted_per_pos=[5, 3, 1, 1])
    now = EngineStats(spec_decode_enabled=True, spec_num_drafts=20, spec_num_draft_tokens=80,
                      spec_num_accepted_tokens=40, spec_accepted_per_pos=[15, 12, 8, 5])
    line = format_stats_line(now, before, 5.0)
    assert line.endswith("Draft acceptance rate: 75.0% (30/40 tokens), Mean acceptance length: 4.00, "
                         "Per-position acceptance rate: 1.000, 0.900, 0.700, 0.400")
    assert "Draft acceptance" not in format_stats_line(before, before, 5.0)
    assert "Draft acceptance" not in format_stats_line(EngineStats(), EngineStats(), 5.0)


def test_stats_line_after_an_engine_restart_counts_from_zero(caplog: pytest.LogCaptureFixture) -> None:
    """A replaced engine's counters start again from zero (AsyncLLM resets its stats): the line after the restart
    shows the new engine's own throughput and acceptance, not negative differences from the old one's totals."""
    readings = iter([
        EngineStats(num_running=1, num_generation_tokens=1000, spec_decode_enabled=True, spec_num_drafts=100,
                    spec_num_draft_tokens=400, spec_num_accepted_tokens=200),
        EngineStats(num_running=1, num_generation_tokens=50, spec_decode_enabled=True, spec_num_drafts=10,
                    spec_num_draft_tokens=40, spec_num_accepted_tokens=30),   # after the restart
    ])
    last = EngineStats()

    def get_stats() -> EngineStats:
        nonlocal last
        last = next(readings, last)
        return last

    async def run() -> None:
        task = asyncio.create_task(log_stats_periodically(get_stats, interval_s=0.05))
        await asyncio.sleep(0.08)   # one line, about 0.05 s after the restart
        task.cancel()

    with caplog.at_level(logging.INFO, logger="kvserve.stats"):
        asyncio.run(run())
    (line,) = [r.getMessage() for r in caplog.records if r.name == "kvserve.stats"]
    assert "-" not in line.split("generation throughput: ")[1].split(" ")[0], line
    assert "Draft acceptance rate: 75.0% (30/40 tokens)" in line
