"""The dashboard's data (kvserve/metrics/dashboard.py): time series computed from a Prometheus registry read
over time, checked against hand-computed values, numpy's quantiles, and the registry's own text rendering."""
from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.metrics.dashboard import RATE_WINDOW_S, MetricsHistory
from kvserve.metrics.prometheus import MetricFamilies, ServerMetrics
from kvserve.metrics.registry_sample import Histogram as Buckets
from kvserve.metrics.registry_sample import histogram_quantile, read_registry

INF = math.inf


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def metrics_text_values(registry: CollectorRegistry) -> dict[str, float]:
    """What a Prometheus scrape of /metrics would sum per sample name (buckets and _created left out)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


# ---------------------------------------------------------------- histogram_quantile

def test_histogram_quantile_interpolates_inside_the_bucket():
    h = Buckets((0.1, 0.5, 1.0, INF), (10, 30, 40, 40))
    assert histogram_quantile(0.5, h) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert histogram_quantile(0.99, h) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert histogram_quantile(0.05, h) == pytest.approx(0.1 * 2 / 10)      # the lowest bucket starts at 0


def test_histogram_quantile_edges():
    assert histogram_quantile(0.5, Buckets((0.1, 1.0, INF), (0, 0, 0))) is None           # nothing observed
    assert histogram_quantile(0.5, Buckets((0.1, 1.0, INF), (0, 0, 5))) == 1.0            # all above: top bound
    assert histogram_quantile(0.99, Buckets((0.1, 1.0, INF), (5, 5, 5))) == pytest.approx(0.099)


def test_histogram_quantile_follows_numpy_within_a_bucket():
    rng = np.random.default_rng(0)
    data = rng.gamma(2.0, 0.05, size=20_000)
    bounds = [0.01 * k for k in range(1, 101)] + [INF]
    cumulative = [float(np.sum(data <= b)) for b in bounds]
    h = Buckets(tuple(bounds), tuple(cumulative))
    for q in (0.5, 0.9, 0.99):
        assert histogram_quantile(q, h) == pytest.approx(np.quantile(data, q), abs=0.01)


# ---------------------------------------------------------------- series

def _registry() -> tuple[CollectorRegistry, dict]:
    r = CollectorRegistry()
    m = {
        "running": Gauge("kvserve:num_requests_running", "", ["model_name"], registry=r).labels("m"),
        "waiting": Gauge("kvserve:num_requests_waiting", "", ["model_name"], registry=r).labels("m"),
        "kv": Gauge("kvserve:kv_cache_usage_perc", "", ["model_name"], registry=r).labels("m"),
        "gen": Counter("kvserve:generation_tokens", "", ["model_name"], registry=r).labels("m"),
        "prompt": Counter("kvserve:prompt_tokens", "", ["model_name"], registry=r).labels("m"),
        "hits": Counter("kvserve:prefix_cache_hits", "", ["model_name"], registry=r).labels("m"),
        "queries": Counter("kvserve:prefix_cache_queries", "", ["model_name"], registry=r).labels("m"),
        "preempt": Counter("kvserve:num_preemptions", "", ["model_name"], registry=r).labels("m"),
        "ttft": Histogram("kvserve:time_to_first_token_seconds", "", ["model_name"], registry=r,
                          buckets=[0.1, 0.2, 0.5, 1.0]).labels("m"),
        "itl": Histogram("kvserve:inter_token_latency_seconds", "", ["model_name"], registry=r,
                         buckets=[0.01, 0.05, 0.1]).labels("m"),
    }
    return r, m


def test_rates_ratios_and_quantiles_over_their_windows():
    registry, m = _registry()
    clock = Clock()
    history = MetricsHistory(registry, clock=clock)
    for second in range(30):
        m["gen"].inc(20)                      # 20 tokens/s throughout
        m["prompt"].inc(100 if second % 10 == 0 else 0)
        m["queries"].inc(10)
        m["hits"].inc(5 if second >= 10 else 0)
        m["running"].set(second % 3)
        if second >= 20:
            m["ttft"].observe(0.15)           # all in the (0.1, 0.2] bucket
        history.sample()
        clock.t += 1.0
    clock.t -= 0.5                            # "now" half a second after the last reading
    d = history.dashboard()
    s = d["series"]
    n = len(d["time"])
    assert n == 31 and d["time"][-1] == clock.t
    assert s["num_requests_running"][:3] == [0, 1, 2]
    assert s["generation_tokens_per_s"][0] is None                       # nothing before the first reading
    assert s["generation_tokens_per_s"][10] == pytest.approx(20.0)       # 100 tokens over the 5 s window
    assert s["prompt_tokens_per_s"][12] == pytest.approx(100 / RATE_WINDOW_S)
    assert s["prompt_tokens_per_s"][16] == pytest.approx(0.0)
    # The hit rate looks back DISTRIBUTION_WINDOW_S (here: to the first reading).
    assert s["prefix_cache_hit_rate"][29] == pytest.approx(5 * 20 / (10 * 29))
    assert s["ttft_p50_s"][19] is None                                   # no first token yet in the window
    assert s["ttft_p50_s"][25] == pytest.approx(0.15)                    # midpoint of the bucket
    assert s["ttft_p99_s"][25] == pytest.approx(0.1 + 0.1 * 0.99)
    assert s["itl_p50_s"][25] is None
    for key in ("num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total"):
        assert len(s[key]) == n
    assert "spec_decode_acceptance_rate" not in s and d["replicas"] == {}


def test_a_short_window_still_looks_back_for_its_first_points():
    registry, m = _registry()
    clock = Clock()
    history = MetricsHistory(registry, clock=clock)
    for _ in range(100):
        m["gen"].inc(10)
        history.sample()
        clock.t += 1.0
    d = history.dashboard(10)
    assert d["window_s"] == 10 and all(t >= clock.t - 10 for t in d["time"])
    # The first point's rate reaches back before the window; the last ("now") saw no tokens in its last second.
    assert d["series"]["generation_tokens_per_s"][:-1] == [pytest.approx(10.0)] * (len(d["time"]) - 1)
    assert d["series"]["generation_tokens_per_s"][-1] == pytest.approx(40 / 5)
    assert history.dashboard(10_000)["window_s"] == history.keep_s     # capped at what is kept


def test_history_is_bounded():
    registry, _ = _registry()
    clock = Clock()
    history = MetricsHistory(registry, interval_s=1.0, keep_s=20.0, clock=clock)
    for _ in range(100):
        history.sample()
        clock.t += 1.0
    assert len(history.dashboard()["time"]) <= 22


def test_totals_are_the_registry_as_metrics_renders_it():
    metrics = ServerMetrics("my-model")
    metrics.generation_tokens.inc(7)
    metrics.ttft.observe(0.3)
    metrics._request_success.labels("my-model", "stop").inc(2)
    metrics._request_success.labels("my-model", "length").inc(1)
    totals = MetricsHistory(metrics.registry).dashboard()["totals"]
    assert totals == metrics_text_values(metrics.registry)
    assert totals["kvserve:request_success_total"] == 3
    assert totals["kvserve:time_to_first_token_seconds_count"] == 1


def test_a_fresh_server_registry_has_every_core_series():
    metrics = ServerMetrics("m")
    d = MetricsHistory(metrics.registry).dashboard()
    assert set(d["series"]) == {
        "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
        "generation_tokens_per_s", "prompt_tokens_per_s", "prefix_cache_hit_rate",
        "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s", "itl_p99_s"}
    # A counter with labels that nothing has incremented still reads as 0, as a dashboard tile should show.
    assert d["totals"]["kvserve:request_success_total"] == 0


def test_the_gateways_queue_is_a_series_and_a_total():
    """Beyond an engine's batch, requests wait in the gateway's queue: the page showed "Waiting 0" beside it."""
    families = MetricFamilies()
    families.gateway_queue_requests.labels("small").set(3)
    families.gateway_queue_requests.labels("large").set(2)
    d = MetricsHistory(families.registry).dashboard()
    assert d["series"]["gateway_queue_requests"] == [5]
    assert d["totals"]["kvserve:gateway_queue_requests"] == 5


def test_speculative_and_replica_series_appear_once_their_metrics_exist():
    registry = CollectorRegistry()
    running = Gauge("kvserve:num_requests_running", "", ["model_name", "replica"], registry=registry)
    accepted = Counter("kvserve:spec_decode_num_accepted_tokens", "", registry=registry)
    drafted = Counter("kvserve:spec_decode_num_draft_tokens", "", registry=registry)
    clock = Clock()
    history = MetricsHistory(registry, clock=clock)
    for _ in range(3):
        drafted.inc(4)
        accepted.inc(3)
        running.labels("m", "0").set(2)
        running.labels("m", "1").set(5)
        history.sample()
        clock.t += 1.0
    d = history.dashboard()
    assert d["series"]["spec_decode_acceptance_rate"][-1] == pytest.approx(0.75)
    assert d["series"]["num_requests_running"][-1] == 7                      # summed over replicas
    assert d["replicas"] == {"0": {"num_requests_running": [2, 2, 2, 2]},
                             "1": {"num_requests_running": [5, 5, 5, 5]}}


def test_read_registry_sums_label_sets():
    r = CollectorRegistry()
    c = Counter("kvserve:request_success", "", ["finished_reason"], registry=r)
    c.labels("stop").inc(2)
    c.labels("length").inc(3)
    h = Histogram("kvserve:e2e_request_latency_seconds", "", ["model_name"], buckets=[1.0], registry=r)
    h.labels("a").observe(0.5)
    h.labels("b").observe(2.0)
    s = read_registry(r, t=5.0)
    assert s.t == 5.0 and s.values["kvserve:request_success_total"] == 5
    assert s.histograms["kvserve:e2e_request_latency_seconds"] == Buckets((1.0, INF), (1, 2))
    assert s.values["kvserve:e2e_request_latency_seconds_count"] == 2


def test_kv_cache_usage_is_the_engines_mean_not_their_sum():
    """Three engines each 60% full are 60% full together (their sum, 180%, was drawn on a 0-100% chart); the
    per-replica split keeps each engine's own."""
    r = CollectorRegistry()
    kv = Gauge("kvserve:kv_cache_usage_perc", "", ["model_name", "replica"], registry=r)
    running = Gauge("kvserve:num_requests_running", "", ["model_name", "replica"], registry=r)
    for model, replica, usage in (("small", "0", 0.6), ("small", "1", 0.6), ("large", "0", 0.3)):
        kv.labels(model, replica).set(usage)
        running.labels(model, replica).set(2)
    d = MetricsHistory(r).dashboard()
    assert d["totals"]["kvserve:kv_cache_usage_perc"] == pytest.approx(0.5)
    assert d["series"]["kv_cache_usage_perc"][-1] == pytest.approx(0.5)
    assert d["totals"]["kvserve:num_requests_running"] == 6                  # counts still add up
    assert d["replicas"]["large/0"]["kv_cache_usage_perc"] == [pytest.approx(0.3)]


def test_kv_cache_usage_weighs_each_engine_by_its_pool_where_engine_info_says():
    """A small pool 60% full beside a large one 30% full is not 45% full: each engine counted alike before."""
    metrics = [ServerMetrics(model, replica=replica, families=families)
               for families in [MetricFamilies()] for model, replica in (("small", "0"), ("small", "1"), ("large", "0"))]
    for m, usage, blocks, block_size in zip(metrics, (0.6, 0.6, 0.3), (100, 100, 400), (16, 16, 32)):
        m.kv_cache_usage_perc.set(usage)
        m.engine_info.info({"num_kv_blocks": str(blocks), "block_size": str(block_size)})
    d = MetricsHistory(metrics[0].registry).dashboard()
    # Pools of 1600, 1600 and 12800 tokens.
    assert d["totals"]["kvserve:kv_cache_usage_perc"] == pytest.approx((0.6 * 3200 + 0.3 * 12800) / 16000)
    assert d["replicas"]["small/1"]["kv_cache_usage_perc"] == [pytest.approx(0.6)]
