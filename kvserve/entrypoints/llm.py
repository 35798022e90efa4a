"""The offline API: `LLM().generate(prompts, SamplingParams(...))`, as in vLLM."""
from __future__ import annotations

import dataclasses
import itertools
import numbers
from collections.abc import Iterable, Sequence as Seq
from dataclasses import fields
from typing import Any

from kvserve.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from kvserve.metrics.reader import Metric, engine_metrics
from kvserve.models.default import served_name
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.tokenizer.chat_messages import check_messages

# Text, token ids, or vLLM's TextPrompt / TokensPrompt dicts: {"prompt": text}, {"prompt_token_ids": ids}.
Prompt = str | list[int] | dict[str, Any]
Messages = list[dict[str, Any]]
_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _is_token_ids(prompt: Any) -> bool:
    """Whether prompt is one prompt's token ids: a list or tuple of integers (numpy's too), rather than a list
    of prompts. A tuple of ids had been taken as one-token prompts, each failing as "not iterable"."""
    return (isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], numbers.Integral)
            and not isinstance(prompt[0], bool))


def _as_engine_prompt(prompt: Prompt) -> str | list[int]:
    """What the engine takes: text, or token ids as a list (a dict prompt's too); a clear error for a dict of
    anything else (iterated as a list, its keys had reached the engine as token ids) and for what is neither
    text nor ids (bytes had been taken as ids, one per byte)."""
    if isinstance(prompt, dict):
        given = [k for k in _PROMPT_KEYS if k in prompt]
        other = sorted(set(prompt) - set(_PROMPT_KEYS))
        if len(given) != 1 or other:
            raise ValueError(f"a dict prompt holds exactly one of 'prompt' (text) or 'prompt_token_ids' (a list of "
                             f"token ids); got keys {sorted(prompt)}"
                             + (f" ({', '.join(other)} not supported)" if other else ""))
        value = prompt[given[0]]
        if (given[0] == "prompt") != isinstance(value, str):
            raise TypeError(f"a dict prompt's {given[0]!r} is {'text' if given[0] == 'prompt' else 'token ids'}, "
                            f"got {type(value).__name__}: {value!r:.80}")
        prompt = value
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise TypeError("a prompt is text, token ids or a dict, got bytes: decode it first")
    if hasattr(prompt, "tolist") and not isinstance(prompt, list):
        prompt = prompt.tolist()  # a numpy array or tensor of ids
    if isinstance(prompt, (str, list, tuple)):  # the engine checks the ids themselves
        return list(prompt) if isinstance(prompt, tuple) else prompt
    raise TypeError(f"a prompt is text, token ids (a list of ints) or a dict, got {type(prompt).__name__}: "
                    f"{prompt!r:.80}")


class LLM:
    """Generate for many prompts at once with continuous batching.

    LLM()                          the embedded default model (SmolLM2-135M-Instruct)
    LLM("path/to/hf_dir")          a Hugging Face directory with safetensors
    LLM("path/to/model.gguf")      a GGUF file
    Other keyword arguments are EngineConfig fields (dtype, block_size, max_num_seqs, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown LLM arguments: {sorted(unknown)}; see kvserve.EngineConfig")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> list[Metric]:
        """The engine's counters since it started and its gauges, named and labelled as the server's /metrics
        names them (kvserve:spec_decode_num_drafts, ...; accepted draft tokens by position as one Vector), as
        vLLM's LLM.get_metrics() returns its own. Request latency histograms are the server's alone."""
        return engine_metrics(self.engine.get_stats(), served_name(self.engine.config.model))

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
                 priority: Seq[int] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in the order given. A prompt is text, token ids (a list, a tuple, a numpy
        array or a tensor; a 2-D one is a prompt per row), or as in vLLM {"prompt": text} or
        {"prompt_token_ids": ids}."""
        if isinstance(prompts, (str, dict, bytes, bytearray, memoryview)):
            prompts = [prompts]  # a single prompt (bytes: refused by _as_engine_prompt, not iterated as ids)
        else:
            one_row = getattr(prompts, "ndim", None) == 1  # an array or tensor of one prompt's ids, of any type
            if hasattr(prompts, "tolist") and not isinstance(prompts, list):
                prompts = prompts.tolist()  # 1-D: one prompt, 2-D: one per row
            if one_row or _is_token_ids(prompts):
                prompts = [prompts]
        if not isinstance(prompts, Iterable):  # None and 5 failed as "object is not iterable", naming nothing
            raise TypeError(f"prompts must be a prompt (text, token ids, or a dict) or a list of them, got {prompts!r}")
        prompts = [_as_engine_prompt(p) for p in prompts]
        return self._run(prompts, sampling_params, priority, use_tqdm)

    def chat(self, messages: Messages | Seq[Messages],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of messages) or to several.
        continue_final_message: the model continues the last message (an assistant's start) instead of answering
        it; chat_template_kwargs: further variables for the template (vLLM's arguments of the same names)."""
        if continue_final_message and add_generation_prompt:  # as vLLM
            raise ValueError("continue_final_message cannot be true with add_generation_prompt true (the default): "
                             "set add_generation_prompt=False to continue the final message")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts: list[Prompt] = []
        texts: list[str] = []
        for conv in convs:
            texts.append(tok.apply_chat_template(check_messages(conv), add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message,
                                                 **(chat_template_kwargs or {})))
            # The template already has the special tokens it wants.
            prompts.append(tok.encode(texts[-1], add_special_tokens=False))
        outputs = self._run(prompts, sampling_params, None, use_tqdm)
        for out, text in zip(outputs, texts):
            out.prompt = text  # the rendered conversation, as vLLM reports it
        return outputs

    def _run(self, prompts: list[str | list[int]], sampling_params: Any, priority: Seq[int] | None,
             use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        if priority is not None and any(priority) and self.engine.config.scheduling_policy != "priority":
            # As vLLM: under fcfs they would be ignored without a word.
            raise ValueError("priority is given but scheduling_policy is fcfs: use LLM(..., "
                             "scheduling_policy=\"priority\") for it to order the requests")

        # Each distinct SamplingParams converted once for the call, so that a warning its conversion gives
        # (a temperature set below 0.01 after construction) is said once, not once per prompt.
        converted: dict[int, SamplingParams] = {}
        for sp in params:
            if isinstance(sp, SamplingParams) and id(sp) not in converted:
                converted[id(sp)] = dataclasses.replace(sp)
        params = [converted.get(id(sp), sp) for sp in params]
        engine = self.engine
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        try:
            for i, (rid, prompt, sp) in enumerate(zip(ids, prompts, params)):
                engine.add_request(rid, prompt, sp, priority=priority[i] if priority else 0)
        except Exception:
            engine.abort_request(ids)  # nothing of this call stays allocated
            raise

        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="Generating", unit="req", dynamic_ncols=True)
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request([r for r in ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in ids]
