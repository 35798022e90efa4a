"""--cache-salt-by-api-key: a real server with two tenants' keys; their prefix-cache entries never mix."""
from __future__ import annotations

import httpx
import pytest

from kvserve.entrypoints.openai.launcher import RemoteServer

KEYS = ("tenant-a-key", "tenant-b-key")
PROMPT = "Tenants must never share cached prompt blocks with one another. " * 10

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server():
    args = ["--api-key", *KEYS, "--cache-salt-by-api-key", "--max-model-len", "512", "--num-kv-blocks", "128",
            "--max-num-seqs", "4"]
    with RemoteServer(args) as s:
        yield s


def cached_tokens(server: RemoteServer, key: str, path: str = "/v1/completions", **extra) -> int:
    body = ({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": PROMPT}]})
    r = httpx.post(server.base_url + path, json={**body, "max_tokens": 1, **extra},
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_each_key_is_accepted_and_others_refused(server):
    for key in KEYS:
        r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200
    r = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer tenant-c-key"})
    assert r.status_code == 401


def test_browser_pages_may_call_the_api_with_a_key(server):
    """CORS, any origin by default as in vLLM: a browser's preflight (which carries no key) had been a 405, so
    no web page could call the server. The key is still asked for on the request itself."""
    origin = "http://localhost:3000"
    pre = httpx.options(server.base_url + "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", origin), pre.headers
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    ok = httpx.get(server.base_url + "/v1/models", headers={"Origin": origin, "Authorization": f"Bearer {KEYS[0]}"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "*"
    assert httpx.get(server.base_url + "/v1/models", headers={"Origin": origin}).status_code == 401


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_tenants_never_share_prefix_cache_entries(server, path):
    a, b = KEYS
    assert cached_tokens(server, a, path) == 0
    assert cached_tokens(server, a, path) >= 64      # tenant a reuses its own prefix
    assert cached_tokens(server, b, path) == 0       # tenant b sends the same prompt: no hit on a's blocks
    assert cached_tokens(server, b, path) >= 64
    # A client-chosen cache_salt cannot reach into another tenant's entries either: it only splits its own.
    assert cached_tokens(server, b, path, cache_salt="shared") == 0
    assert cached_tokens(server, a, path, cache_salt="shared") == 0
    assert cached_tokens(server, a, path, cache_salt="shared") >= 64
