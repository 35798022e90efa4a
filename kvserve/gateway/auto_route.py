"""`model: "auto"`: which of routing.auto's two models (small or large) answers a request.

The gateway takes any AutoRouter; `PromptLengthRouter` is the baseline it uses unless given another: long
prompts go to the large model. It costs a regular-expression pass over the text (microseconds), far under
one decode step, and needs no model: a length cut is the simplest difficulty signal there is (long
contexts ask more of a small model), and the reference any learned estimator must beat.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal, Protocol

AutoChoice = Literal["small", "large"]

# Words, numbers and single punctuation marks: close to a BPE tokenizer's count on English text
# (SmolLM2's tokenizer gives 1.0-1.3 tokens per such piece on prose and code).
_PIECES = re.compile(r"\w+|[^\w\s]")


class AutoRouter(Protocol):
    def choose(self, prompt_text: str) -> AutoChoice:
        """"small" or "large" for a request whose prompt (or chat messages, joined) reads prompt_text."""


def estimate_tokens(text: str) -> int:
    return len(_PIECES.findall(text))


class PromptLengthRouter:
    """Prompts of more than `threshold_tokens` tokens (estimated, or counted by `count_tokens`) go to the
    large model, the rest to the small one."""

    def __init__(self, threshold_tokens: int = 256, count_tokens: Callable[[str], int] | None = None) -> None:
        if threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be >= 0, got {threshold_tokens}")
        self.threshold_tokens = threshold_tokens
        self.count_tokens = count_tokens or estimate_tokens

    def choose(self, prompt_text: str) -> AutoChoice:
        return "large" if self.count_tokens(prompt_text) > self.threshold_tokens else "small"
