"""Pydantic models of OpenAI's request and response shapes, plus the extra sampling fields vLLM accepts.

Requests ignore unknown fields (OpenAI-style clients add their own) and reject NaN/inf. Integers that reach
the engine are bounded here so that no client value can overflow a tensor or a msgpack int downstream."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, WithJsonSchema, ConfigDict, Field, ValidationInfo, field_validator,
                      model_serializer, model_validator)

from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.chat_messages import CHAT_ROLES, NULL_CONTENT_ROLES, content_text

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Bounded so that anything passing validation fits the engine (torch seeds are 64-bit, msgpack ints too).
BoundedInt = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestBody(OpenAIBase):
    """A whole request body (not a part nested in one): checked once, with every string in it."""
    # Fields OpenAI documents as nullable ("integer or null") whose null means the default: dropped before
    # validation, as if left out (a client sending every field, unset ones as null, had got a 400 for n).
    NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_null_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(k, 0) is None for k in cls.NULL_IS_DEFAULT):
            return {k: v for k, v in data.items() if not (v is None and k in cls.NULL_IS_DEFAULT)}
        return data

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON may escape half of a UTF-16 pair ("\ud800") and Python decodes it into a str that no UTF-8
        # encoder takes: the tokenizer, the crash quarantine's digest and the error body itself raised (500s).
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where or 'the body'} holds an unpaired UTF-16 surrogate, which is not valid Unicode")
        return data


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string (or key) in a JSON value that UTF-8 cannot encode, else None."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            here = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and lone_surrogate(key) is not None:
                return f"{path} (a key)" if path else "a key"
            if (found := lone_surrogate(item, here)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := lone_surrogate(item, f"{path}.{i}" if path else str(i))) is not None:
                return found
    return None


class StreamOptions(OpenAIBase):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(RequestBody):
    """Fields shared by completions and chat. Defaults follow vLLM's OpenAI server."""
    model: str | None = None
    n: BoundedInt = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: BoundedInt | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: BoundedInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: BoundedInt = 0
    skip_special_tokens: bool = True
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    priority: BoundedInt = 0
    add_special_tokens: bool | None = None
    request_id: str | None = None
    # vLLM's field: only requests with the same salt share prefix-cache entries (e.g. one salt per tenant).
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # OpenAI's structured outputs: kvserve does not constrain what it samples, so anything but plain text is
    # refused (accepted and ignored, a JSON schema had come back as free text with a 200).
    response_format: dict[str, Any] | None = None
    # vLLM's: completions' choices[i].prompt_logprobs, chat's ChatCompletionResponse.prompt_logprobs.
    prompt_logprobs: BoundedInt | None = None

    # vLLM's request fields that constrain what is sampled, which kvserve does not implement. Unknown fields are
    # ignored, and these had been too: a client asking for one of two choices got free text with a 200.
    UNSUPPORTED_CONSTRAINTS: ClassVar[tuple[str, ...]] = (
        "allowed_token_ids", "bad_words", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "structured_outputs", "logits_processors")

    @model_validator(mode="before")
    @classmethod
    def _unsupported_constraints(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in cls.UNSUPPORTED_CONSTRAINTS:
                if data.get(key) not in (None, []):  # null or no tokens: a client sending every field
                    raise ValueError(f"{key} is not supported: kvserve does not constrain the tokens it samples "
                                     f"(structured outputs, allowed or banned tokens); leave {key} out")
        return data

    @model_validator(mode="after")
    def _supported(self) -> SamplingFields:
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format type {kind!r} is not supported: kvserve does not constrain its "
                             f"output to JSON or a schema (structured outputs); leave response_format out")
        if self.stream_options is not None and self.stream_options.model_fields_set and not self.stream:
            # as vLLM, which refuses a non-empty object
            raise ValueError("stream_options is only allowed with stream set to true")
        if self.prompt_logprobs and self.stream:  # as vLLM: they would have nowhere to go (they had been dropped)
            raise ValueError("prompt_logprobs is not returned in a streamed response")
        return self

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field (SamplingParams validates)."""
        bias: dict[int, float] | None = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids (integers as strings)") from None
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=bias,
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


# ---------------------------------------------------------------- completions

Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(SamplingFields):
    # max_tokens: 16, OpenAI's default, also for an explicit null (as vLLM's): null had meant the whole context.
    NULL_IS_DEFAULT = frozenset({"n", "max_tokens", "echo"})
    prompt: Prompt
    max_tokens: BoundedInt = 16
    echo: bool = False
    logprobs: BoundedInt | None = None
    suffix: str | None = None
    best_of: BoundedInt | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's Logprob: a token's log-probability at one prompt position, its rank (1: likeliest), its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's: where the request asked for prompt_logprobs (or echo with logprobs), per prompt token (None for the
    # first) the prompt's own token and the top ones, by token id. Not in streamed chunks, as in vLLM.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None  # OpenAI's field; null, as vLLM sends it
    # vLLM's per-request `metrics` (here its speculative_decoding part): in a body only where the server reports
    # them (--per-request-spec-decode-metrics; serving_base.body_json), null for n > 1 or several prompts.
    metrics: dict | None = None


# ---------------------------------------------------------------- chat

_CONTENT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": {
    "type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}}, "required": ["type", "text"]}}]}


class ChatMessage(OpenAIBase):
    role: Literal[CHAT_ROLES]  # type: ignore[valid-type]  # an unknown role is a 400 naming messages.N.role
    # A string, or OpenAI's list of content parts; only text parts are supported. Checked by hand so that a
    # bad part gives one error at messages.N.content rather than one per member of a Union.
    content: Annotated[Any, WithJsonSchema(_CONTENT_SCHEMA)] = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _check_content(cls, v: Any, info: ValidationInfo) -> Any:
        content_text(v)
        role = info.data.get("role")  # absent when the role itself was invalid (that error is reported)
        if v is None and role is not None and role not in NULL_CONTENT_ROLES:
            raise ValueError(f"content is required for role {role!r}")
        return v

    @property
    def text(self) -> str:
        return content_text(self.content) or ""


class ChatCompletionRequest(SamplingFields):
    NULL_IS_DEFAULT = frozenset({"n"})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: BoundedInt | None = None            # deprecated by OpenAI in favour of the next one
    max_completion_tokens: BoundedInt | None = None
    logprobs: bool | None = False
    top_logprobs: BoundedInt | None = None
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's tool calling: kvserve has no tool-call parser, so tools are refused unless tool_choice is "none"
    # (as vLLM refuses them without --enable-auto-tool-choice); they had been dropped with a 200.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None        # OpenAI's deprecated form of tools
    function_call: str | dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat_supported(self) -> ChatCompletionRequest:
        if self.tools and self.tool_choice != "none":
            raise ValueError("tools are not supported (kvserve has no tool-call parser): leave tools out, or set "
                             "tool_choice to \"none\" to have them ignored")
        if self.tool_choice not in (None, "none", "auto") and self.tools is None:
            raise ValueError("tool_choice names a tool choice, and no tools are given")
        if self.functions and self.function_call != "none":
            raise ValueError("functions are not supported (kvserve has no tool-call parser): leave functions out")
        if self.continue_final_message and self.add_generation_prompt:  # as vLLM
            raise ValueError("continue_final_message cannot be true with add_generation_prompt true (the default): "
                             "set add_generation_prompt to false to continue the final message")
        # What the template is rendered with already (kvserve/tokenizer/tokenizer.py): given twice, the render
        # raised a TypeError, reported as a problem with the messages.
        reserved = sorted({"messages", "add_generation_prompt", "continue_final_message", "bos_token", "eos_token"}
                          & set(self.chat_template_kwargs or {}))
        if reserved:
            raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)} (a field of its own, or the "
                             f"tokenizer's)")
        return self


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None  # OpenAI's field; null, as vLLM sends it
    metrics: dict | None = None  # as CompletionResponse.metrics
    # vLLM's, where the request asked for prompt_logprobs: per prompt token (None for the first) its own token
    # and the top ones, by token id; not streamed.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):  # OpenAI sends only the fields a delta carries
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None  # OpenAI's field; null, as vLLM sends it
    metrics: dict | None = None  # as CompletionResponse.metrics, in the final usage chunk only


# ---------------------------------------------------------------- models, tokenize

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
