"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

Timing follows `vllm bench serve`: the clock starts just before the POST; TTFT is when the first
chunk carrying generated text arrives; every later such chunk adds one inter-chunk gap to `itl`;
latency ends when the stream closes. Chunks with no text (a role-only first delta, the final
finish_reason chunk, the usage chunk) are not token events: counting them would add near-zero gaps
that flatter ITL."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import aiohttp

from kvserve.bench.datasets import BenchRequest


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0  # the dataset's count; replaced by the server's usage when it sends one
    output_tokens: int | None = None  # from the server's usage; None means "tokenize the text"
    usage_reported: bool = False
    generated_text: str = ""
    start_time: float = 0.0  # perf_counter() when the request was sent
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds, one per text chunk after the first
    latency: float = 0.0  # seconds, request sent -> stream closed


IGNORE_EOS_METHODS = ("field", "generation-config", "logit-bias", "none")


@dataclass
class EndpointConfig:
    base_url: str
    model: str | None  # None: the first the server lists (run_benchmark reads it)
    endpoint: str = "completions"  # or "chat"
    # How to make the server generate exactly max_tokens whatever it samples:
    #   "field": the `ignore_eos` request field (vLLM, llama.cpp, kvserve);
    #   "generation-config": transformers serve's `generation_config` JSON with eos_token_id -1
    #   (it rejects unknown fields, and -1 disables its EOS check);
    #   "logit-bias": logit_bias -100 on the tokenizer's special tokens (llama-cpp-python's server,
    #   which has neither; filled in from the benchmark tokenizer);
    #   "none": send nothing (outputs may end early at EOS).
    ignore_eos_via: str = "field"
    banned_token_ids: list[int] = field(default_factory=list)  # for "logit-bias"
    temperature: float = 0.0
    extra_body: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        path = "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"
        return self.base_url.rstrip("/") + path


def build_payload(cfg: EndpointConfig, req: BenchRequest) -> dict[str, object]:
    payload: dict[str, object] = {
        "model": cfg.model,
        "max_tokens": req.output_len,
        "temperature": cfg.temperature,
        "stream": True,
        # Ask for a final usage chunk: the server's own token counts beat re-tokenizing text.
        "stream_options": {"include_usage": True},
    }
    # Generating exactly max_tokens makes every server do the same work whatever text it produces.
    if cfg.ignore_eos_via == "field":
        payload["ignore_eos"] = True
    elif cfg.ignore_eos_via == "generation-config":
        gen = {"eos_token_id": -1, "do_sample": cfg.temperature > 0}
        payload["generation_config"] = json.dumps(gen)
    elif cfg.ignore_eos_via == "logit-bias":
        if not cfg.banned_token_ids:
            raise ValueError("ignore-eos via logit-bias needs the EOS token ids")
        payload["logit_bias"] = {str(i): -100 for i in cfg.banned_token_ids}
    elif cfg.ignore_eos_via != "none":
        raise ValueError(f"unknown ignore-eos method {cfg.ignore_eos_via!r}")
    if cfg.endpoint == "chat":
        payload["messages"] = req.messages or [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    payload.update(cfg.extra_body)
    return payload


def sent_max_tokens(cfg: EndpointConfig, req: BenchRequest) -> object:
    """The output limit a request was sent with: --extra-body can override the dataset's."""
    extra = cfg.extra_body
    if cfg.endpoint == "chat" and extra.get("max_completion_tokens") is not None:  # the server prefers it
        return extra["max_completion_tokens"]
    return extra.get("max_tokens", req.output_len)


def request_headers() -> dict[str, str]:
    h = {"Content-Type": "application/json"}
    key = os.environ.get("OPENAI_API_KEY")
    if key:
        h["Authorization"] = f"Bearer {key}"
    return h


def _chunk_output(data: dict, chat: bool) -> tuple[bool, str]:
    """Whether a chunk carries generated tokens, and their text. As vLLM's client, a chunk whose tokens decode to
    no text yet (special tokens, part of a UTF-8 character) carries output too: left out, its gap vanished from
    ITL, and a request whose whole output decoded to "" was booked as failed. Not counted: a chat stream's
    role-only opening delta, a chunk that only says why the request finished, and the usage chunk (no choices)."""
    choices = data.get("choices") or []
    if not choices:
        return False, ""
    c = choices[0]
    if chat:
        delta = c.get("delta") or {}
        # reasoning: vLLM's reasoning parsers' field (reasoning_content before it)
        text = "".join(delta.get(k) or "" for k in ("content", "reasoning", "reasoning_content"))
        return bool(text) or (delta.get("role") is None and c.get("finish_reason") is None), text
    text = c.get("text") or ""
    return bool(text) or c.get("finish_reason") is None, text


async def send_request(session: aiohttp.ClientSession, cfg: EndpointConfig,
                       req: BenchRequest) -> RequestResult:
    out = RequestResult(prompt_len=req.prompt_len)
    chat = cfg.endpoint == "chat"
    payload = build_payload(cfg, req)
    text_parts: list[str] = []
    out.start_time = st = time.perf_counter()
    last = st
    got_first = False
    try:
        async with session.post(cfg.url, json=payload, headers=request_headers()) as resp:
            if resp.status != 200:
                body = (await resp.text())[:500]
                out.error = f"HTTP {resp.status}: {body}"
                return out
            # aiohttp yields one line at a time (split on \n), whatever the network chunking.
            async for raw in resp.content:
                line = raw.strip()
                if not line or line.startswith(b":") or not line.startswith(b"data:"):
                    continue  # blank separators, SSE comments / keep-alives, event: lines
                body = line[5:].strip()
                if body == b"[DONE]":
                    break
                now = time.perf_counter()
                data = json.loads(body)
                if "error" in data:
                    out.error = f"stream error: {json.dumps(data['error'])[:500]}"
                    return out
                carries, text = _chunk_output(data, chat)
                if carries:
                    if not got_first:
                        out.ttft = now - st
                        got_first = True
                    else:
                        out.itl.append(now - last)
                    last = now
                    text_parts.append(text)
                usage = data.get("usage")
                if usage:
                    out.usage_reported = True
                    if usage.get("completion_tokens") is not None:
                        out.output_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens"):
                        out.prompt_len = int(usage["prompt_tokens"])
        # As vLLM's: the request ends with its last output chunk, not with the usage chunk and [DONE] after it.
        out.latency = (last if got_first else time.perf_counter()) - st
        out.generated_text = "".join(text_parts)
        if got_first:
            out.success = True
        else:
            out.error = "stream ended without any generated output (no TTFT)"
    except Exception as e:  # a benchmark records failures and carries on
        out.error = f"{type(e).__name__}: {e}"
        out.latency = time.perf_counter() - st
    return out


def make_session(max_connections: int = 0) -> aiohttp.ClientSession:
    # limit=0: aiohttp's default pool of 100 would queue requests inside the client above 100
    # concurrent streams, and that wait would be booked as server TTFT.
    # force_close: one fresh connection per request. Reusing pooled keep-alive connections raced with
    # servers that close them (llama-server's cpp-httplib closes a connection after a few requests):
    # a request written into a just-closed connection failed at once ("Server disconnected", "Can not
    # write request body"), seen on 4 of 80 llama.cpp requests at concurrency 8/32. A localhost connect
    # costs well under a millisecond, inside TTFT for every server alike.
    connector = aiohttp.TCPConnector(limit=max_connections, force_close=True)
    timeout = aiohttp.ClientTimeout(total=6 * 3600, sock_read=None)
    return aiohttp.ClientSession(connector=connector, timeout=timeout,
                                 read_bufsize=1 << 20, trust_env=False)
