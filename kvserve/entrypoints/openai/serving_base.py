"""What completions and chat share: which model serves the request, admission control, prompt validation,
max_tokens, running requests so that a client that goes away aborts them, SSE framing, logprob token strings."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel

from kvserve.entrypoints.async_llm import EngineDeadError, EngineRequestError, ServerStopping
from kvserve.entrypoints.openai.auth import bearer_token, tenant_cache_salt
from kvserve.entrypoints.openai.errors import SHUTDOWN_RETRY_AFTER, OpenAIError, bad_request, error_body
from kvserve.entrypoints.openai.protocol import PromptLogprob, PromptTokensDetails, SamplingFields, UsageInfo
from kvserve.gateway.admission import NoReplica, QueueFull
from kvserve.gateway.config import AUTO_MODEL
from kvserve.gateway.registry import ModelRegistry, UnknownModel
from kvserve.gateway.served_model import ServedModel
from kvserve.outputs import PositionLogprobs, RequestDelta, SpecDecodeMetrics
from kvserve.sampling_params import SamplingParams

T = TypeVar("T")


class ClientDisconnected(Exception):
    pass


class OpenAIServing:
    """The per-request work both endpoints share. Every request is served by one model of the registry,
    resolved from its `model` field first: its tokenizer, context length and engines are the ones used."""

    def __init__(self, registry: ModelRegistry, cache_salt_by_api_key: bool = False) -> None:
        self.registry = registry
        self.cache_salt_by_api_key = cache_salt_by_api_key

    def resolve(self, requested: str | None, prompt_text: Callable[[], str] | None = None, *,
                chat: bool = False) -> ServedModel:
        try:
            return self.registry.resolve(requested, prompt_text, chat=chat)
        except UnknownModel as e:
            raise OpenAIError(404, str(e), "model") from None

    @staticmethod
    def response_model_name(requested: str | None, model: ServedModel) -> str:
        """What the response's `model` says: the name the client sent, or for none and for `auto` the name of
        the model that answered."""
        return requested if requested and requested != AUTO_MODEL else model.name

    @staticmethod
    async def encode(model: ServedModel, text: str, add_special_tokens: bool) -> list[int]:
        # A long text takes a while to tokenize: do it off the event loop so /health and streams keep going.
        if len(text) < 20_000:
            return model.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(model.tokenizer.encode, text, add_special_tokens)

    def cache_salt(self, raw_request: Request, requested: str | None) -> str | None:
        """The prefix-cache salt the engine gets: the request's cache_salt, under its API key's when the
        server salts by key."""
        if not self.cache_salt_by_api_key:
            return requested
        return tenant_cache_salt(bearer_token(raw_request.headers.get("authorization")), requested)

    @staticmethod
    def check_admission(model: ServedModel, num_new: int, priority: int = 0, n: int = 1) -> None:
        """A cheap early refusal; the model's admission queue makes the binding check as each request joins."""
        queue = model.queue
        why = queue.refusal(priority, n, num_new)
        if why is not None:
            raise bad_request(why, "n" if n > queue.cap(priority) else "prompt")
        if model.dead is not None:
            raise OpenAIError(503, f"engine is not running: {model.dead}", headers={"Retry-After": "2"})
        if not queue.admits(priority, num_new):
            raise OpenAIError(429, f"too many requests waiting (max_waiting={queue.max_waiting}); retry later",
                              headers={"Retry-After": str(queue.retry_after_s())})

    @staticmethod
    def check_prompt(model: ServedModel, token_ids: list[int], param: str = "prompt") -> None:
        if not token_ids:
            raise bad_request("prompt must not be empty", param)
        vocab = model.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {vocab})", param)

    @staticmethod
    def resolve_max_tokens(model: ServedModel, prompt_len: int, max_tokens: int | None,
                           param: str = "max_tokens", prompt_param: str = "prompt") -> int:
        room = model.max_model_len - prompt_len
        if room < 1:
            raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens; "
                              f"the prompt has {prompt_len} tokens, leaving no room to generate.", prompt_param)
        if max_tokens is None:
            return room
        if max_tokens < 1:
            raise bad_request(f"{param} must be an integer >= 1, got {max_tokens}", param)
        if max_tokens > room:
            raise bad_request(f"This model's maximum context length is {model.max_model_len} tokens. "
                              f"However, you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                              f"prompt, {max_tokens} for the completion).", param)
        return max_tokens

    @staticmethod
    def sampling_params(model: ServedModel, req: SamplingFields, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        if req.n > model.config.max_num_seqs:
            raise bad_request(f"n must be <= max_num_seqs={model.config.max_num_seqs}, got {req.n}", "n")
        if req.logit_bias:
            for key in req.logit_bias:
                # ASCII digits only: str.isdigit() also takes "²", which int() refuses (a 500 before).
                if not re.fullmatch(r"-?[0-9]+", key) or not 0 <= int(key) < model.vocab_size:
                    raise bad_request(f"logit_bias key {key!r} is not a token id in [0, {model.vocab_size})",
                                      "logit_bias")
        try:
            params = req.to_sampling_params(max_tokens, logprobs, prompt_logprobs)
        except ValueError as e:
            raise bad_request(str(e)) from None
        return params

    async def generate(self, model: ServedModel, raw_request: Request, prompt_token_ids: list[int],
                       params: SamplingParams, priority: int, request_id: str,
                       cache_salt: str | None = None) -> AsyncIterator[RequestDelta]:
        """The model's generate (admission, routing, the engine) with its errors mapped to HTTP errors."""
        gen = model.generate(prompt_token_ids, params, request_id=request_id, priority=priority,
                             cache_salt=self.cache_salt(raw_request, cache_salt), arrival_time=time.monotonic())
        async with contextlib.aclosing(gen):
            try:
                async for out in gen:
                    yield out
            except EngineRequestError as e:
                if e.client_error:
                    raise bad_request(str(e)) from None
                raise OpenAIError(500, str(e)) from None
            except (EngineDeadError, NoReplica) as e:
                raise OpenAIError(503, f"engine is not running: {e}", headers={"Retry-After": "2"}) from None
            except QueueFull as e:
                raise OpenAIError(429, str(e), headers={"Retry-After": str(e.retry_after_s)}) from None
            except ServerStopping as e:
                raise OpenAIError(503, str(e), headers=SHUTDOWN_RETRY_AFTER) from None


async def merge(gens: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as their items arrive; closes them all if the consumer stops."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: AsyncIterator[T]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((i, e))
            return
        await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and so aborting its requests) if the client disconnects first."""
    work = asyncio.ensure_future(awaitable)

    async def watch() -> None:
        while True:
            message = await raw_request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        watcher.cancel()
        await asyncio.gather(work, watcher, return_exceptions=True)
        raise
    watcher.cancel()
    if not work.done():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise ClientDisconnected()
    return work.result()


async def first_output(raw_request: Request, gen: AsyncIterator[T]) -> T | None:
    """A stream's first item, awaited before any header is sent, so that an engine-side rejection is still
    a proper HTTP error rather than an error inside a 200 stream. None if the client left first; on any
    error the generator is closed (aborting its requests) before the error propagates."""
    try:
        return await until_disconnected(raw_request, anext(gen))
    except ClientDisconnected:
        return None
    except BaseException:
        await gen.aclose()
        raise


def reports_metrics(model: ServedModel) -> bool:
    """Whether this model's responses carry vLLM's per-request `metrics` object: where it speculates and was
    asked to report them."""
    config = model.config
    return config.per_request_spec_decode_metrics != "none" and config.speculative_config is not None


def body_json(body: BaseModel, model: ServedModel) -> dict:
    """A response body as JSON, with its `metrics` field only where the model reports them: otherwise the
    body is what it was without the option, as in vLLM."""
    return body.model_dump(exclude=None if reports_metrics(model) else {"metrics"})


def request_metrics(spec: SpecDecodeMetrics | None) -> dict | None:
    """The `metrics` object of a response that maps to one sequence; None (null) where the engine collected
    nothing for it (n > 1)."""
    return None if spec is None else {"speculative_decoding": spec.to_json()}


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def sse_error(e: OpenAIError) -> str:
    return sse(error_body(e.status, e.message, e.param))


def prompt_logprobs_body(entries: list[PositionLogprobs | None] | None) -> list[dict[int, PromptLogprob] | None] | None:
    """The engine's prompt logprobs in vLLM's response shape (None where the request asked for none)."""
    if entries is None:
        return None
    return [None if e is None else {t: PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                                    for t, lp in e.items()} for e in entries]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


def token_str(tokenizer, token_id: int, decoded: str | None) -> str:
    return decoded if decoded is not None else tokenizer.decode([token_id], skip_special_tokens=False)
