"""POST /v1/completions: text or token-id prompts (one or several), n samples each, streamed or not,
with OpenAI's legacy logprobs format (tokens, token_logprobs, top_logprobs, text_offset) and echo."""
from __future__ import annotations

import codecs
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.entrypoints.openai.errors import OpenAIError, bad_request
from kvserve.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from kvserve.entrypoints.openai.serving_base import (
    ClientDisconnected,
    OpenAIServing,
    body_json,
    first_output,
    merge,
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


def _prompt_text(req: CompletionRequest) -> str:
    """The text `model: "auto"` judges: the prompt, or the prompts joined. Token ids belong to one model's
    vocabulary, so they cannot be judged (nor sent to either model) without naming the model."""
    p = req.prompt
    items = [p] if isinstance(p, str) else list(p or [])
    if not all(isinstance(item, str) for item in items):
        raise bad_request("model `auto` needs a text prompt: token ids belong to one model's vocabulary; "
                          "name the model", "prompt")
    return "\n".join(items)


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, req: CompletionRequest, raw_request: Request) -> Response:
        m = self.resolve(req.model, lambda: _prompt_text(req))
        model = self.response_model_name(req.model, m)
        if req.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (best-of selection is not supported)", "best_of")
        prompts = await self._prompts(m, req)
        if req.echo and req.logprobs is not None:
            prompt_logprobs = req.prompt_logprobs if req.prompt_logprobs is not None else req.logprobs
        else:  # streamed, they have nowhere to go: none asked of the engine (they skip the prefix cache)
            prompt_logprobs = None if req.stream else req.prompt_logprobs
        params = []
        for _, ids in prompts:
            self.check_prompt(m, ids)
            max_tokens = self.resolve_max_tokens(m, len(ids), req.max_tokens)
            params.append(self.sampling_params(m, req, max_tokens, req.logprobs, prompt_logprobs))
        self.check_admission(m, len(prompts), req.priority, req.n)

        request_id = req.request_id or random_id("cmpl")
        gens = [self.generate(m, raw_request, ids, p, req.priority, f"{request_id}-{i}", req.cache_salt)
                for i, ((_, ids), p) in enumerate(zip(prompts, params))]
        merged = merge(gens)
        if req.stream:
            return await self._stream(m, req, raw_request, request_id, model, prompts, merged)

        # The engine sends each step's additions; the whole answer is assembled here, once.
        accs = [RequestOutputAccumulator(f"{request_id}-{i}", text, ids, req.n, req.logprobs is not None)
                for i, (text, ids) in enumerate(prompts)]

        async def collect() -> list[RequestOutput]:
            async with contextlib.aclosing(merged):
                async for i, delta in merged:
                    accs[i].add(delta)
            return [acc.output for acc in accs]

        try:
            finals = await until_disconnected(raw_request, collect())
        except ClientDisconnected:
            return Response(status_code=499)
        choices: list[CompletionChoice] = []
        prompt_tokens = completion_tokens = cached = 0
        for (text, ids), out in zip(prompts, finals):
            prompt_tokens += len(ids)
            cached += out.num_cached_tokens
            prompt_text = text if text is not None else m.tokenizer.decode(ids, skip_special_tokens=False)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if req.logprobs is not None:
                    tok_ids, entries = list(c.token_ids), list(c.logprobs or [])
                    if req.echo:
                        tok_ids = ids + tok_ids
                        entries = list(out.prompt_logprobs or [None] * len(ids)) + entries
                    logprobs = self._logprobs(m.tokenizer, tok_ids, entries, TextOffsets())
                choices.append(CompletionChoice(
                    index=len(choices), text=(prompt_text if req.echo else "") + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs)))
        body = CompletionResponse(id=request_id, model=model, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens, cached),
                                  metrics=request_metrics(finals[0].spec_decode_metrics) if len(finals) == 1 else None)
        return JSONResponse(body_json(body, m))

    async def _prompts(self, m: ServedModel, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """[(text or None, token ids)] for each prompt of the request."""
        p = req.prompt
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        out = []
        for item in items:
            if isinstance(item, str):
                out.append((item, await self.encode(m, item, add_special)))
            else:
                out.append((None, list(item)))
        return out

    @staticmethod
    def _logprobs(tokenizer, token_ids: list[int], entries: list[PositionLogprobs | None],
                  offsets: TextOffsets) -> CompletionLogprobs:
        result = CompletionLogprobs()
        for tid, entry in zip(token_ids, entries):
            if entry is None or tid not in entry:
                s = token_str(tokenizer, tid, None)
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
            else:
                s = token_str(tokenizer, tid, entry[tid].decoded_token)
                result.token_logprobs.append(entry[tid].logprob)
                result.top_logprobs.append({token_str(tokenizer, t, lp.decoded_token): lp.logprob
                                            for t, lp in entry.items()})
            result.tokens.append(s)
            result.text_offset.append(offsets.advance(tokenizer, tid, s))
        return result

    async def _stream(self, m: ServedModel, req: CompletionRequest, raw_request: Request, request_id: str, model: str,
                      prompts: list[tuple[str | None, list[int]]],
                      merged: AsyncIterator[tuple[int, RequestDelta]]) -> Response:
        first = await first_output(raw_request, merged)
        if first is None:
            return Response(status_code=499)
        created = int(time.time())
        n = req.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and bool(req.stream_options.continuous_usage_stats)
        sent_tokens = [[0] * n for _ in prompts]     # tokens streamed per (prompt, completion)
        # Per (prompt, completion), carried from chunk to chunk: the same text_offsets as the whole answer's. (Each
        # chunk's had started at the length of the text sent before it, as vLLM's, and within it counted the tokens'
        # strings: with several tokens a chunk, a speculative step's, the offsets ran ahead and went back.)
        offsets = [[TextOffsets() for _ in range(n)] for _ in prompts]
        echoed = [[False] * n for _ in prompts]
        prompt_lps: list[list[PositionLogprobs | None] | None] = [None] * len(prompts)
        prompt_tokens = [len(ids) for _, ids in prompts]
        cached = [0] * len(prompts)
        spec = [None] * len(prompts)                 # each prompt's speculative decoding figures, once finished

        def usage_now() -> UsageInfo:
            completion = sum(sum(row) for row in sent_tokens)
            return usage(sum(prompt_tokens), completion, sum(cached))

        def chunks(i: int, delta: RequestDelta) -> list[str]:
            """One SSE chunk per sample this delta touched: the delta is already only what is new."""
            lines = []
            cached[i] = delta.num_cached_tokens
            if delta.spec_decode is not None:
                spec[i] = delta.spec_decode
            if delta.prompt_logprobs is not None:  # the request's first delta
                prompt_lps[i] = delta.prompt_logprobs
            text, ids = prompts[i]
            for c in delta.outputs:
                j = c.index
                delta_text, new_ids, new_lps = c.text, c.token_ids, c.logprobs or []
                if req.echo and not echoed[i][j]:
                    echoed[i][j] = True
                    prompt_text = text if text is not None else m.tokenizer.decode(ids, skip_special_tokens=False)
                    delta_text = prompt_text + delta_text
                    new_ids = ids + new_ids
                    new_lps = list(prompt_lps[i] or [None] * len(ids)) + new_lps
                sent_tokens[i][j] += len(c.token_ids)
                if not delta_text and not new_ids and c.finish_reason is None:
                    continue
                logprobs = None
                if req.logprobs is not None:
                    logprobs = self._logprobs(m.tokenizer, new_ids, new_lps, offsets[i][j])
                chunk = CompletionResponse(
                    id=request_id, created=created, model=model,
                    choices=[CompletionChoice(index=i * n + j, text=delta_text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)],
                    # continuous usage: this choice's own counts, as vLLM's (the final chunk has the totals)
                    usage=usage(prompt_tokens[i], sent_tokens[i][j], cached[i]) if continuous else None)
                lines.append(sse(chunk.model_dump(exclude={"metrics": True,
                                                           "choices": {"__all__": {"prompt_logprobs"}}})))
            return lines

        async def body() -> AsyncIterator[str]:
            async with contextlib.aclosing(merged):
                try:
                    for line in chunks(*first):
                        yield line
                    async for i, out in merged:
                        for line in chunks(i, out):
                            yield line
                    if include_usage:
                        final = CompletionResponse(
                            id=request_id, created=created, model=model, choices=[], usage=usage_now(),
                            metrics=request_metrics(spec[0]) if len(prompts) == 1 else None)
                        yield sse(body_json(final, m))
                except OpenAIError as e:
                    yield sse_error(e)
                yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")


class TextOffsets:
    """OpenAI's text_offset: where each token's text starts in the choice's text (the echoed prompt's first), in
    characters. A character split across tokens (an emoji, a CJK character: each part alone decodes to U+FFFD)
    counts once, when its last byte comes, so the token that finishes it starts at it. Held across a stream's
    chunks, it gives the offsets of the whole answer however the tokens were grouped."""

    def __init__(self) -> None:
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # holds a split character's first bytes

    def advance(self, tokenizer, token_id: int, text: str) -> int:
        start = self.chars
        if "\ufffd" not in text and not self._utf8.getstate()[0]:  # whole characters, none waiting: the common case
            self.chars += len(text)
        else:
            self.chars += len(self._utf8.decode(tokenizer.token_bytes(token_id, text)))
        return start
