"""Easy -> small routing for `model: "auto"`: a linear estimate, from the prompt's text alone, of how much
more often the large model answers it correctly than the small one.

Method. Each prompt becomes a sparse feature vector: a handful of shape features (length, digits, how many
numbers and how long the longest, arithmetic operators, quotes, capitals, commas) and its lower-cased
words, word pairs and number shapes ("3-digit number") hashed (CRC-32, so the same on every process and
run) into a fixed number of buckets. A ridge regression on those features predicts the *gain*
`correct(large) - correct(small)` in [-1, 1]; it was fitted by `benchmarks/auto_routing.py` on the training
split of its offline question set, where both models answered every question (greedy) and each answer was
checked against the reference. A request goes to the large model when its predicted gain reaches the
threshold. Ranking by gain rather than by "hardness" matters: a question both models fail is hard, yet sending
it to the large model buys nothing, so it stays on the small one. The alternative, a cascade on the small
model's own confidence in its answer, was measured on the same held-out questions and gained about half as
much over random routing, while it has to run the small model on every request first
(`benchmarks/results/auto_routing.md`).

The cost knob is the share of requests sent to the large model, `large_share` in [0, 1]: the shipped
parameters carry the quantiles of the predicted gain over the training prompts, and a share becomes the
threshold that sends that share of those prompts to the large model (a higher share never sends a prompt
back to the small one). On traffic unlike the training questions the share sent differs from the target.
A raw `threshold` on the predicted gain may be given instead; `threshold=0.0` sends to the large model
only where a gain is predicted. `prompt_text` is what the user asked: a completion's prompt, or a chat request's
last user message (the fit saw bare questions, not a chat template's markup).

Cost: pure Python (no torch, no numpy), reading at most the last `MAX_CHARS` characters of a prompt, so one
choice stays far below a decode step (about 20 us for a one-line question, a few hundred at most;
`benchmarks/results/auto_routing.md` measures it and `tests/test_auto_router.py` bounds it at 1 ms).
"""
from __future__ import annotations

import json
import math
import re
import zlib
from dataclasses import dataclass
from importlib import resources
from typing import Literal

# The router is fitted on short questions, and a long prompt's question is at its end: reading only the
# tail keeps a choice cheap whatever the prompt's length (~0.15 ms of CPU at 400 characters here).
MAX_CHARS = 400
_WORD = re.compile(r"[a-z]+|\d+|[^\sa-z\d]")
_NUMBER = re.compile(r"\d+")
_DIGIT = re.compile(r"\d")
_LETTER = re.compile(r"[^\W\d_]")
_UPPER = re.compile(r"[A-Z]")
_OPS = re.compile(r"\d\s*[-+*/x×]\s*\d")
DEFAULT_LARGE_SHARE = 0.3
PARAMS_FILE = "difficulty_params.json"

SHAPE_FEATURES = ("bias", "log_chars", "log_words", "digits", "numbers", "max_number_digits", "arith_op",
                  "quotes", "upper_share", "commas")


def shape_features(text: str) -> list[float]:
    """The dense features, in SHAPE_FEATURES order, each scaled to roughly [0, 1]."""
    # regexes rather than per-character Python loops: 10x faster on a long prompt
    numbers = _NUMBER.findall(text)
    letters = len(_LETTER.findall(text))
    return [1.0,
            math.log1p(len(text)) / 8.0,
            math.log1p(len(text.split())) / 6.0,
            min(len(_DIGIT.findall(text)), 40) / 10.0,
            min(len(numbers), 20) / 5.0,
            min(max((len(n) for n in numbers), default=0), 12) / 4.0,
            1.0 if _OPS.search(text) else 0.0,
            1.0 if ('"' in text or "'" in text) else 0.0,
            len(_UPPER.findall(text)) / letters if letters else 0.0,
            min(text.count(","), 20) / 5.0]


def hashed_tokens(text: str) -> list[str]:
    """Words, numbers as their shape ("#3" for a 3-digit number) and punctuation, then adjacent pairs."""
    toks = ["#" + str(len(t)) if t.isdigit() else t for t in _WORD.findall(text.lower())]
    return toks + [a + " " + b for a, b in zip(toks, toks[1:])]


def featurize(text: str, num_buckets: int) -> dict[int, float]:
    """Sparse vector: shape features at 0..len(SHAPE_FEATURES)-1, hashed tokens after them (present = 1)."""
    text = text[-MAX_CHARS:]
    vec = {i: v for i, v in enumerate(shape_features(text)) if v}
    base = len(SHAPE_FEATURES)
    for tok in hashed_tokens(text):
        vec[base + zlib.crc32(tok.encode("utf-8")) % num_buckets] = 1.0
    return vec


@dataclass
class DifficultyParams:
    """What `benchmarks/auto_routing.py` fits and ships as JSON beside this module."""
    num_buckets: int
    weights: list[float]            # len(SHAPE_FEATURES) + num_buckets
    gain_quantiles: list[float]     # predicted gain on the training prompts at 0%, 1%, ..., 100%

    @classmethod
    def load(cls, path: str | None = None) -> DifficultyParams:
        if path is None:
            raw = (resources.files("kvserve.gateway") / PARAMS_FILE).read_text(encoding="utf-8")
        else:
            with open(path, encoding="utf-8") as f:
                raw = f.read()
        d = json.loads(raw)
        p = cls(num_buckets=d["num_buckets"], weights=d["weights"], gain_quantiles=d["gain_quantiles"])
        assert len(p.weights) == len(SHAPE_FEATURES) + p.num_buckets, "weights do not match num_buckets"
        return p

    def to_json(self) -> dict:
        return {"num_buckets": self.num_buckets, "weights": self.weights, "gain_quantiles": self.gain_quantiles}

    def threshold_for_share(self, large_share: float) -> float:
        """The predicted gain above which `large_share` of the training prompts lie."""
        if not 0.0 <= large_share <= 1.0:
            raise ValueError(f"large_share must be in [0, 1], got {large_share}")
        if large_share == 0.0:
            return math.inf
        if large_share == 1.0:
            return -math.inf
        q = self.gain_quantiles
        pos = (1.0 - large_share) * (len(q) - 1)      # interpolate between the stored quantiles
        lo = int(pos)
        return q[lo] + (q[min(lo + 1, len(q) - 1)] - q[lo]) * (pos - lo)


class DifficultyRouter:
    """AutoRouter: "large" when the predicted gain of the large model over the small one reaches a threshold."""

    def __init__(self, params: DifficultyParams, *, large_share: float | None = DEFAULT_LARGE_SHARE,
                 threshold: float | None = None) -> None:
        self.params = params
        self.threshold = threshold if threshold is not None else params.threshold_for_share(
            DEFAULT_LARGE_SHARE if large_share is None else large_share)

    def predicted_gain(self, prompt_text: str) -> float:
        w = self.params.weights
        return sum(w[i] * v for i, v in featurize(prompt_text, self.params.num_buckets).items())

    def choose(self, prompt_text: str) -> Literal["small", "large"]:
        return "large" if self.predicted_gain(prompt_text) >= self.threshold else "small"


def load_default_router(large_share: float = DEFAULT_LARGE_SHARE) -> DifficultyRouter:
    """The router fitted on SmolLM2-135M-Instruct (small) vs Gemma 3 270M (large), sending about
    `large_share` of requests like the training questions to the large model."""
    return DifficultyRouter(DifficultyParams.load(), large_share=large_share)


__all__ = ["DifficultyParams", "DifficultyRouter", "load_default_router", "featurize"]
