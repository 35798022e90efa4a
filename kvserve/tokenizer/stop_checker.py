"""When a sequence stops: on a token (EOS, stop_token_ids, max_tokens) or on a stop string."""
from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from kvserve.sampling_params import SamplingParams


@dataclass
class StopMatch:
    stop: str
    start: int   # index of the stop string's first char in the text
    end: int     # index just past its last char


def find_stop_string(text: str, new_from: int, stops: list[str]) -> StopMatch | None:
    """The first stop string to complete in `text`, given that text[:new_from] was already checked.

    "First to complete" (smallest end, then smallest start) is what a char-by-char stream would see,
    so the result does not depend on how the text was split into tokens: with stops ["abc", "b"],
    "abc" stops at "b"."""
    best: StopMatch | None = None
    for stop in stops:
        # A match must end in the new text, so it starts at most len(stop)-1 chars before it.
        i = text.find(stop, max(0, new_from - len(stop) + 1))
        if i < 0:
            continue
        m = StopMatch(stop, i, i + len(stop))
        if best is None or (m.end, m.start) < (best.end, best.start):
            best = m
    return best


def partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string: the text a
    stream must hold back because the next token may complete the stop string.

    Only lengths n where the stop's n-th char is the text's last one can match, and str.rfind finds them
    at C speed. Trying every n, as before, took 116 ms a call for 1,000 random stop strings of 1,000 chars
    after 800 chars of text (this, 6 ms), at every step inside the engine loop, which every other request
    waits on."""
    if not text:
        return 0
    last, longest = text[-1], 0
    for stop in stops:
        end = min(len(stop) - 1, len(text))  # stop[:end]: the longest prefix that could be the tail
        while end > longest:
            i = stop.rfind(last, longest, end)  # the candidate n = i + 1, longest first
            if i < 0:
                break
            if text.endswith(stop[:i + 1]):
                longest = i + 1
                break
            end = i
    return longest


def check_token_stop(
    params: SamplingParams, output_token_ids: list[int], eos_token_ids: Collection[int]
) -> tuple[str, int | None] | None:
    """(finish_reason, stop_reason) once the last generated token ends the sequence, else None.

    vLLM's rules: nothing stops before min_tokens; EOS stops unless ignore_eos (stop_reason None); a
    stop_token_id stops with that id as stop_reason; then max_tokens gives "length"."""
    if not output_token_ids:
        return None
    return token_stop_after(params, len(output_token_ids), output_token_ids[-1], eos_token_ids)


def token_stop_after(params: SamplingParams, num_output_tokens: int, last: int,
                     eos_token_ids: Collection[int]) -> tuple[str, int | None] | None:
    """check_token_stop from the count and the last token alone: O(1) per token, whatever the length."""
    n = num_output_tokens
    if n < params.min_tokens:
        return None
    if not params.ignore_eos and last in eos_token_ids:
        return "stop", None
    if last in params.stop_token_ids:
        return "stop", last
    if params.max_tokens is not None and n >= params.max_tokens:
        return "length", None
    return None
