"""The OpenAI-compatible server, started as a real subprocess and driven over HTTP by real clients
(the official `openai` package, httpx). One server for the whole module; the SIGTERM test runs last and
ends it."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from kvserve.entrypoints.openai.launcher import RemoteServer
from server_helpers import metrics, wait_for

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 16
MAX_WAITING = 100
BODY_LIMIT = 1 << 20
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    args = ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256",
            "--max-waiting", str(MAX_WAITING), "--api-key", API_KEY, "--max-request-body-bytes", str(BODY_LIMIT),
            "--log-stats-interval", "2", "--max-num-batched-tokens", "512"]
    with RemoteServer(args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    from kvserve import LLM
    return LLM(max_model_len=MAX_MODEL_LEN, num_threads=1)


def wait_idle(http: httpx.Client) -> dict[str, float]:
    wait_for(lambda: (m := metrics(http))["kvserve:num_requests_running"] == 0
             and m["kvserve:num_requests_waiting"] == 0, 30, "the engine to go idle")
    return metrics(http)


# ---------------------------------------------------------------- basics

def test_health_models_and_tokenize(server, http):
    assert httpx.get(server.base_url + "/health").status_code == 200
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    # OpenAI's "retrieve model" (the client's models.retrieve) had been a 404 for every name
    assert http.get(f"/v1/models/{MODEL}").json() == models["data"][0]
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model", missing.text
    tok = http.post("/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"].endswith("Hello world")
    chat_tok = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat_tok["count"] > tok["count"]


def test_greedy_matches_offline_generation(client, offline):
    from kvserve import SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    for prompt, want in zip(PROMPTS, expected):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
    want_chat = offline.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    got_chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12, temperature=0)
    assert got_chat.choices[0].message.content == want_chat and want_chat


def test_streaming_equals_non_streaming(client):
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    full_chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        full_chat.choices[0].message.content
    assert chunks[-1].usage.total_tokens == full_chat.usage.total_tokens
    assert all(c.usage is not None for c in chunks)  # continuous_usage_stats
    # Without --per-request-spec-decode-metrics (tests/test_spec_decode_server.py), bodies carry no `metrics`.
    assert all("metrics" not in (body.model_extra or {}) for body in [full, full_chat, *chunks])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_counts_each_choice_on_its_own(http, path):
    """With n = 2, each chunk's usage had summed both choices' tokens; vLLM's counts the chunk's own choice."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 1.0, "seed": 3, "n": 2, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body |= {"prompt": PROMPTS[0]} if path == "/v1/completions" else {"messages": CHAT}
    with http.stream("POST", path, json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    seen = {0: 0, 1: 0}
    for c in chunks[:-1]:
        choice = c["choices"][0]
        seen[choice["index"]] = c["usage"]["completion_tokens"]
        assert c["usage"]["completion_tokens"] <= 4, c
    assert seen == {0: 4, 1: 4}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8


def test_n_seed_and_stop(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, n=3, seed=1234)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # same seed, same samples
    assert 3 <= a.usage.completion_tokens <= 3 * 8
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=1.0, n=2, seed=5)
    assert [c.index for c in chat.choices] == [0, 1]

    stopped = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=["."])
    assert "." not in stopped.choices[0].text and stopped.choices[0].finish_reason == "stop"
    # Within min_tokens a stop string is not looked for (the greedy answer has its "." in the first few tokens).
    held = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, temperature=0, stop=["."],
                                     extra_body={"min_tokens": 12})
    assert stopped.usage.completion_tokens < 12 <= held.usage.completion_tokens


def test_tiny_temperatures_are_greedy_and_fail_no_one_beside_them(client):
    """Below 1e-5 a temperature is greedy (vLLM's rule). 1e-300 once made the sampler's 1 / T inf: it refused the
    whole step, and every request in it, the long one running beside, ended with an engine error (a 500)."""
    from concurrent.futures import ThreadPoolExecutor

    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    with ThreadPoolExecutor(4) as pool:
        long = pool.submit(client.completions.create, model=MODEL, prompt=PROMPTS[1], max_tokens=160, temperature=0,
                           extra_body={"ignore_eos": True})
        time.sleep(0.2)  # the long request is decoding when the others arrive
        tiny = [pool.submit(client.completions.create, model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=t)
                for t in (1e-300, 1e-39, 1e-9)]
        assert [f.result().choices[0].text for f in tiny] == [greedy] * 3
        assert long.result().usage.completion_tokens == 160


def test_prompt_logprobs_without_echo_are_returned_as_vllm_does(http, offline):
    """vLLM's choices[i].prompt_logprobs: per prompt token (None for the first) the prompt's own token and the
    top ones by id, each with logprob, rank and text; the offline engine's values. They were computed and
    dropped before (returned only through echo with logprobs). Refused with stream, as in vLLM (they had been
    accepted and dropped there); 0 passes."""
    from kvserve import SamplingParams

    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3}
    got = http.post("/v1/completions", json=body).json()["choices"][0]["prompt_logprobs"]
    want = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
                            use_tqdm=False)[0]
    assert got[0] is None and len(got) == len(want.prompt_token_ids) == len(want.prompt_logprobs) > 3
    for position, (entry, ref) in enumerate(zip(got[1:], want.prompt_logprobs[1:]), 1):
        assert str(want.prompt_token_ids[position]) in entry and 3 <= len(entry) <= 4
        assert {int(t): (e["rank"], e["decoded_token"]) for t, e in entry.items()} == {
            t: (lp.rank, lp.decoded_token) for t, lp in ref.items()}
        for t, e in entry.items():
            assert e["logprob"] == pytest.approx(ref[int(t)].logprob, abs=1e-4)
    assert http.post("/v1/completions", json={**body, "prompt_logprobs": None}).json()["choices"][0][
        "prompt_logprobs"] is None
    refused = http.post("/v1/completions", json={**body, "stream": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    with http.stream("POST", "/v1/completions", json={**body, "stream": True, "prompt_logprobs": 0}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all("prompt_logprobs" not in c["choices"][0] for c in chunks if c["choices"])


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(2 <= len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)

    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=1,
                                     echo=True)
    assert echo.choices[0].text.startswith(PROMPTS[0])
    elp = echo.choices[0].logprobs
    assert len(elp.tokens) == echo.usage.prompt_tokens + echo.usage.completion_tokens
    assert elp.token_logprobs[0] is None and all(v is not None for v in elp.token_logprobs[1:])


def streamed_logprobs(http: httpx.Client, body: dict) -> tuple[str, dict[str, list]]:
    """A streamed completion's text and its chunks' legacy logprobs, joined."""
    text, joined = "", {"tokens": [], "token_logprobs": [], "text_offset": []}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and (choices := json.loads(line[6:])["choices"]):
                text += choices[0]["text"]
                for key in joined:
                    joined[key] += (choices[0]["logprobs"] or {}).get(key) or []
    return text, joined


def test_streamed_text_offsets_are_the_whole_answers(http):
    """Where each token starts in the text, streamed as not. Each chunk's offsets had started at the length of the
    text sent before it: a stop string's possible start held back, several tokens then came at one offset."""
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 10, "temperature": 0,
            "logprobs": 0, "stop": ["s Pa"]}   # "...States" waits on whether " Pa" follows
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    text, streamed = streamed_logprobs(http, body)
    assert text == whole["text"] and "States" in text                       # the held-back case occurred
    assert streamed == {k: whole["logprobs"][k] for k in streamed}
    for token, offset in zip(streamed["tokens"], streamed["text_offset"]):
        assert text[offset:offset + len(token)] == token, (token, offset, text)


def test_text_offsets_count_a_split_character_once():
    """An emoji or a CJK character split over tokens (each part alone decodes to U+FFFD) is one character of the
    text: the offsets match the tokenizer's own decoding of each prefix, and a token-string sum would not."""
    from kvserve.entrypoints.openai.serving_completions import TextOffsets
    from kvserve.models.loader import load_tokenizer
    tok = load_tokenizer(None)
    text = " Bonjour 😀 le café ☕ est prêt. 東京タワーは高い。"
    ids = tok.encode(text, add_special_tokens=False)
    strings = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert sum("\ufffd" in s for s in strings) >= 4                       # characters split over tokens
    offsets = TextOffsets()
    got = [offsets.advance(tok, i, s) for i, s in zip(ids, strings)]
    # The reference: the characters that the first k tokens make whole, by the tokenizer's own decoder.
    want = [len(tok.decode(ids[:k], skip_special_tokens=False).rstrip("\ufffd")) for k in range(len(ids))]
    assert got == want and tok.decode(ids) == text
    assert got != [sum(map(len, strings[:k])) for k in range(len(ids))]


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token  # greedy picks the top one


def test_chat_logprob_bytes_rebuild_a_character_split_across_tokens(client, http):
    """An emoji is three tokens here, each alone decoding to U+FFFD: their `bytes` (OpenAI's field for this) must
    be the token's own bytes, which joined give the emoji back, not U+FFFD's three bytes each."""
    emoji = "😀"
    ids = http.post("/tokenize", json={"prompt": emoji, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) > 1
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=len(ids), temperature=0,
                                         logit_bias={str(i): 100 for i in ids}, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == len(ids)
    joined = b"".join(bytes(c.bytes) for c in content)
    assert joined.decode("utf-8", errors="replace") == out.choices[0].message.content
    for c in content:  # each token's bytes are a piece of the emoji's UTF-8, never U+FFFD's
        assert c.bytes and bytes(c.bytes) in emoji.encode(), c
        # (logprobs are the model's, before logit_bias: the top ones are other, whole tokens)
        assert all(bytes(t.bytes).decode("utf-8", errors="replace") == t.token for t in c.top_logprobs), c


def test_prompt_forms_and_cached_tokens(client, http):
    ids = http.post("/tokenize", json={"prompt": PROMPTS[0]}).json()["tokens"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    several = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0, n=2)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    several_ids = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, temperature=0)
    assert len(several_ids.choices) == 2
    # A long prompt sent twice: the second is served from the prefix cache.
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 12
    client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    again = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_message_shapes_accepted(http):
    """Every OpenAI role, text content parts, and an assistant turn with null content are valid."""
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
                {"role": "user", "content": [{"type": "text", "text": "Capital of"},
                                             {"type": "text", "text": "France?"}]},
                {"role": "assistant", "content": None},
                {"role": "user", "content": "Well?", "name": "ann"}]
    r = http.post("/v1/chat/completions", json={**CHAT_REQ, "messages": messages})
    assert r.status_code == 200, r.text
    rendered = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": rendered}).json()["prompt"]
    assert "Capital of\nFrance?" in text and "Answer in one word." in text   # parts joined by "\n", as in vLLM


def test_cache_salt_separates_prefix_cache_entries(http):
    """vLLM's cache_salt on both endpoints: the same salt shares cached blocks, another salt (or none) does not."""
    long_prompt = "Salted prefixes stay apart from each other. " * 12
    chat = [{"role": "user", "content": long_prompt}]

    def cached(path: str, salt: str | None) -> int:
        body = {**COMPLETION, "prompt": long_prompt} if path == "/v1/completions" else {**CHAT_REQ, "messages": chat}
        if salt is not None:
            body["cache_salt"] = salt
        r = http.post(path, json={**body, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for path in ("/v1/completions", "/v1/chat/completions"):
        assert cached(path, "salt-a") == 0                 # first time under this salt
        assert cached(path, "salt-a") >= 64                # same salt: served from the cache
        assert cached(path, "salt-b") == 0                 # another salt sees nothing of salt-a's
        # Nor does an unsalted request (which may find the chat template's opening, cached by earlier tests).
        assert cached(path, None) < 64
        assert cached(path, None) >= 64 and cached(path, "salt-b") >= 64


def test_extra_fields_accepted(http):
    r = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": CHAT, "max_completion_tokens": 3, "ignore_eos": True, "min_tokens": 3,
        "user": "someone", "priority": 1, "top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1,
        "logit_bias": {"0": -5}, "some_client_specific_field": {"x": 1}, "stream": False})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- concurrency, disconnects

async def _stream_one(c: httpx.AsyncClient, i: int) -> list[str]:
    body = {"model": MODEL, "prompt": f"Request {i}: count to ten.", "max_tokens": 8, "temperature": 0,
            "stream": True, "ignore_eos": True}
    events = []
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line:
                assert line.startswith("data: ")
                events.append(line[6:])
    return events


def test_64_concurrent_streams(server, http):
    async def run() -> list[list[str]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=120, limits=limits) as c:
            return await asyncio.gather(*(_stream_one(c, i) for i in range(64)))

    results = asyncio.run(run())
    for events in results:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks and all(ch["object"] == "text_completion" for ch in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    wait_idle(http)


def test_disconnect_aborts_request_and_frees_kv(server, http):
    before = wait_idle(http)
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(3):
                while not next(lines):
                    pass
            during = metrics(http)
            assert during["kvserve:num_requests_running"] == 1
            assert during["kvserve:kv_cache_usage_perc"] > before["kvserve:kv_cache_usage_perc"]
        # leaving the block closes the connection mid-stream
    wait_for(lambda: metrics(http)["kvserve:num_requests_running"] == 0, 10, "the aborted request to leave")
    after = metrics(http)
    assert after["kvserve:kv_cache_usage_perc"] == before["kvserve:kv_cache_usage_perc"]
    assert after["kvserve:num_requests_waiting"] == 0


def test_disconnect_non_streaming(server, http):
    before = wait_idle(http)
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=1.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    wait_for(lambda: metrics(http)["kvserve:num_requests_running"] == 0, 10, "the aborted request to leave")
    assert metrics(http)["kvserve:kv_cache_usage_perc"] == before["kvserve:kv_cache_usage_perc"]


def test_request_id_reused_right_after_a_disconnect(server, http):
    """A client leaves a stream after its first chunk and at once retries with the same request_id and another
    prompt: the answer is the new prompt's own (none of the steps the engine made for the first before it saw
    the abort), and both requests leave the engine."""
    before = wait_idle(http)
    retry = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    expected = http.post("/v1/completions", json=retry).json()["choices"][0]["text"]
    for trial in range(4):
        rid = f"reused-{trial}"
        first = {"model": MODEL, "prompt": "Count from one to two hundred: one, two, three,", "max_tokens": 200,
                 "temperature": 0, "ignore_eos": True, "stream": True, "request_id": rid}
        with http.stream("POST", "/v1/completions", json=first) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line)   # the first chunk, then leave
        body = http.post("/v1/completions", json={**retry, "request_id": rid}).json()
        assert body["choices"][0]["text"] == expected, trial
        assert body["usage"]["completion_tokens"] == 12
    after = wait_idle(http)
    assert after["kvserve:kv_cache_usage_perc"] == before["kvserve:kv_cache_usage_perc"]


# ---------------------------------------------------------------- errors

COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 4}
CHAT_REQ = {"model": MODEL, "messages": CHAT, "max_tokens": 4}

BAD_REQUESTS = [
    ("max_tokens<1", "/v1/completions", {**COMPLETION, "max_tokens": 0}, "max_tokens"),
    ("temperature<0", "/v1/completions", {**COMPLETION, "temperature": -0.5}, "temperature"),
    ("top_p=0", "/v1/completions", {**COMPLETION, "top_p": 0}, "top_p"),
    ("top_p>1", "/v1/chat/completions", {**CHAT_REQ, "top_p": 1.5}, "top_p"),
    ("n<1", "/v1/completions", {**COMPLETION, "n": 0}, "n"),
    ("max_tokens wrong type", "/v1/completions", {**COMPLETION, "max_tokens": "many"}, "max_tokens"),
    ("messages wrong type", "/v1/chat/completions", {**CHAT_REQ, "messages": "hello"}, "messages"),
    ("empty messages", "/v1/chat/completions", {**CHAT_REQ, "messages": []}, "messages"),
    ("empty prompt list", "/v1/completions", {**COMPLETION, "prompt": []}, "prompt"),
    ("no prompt", "/v1/completions", {"model": MODEL}, "prompt"),
    ("over the context", "/v1/completions", {**COMPLETION, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("chat over the context", "/v1/chat/completions", {**CHAT_REQ, "max_completion_tokens": 10**6},
     "max_completion_tokens"),
    ("token id out of range", "/v1/completions", {**COMPLETION, "prompt": [1, 10**9]}, "prompt"),
    ("huge int", "/v1/completions", {**COMPLETION, "seed": 10**40}, "seed"),
    ("huge n", "/v1/completions", {**COMPLETION, "n": 10**6}, "n"),
    ("logprobs > 20", "/v1/completions", {**COMPLETION, "logprobs": 50}, "logprobs"),
    ("top_logprobs > 20", "/v1/chat/completions", {**CHAT_REQ, "logprobs": True, "top_logprobs": 100}, "top_logprobs"),
    ("top_logprobs < 0", "/v1/chat/completions", {**CHAT_REQ, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("bad logit_bias", "/v1/completions", {**COMPLETION, "logit_bias": {"abc": 1}}, "logit_bias"),
    # Keys that str.isdigit() took and int() refused: 500s before.
    ("logit_bias key with two minus signs", "/v1/completions", {**COMPLETION, "logit_bias": {"--5": 1}}, "logit_bias"),
    ("logit_bias key a superscript digit", "/v1/completions", {**COMPLETION, "logit_bias": {"\u00b2": 1}},
     "logit_bias"),
    # Half a UTF-16 pair, escaped in the JSON ("\ud800"): a str no UTF-8 encoder takes (500s before, from the
    # tokenizer, the crash quarantine's digest, the engine's request channel or the 404 body itself).
    ("lone surrogate in prompt", "/v1/completions", {**COMPLETION, "prompt": "hi \ud800"}, "prompt"),
    ("lone surrogate in chat content", "/v1/chat/completions",
     {**CHAT_REQ, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
     "messages.0.content.0.text"),
    ("lone surrogate in stop", "/v1/completions", {**COMPLETION, "stop": ["\ud800"]}, "stop.0"),
    ("lone surrogate in request_id", "/v1/completions", {**COMPLETION, "request_id": "x\ud800"}, "request_id"),
    ("lone surrogate in model", "/v1/completions", {**COMPLETION, "model": "m\ud800"}, "model"),
    ("lone surrogate in a logit_bias key", "/v1/completions", {**COMPLETION, "logit_bias": {"1\ud800": 1}},
     "logit_bias"),
    ("lone surrogate to tokenize", "/tokenize", {"prompt": "a\ud800"}, "prompt"),
    # Checked every step inside the engine loop: 20,000 stop strings slowed every other request ~20x.
    ("too many stop strings", "/v1/completions", {**COMPLETION, "stop": [f"s{i}" for i in range(257)]}, "stop"),
    ("too many stop_token_ids", "/v1/completions", {**COMPLETION, "stop_token_ids": list(range(1025))},
     "stop_token_ids"),
    ("min_tokens > max_tokens", "/v1/completions", {**COMPLETION, "min_tokens": 10}, "min_tokens"),
    ("image content", "/v1/chat/completions",
     {**CHAT_REQ, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    # Chat message shapes: each names the offending message and field.
    ("unknown role", "/v1/chat/completions", {**CHAT_REQ, "messages": [{"role": "wizard", "content": "hi"}]},
     "messages.0.role"),
    ("unknown role in a later message", "/v1/chat/completions",
     {**CHAT_REQ, "messages": [*CHAT, {"role": "assistant", "content": "Paris."}, {"role": "robot", "content": "x"}]},
     "messages.2.role"),
    ("role missing", "/v1/chat/completions", {**CHAT_REQ, "messages": [{"content": "hi"}]}, "messages.0.role"),
    ("role not a string", "/v1/chat/completions", {**CHAT_REQ, "messages": [{"role": 1, "content": "hi"}]},
     "messages.0.role"),
    ("message not an object", "/v1/chat/completions", {**CHAT_REQ, "messages": ["hello"]}, "messages.0"),
    ("content a number", "/v1/chat/completions", {**CHAT_REQ, "messages": [{"role": "user", "content": 5}]},
     "messages.0.content"),
    ("user content missing", "/v1/chat/completions", {**CHAT_REQ, "messages": [{"role": "user"}]},
     "messages.0.content"),
    ("text part without text", "/v1/chat/completions",
     {**CHAT_REQ, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content"),
    ("content part not an object", "/v1/chat/completions",
     {**CHAT_REQ, "messages": [{"role": "user", "content": ["hi"]}]}, "messages.0.content"),
    ("name not a string", "/v1/chat/completions",
     {**CHAT_REQ, "messages": [{"role": "user", "content": "hi", "name": ["x"]}]}, "messages.0.name"),
    ("empty cache_salt", "/v1/completions", {**COMPLETION, "cache_salt": ""}, "cache_salt"),
    ("cache_salt not a string", "/v1/chat/completions", {**CHAT_REQ, "cache_salt": 5}, "cache_salt"),
    ("tokenize unknown role", "/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
]


@pytest.mark.parametrize("path,body,param", [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS])
def test_invalid_parameters_are_400(http, path, body, param):
    # json.dumps escapes non-ASCII (a lone surrogate as \\ud800, as a client in another language would send it)
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400 and err["message"]
    if param is not None:
        assert err["param"] is not None and err["param"].startswith(param), err


RAW_BODIES = [
    ("malformed JSON", b'{"model": "x", "prompt": '),
    ("not an object", b"[1, 2, 3]"),
    ("non-UTF-8", b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}'),
    ("huge float", b'{"prompt": "hi", "max_tokens": 1e400}'),
    ("huge temperature", b'{"prompt": "hi", "max_tokens": 2, "temperature": 1e999}'),
    ("enormous integer", b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    ("deep nesting", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("NaN", b'{"prompt": "hi", "max_tokens": 2, "top_p": NaN}'),
    ("empty body", b""),
]


@pytest.mark.parametrize("body", [b[1] for b in RAW_BODIES], ids=[b[0] for b in RAW_BODIES])
def test_malformed_bodies_are_400(http, body):
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == 400


def test_auth_model_and_size_errors(server, http):
    url = server.base_url + "/v1/completions"
    missing = httpx.post(url, json=COMPLETION)
    wrong = httpx.post(url, json=COMPLETION, headers={"Authorization": "Bearer nope"})
    for r in (missing, wrong):
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(server.base_url + "/health").status_code == 200  # unauthenticated
    assert httpx.get(server.base_url + "/metrics").status_code == 200

    r = http.post("/v1/completions", json={**COMPLETION, "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
            model="nope", messages=CHAT)

    big = http.post("/v1/completions", json={**COMPLETION, "prompt": "x" * (BODY_LIMIT + 10)})
    assert big.status_code == 413 and big.json()["error"]["code"] == 413

    def chunked():
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * (BODY_LIMIT // 10)
        yield b'"}'

    assert http.post("/v1/completions", content=chunked()).status_code == 413
    assert http.get("/v1/nothing-here").status_code == 404
    assert http.get("/v1/completions").status_code == 405


def test_too_many_waiting_is_429(server, http):
    wait_idle(http)
    total = MAX_NUM_SEQS + MAX_WAITING + 20

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=total)
        async with httpx.AsyncClient(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"},
                                     timeout=60, limits=limits) as c:
            body = {**COMPLETION, "max_tokens": 256, "ignore_eos": True}  # long enough to keep the running set full
            tasks = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(total)]
            statuses = []
            for fut in asyncio.as_completed(tasks):
                r = await fut
                statuses.append(r.status_code)
                if r.status_code == 429:
                    assert r.headers["retry-after"] and r.json()["error"]["code"] == 429
                    break
            for t in tasks:
                t.cancel()  # closes the connections: the admitted requests are aborted
            await asyncio.gather(*tasks, return_exceptions=True)
            return statuses

    assert 429 in asyncio.run(run())
    # The server may still be working through requests it read before the client hung up (each is admitted,
    # then aborted on the disconnect), so it can answer 429 for a moment longer. A client that honours
    # Retry-After must get in soon; a leaked waiting count would keep it out for good.
    deadline = time.monotonic() + 60
    while (r := http.post("/v1/completions", json=COMPLETION)).status_code == 429 and time.monotonic() < deadline:
        time.sleep(float(r.headers["retry-after"]))
    assert r.status_code == 200
    wait_idle(http)


# ---------------------------------------------------------------- metrics, fuzz, shutdown

def test_metrics_are_consistent(client, http):
    before = wait_idle(http)
    n_requests, prompt_tokens, completion_tokens = 5, 0, 0
    for i in range(n_requests):
        if i % 2:
            r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3 + i, temperature=0)
        else:
            r = client.completions.create(model=MODEL, prompt=f"Number {i} is", max_tokens=3 + i, temperature=0)
        prompt_tokens += r.usage.prompt_tokens
        completion_tokens += r.usage.completion_tokens
    after = wait_idle(http)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvserve:time_to_first_token_seconds_count") == n_requests
    assert delta("kvserve:e2e_request_latency_seconds_count") == n_requests
    assert delta("kvserve:request_queue_time_seconds_count") == n_requests
    assert delta("kvserve:request_prefill_time_seconds_count") == n_requests
    assert delta("kvserve:request_decode_time_seconds_count") == n_requests
    assert delta("kvserve:prompt_tokens_total") == prompt_tokens
    assert delta("kvserve:generation_tokens_total") == completion_tokens
    assert delta("kvserve:inter_token_latency_seconds_count") == completion_tokens - n_requests
    # vLLM's per-request histograms: the same totals, one observation a request
    assert delta("kvserve:request_prompt_tokens_sum") == prompt_tokens
    assert delta("kvserve:request_generation_tokens_sum") == completion_tokens
    assert delta("kvserve:request_max_num_generation_tokens_sum") == completion_tokens  # n = 1: one sample each
    assert delta("kvserve:request_params_n_sum") == delta("kvserve:request_params_n_count") == n_requests
    assert delta("kvserve:request_inference_time_seconds_count") == n_requests
    assert delta("kvserve:request_time_per_output_token_seconds_count") == n_requests  # every one made > 1 token
    assert delta("kvserve:request_inference_time_seconds_sum") == pytest.approx(
        delta("kvserve:request_prefill_time_seconds_sum") + delta("kvserve:request_decode_time_seconds_sum"),
        abs=0.05)
    finished = sum(v for k, v in after.items() if k.startswith("kvserve:request_success_total"))
    finished_before = sum(v for k, v in before.items() if k.startswith("kvserve:request_success_total"))
    assert finished - finished_before == n_requests
    assert delta("kvserve:iteration_tokens_total_count") > 0
    for name in ("kvserve:num_preemptions_total", "kvserve:prefix_cache_queries_total",
                 "kvserve:prefix_cache_hits_total"):
        assert name in after
    assert after["kvserve:kv_cache_usage_perc"] == 0


def test_schema_fuzz_never_500(server, http):
    import hypothesis
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
    strategy = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
    statuses: list[int] = []

    @settings(max_examples=120, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
    @given(case=strategy)
    def fuzz(case) -> None:
        try:
            r = case.call(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=3)
        except Exception as e:  # noqa: BLE001 - a valid request that runs long: the client gives up
            if "timed out" not in str(e).lower() and "timeout" not in type(e).__name__.lower():
                raise
            return
        statuses.append(r.status_code)
        assert r.status_code < 500, (case.path, case.body, r.text)
        if r.status_code >= 400:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    fuzz()
    assert any(s == 200 for s in statuses) and any(s == 400 for s in statuses)
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_fuzz_chat_messages_and_cache_salt(server, http):
    """Hypothesis-built messages (any role, content of any JSON type, text parts or not) and cache_salt values:
    always 200, or a 400 whose param names the offending field; never a 5xx."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    json_value = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                              lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                         max_size=3), max_leaves=6)
    role = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "wizard", "", "USER"]) \
        | json_value
    part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}) \
        | json_value
    content = st.text(max_size=20) | st.lists(part, max_size=3) | json_value
    message = st.fixed_dictionaries({"role": role, "content": content}) | json_value
    salt = st.none() | st.text(max_size=6) | json_value

    @settings(max_examples=80, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(messages=st.lists(message, min_size=1, max_size=3), cache_salt=salt)
    def fuzz(messages, cache_salt) -> None:
        body = {"messages": messages, "max_tokens": 2}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code in (200, 400), (body, r.text)
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["param"] is not None and err["param"].split(".")[0] in ("messages", "cache_salt"), (body, err)

    fuzz()
    assert http.get("/health").status_code == 200


def test_fields_whose_answer_kvserve_cannot_give_are_refused_as_vllm_refuses_them(http):
    """response_format, tools and the rest had been accepted with a 200 and dropped: a JSON schema came back
    as free text, tools never reached the prompt."""
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    refused = [
        (chat | {"response_format": {"type": "json_object"}}, "response_format"),
        (chat | {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
         "response_format"),
        (chat | {"tools": [tool]}, "tools"), (chat | {"tools": [tool], "tool_choice": "auto"}, "tools"),
        (chat | {"tool_choice": "required"}, "tool_choice"),
        (chat | {"stream_options": {"include_usage": True}}, "stream_options"),
        (chat | {"continue_final_message": True}, "continue_final_message"),
        (chat | {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
        (chat | {"chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs"),
        (chat | {"functions": [tool["function"]]}, "functions"),
        (chat | {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ]
    for body, param in refused:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    completion = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}
    # vLLM's constraints, which kvserve does not implement (ignored, they had given free text with a 200)
    constraints = [({"allowed_token_ids": [28]}, "allowed_token_ids"), ({"bad_words": ["Paris"]}, "bad_words"),
                   ({"guided_choice": ["yes", "no"]}, "guided_choice"), ({"guided_json": {}}, "guided_json"),
                   ({"guided_regex": "[0-9]+"}, "guided_regex"),
                   ({"structured_outputs": {"choice": ["yes", "no"]}}, "structured_outputs")]
    for extra, param in constraints:
        r = http.post("/v1/chat/completions", json=chat | extra)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
    for body, param in [(completion | {"response_format": {"type": "json_object"}}, "response_format"),
                        (completion | {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        *((completion | extra, param) for extra, param in constraints)]:
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    for body in (chat | {"response_format": {"type": "text"}}, chat | {"tools": [tool], "tool_choice": "none"},
                 chat | {"tools": []}, chat | {"tools": [], "tool_choice": "required"}, chat | {"stream_options": {}},
                 chat | {"allowed_token_ids": None, "bad_words": [], "guided_json": None}):
        assert http.post("/v1/chat/completions", json=body).status_code == 200, body


def test_errors_name_the_request_field(http):
    """A union's branch ("prompt.str") was given as the field, and a chat over the context named "prompt"."""
    for body, param in [({"prompt": None}, "prompt"), ({"prompt": ["a", [1, 2]]}, "prompt"),
                        ({"prompt": "hi", "stop": ["a", 5]}, "stop")]:
        r = http.post("/v1/completions", json={"model": MODEL, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    long = [{"role": "user", "content": "hi " * (2 * MAX_MODEL_LEN)}]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": long})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_openais_system_fingerprint_and_vllms_top_logprobs_zero(http):
    """system_fingerprint was missing (vLLM sends null); top_logprobs 0 without logprobs was a 400 (vLLM takes
    it: only a count above 0 needs logprobs)."""
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                   "top_logprobs": 0})
    assert chat.status_code == 200 and chat.json()["system_fingerprint"] is None, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2})
    assert completion.json()["system_fingerprint"] is None
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                            "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(c["system_fingerprint"] is None for c in chunks)
    refused = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "top_logprobs": 2})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"


def test_null_max_tokens_on_completions_is_openais_16(http):
    """It had meant the whole context left (as chat's does, where vLLM also takes it so)."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": None,
                                           "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 16, r.text


def test_null_n_and_echo_mean_their_defaults(http):
    """OpenAI documents n (both endpoints) and echo (completions) as nullable; a client that sends every field,
    unset ones as null, had got a 400 naming n."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "n": None,
                                           "echo": None, "temperature": 0})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert not choice["text"].startswith(PROMPTS[0])  # not echoed
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "n": None})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2, "echo": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text  # chat's echo is vLLM's: a bool


def test_chat_echo_and_prompt_logprobs_as_vllm_gives_them(http, offline):
    """echo had been accepted and ignored, prompt_logprobs too (chat only: completions returned them)."""
    from kvserve import SamplingParams
    tok = offline.get_tokenizer()
    start = "My favourite fruit is"
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": start}]
    body = {"model": MODEL, "messages": messages, "continue_final_message": True, "add_generation_prompt": False,
            "max_tokens": 4, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    echoed = http.post("/v1/chat/completions", json=body | {"echo": True}).json()["choices"][0]["message"]["content"]
    assert echoed == start + plain and plain
    with http.stream("POST", "/v1/chat/completions", json=body | {"echo": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": start}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == echoed

    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                "prompt_logprobs": 1, "temperature": 0}).json()
    got = r["prompt_logprobs"]
    ids = tok.encode(tok.apply_chat_template(CHAT), add_special_tokens=False)
    assert len(got) == len(ids) == r["usage"]["prompt_tokens"] and got[0] is None
    ref = offline.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0].prompt_logprobs
    for position, (mine, theirs) in enumerate(zip(got[1:], ref[1:]), 1):
        assert str(ids[position]) in mine  # JSON keys: the position's own token is always there
        assert {int(t): (e["rank"], e["decoded_token"]) for t, e in mine.items()} == {
            t: (lp.rank, lp.decoded_token) for t, lp in theirs.items()}, position
        for t, e in mine.items():
            assert e["logprob"] == pytest.approx(theirs[int(t)].logprob, abs=1e-4), position


def test_sigterm_finishes_inflight_stream_then_exits_0(server):
    """Runs last: it stops the module's server."""
    # 400 tokens (1.3 s at 3.2 ms a token) outlast the 0.3 s before the refused request: with 40, a fast host
    # finished the stream and the server had exited by then (connection refused instead of a 503).
    body = {"model": MODEL, "prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            # New requests are refused while the stream drains.
            refused = httpx.post(server.base_url + "/v1/completions", json=COMPLETION, headers=headers, timeout=10)
            assert refused.status_code == 503
            events = [first] + [line for line in lines if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for ch in chunks if ch["choices"][0]["text"]) >= 300
    assert server.proc.wait(60) == 0, server.output()[-3000:]
