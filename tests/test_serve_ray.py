"""`--backend ray`: a tiny model as a Ray Serve deployment on a real local Ray cluster, driven over real
HTTP (httpx and the official openai client). Checks the OpenAI surface and streaming through the
ingress, and that a burst scales the model from 1 to 2 replicas and idleness back to 1, with every
request answered once, with the same greedy text as kvserve's own engine. Skipped without ray[serve]."""
from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from kvserve.entrypoints.openai.launcher import RemoteServer  # noqa: E402
from kvserve.gateway.config import ModelsConfig  # noqa: E402
from kvserve.sampling_params import SamplingParams  # noqa: E402
from kvserve.serve_ray.app import APP_NAME, deployment_name  # noqa: E402
from kvserve.serve_ray.forwarding import REPLICA_HEADER  # noqa: E402

pytestmark = [pytest.mark.timeout(600),
              # Ray's own knob for how often queues are reported; its replacement is not read yet.
              pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")]

NAME = "tiny"
ENGINE = {"dtype": "float32", "max_num_seqs": 2, "max_model_len": 512, "num_kv_blocks": 128, "num_threads": 1}
MAX_TOKENS = 24
CHAT = [{"role": "user", "content": "Say something."}]


def prompt(i: int) -> list[int]:
    """Distinct token-id prompts, so that every answer can be checked against its own reference."""
    return [(i * 37 + k * 11) % 256 for k in range(5 + i % 7)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tiny_models import make_tiny_model

    path = tmp_path_factory.mktemp("ray") / "tiny-llama"
    make_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def offline(model_dir):
    from kvserve import LLM

    return LLM(str(model_dir), **ENGINE)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`kvserve serve --models-config FILE --backend ray`, as a subprocess joined to a local Ray cluster that
    this process started (so that the test can read the replica counts from Ray Serve)."""
    import ray

    config = {"models": [{
        "name": NAME, "model": str(model_dir), "engine": ENGINE,
        # 2 batch slots and 1 queue place per replica: 8 concurrent clients leave ~5 waiting, far above
        # target_queue_depth 1 per replica. Short delays so the test sees both directions quickly.
        "autoscaling": {"min_replicas": 1, "max_replicas": 2, "target_queue_depth": 1,
                        "upscale_delay_s": 0.5, "downscale_delay_s": 2.0}}],
        "admission": {"max_waiting": 12}}     # above the burst's queue, below the flood's
    ModelsConfig.from_dict(config)   # the file below is valid
    path = tmp_path_factory.mktemp("ray") / "models.yaml"
    path.write_text(json.dumps(config))   # JSON is YAML
    # Logical CPUs: one per model replica (the ingress, proxy and controller take none).
    ray.init(num_cpus=3, object_store_memory=96 * 2**20, include_dashboard=False)
    args = ["--models-config", str(path), "--backend", "ray", "--shutdown-grace", "20", "--log-level", "warning"]
    try:
        with RemoteServer(args, env={"RAY_ADDRESS": ray.get_runtime_context().gcs_address},
                          startup_timeout_s=400) as s:
            yield s
    finally:
        ray.shutdown()


def running_replicas() -> int:
    from ray import serve

    d = serve.status().applications[APP_NAME].deployments[deployment_name(0, NAME)]
    return d.replica_states.get("RUNNING", 0)


def all_replica_states() -> dict[str, int]:
    from ray import serve

    return dict(serve.status().applications[APP_NAME].deployments[deployment_name(0, NAME)].replica_states)


def engine_stats(wait_idle_s: float = 0.0) -> dict:
    """The replica's engine stats (there is one replica when this is called), after waiting up to
    wait_idle_s for it to run nothing. Asked from a one-off Ray task: a deployment handle made in this
    process would keep reporting to Serve's controller after the server under test has shut Serve down."""
    import ray

    @ray.remote(num_cpus=0, max_calls=1)
    def ask(deployment: str, app: str, wait_idle_s: float) -> dict:
        from ray import serve

        handle = serve.get_deployment_handle(deployment, app)
        deadline = time.monotonic() + wait_idle_s
        while (stats := handle.engine_stats.remote().result())["num_running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        return stats

    return ray.get(ask.remote(deployment_name(0, NAME), APP_NAME, wait_idle_s))


def expected_text(offline, prompts: list[list[int]]) -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [out.outputs[0].text for out in offline.generate(prompts, params, use_tqdm=False)]


def sse_events(lines) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_openai_surface_and_streaming_through_the_ingress(server, offline):
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        assert http.get("/health").status_code == 200
        models = http.get("/v1/models").json()
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(NAME, 512)]
        assert http.get(f"/v1/models/{NAME}").json() == models["data"][0]
        assert http.get("/v1/models/no-such-model").json()["error"]["code"] == 404

        # Non-streamed, then streamed: the same greedy text as the engine run in this process.
        want = expected_text(offline, [prompt(0)])[0]
        body = {"model": NAME, "prompt": prompt(0), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.headers[REPLICA_HEADER]
        assert r.json()["choices"][0]["text"] == want and r.json()["model"] == NAME
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            events = sse_events(s.iter_lines())
        assert events[-1] == "[DONE]" and len(events) > 3          # token by token, not one blob
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == want

        # OpenAI error JSON with the right status: from the ingress (unknown model) and from the replica.
        r = http.post("/v1/completions", json={**body, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = http.post("/v1/completions", json={**body, "max_tokens": 10_000})
        assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"
        r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()

    # A client that leaves mid-stream has its request aborted in the replica's engine.
    before = engine_stats()
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 480, "stream": True}) as s:
            lines = s.iter_lines()
            for _ in range(3):
                while not next(lines):
                    pass
    after = engine_stats(wait_idle_s=30)
    assert after["num_running"] == 0 and after["num_waiting"] == 0
    assert after["num_generation_tokens"] - before["num_generation_tokens"] < 480

    # Chat, streamed, through the official client.
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    want_chat = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    stream = client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_chat
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


async def _ask(http: httpx.AsyncClient, i: int, results: dict[int, dict]) -> None:
    """One request (every other one streamed); records what came back, keyed by the request's index."""
    body = {"model": NAME, "prompt": prompt(i), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": i % 2 == 1}
    assert i not in results
    if body["stream"]:
        async with http.stream("POST", "/v1/completions", json=body) as s:
            lines = [line async for line in s.aiter_lines()]
            status, replica = s.status_code, s.headers.get(REPLICA_HEADER)
        events = sse_events(lines) if status == 200 else []
        chunks = [e for e in events if e != "[DONE]"]
        results[i] = {"status": status, "replica": replica, "ids": {c["id"] for c in chunks},
                      "text": "".join(c["choices"][0]["text"] for c in chunks),
                      "finish": [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]],
                      "done": events.count("[DONE]")}
    else:
        r = await http.post("/v1/completions", json=body)
        choice = r.json()["choices"][0] if r.status_code == 200 else {}
        results[i] = {"status": r.status_code, "replica": r.headers.get(REPLICA_HEADER), "ids": {r.json().get("id")},
                      "text": choice.get("text"), "finish": [choice.get("finish_reason")], "done": 1}


async def _burst_then_idle(server: str) -> tuple[dict[int, dict], dict]:
    results: dict[int, dict] = {}
    seen = {"max_running": 0, "scaled_up_at": None, "scaled_down_at": None}
    next_i = iter(range(10**6))
    loaded = True

    async def client(http: httpx.AsyncClient) -> None:
        while loaded:
            await _ask(http, next(next_i), results)

    async with httpx.AsyncClient(base_url=server, timeout=180) as http:
        t0 = time.monotonic()
        # Burst: 8 clients back to back, until the second replica has answered a few requests.
        clients = [asyncio.create_task(client(http)) for _ in range(8)]
        deadline = t0 + 300
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            seen["max_running"] = max(seen["max_running"], await asyncio.to_thread(running_replicas))
            replicas = [r["replica"] for r in results.values()]
            if len(set(replicas)) >= 2 and min(replicas.count(x) for x in set(replicas)) >= 3:
                break
        seen["scaled_up_at"] = time.monotonic() - t0
        loaded = False
        await asyncio.gather(*clients)
        # Idle, but for a request now and then: the model goes back to 1 replica, answering all the while.
        t1 = time.monotonic()
        while time.monotonic() < t1 + 120:
            await _ask(http, next(next_i), results)
            states = await asyncio.to_thread(all_replica_states)
            if states == {"RUNNING": 1}:
                seen["scaled_down_at"] = time.monotonic() - t1
                break
            await asyncio.sleep(1.0)
    return results, seen


def test_burst_scales_up_and_idle_scales_down_answering_every_request_once(server, offline):
    assert running_replicas() == 1
    results, seen = asyncio.run(_burst_then_idle(server.base_url))
    by_replica = Counter(r["replica"] for r in results.values())
    print(f"scaled up after {seen['scaled_up_at']:.1f}s, down after {seen['scaled_down_at']}s; "
          f"{len(results)} requests; by replica: {dict(by_replica)}")
    assert seen["max_running"] == 2, seen
    assert len(by_replica) == 2
    assert seen["scaled_down_at"] is not None, f"still {all_replica_states()} replicas after the load stopped"

    # Every request answered once: one 200, one answer id, one finish, one [DONE], the engine's own text.
    indices = sorted(results)
    assert indices == list(range(len(indices)))
    want = expected_text(offline, [prompt(i) for i in indices])
    for i in indices:
        r = results[i]
        assert r["status"] == 200, (i, r)
        assert len(r["ids"]) == 1 and r["finish"] == ["length"] and r["done"] == 1, (i, r)
        assert r["text"] == want[i], (i, r["replica"])
    assert len({next(iter(r["ids"])) for r in results.values()}) == len(results)


def test_more_waiting_than_admission_allows_is_429(server):
    """40 long requests at once: the replicas take a batch and a queue place each, 12 wait at the ingress,
    the rest are refused at once with OpenAI's 429 and Retry-After."""
    async def flood() -> list[httpx.Response]:
        body = {"model": NAME, "prompt": prompt(1), "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=180) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(40)))

    responses = asyncio.run(flood())
    refused = [r for r in responses if r.status_code == 429]
    others = [(r.status_code, r.text[:300]) for r in responses if r.status_code not in (200, 429)]
    assert refused and not others, others
    assert refused[0].headers["retry-after"] == "1"
    assert refused[0].json()["error"]["type"] == "RateLimitError"


def test_sigterm_stops_the_server_cleanly(server):
    assert server.stop(timeout_s=120) == 0, server.output()[-3000:]
