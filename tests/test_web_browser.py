"""The web page in a real headless Chromium (Debian's chromium + chromium-driver, driven by Selenium) against
a real `kvserve serve` with --api-key and two served names: a clean load, the key asked for once, a reply
streamed in token by token, stop and regenerate, a model's markup shown as text, and the dashboard
following load with the numbers of /metrics. Screenshots go to test-artifacts/ (git-ignored).

.ci/run installs the browser. Without it these tests skip locally and fail in CI (CI=true)."""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvserve.entrypoints.openai.launcher import RemoteServer
from server_helpers import wait_for

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts"
API_KEY = "browser-test-key"
MODEL = "SmolLM2-135M-Instruct"
ALIAS = "smol"
XSS = "<img src=x onerror=alert(1)>"
DONE_STATES = ("done", "length", "stopped", "error")

pytestmark = pytest.mark.timeout(240)


# ---------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def server():
    args = ["--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-seqs", "8", "--api-key", API_KEY,
            "--served-model-name", MODEL, ALIAS]
    with RemoteServer(args) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        webdriver = None
    if webdriver is None or not chromium or not driver_path:
        message = "needs selenium and Debian's chromium + chromium-driver (bash .ci/run installs them)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900",
                "--no-first-run", "--disable-extensions", "--disable-background-networking"):
        options.add_argument(arg)
    # The console (browser) and the network events (performance), to check for errors and failed requests.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    # An explicit driver path: Selenium Manager would otherwise try to download one.
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    driver.set_script_timeout(30)
    ARTIFACTS.mkdir(exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


# ---------------------------------------------------------------- helpers

def js(browser, script: str, *args):
    return browser.execute_script(script, *args)


def by_id(browser, element_id: str):
    from selenium.webdriver.common.by import By
    return browser.find_element(By.ID, element_id)


def set_value(browser, element_id: str, value: str) -> None:
    # Through the DOM and a change event, as a person's edit ends.
    js(browser, "const e = document.getElementById(arguments[0]); e.value = arguments[1];"
                "e.dispatchEvent(new Event('change'));", element_id, value)


def last_reply(browser) -> dict | None:
    return js(browser, """
        const all = document.querySelectorAll('#messages .msg-assistant');
        if (!all.length) return null;
        const m = all[all.length - 1];
        const stats = {};
        for (const s of m.querySelectorAll('[data-stat]')) stats[s.dataset.stat] = s.textContent;
        return {text: m.querySelector('.msg-body').textContent, state: m.dataset.state, stats: stats,
                count: all.length};""")


def send(browser, text: str) -> None:
    box = by_id(browser, "prompt")
    box.clear()
    box.send_keys(text)
    by_id(browser, "send").click()


def wait_reply_done(browser, timeout_s: float = 60.0) -> dict:
    return wait_for(lambda: (r := last_reply(browser)) and r["state"] in DONE_STATES and r, timeout_s, "the reply")


def record_chat_requests(browser) -> None:
    """From now until the page reloads, the bodies the page posts to /v1/chat/completions: window.sentBodies."""
    js(browser, """
        window.sentBodies = [];
        const realFetch = window.fetch;
        window.fetch = (url, init) => {
          if (String(url).endsWith('v1/chat/completions')) window.sentBodies.push(JSON.parse(init.body));
          return realFetch(url, init);
        };""")


def network_events(browser) -> list[dict]:
    """Responses and failures since the last call, from Chrome's DevTools network events."""
    out = []
    for entry in browser.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.responseReceived":
            r = message["params"]["response"]
            out.append({"url": r["url"], "status": r["status"]})
        elif message["method"] == "Network.loadingFailed":
            out.append({"url": message["params"].get("requestId"), "failed": message["params"]["errorText"]})
    return out


def console_errors(browser) -> list[dict]:
    return [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]


def metrics(http: httpx.Client) -> dict[str, float]:
    """/metrics summed per sample name over its labels (buckets left out), as the dashboard sums them."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            if not s.name.endswith(("_bucket", "_created")):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def wait_idle(http: httpx.Client) -> dict[str, float]:
    return wait_for(lambda: (m := metrics(http))["kvserve:num_requests_running"] == 0
                    and m["kvserve:num_requests_waiting"] == 0 and m, 60, "the engine to go idle", 0.1)


def screenshot(browser, name: str) -> None:
    browser.save_screenshot(str(ARTIFACTS / f"{name}.png"))


# ---------------------------------------------------------------- the dashboard's JSON (no browser)

def test_dashboard_json_agrees_with_metrics(server, http):
    before = wait_idle(http)
    usage = [http.post("/v1/completions", json={"model": MODEL, "prompt": f"Fact {i}:", "max_tokens": 6,
                                                  "temperature": 0}).json()["usage"] for i in range(3)]
    after = wait_idle(http)
    # Open without the key, as /metrics is.
    dashboard = httpx.get(server.base_url + "/api/dashboard", timeout=30).json()
    assert dashboard["totals"] == {k: v for k, v in metrics(http).items()}
    assert after["kvserve:generation_tokens_total"] - before["kvserve:generation_tokens_total"] == \
        sum(u["completion_tokens"] for u in usage)
    assert dashboard["series"]["ttft_p50_s"][-1] > 0          # three first tokens within the last minute


# ---------------------------------------------------------------- the page

def test_page_loads_cleanly_and_asks_for_the_key_once(server, browser):
    browser.get(server.base_url + "/")
    wait_for(lambda: js(browser, "return document.body.dataset.ready === 'true'"), 20, "the page to start")
    assert js(browser, "return document.getElementById('key-dialog').open")
    assert console_errors(browser) == []
    loaded = network_events(browser)
    assert loaded and all(e.get("status", 0) < 400 and "failed" not in e for e in loaded), loaded
    loaded_urls = {e["url"].removeprefix(server.base_url) for e in loaded}
    assert {"/", "/static/style.css", "/static/js/main.js", "/static/js/markdown.js", "/api/info"} <= loaded_urls
    # Headless Chromium does not fetch favicons itself: fetch the one the page links, as a browser would.
    icon = browser.execute_async_script("""
        const done = arguments[arguments.length - 1];
        fetch(document.querySelector('link[rel=icon]').href)
          .then(r => done([r.status, r.headers.get('content-type')]));""")
    assert icon[0] == 200 and icon[1].startswith("image/svg+xml")
    screenshot(browser, "01-key-dialog")

    by_id(browser, "key-input").send_keys("wrong-key")
    by_id(browser, "key-submit").click()
    wait_for(lambda: by_id(browser, "key-error").text, 10, "the wrong key to be refused")
    assert js(browser, "return document.getElementById('key-dialog').open")
    browser.get_log("browser")          # the refused key's 401, expected
    by_id(browser, "key-input").clear()
    by_id(browser, "key-input").send_keys(API_KEY)
    by_id(browser, "key-submit").click()
    wait_for(lambda: not js(browser, "return document.getElementById('key-dialog').open"), 10, "the dialog to close")
    # Two served names: a picker with auto first.
    wait_for(lambda: by_id(browser, "model-field").is_displayed(), 10, "the model picker")
    options = js(browser, "return [...document.querySelectorAll('#model option')].map(o => o.value)")
    assert options == ["", MODEL, ALIAS]
    # The key is kept for this tab only, and went only into headers, never a URL.
    assert js(browser, "return sessionStorage.getItem('kvserve.apiKey')") == API_KEY
    assert js(browser, "return localStorage.getItem('kvserve.apiKey')") is None
    events = network_events(browser)
    assert all(API_KEY not in e["url"] for e in events if "url" in e)
    # A reload does not ask again.
    browser.refresh()
    wait_for(lambda: js(browser, "return document.body.dataset.ready === 'true'"), 20, "the page to start")
    assert not js(browser, "return document.getElementById('key-dialog').open")
    assert console_errors(browser) == []


def test_a_wrong_key_leaves_the_remembered_one(server, browser):
    """Trying a key that the server refuses had erased the key remembered on this device."""
    js(browser, "localStorage.setItem('kvserve.apiKey', arguments[0])", API_KEY)  # remembered earlier
    by_id(browser, "key-button").click()
    wait_for(lambda: js(browser, "return document.getElementById('key-dialog').open"), 10, "the dialog")
    if by_id(browser, "key-remember").is_selected():
        by_id(browser, "key-remember").click()
    by_id(browser, "key-input").send_keys("mistyped-key")
    by_id(browser, "key-submit").click()
    wait_for(lambda: by_id(browser, "key-error").text, 10, "the wrong key to be refused")
    js(browser, "document.getElementById('key-dialog').close()")   # as Escape does
    assert js(browser, "return [sessionStorage.getItem('kvserve.apiKey'), localStorage.getItem('kvserve.apiKey')]"
              ) == [API_KEY, API_KEY]
    browser.get_log("browser")          # the refused key's 401, expected
    js(browser, "localStorage.removeItem('kvserve.apiKey')")


def test_a_saved_key_the_server_refuses_is_asked_for_at_load(server, browser):
    """A remembered key that no longer works (the server's key changed) was only found out when the first
    message failed."""
    js(browser, "sessionStorage.removeItem('kvserve.apiKey'); localStorage.setItem('kvserve.apiKey', 'old-key')")
    browser.refresh()
    wait_for(lambda: js(browser, "return document.body.dataset.ready === 'true'"), 20, "the page to start")
    wait_for(lambda: js(browser, "return document.getElementById('key-dialog').open"), 10, "the key dialog")
    assert "did not accept the saved key" in by_id(browser, "key-error").text
    browser.get_log("browser")          # the old key's 401, expected
    by_id(browser, "key-input").send_keys(API_KEY)
    by_id(browser, "key-submit").click()
    wait_for(lambda: not js(browser, "return document.getElementById('key-dialog').open"), 10, "the dialog to close")
    js(browser, "localStorage.removeItem('kvserve.apiKey')")
    assert console_errors(browser) == []


def test_reply_streams_in_token_by_token_with_its_stats(server, browser, http):
    set_value(browser, "temperature", "0")
    set_value(browser, "max-tokens", "48")
    send(browser, "Explain in two sentences what a KV cache is.")
    # Poll the reply as a person watching would; a page that showed it only at the end would be seen once.
    seen: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = last_reply(browser)
        if r and r["state"] == "streaming":
            seen.append(len(r["text"]))
        if r and r["state"] in DONE_STATES:
            break
        time.sleep(0.02)
    final = wait_reply_done(browser)
    assert final["state"] in ("done", "length"), final
    partial = sorted(set(seen))
    assert len(partial) >= 3, f"saw the reply at only {partial} characters while streaming"
    assert seen == sorted(seen), "the reply's text shrank while streaming"
    assert partial[-1] <= len(final["text"]) and final["text"].strip()
    stats = final["stats"]
    assert stats["ttft"].startswith("TTFT ") and stats["tps"].endswith("tok/s") and stats["tokens"].endswith("tokens")
    assert "prompt tokens cached" in stats["cached"]
    screenshot(browser, "02-chat-reply")

    # Regenerate replaces the reply with a new one for the same prompt: served partly from the prefix cache.
    count = final["count"]
    from selenium.webdriver.common.by import By
    browser.find_element(By.CSS_SELECTOR, "[data-action=regenerate]").click()
    wait_for(lambda: (r := last_reply(browser)) and r["state"] not in DONE_STATES, 10, "the new reply to start")
    again = wait_reply_done(browser)
    assert again["count"] == count and again["state"] in ("done", "length") and again["text"].strip()
    cached = int(again["stats"]["cached"].split()[0])
    assert cached > 0, again["stats"]
    wait_idle(http)


def test_stop_ends_the_reply_and_the_request(server, browser, http):
    by_id(browser, "clear-chat").click()
    set_value(browser, "max-tokens", "400")
    send(browser, "Count from 1 to 300, one number per line.")
    wait_for(lambda: (r := last_reply(browser)) and r["state"] == "streaming" and len(r["text"]) > 10, 60,
             "the reply to start streaming")
    by_id(browser, "stop").click()
    stopped = wait_reply_done(browser, 10)
    assert stopped["state"] == "stopped" and stopped["stats"]["end"] == "stopped"
    time.sleep(0.3)
    assert last_reply(browser)["text"] == stopped["text"]       # no more text after stop
    assert by_id(browser, "send").is_displayed() and not by_id(browser, "stop").is_displayed()
    wait_idle(http)                                              # the server aborted the request
    assert console_errors(browser) == []                         # an aborted stream is not an error


def shown_messages(browser) -> list[list[str]]:
    return js(browser, """return [...document.querySelectorAll('#messages .msg')].map(
        m => [m.dataset.role, m.dataset.state, m.querySelector('.msg-body').textContent])""")


def reload_page(browser) -> None:
    browser.refresh()
    wait_for(lambda: js(browser, "return document.body.dataset.ready === 'true'"), 20, "the page to start")


def test_the_conversation_survives_a_reload(server, browser, http):
    """A reload (or a closed tab) had lost the whole conversation."""
    by_id(browser, "clear-chat").click()
    set_value(browser, "temperature", "0")
    set_value(browser, "max-tokens", "12")
    send(browser, "Name a colour.")
    first = wait_reply_done(browser)
    assert first["state"] in ("done", "length") and first["text"].strip(), first
    before = shown_messages(browser)
    reload_page(browser)
    assert shown_messages(browser) == before and [m[0] for m in before] == ["user", "assistant"]
    assert last_reply(browser)["stats"] == first["stats"]          # its TTFT, speed and cache line too
    # The next question goes out with the restored turns, the reply as the model wrote it.
    record_chat_requests(browser)
    send(browser, "And another one?")
    assert wait_reply_done(browser)["state"] in ("done", "length")
    (body,) = js(browser, "return window.sentBodies")
    turns = [m for m in body["messages"] if m["role"] != "system"]
    assert [(m["role"], m["content"] if m["role"] == "user" else None) for m in turns] == [
        ("user", "Name a colour."), ("assistant", None), ("user", "And another one?")], turns
    reference = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": body["messages"][:-2], "temperature": body["temperature"],
        "top_p": body["top_p"], "max_tokens": 12}).json()["choices"][0]["message"]["content"]
    assert turns[1]["content"] == reference
    # A reply cut off by the reload is kept as far as it had come, marked stopped.
    set_value(browser, "max-tokens", "400")
    send(browser, "Count from 1 to 300, one number per line.")
    wait_for(lambda: (r := last_reply(browser)) and r["state"] == "streaming" and len(r["text"]) > 10, 60,
             "the reply to start streaming")
    reload_page(browser)
    cut = last_reply(browser)
    assert cut["count"] == 3 and cut["state"] == "stopped" and cut["stats"].get("end") == "stopped"
    assert cut["text"].strip()
    # Clear forgets it, also for the next load.
    by_id(browser, "clear-chat").click()
    reload_page(browser)
    assert shown_messages(browser) == [] and by_id(browser, "chat-empty").is_displayed()
    wait_idle(http)
    assert [e["message"] for e in console_errors(browser)] == []


def test_a_failed_turn_is_not_sent_again_with_the_next(server, browser, http):
    """A question whose reply failed (here a 400) had gone out again with the next one: two user turns in a row."""
    by_id(browser, "clear-chat").click()
    set_value(browser, "temperature", "0")
    set_value(browser, "max-tokens", "100000")
    send(browser, "First question")
    assert wait_reply_done(browser)["state"] == "error"
    set_value(browser, "max-tokens", "4")
    record_chat_requests(browser)
    send(browser, "Second question")
    assert wait_reply_done(browser)["state"] in ("done", "length")
    (body,) = js(browser, "return window.sentBodies")
    assert [(m["role"], m["content"]) for m in body["messages"] if m["role"] != "system"] == [
        ("user", "Second question")], body["messages"]
    browser.refresh()
    wait_for(lambda: js(browser, "return document.body.dataset.ready === 'true'"), 20, "the page to start")
    # The 400 is the only thing the console said (read here, so that the next test starts from nothing).
    assert [e["message"] for e in console_errors(browser) if "status of 400" not in e["message"]] == []
    wait_idle(http)


@pytest.fixture()
def proxy(server):
    """A reverse proxy serving the server under /kv/ (the prefix stripped, as nginx's proxy_pass with a path
    does), streaming each response as it comes."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Forward(BaseHTTPRequestHandler):
        def forward(self) -> None:
            if not self.path.startswith("/kv/"):
                self.send_error(404)
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
            with httpx.stream(self.command, server.base_url + self.path[3:], headers=headers, content=body,
                              timeout=120) as r:
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                for chunk in r.iter_raw():
                    self.wfile.write(chunk)
                    self.wfile.flush()

        do_GET = do_POST = forward

        def log_message(self, *args) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Forward)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/kv/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_page_works_behind_a_proxy_under_a_path(server, browser, http, proxy):
    """Every URL had been from the root: under /kv/ the assets were 404s and the page stayed blank."""
    browser.get(proxy)
    wait_for(lambda: js(browser, "return document.body.dataset.ready === 'true'"), 20, "the page to start")
    if js(browser, "return document.getElementById('key-dialog').open"):  # a new origin: the key again
        by_id(browser, "key-input").send_keys(API_KEY)
        by_id(browser, "key-submit").click()
        wait_for(lambda: not js(browser, "return document.getElementById('key-dialog').open"), 20, "the key")
    set_value(browser, "temperature", "0")
    set_value(browser, "max-tokens", "8")
    send(browser, "Hello")
    reply = wait_reply_done(browser)
    assert reply["state"] in ("done", "length") and reply["text"].strip(), reply
    assert js(browser, "return document.styleSheets.length") >= 1
    assert console_errors(browser) == []
    browser.get(server.base_url + "/")
    wait_for(lambda: js(browser, "return document.body.dataset.ready === 'true'"), 20, "the page to start")
    wait_idle(http)


def test_model_markup_is_shown_as_text(server, browser, http):
    by_id(browser, "clear-chat").click()
    set_value(browser, "temperature", "0")
    set_value(browser, "max-tokens", "40")
    js(browser, "window.__alerts = []; window.alert = (m) => window.__alerts.push(String(m));")
    prompt = f"Repeat exactly: {XSS}"
    # The model repeats it (greedy; checked with both kernel variants and compute dtypes: AVX-512 bf16,
    # AVX2 fp32 and bf16); check with the API first so a failure says which side changed.
    reply = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 40,
        "temperature": 0}).json()["choices"][0]["message"]["content"]
    assert XSS in reply, f"the model no longer echoes the markup: {reply!r}"
    send(browser, prompt)
    shown = wait_reply_done(browser)
    assert XSS in shown["text"], shown                          # the model's characters, as characters
    assert js(browser, "return document.querySelectorAll('#messages img, #messages script').length") == 0
    assert js(browser, "return window.__alerts") == []
    user_text = js(browser, "return document.querySelector('#messages .msg-user .msg-body').textContent")
    assert user_text == prompt
    screenshot(browser, "03-markup-as-text")

    # The same through the page's whole client path with a reply we write: the stream parser, the Markdown
    # renderer and the DOM. fetch is replaced for this one request by a stream of chat.completion.chunks.
    hostile = ("Here: <img src=x onerror=alert(1)> and <script>alert(2)</script>\n\n"
               "**bold** [safe](https://example.com) [bad](javascript:alert(3))\n\n"
               "```html\n<b onclick=alert(4)>code</b>\n```")
    js(browser, """
        const pieces = arguments[0].match(/[\\s\\S]{1,7}/g);
        const realFetch = window.fetch;
        window.fetch = (url, init) => {
          if (!String(url).endsWith('v1/chat/completions')) return realFetch(url, init);
          window.fetch = realFetch;
          const enc = new TextEncoder();
          const events = pieces.map(p => `data: ${JSON.stringify({choices: [{index: 0, delta: {content: p}}]})}\\n\\n`);
          events.push('data: ' + JSON.stringify({choices: [], usage: {prompt_tokens: 9, completion_tokens: 20,
            prompt_tokens_details: {cached_tokens: 0}}}) + '\\n\\n', 'data: [DONE]\\n\\n');
          const body = new ReadableStream({start(c) { for (const e of events) c.enqueue(enc.encode(e)); c.close(); }});
          return Promise.resolve(new Response(body, {headers: {'Content-Type': 'text/event-stream'}}));
        };""", hostile)
    send(browser, "anything")
    wait_for(lambda: (r := last_reply(browser)) and r["count"] == 2 and r["state"] in DONE_STATES, 10, "the reply")
    found = js(browser, """
        const all = document.querySelectorAll('#messages .msg-assistant .msg-body');
        const m = all[all.length - 1];
        return {text: m.textContent, tags: [...m.querySelectorAll('*')].map(e => e.tagName.toLowerCase()),
                links: [...m.querySelectorAll('a')].map(a => a.href),
                code: m.querySelector('pre code') && m.querySelector('pre code').textContent};""")
    assert XSS in found["text"] and "<script>alert(2)</script>" in found["text"]
    assert "[bad](javascript:alert(3))" in found["text"]         # not a link
    assert found["links"] == ["https://example.com/"]
    assert found["code"] == "<b onclick=alert(4)>code</b>"
    assert set(found["tags"]) <= {"p", "strong", "a", "pre", "code"}, found["tags"]
    assert js(browser, "return document.querySelectorAll('#messages img, #messages script, #messages b').length") == 0
    assert js(browser, "return window.__alerts") == []
    assert console_errors(browser) == []


MARKDOWN_CASES = [
    ("plain <b>text</b> & more", "<p>plain &lt;b&gt;text&lt;/b&gt; &amp; more</p>"),
    ("# Title\nSome *em* and **strong** and `a<b>`", "<h3>Title</h3><p>Some <em>em</em> and <strong>strong</strong> "
                                                     "and <code>a&lt;b&gt;</code></p>"),
    ("```python\nif a < b:\n    pass\n```", '<pre data-lang="python"><code class="language-python">if a &lt; b:\n'
                                             '    pass</code></pre>'),
    ("```\nstill streaming <", "<pre><code>still streaming &lt;</code></pre>"),     # unclosed fence
    ("- one\n- two\n\n3. three", "<ul><li>one</li><li>two</li></ul><ol start=\"3\"><li>three</li></ol>"),
    ("snake_case_name and _em_", "<p>snake_case_name and <em>em</em></p>"),
    ("| a | b |\n|---|---|\n| 1 | <i>2</i> |", '<div class="table-wrap"><table><thead><tr><th>a</th><th>b</th></tr>'
     '</thead><tbody><tr><td>1</td><td>&lt;i&gt;2&lt;/i&gt;</td></tr></tbody></table></div>'),
    ("> quoted <u>", "<blockquote><p>quoted &lt;u&gt;</p></blockquote>"),
    # A table right under a line of text or a list (no blank line between, as models write them) had been text.
    ("Here they are:\n| a | b |\n|---|---|\n| 1 | 2 |", '<p>Here they are:</p><div class="table-wrap"><table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td><td>2</td></tr></tbody></table></div>'),
    ("- item\n| a | b |\n|---|---|\n| 1 | 2 |", '<ul><li>item</li></ul><div class="table-wrap"><table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td><td>2</td></tr></tbody></table></div>'),
    ("a | b\n---", "<p>a | b</p><hr>"),            # a divider of one cell under two: not a table (GFM)
    # Lists indented under an item nest in it (they had been flattened, an ordered list cut in two).
    ("1. First:\n   - x\n   - y\n2. Second", "<ol><li>First:<ul><li>x</li><li>y</li></ul></li><li>Second</li></ol>"),
    ("- a\n  - b\n    - c\n- d", "<ul><li>a<ul><li>b<ul><li>c</li></ul></li></ul></li><li>d</li></ul>"),
    ("[x](javascript:alert(1)) [y](https://a.example/p?q=1)",
     '<p>[x](javascript:alert(1)) <a href="https://a.example/p?q=1" target="_blank" rel="noopener noreferrer">y</a></p>'),
]


def test_markdown_renderer(server, browser):
    """The page's own renderer module, run in the browser on each case; compared as the DOM serialises."""
    got = browser.execute_async_script("""
        const [cases, done] = [arguments[0], arguments[arguments.length - 1]];
        import('/static/js/markdown.js').then(({renderMarkdown}) => done(cases.map(text => {
          const box = document.createElement('div');
          box.append(renderMarkdown(text));
          return box.innerHTML;
        })));""", [text for text, _ in MARKDOWN_CASES])
    for (text, want), html in zip(MARKDOWN_CASES, got):
        assert html == want, text


def test_dashboard_follows_load_and_agrees_with_metrics(server, browser, http):
    browser.get(server.base_url + "/#dashboard")
    wait_for(lambda: js(browser, "return document.body.dataset.ready === 'true'"), 20, "the page to start")

    def tiles() -> dict[str, float]:
        return js(browser, """
            const out = {};
            for (const t of document.querySelectorAll('.tile[data-metric]')) {
              if (t.querySelector('.tile-value').dataset.value !== undefined && !t.hidden)
                out[t.dataset.metric] = Number(t.querySelector('.tile-value').dataset.value);
            }
            return out;""")

    before = wait_idle(http)
    wait_for(lambda: tiles().get("kvserve:generation_tokens_total") == before["kvserve:generation_tokens_total"],
             10, "the dashboard to show the current totals")
    shown_before = tiles()

    # Three streams at once, long enough for the dashboard's once-a-second poll to see them running: 400
    # tokens take ~2 s on the fastest CPU path here (64 had finished within one poll there).
    usage: list[dict] = []

    def stream(i: int) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"Tell me a story about cache {i}."}],
                "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk.get("usage") and not chunk["choices"]:
                        usage.append(chunk["usage"])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_for(lambda: tiles().get("kvserve:num_requests_running", 0) >= 1, 30, "the dashboard to show running requests")
    screenshot(browser, "04-dashboard-under-load")
    for t in threads:
        t.join(120)
    assert len(usage) == 3
    after = wait_idle(http)

    # Every tile settles on exactly the value /metrics reports.
    def agrees() -> bool:
        shown = tiles()
        return all(shown[k] == after[k] for k in shown)
    wait_for(agrees, 10, "the dashboard to agree with /metrics")
    shown = tiles()
    assert set(shown) == {"kvserve:num_requests_running", "kvserve:num_requests_waiting",
                          "kvserve:gateway_queue_requests", "kvserve:kv_cache_usage_perc", "kvserve:request_success_total",
                          "kvserve:prompt_tokens_total", "kvserve:generation_tokens_total",
                          "kvserve:num_preemptions_total"}
    assert shown["kvserve:generation_tokens_total"] - shown_before["kvserve:generation_tokens_total"] == \
        sum(u["completion_tokens"] for u in usage) == 3 * 400
    assert shown["kvserve:request_success_total"] - shown_before["kvserve:request_success_total"] == 3
    # The charts of what exists are shown, each with its current value as text; the rest stay hidden.
    charts = js(browser, """
        const out = {};
        for (const c of document.querySelectorAll('.chart'))
          out[c.dataset.chart] = {hidden: c.hidden, value: c.querySelector('.chart-value').textContent,
                                  lines: c.querySelectorAll('path.line').length};
        return out;""")
    for name in ("requests", "kv-cache", "prefix-cache", "throughput", "ttft", "itl", "preemptions"):
        assert not charts[name]["hidden"], name
    assert charts["spec-decode"]["hidden"] and charts["replicas"]["hidden"]
    for name in ("requests", "throughput", "ttft", "itl"):
        assert charts[name]["lines"] >= 1 and charts[name]["value"] != "–", (name, charts[name])
    assert charts["ttft"]["value"].endswith(("ms", "s"))
    assert "live" in by_id(browser, "dash-status").text
    screenshot(browser, "05-dashboard")
    # A shorter window: the charts redraw over the last minute.
    set_value(browser, "dash-window", "60")
    wait_for(lambda: "−1 min" in js(browser, "return document.querySelector('[data-chart=requests] svg').textContent"),
             10, "the charts to span one minute")
    assert console_errors(browser) == []
