"""`kvserve serve --speculative-config`: the flag reaches the engine process, greedy completions are those of
the engine without speculation, /metrics exports vLLM's spec_decode_* counters and the stats line the
acceptance rate."""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.entrypoints.openai.launcher import RemoteServer

pytestmark = pytest.mark.timeout(300)
PROMPT = "Copy the list: apples, pears, plums, cherries, grapes, lemons. Copy: apples, pears,"
SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2}'


def test_server_speculates_and_exports_counters():
    from kvserve import LLM, SamplingParams
    expected = LLM(dtype="float32", quantization="none", max_model_len=256, num_threads=1).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text

    args = ["--dtype", "float32", "--quantization", "none", "--max-model-len", "256", "--num-kv-blocks", "64",
            "--log-stats-interval", "0.5", "--speculative-config", SPEC]
    with RemoteServer(args) as server, httpx.Client(base_url=server.base_url, timeout=120) as http:
        r = http.post("/v1/completions", json={"model": "SmolLM2-135M-Instruct", "prompt": PROMPT,
                                               "max_tokens": 24, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == expected
        values = {}
        for fam in text_string_to_metric_families(http.get("/metrics").text):
            for s in fam.samples:
                values[s.name + s.labels.get("position", "")] = s.value
        assert values["kvserve:spec_decode_num_drafts_total"] > 0
        assert values["kvserve:spec_decode_num_draft_tokens_total"] >= values["kvserve:spec_decode_num_drafts_total"]
        assert 0 < values["kvserve:spec_decode_num_accepted_tokens_total"] <= \
               values["kvserve:spec_decode_num_draft_tokens_total"]
        assert values["kvserve:spec_decode_num_accepted_tokens_per_pos_total0"] >= \
               values["kvserve:spec_decode_num_accepted_tokens_per_pos_total1"]
        deadline = time.monotonic() + 10
        while "Draft acceptance rate" not in server.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "Draft acceptance rate" in server.output()
