"""`kvserve serve --speculative-config`: the flag reaches the engine process, greedy completions are those of
the engine without speculation, /metrics exports vLLM's spec_decode_* counters and the stats line the
acceptance rate; streams carry accepted runs with stops and seeded samples as without speculation, and a
client that disconnects frees its blocks; with --per-request-spec-decode-metrics, responses carry each request's
acceptance figures as vLLM's do; concurrent requests that overflow the KV pool (preemptions while drafting) answer
as without speculation and leave no block held."""
from __future__ import annotations

import json

import httpx
import pytest

from kvserve.entrypoints.openai.launcher import RemoteServer
from server_helpers import metrics, wait_for
from spec_helpers import check_request_acceptance

pytestmark = pytest.mark.timeout(300)
PROMPT = "Copy the list: apples, pears, plums, cherries, grapes, lemons. Copy: apples, pears,"
# The draft-length rule off: it weighs real step times, and on a slow host one slow first step could leave these
# short requests without a draft (the rule's own tests model the times).
SPEC = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2, '
        '"adaptive_draft_length": false}')


@pytest.fixture(scope="module")
def server():
    args = ["--dtype", "float32", "--quantization", "none", "--max-model-len", "256", "--num-kv-blocks", "64",
            "--log-stats-interval", "0.5", "--speculative-config", SPEC,
            "--per-request-spec-decode-metrics", "detailed"]
    with RemoteServer(args) as s:
        yield s


@pytest.fixture(scope="module")
def llm():
    """The same model without speculation, in this process: the reference outputs."""
    from kvserve import LLM
    return LLM(dtype="float32", quantization="none", max_model_len=256, num_threads=1)


def test_server_speculates_and_exports_counters(server, llm):
    from kvserve import SamplingParams
    expected = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        # Before any request the counters are there, at 0, one per draft position too (as vLLM's).
        values = metrics(http)
        assert [values[f"kvserve:spec_decode_{name}_total"] for name in
                ("num_drafts", "num_draft_tokens", "num_accepted_tokens")] == [0, 0, 0]
        assert [values[f"kvserve:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"]
                for i in range(3)] == [0, 0, 0]
        r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT,
                                               "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        values = metrics(http)
        assert values["kvserve:spec_decode_num_drafts_total"] > 0
        assert values["kvserve:spec_decode_num_draft_tokens_total"] >= values["kvserve:spec_decode_num_drafts_total"]
        assert 0 < values["kvserve:spec_decode_num_accepted_tokens_total"] <= \
               values["kvserve:spec_decode_num_draft_tokens_total"]
        assert values["kvserve:spec_decode_num_accepted_tokens_per_pos_total{position=0}"] >= \
               values["kvserve:spec_decode_num_accepted_tokens_per_pos_total{position=1}"]
        wait_for(lambda: "Draft acceptance rate" in server.output(), 10, "the stats line")


def stream_texts(http: httpx.Client, body: dict) -> tuple[list[str], list[str | None]]:
    """A streamed completion's text and finish reason per choice, from its SSE events."""
    texts: list[str] = [""] * body.get("n", 1)
    reasons: list[str | None] = [None] * len(texts)
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line and line != "data: [DONE]":
                for c in json.loads(line.removeprefix("data: "))["choices"]:
                    texts[c["index"]] += c["text"]
                    reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
    return texts, reasons


def test_streams_with_drafts_stop_where_decoding_does_and_a_disconnect_frees_the_blocks(server, llm):
    """Accepted runs reach the client as multi-token deltas: streamed, a stop string inside a run ends the text
    where the engine without speculation ends it, and seeded sampling (n = 2) gives the same samples. A client
    that leaves mid-stream, with drafts in flight, gets its request aborted and its blocks freed."""
    from kvserve import SamplingParams
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 24}
    cases = [({"temperature": 0, "stop": [" grapes"]}, SamplingParams(temperature=0, max_tokens=24, stop=[" grapes"])),
             ({"temperature": 0.8, "top_p": 0.9, "seed": 7, "n": 2},
              SamplingParams(temperature=0.8, top_p=0.9, seed=7, n=2, max_tokens=24))]
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for extra, params in cases:
            drafts_before = metrics(http)["kvserve:spec_decode_num_drafts_total"]
            want = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
            texts, reasons = stream_texts(http, {**body, **extra})
            assert texts == [o.text for o in want]
            assert reasons == [o.finish_reason for o in want]
            assert metrics(http)["kvserve:spec_decode_num_drafts_total"] > drafts_before
            if "stop" in extra:
                assert reasons == ["stop"]  # the copy reached the stop string

        before = metrics(http)
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 200, "ignore_eos": True,
                                                          "temperature": 0, "stream": True}) as r:
            events = (line for line in r.iter_lines() if line)
            chunks = [json.loads(next(events).removeprefix("data: ")) for _ in range(3)]
            assert all(c["choices"][0]["finish_reason"] is None for c in chunks)  # still generating
            during = metrics(http)
            usage = "kvserve:kv_cache_usage_perc"
            assert during["kvserve:num_requests_running"] == 1 and during[usage] > before[usage]
        # Leaving the block closes the connection mid-stream.
        wait_for(lambda: metrics(http)["kvserve:num_requests_running"] == 0, 10, "the aborted request to leave")
        after = metrics(http)
        assert after[usage] == before[usage]
        assert after["kvserve:spec_decode_num_drafts_total"] > before["kvserve:spec_decode_num_drafts_total"]


def test_streamed_logprobs_of_accepted_runs_are_the_whole_answers(server):
    """A chunk of several tokens (an accepted run) had its text_offsets counted from the text sent before it and
    then by the tokens' strings: they ran ahead of the text and went back at the next chunk. Streamed, the
    logprobs are now the non-streamed answer's, and each offset is where its token is in the text."""
    # " pl", then " plums," wait on whether the stop string follows; the copy goes on with " grapes" in one run.
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "logprobs": 0,
            "stop": [" plums, cherries, figs"]}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        whole = http.post("/v1/completions", json=body).json()["choices"][0]
        text, sizes, joined = "", [], {"tokens": [], "token_logprobs": [], "text_offset": []}
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and (choices := json.loads(line[6:])["choices"]):
                    text += choices[0]["text"]
                    lp = choices[0]["logprobs"] or {}
                    sizes.append(len(lp.get("tokens") or []))
                    for key in joined:
                        joined[key] += lp.get(key) or []
    assert max(sizes) > 1                                        # accepted runs came as multi-token chunks
    assert text == whole["text"] and joined == {k: whole["logprobs"][k] for k in joined}
    for token, offset in zip(joined["tokens"], joined["text_offset"]):
        assert text[offset:offset + len(token)] == token, (token, offset, text)


def test_bench_serve_reports_what_the_server_counted(server, tmp_path, capsys):
    """`kvserve bench serve` against a speculating server adds a Speculative Decoding section, as `vllm bench
    serve` does: the drafts, draft tokens and accepted tokens the server counted over the run (its /metrics,
    read here before and after), the acceptance rate and length they give, and acceptance by draft position."""
    from kvserve.bench.cli import main as bench_main
    out = tmp_path / "bench.json"
    argv = ["serve", "--base-url", server.base_url, "--model", "SmolLM2-135M-Instruct", "--dataset", "random",
            "--num-prompts", "4", "--input-len", "48", "--output-len", "96", "--max-concurrency", "2", "--seed", "5",
            "--no-test-request", "--disable-tqdm", "--save-result", str(out)]
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        # Drafts before the run, which the benchmark must not count.
        assert http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT,
                                                  "max_tokens": 16, "temperature": 0}).status_code == 200
        before = wait_for(lambda: (m := metrics(http)).get("kvserve:spec_decode_num_drafts_total") and m, 10,
                          "the warm-up's drafts in /metrics")
        assert bench_main(argv) == 0
        after = metrics(http)
    delta = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("kvserve:spec_decode_")}
    spec = json.loads(out.read_text())["spec_decode"]
    assert spec["drafts"] == delta["kvserve:spec_decode_num_drafts_total"] > 0
    assert spec["draft_tokens"] == delta["kvserve:spec_decode_num_draft_tokens_total"]
    assert spec["accepted_tokens"] == delta["kvserve:spec_decode_num_accepted_tokens_total"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    assert spec["acceptance_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["drafts"])
    by_pos = [delta[f"kvserve:spec_decode_num_accepted_tokens_per_pos_total{{position={i}}}"] / spec["drafts"]
              for i in range(3)]
    assert spec["acceptance_by_position"] == pytest.approx(by_pos)
    assert sum(by_pos) == pytest.approx(spec["acceptance_length"] - 1)
    table = capsys.readouterr().out
    assert "Speculative Decoding" in table
    assert f"{100 * spec['acceptance_rate']:.2f}" in table.split("Acceptance rate (%):")[1].split("\n")[0]


def test_offline_get_metrics_gives_the_engines_counts_under_the_servers_series(server):
    """LLM.get_metrics(), what vLLM's offline speculative example reads acceptance from: the engine's own
    counts, each under a name and label set that the real server's /metrics has (read over HTTP and parsed
    by prometheus_client), the accepted tokens by position as one Vector."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvserve import LLM, SamplingParams
    from kvserve.metrics.reader import Counter, Gauge, Vector

    offline = LLM(dtype="float32", quantization="none", max_model_len=256, num_threads=1,
                  speculative_config=json.loads(SPEC))
    out = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    got = {m.name: m for m in offline.get_metrics()}
    s = offline.engine.get_stats()
    assert isinstance(got["kvserve:spec_decode_num_drafts"], Counter)
    assert got["kvserve:spec_decode_num_drafts"].value == s.spec_num_drafts > 0
    assert got["kvserve:spec_decode_num_draft_tokens"].value == s.spec_num_draft_tokens
    assert got["kvserve:spec_decode_num_accepted_tokens"].value == s.spec_num_accepted_tokens > 0
    per_pos = got["kvserve:spec_decode_num_accepted_tokens_per_pos"]
    assert isinstance(per_pos, Vector) and per_pos.values == s.spec_accepted_per_pos
    assert sum(per_pos.values) == s.spec_num_accepted_tokens
    assert got["kvserve:generation_tokens"].value == len(out.outputs[0].token_ids) == 24
    assert got["kvserve:prompt_tokens"].value == len(out.prompt_token_ids)
    assert isinstance(got["kvserve:kv_cache_usage_perc"], Gauge) and got["kvserve:num_requests_running"].value == 0

    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT,
                                               "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        page = http.get("/metrics").text
    series = {(sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k != "position")))
              for family in text_string_to_metric_families(page) for sample in family.samples}
    for m in got.values():
        name = m.name + ("_total" if isinstance(m, (Counter, Vector)) else "")
        assert (name, tuple(sorted(m.labels.items()))) in series, m


COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
FIGURES = ("num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens")  # the per-request names of COUNTERS


def sse_chunks(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_responses_carry_each_requests_acceptance(server):
    """--per-request-spec-decode-metrics detailed: a completion of one sequence carries metrics.speculative_decoding
    (vLLM's shape), whose counts are what /metrics counted for it; streamed, only the final usage chunk carries
    it (none without stream_options.include_usage); n = 2 or several prompts give metrics null; a request that
    never drafted gets zeros; chat too, read through the official client. (test_server.py checks that a server
    without the option adds no `metrics`.)"""
    import openai

    model = "SmolLM2-135M-Instruct"
    body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        before = metrics(http)
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        figures = r.json()["metrics"]["speculative_decoding"]
        check_request_acceptance(figures, detailed=True)
        assert figures["num_spec_tokens"] == 3 and figures["num_accepted_draft_tokens"] > 0
        want = [before[f"kvserve:spec_decode_{c}_total"] + figures[f] for c, f in zip(COUNTERS, FIGURES)]
        wait_for(lambda: [metrics(http)[f"kvserve:spec_decode_{c}_total"] for c in COUNTERS] == want, 10,
                 f"/metrics to count {figures}")

        chunks = sse_chunks(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        carrying = [c for c in chunks if c.get("metrics") is not None]
        assert len(carrying) == 1 and carrying[0] is chunks[-1] and chunks[-1]["usage"]["completion_tokens"] == 24
        assert carrying[0]["metrics"]["speculative_decoding"] == figures  # greedy: the same drafts, step by step
        assert not any("metrics" in c for c in sse_chunks(http, "/v1/completions", body))

        assert http.post("/v1/completions", json={**body, "n": 2}).json()["metrics"] is None
        # One token: no step drafted. The figures are there, at zero, and the two ratios null.
        r = http.post("/v1/completions", json={**body, "max_tokens": 1})
        none = r.json()["metrics"]["speculative_decoding"]
        assert none["num_spec_steps"] == none["num_draft_tokens"] == 0 and none["acceptance_histogram"] == [0] * 4
        assert none["mean_acceptance_length"] is None and none["draft_acceptance_rate"] is None
        assert http.post("/v1/completions", json={**body, "prompt": [PROMPT, PROMPT]}).json()["metrics"] is None

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Repeat exactly: red, green, blue, red, green, blue, red, green"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    figures = chat.model_extra["metrics"]["speculative_decoding"]
    check_request_acceptance(figures, detailed=True)
    stream = list(client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert [c.model_extra.get("metrics") is not None for c in stream] == [False] * (len(stream) - 1) + [True]
    assert stream[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert stream[-1].model_extra["metrics"]["speculative_decoding"] == figures


def test_concurrent_requests_that_overflow_the_pool_answer_as_without_speculation(server, llm):
    """Eight greedy copies and a seeded n = 2 sample at once, more than the server's 64 KV blocks hold, so the
    scheduler preempts while drafts are in flight: every text is what the engine without speculation gives it,
    drafts were made, a preemption happened, and afterwards no block is held."""
    from concurrent.futures import ThreadPoolExecutor

    from kvserve import SamplingParams
    fruit = ["apples", "pears", "plums", "cherries", "grapes", "lemons", "limes", "figs", "dates", "melons"]
    prompts = [f"Copy the list: {', '.join(fruit[i:] + fruit[:i])}. Copy: {fruit[i]}," for i in range(8)]
    greedy = {"temperature": 0, "max_tokens": 112, "ignore_eos": True}
    seeded = {"temperature": 0.8, "top_p": 0.9, "seed": 11, "n": 2, "max_tokens": 112, "ignore_eos": True}
    jobs = [(p, greedy) for p in prompts] + [(prompts[0], seeded)]
    # The reference in one batch (the engine's greedy and seeded outputs do not depend on what else runs with
    # them, which the server's answers below rely on too): the test took 9 s against 24 s with the requests
    # one after another (2-core Zen 5).
    want = [[o.text for o in out.outputs] for out in llm.generate([p for p, _ in jobs],
                                                                  [SamplingParams(**extra) for _, extra in jobs],
                                                                  use_tqdm=False)]

    def complete(job: tuple[str, dict]) -> list[str]:
        prompt, extra = job
        with httpx.Client(base_url=server.base_url, timeout=240) as http:
            r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": prompt, **extra})
            assert r.status_code == 200, r.text
            return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]

    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        before = metrics(http)
        with ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(complete, jobs))
        assert got == want
        wait_for(lambda: metrics(http)["kvserve:num_requests_running"] == 0, 10, "the requests to finish")
        after = metrics(http)
    assert after["kvserve:num_preemptions_total"] > before["kvserve:num_preemptions_total"]
    assert after["kvserve:spec_decode_num_drafts_total"] > before["kvserve:spec_decode_num_drafts_total"]
    assert after["kvserve:kv_cache_usage_perc"] == 0
