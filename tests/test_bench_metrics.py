"""`kvserve bench` metric definitions on hand-built timelines (vLLM `bench serve` semantics)."""

import math

import numpy as np
import pytest

from kvserve.bench.client import RequestResult
from kvserve.bench.metrics import (Distribution, calculate_metrics, max_concurrency_seen,
                                   parse_goodput, request_tpot)


def _req(start, ttft, itl, output_tokens, prompt_len=10, success=True):
    latency = ttft + sum(itl)
    return RequestResult(success=success, prompt_len=prompt_len, output_tokens=output_tokens,
                         start_time=start, ttft=ttft, itl=list(itl), latency=latency,
                         generated_text="x " * (output_tokens or 0))


@pytest.fixture
def timeline():
    # A: sent at 0.0, first token at 0.1, three more at +20, +30, +50 ms -> ends at 0.2 s.
    a = _req(0.0, 0.100, [0.020, 0.030, 0.050], output_tokens=4, prompt_len=10)
    # B: sent at 0.05, one token only at 0.3 s after sending -> no TPOT, no ITL.
    b = _req(0.05, 0.300, [], output_tokens=1, prompt_len=20)
    # C: failed -- counts as failed, contributes to nothing else.
    c = RequestResult(success=False, error="HTTP 500", prompt_len=99, start_time=0.1, latency=0.01)
    return [a, b, c]


def test_counts_and_throughputs_match_hand_computation(timeline):
    m = calculate_metrics(timeline, duration_s=2.0)
    assert (m.completed, m.failed) == (2, 1)
    assert m.total_input_tokens == 30  # failed request's prompt not counted
    assert m.total_output_tokens == 5
    assert m.request_throughput == pytest.approx(1.0)
    assert m.output_throughput == pytest.approx(2.5)
    assert m.total_token_throughput == pytest.approx(17.5)
    assert m.request_goodput is None  # no SLO given


def test_ttft_e2el_distributions(timeline):
    m = calculate_metrics(timeline, duration_s=2.0)
    # TTFTs 100 and 300 ms: linear-interpolated percentiles between them.
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.median == pytest.approx(200.0)
    assert m.ttft_ms.std == pytest.approx(100.0)  # population std, as vLLM (np.std)
    assert m.ttft_ms.percentiles["p90"] == pytest.approx(280.0)
    assert m.ttft_ms.percentiles["p99"] == pytest.approx(298.0)
    # E2E: A = 100+20+30+50 = 200 ms, B = 300 ms.
    assert m.e2el_ms.mean == pytest.approx(250.0)
    assert m.e2el_ms.percentiles["p99"] == pytest.approx(299.0)


def test_tpot_excludes_first_token_and_single_token_requests(timeline):
    m = calculate_metrics(timeline, duration_s=2.0)
    # A: (200 - 100) / (4 - 1) ms; B has one token, so only A counts.
    assert m.tpot_ms.mean == pytest.approx(100.0 / 3)
    assert m.tpot_ms.median == pytest.approx(100.0 / 3)
    assert m.tpot_ms.std == pytest.approx(0.0)
    assert request_tpot(0.2, 0.1, 1) is None


def test_itl_is_every_gap_between_chunks(timeline):
    m = calculate_metrics(timeline, duration_s=2.0)
    # Gaps 20, 30, 50 ms; p90 = 30 + 0.8*20, p99 = 30 + 0.98*20.
    assert m.itl_ms.mean == pytest.approx(100.0 / 3)
    assert m.itl_ms.median == pytest.approx(30.0)
    assert m.itl_ms.percentiles["p90"] == pytest.approx(46.0)
    assert m.itl_ms.percentiles["p99"] == pytest.approx(49.6)


def test_tpot_differs_from_itl_mean_when_chunks_carry_several_tokens():
    # 10 tokens in 3 chunks (e.g. speculative decoding): TPOT divides by tokens, ITL by chunks.
    r = _req(0.0, 0.1, [0.09, 0.09], output_tokens=10)
    m = calculate_metrics([r], duration_s=1.0)
    assert m.tpot_ms.mean == pytest.approx(180.0 / 9)
    assert m.itl_ms.mean == pytest.approx(90.0)


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 150}, 1),                 # A meets it, B (300 ms) does not
    ({"ttft": 400}, 2),
    ({"ttft": 400, "tpot": 30}, 1),     # A's TPOT 33.3 ms fails; B's TPOT counts as 0
    ({"ttft": 400, "tpot": 34}, 2),
    ({"e2el": 250}, 1),
    ({"ttft": 50}, 0),
])
def test_goodput_counts_requests_meeting_every_slo(timeline, slos, good):
    m = calculate_metrics(timeline, duration_s=2.0, goodput_slos_ms=slos)
    assert m.request_goodput == pytest.approx(good / 2.0)
    assert m.goodput_slos_ms == slos


def test_custom_percentiles_match_numpy():
    vals = [0.013, 0.2, 0.05, 0.5, 0.09, 0.31, 0.07]
    rs = [_req(i * 0.01, v, [], 1) for i, v in enumerate(vals)]
    m = calculate_metrics(rs, 1.0, percentiles=(25.0, 75.0, 99.9))
    ms = np.array(vals) * 1e3
    for p in (25.0, 75.0, 99.9):
        assert m.ttft_ms.percentiles[f"p{p:g}"] == pytest.approx(np.percentile(ms, p))


def test_output_tokens_fall_back_to_tokenizing_text():
    r = _req(0.0, 0.1, [0.01, 0.01], output_tokens=None)
    r.generated_text = "a b c"
    m = calculate_metrics([r], 1.0, tokenize=lambda s: len(s.split()))
    assert m.total_output_tokens == 3
    with pytest.raises(ValueError):
        calculate_metrics([r], 1.0, tokenize=None)
    # A usage count of 0 beside streamed text is counted again, as vLLM's client does (it had been kept).
    r.output_tokens = 0
    assert calculate_metrics([r], 1.0, tokenize=lambda s: len(s.split())).total_output_tokens == 3
    assert calculate_metrics([r], 1.0, tokenize=None).total_output_tokens == 0


def test_no_successes_gives_zeros_not_nan():
    m = calculate_metrics([RequestResult(success=False, error="x")], 1.0, {"ttft": 1})
    assert m.completed == 0 and m.failed == 1
    assert m.ttft_ms == Distribution(0.0, 0.0, 0.0, {"p50": 0.0, "p90": 0.0, "p99": 0.0})
    assert m.request_goodput == 0.0
    assert not math.isnan(m.output_throughput)


def test_max_concurrency_seen():
    rs = [_req(0.0, 1.0, [], 1), _req(0.5, 1.0, [], 1), _req(1.0, 1.0, [], 1), _req(3.0, 0.1, [], 1)]
    # [0,1), [0.5,1.5), [1,2): at most 2 overlap (a request ending at t=1 frees its slot first).
    assert max_concurrency_seen(rs) == 2


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5"]) == {"ttft": 500.0, "tpot": 50.5}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["foo:1"], ["tpot:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_spec_counters_read_vllms_names_and_only_the_benchmarked_model():
    """The speculative-decoding section reads vLLM's counters too (prefix vllm:, an engine label, and the
    _created samples prometheus_client adds), and on a server of several models only the one benchmarked."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    from kvserve.bench.report import format_table
    from kvserve.bench.spec_decode import SpecCounters, SpecDecodeStats, parse_spec_counters

    reg = CollectorRegistry()
    labels = ["model_name", "engine"]
    drafts = Counter("vllm:spec_decode_num_drafts", "", labels, registry=reg)
    tokens = Counter("vllm:spec_decode_num_draft_tokens", "", labels, registry=reg)
    accepted = Counter("vllm:spec_decode_num_accepted_tokens", "", labels, registry=reg)
    per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "", [*labels, "position"], registry=reg)
    Counter("vllm:request_success", "", labels, registry=reg).labels("a", "0").inc(7)
    for model, engine, n in (("a", "0", 10), ("a", "1", 6), ("b", "0", 100)):
        drafts.labels(model, engine).inc(n)
        tokens.labels(model, engine).inc(2 * n)
        accepted.labels(model, engine).inc(n + n // 2)
        per_pos.labels(model, engine, "0").inc(n)
        per_pos.labels(model, engine, "1").inc(n // 2)
    page = generate_latest(reg).decode()
    assert "_created" in page

    a = parse_spec_counters(page, "a")
    assert a == SpecCounters(drafts=16, draft_tokens=32, accepted=24, accepted_per_pos={0: 16, 1: 8})
    assert parse_spec_counters(page, "b").drafts == 100
    # A third model that does not speculate: nothing, not the others' drafts.
    Counter("vllm:request_success_x", "", labels, registry=reg).labels("c", "0").inc()
    assert parse_spec_counters(generate_latest(reg).decode(), "c") is None
    assert parse_spec_counters("# nothing here\n", "a") is None
    # One model, asked for by another name (an alias): its counters.
    one = CollectorRegistry()
    Counter("kvserve:spec_decode_num_drafts", "", ["model_name", "replica"], registry=one).labels("main", "0").inc(5)
    assert parse_spec_counters(generate_latest(one).decode(), "alias").drafts == 5

    earlier = SpecCounters(drafts=6, draft_tokens=12, accepted=9, accepted_per_pos={0: 6, 1: 3})
    stats = SpecDecodeStats.between(earlier, a)
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens) == (10, 20, 15)
    assert stats.acceptance_rate == 0.75 and stats.acceptance_length == 2.5
    assert stats.acceptance_by_position == [1.0, 0.5]
    none_drafted = SpecDecodeStats.between(a, a)
    assert none_drafted.acceptance_rate is None and none_drafted.acceptance_by_position == []
    assert "Acceptance rate (%):                    n/a" in format_table(
        calculate_metrics([], 1.0, {}, (50.0,)), float("inf"), 1.0, None, spec=none_drafted)
    # Counters lower after the run than before: the server restarted, and what they hold is the run's.
    restarted = SpecDecodeStats.between(a, earlier)
    assert (restarted.drafts, restarted.accepted_tokens, restarted.acceptance_by_position) == (6, 9, [1.0, 0.5])
    # A per-position sample without its position label is left out, not a crash.
    page_without = "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n" \
                   "vllm:spec_decode_num_accepted_tokens_per_pos_total 3.0\n"
    assert parse_spec_counters(page_without, "a") == SpecCounters()
