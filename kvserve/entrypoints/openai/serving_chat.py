"""POST /v1/chat/completions: render the model's chat template, generate n samples, answer as OpenAI's
chat.completion object or as a stream of chat.completion.chunk events; chat-format logprobs."""
from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.entrypoints.openai.errors import OpenAIError, bad_request
from kvserve.entrypoints.openai.protocol import (
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChatTopLogprob,
    DeltaMessage,
    random_id,
)
from kvserve.entrypoints.openai.serving_base import (
    ClientDisconnected,
    OpenAIServing,
    body_json,
    first_output,
    prompt_logprobs_body,
    request_metrics,
    sse,
    sse_error,
    token_str,
    until_disconnected,
    usage,
)
from kvserve.gateway.served_model import ServedModel
from kvserve.outputs import PositionLogprobs, RequestDelta, RequestOutput, RequestOutputAccumulator


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict]:
    """What the chat template renders; roles and content were validated with the request."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text}
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def last_user_text(messages: list[ChatMessage]) -> str:
    """What model "auto" judges a chat by: what the user asked last (the router was fitted on questions, not on
    transcripts); /tokenize with messages judges the same, so that it counts the tokens the chat would."""
    return next((m.text for m in reversed(messages) if m.role == "user"), "")


class OpenAIServingChat(OpenAIServing):
    async def render_prompt(self, m: ServedModel, messages: list[ChatMessage], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict | None = None) -> list[int]:
        if not messages:
            raise bad_request("messages must not be empty", "messages")
        dicts = messages_to_dicts(messages)
        try:
            text = m.tokenizer.apply_chat_template(dicts, add_generation_prompt=add_generation_prompt,
                                                   continue_final_message=continue_final_message,
                                                   **(template_kwargs or {}))
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            raise bad_request(f"cannot apply the chat template to these messages: {e}", "messages") from None
        # The template already holds the special tokens it wants (BOS etc.).
        return await self.encode(m, text, add_special_tokens=False)

    async def create(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        m = self.resolve(req.model, lambda: last_user_text(req.messages), chat=True)
        model = self.response_model_name(req.model, m)
        ids = await self.render_prompt(m, req.messages, req.add_generation_prompt, req.continue_final_message,
                                       req.chat_template_kwargs)
        self.check_prompt(m, ids, "messages")
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = self.resolve_max_tokens(
            m, len(ids), requested, "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
            prompt_param="messages")
        if req.top_logprobs and not req.logprobs:  # 0 passes, as in vLLM
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            # Checked here, not by SamplingParams, which would name its own field (logprobs) in the error.
            raise bad_request(f"top_logprobs must be an integer in [0, 20], got {req.top_logprobs}", "top_logprobs")
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        # Streamed, prompt logprobs have nowhere to go: none asked of the engine (they skip the prefix cache).
        params = self.sampling_params(m, req, max_tokens, num_top, None if req.stream else req.prompt_logprobs)
        self.check_admission(m, 1, req.priority, req.n)

        request_id = req.request_id or random_id("chatcmpl")
        gen = self.generate(m, raw_request, ids, params, req.priority, request_id, req.cache_salt)
        if req.stream:
            return await self._stream(m, req, raw_request, request_id, model, len(ids), gen)

        async def collect() -> RequestOutput:
            # The engine sends each step's additions; the whole answer is assembled here, once.
            acc = RequestOutputAccumulator(request_id, None, ids, req.n, num_top is not None)
            async with contextlib.aclosing(gen):
                async for delta in gen:
                    acc.add(delta)
            return acc.output

        try:
            out = await until_disconnected(raw_request, collect())
        except ClientDisconnected:
            return Response(status_code=499)
        choices = []
        echoed = self._echoed(req)
        for c in out.outputs:
            logprobs = (self._logprobs(m.tokenizer, c.token_ids, c.logprobs or [], num_top)
                        if num_top is not None else None)
            choices.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=echoed + c.text),
                                      logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        body = ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                      usage=usage(len(ids), completion_tokens, out.num_cached_tokens),
                                      metrics=request_metrics(out.spec_decode_metrics),
                                      prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs))
        return JSONResponse(body_json(body, m))

    @staticmethod
    def _echoed(req: ChatCompletionRequest) -> str:
        """vLLM's `echo`: the final message's text, to go before the answer, where that message is the
        assistant's (the one continue_final_message continues); "" otherwise. It was accepted and ignored."""
        last = req.messages[-1]
        return last.text if req.echo and last.role == "assistant" else ""

    @staticmethod
    def _logprobs(tokenizer, token_ids: list[int], entries: list[PositionLogprobs],
                  num_top: int) -> ChatChoiceLogprobs:
        content = []
        for tid, entry in zip(token_ids, entries):
            if tid not in entry:
                continue
            s = token_str(tokenizer, tid, entry[tid].decoded_token)
            tops = sorted(((t, lp) for t, lp in entry.items() if lp.rank <= num_top), key=lambda x: x[1].rank)
            content.append(ChatTokenLogprob(
                token=s, logprob=entry[tid].logprob, bytes=list(tokenizer.token_bytes(tid, s)),
                top_logprobs=[ChatTopLogprob(token=(ts := token_str(tokenizer, t, lp.decoded_token)),
                                             logprob=lp.logprob, bytes=list(tokenizer.token_bytes(t, ts)))
                              for t, lp in tops[:num_top]]))
        return ChatChoiceLogprobs(content=content)

    async def _stream(self, m: ServedModel, req: ChatCompletionRequest, raw_request: Request, request_id: str, model: str,
                      prompt_len: int, gen: AsyncIterator[RequestDelta]) -> Response:
        first = await first_output(raw_request, gen)
        if first is None:
            return Response(status_code=499)
        created = int(time.time())
        n = req.n
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        sent = [0] * n           # tokens streamed per choice
        cached = 0
        spec = None              # the request's speculative decoding figures, once finished

        def chunk(choices: list[ChatStreamChoice], with_usage: bool, last: bool = False) -> str:
            # continuous usage: the chunk's choice's own count, as vLLM's; the final chunk: every choice's
            completion = sum(sent) if last or not choices else sent[choices[0].index]
            u = usage(prompt_len, completion, cached) if with_usage else None
            body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=u,
                                       metrics=request_metrics(spec) if last else None)
            return sse(body_json(body, m) if last else body.model_dump(exclude={"metrics"}))

        def deltas(out: RequestDelta) -> list[str]:
            """One chunk per choice the engine's delta touched: the delta is already only what is new."""
            nonlocal cached, spec
            cached = out.num_cached_tokens
            if out.spec_decode is not None:
                spec = out.spec_decode
            lines = []
            for c in out.outputs:
                sent[c.index] += len(c.token_ids)
                if not c.text and not c.token_ids and c.finish_reason is None:
                    continue
                logprobs = (self._logprobs(m.tokenizer, c.token_ids, c.logprobs or [], num_top)
                            if num_top is not None else None)
                lines.append(chunk([ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                     logprobs=logprobs, finish_reason=c.finish_reason,
                                                     stop_reason=c.stop_reason)], continuous))
            return lines

        async def body() -> AsyncIterator[str]:
            async with contextlib.aclosing(gen):
                try:
                    # OpenAI opens each choice with a role-only delta (with echo, the text echoed).
                    echoed = self._echoed(req)
                    for j in range(n):
                        yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content=echoed))],
                                    continuous)
                    for line in deltas(first):
                        yield line
                    async for out in gen:
                        for line in deltas(out):
                            yield line
                    if include_usage:
                        yield chunk([], True, last=True)
                except OpenAIError as e:
                    yield sse_error(e)
                yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")
