"""Per-request sampling parameters, with vLLM's names and defaults. Validation lives here so that the
offline API and the HTTP server reject the same inputs with the same messages."""
from __future__ import annotations

import logging
import numbers
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from kvserve.utils.value_checks import is_finite, is_int

logger = logging.getLogger(__name__)

# vLLM's thresholds: a temperature below SAMPLING_EPS means greedy, and one below MIN_TEMPERATURE is raised to it.
# Logits are divided by the temperature in float32: at 1e-39 the scale 1 / T is inf and the sampler refused the
# whole step (every request in it failed); from ~1e-8 down the scaled logits' rounding outgrows exp's range, and
# tokens of logprob -16 came out where the argmax was meant (at 1e-10, one a whole logit ahead never did).
SAMPLING_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
# The other ends, where float32 would round a valid value to one the sampler refuses (0 for 1 / T, or for top_p),
# taken to the nearest value that samples alike: past 1e30 every logit / T is ~1e-29 and the draw uniform either
# way; a top_p below the likeliest token's probability (at least 1 / vocabulary) keeps that token alone.
MAX_TEMPERATURE = 1e30
MIN_TOP_P = 1e-9
# Stops are checked for every sequence of the request at every step, inside the engine loop that every other
# request waits on: 20,000 stop strings (a 1 MB request) slowed two other streams from 1.1 s to 20 s, 200,000
# stop_token_ids with min_tokens to 14 s. Far above any real use (OpenAI's API takes 4 stop strings).
MAX_STOP_STRINGS = 256
MAX_N = 16384  # vLLM's default bound (VLLM_MAX_N_SEQUENCES): n of 10**30 made add_request build sequences until OOM
MAX_STOP_TOKEN_IDS = 1024
# The HTTP API's bound (a 64-bit signed seed); beyond it seeds wrapped modulo 2**64 and met other seeds' draws.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
_FLAG_FIELDS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16           # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0              # 0 (or below SAMPLING_EPS) means greedy
    top_p: float = 1.0
    top_k: int = 0                        # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0       # applies to prompt and output tokens (as in vLLM / HF)
    presence_penalty: float = 0.0         # apply to output tokens only (OpenAI semantics)
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None           # number of top alternatives; 0 = only the sampled token's
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):  # numpy scalars (np.int64(5), np.float32(0.5)) as the Python numbers they stand for
            v = getattr(self, f.name)
            if isinstance(v, numbers.Number) and not isinstance(v, (bool, int, float)):
                if isinstance(v, numbers.Integral):
                    setattr(self, f.name, int(v))
                elif isinstance(v, numbers.Real):
                    setattr(self, f.name, float(v))
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()
        if 0 < self.temperature < SAMPLING_EPS:
            self.temperature = 0.0
        elif 0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %g is below %g, where float32 logits / temperature lose precision; "
                           "sampling at %g (as vLLM does)", self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        self.temperature = min(self.temperature, MAX_TEMPERATURE)
        self.top_p = max(self.top_p, MIN_TOP_P)

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        for name in _FLAG_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise bad(name, f"must be True or False, got {getattr(self, name)!r}")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if self.n > MAX_N:
            raise bad("n", f"must be <= {MAX_N}, got {self.n}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        if not is_finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", f"must be -1 (disabled) or an integer >= 0, got {self.top_k!r}")
        if not is_finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        # At most the largest float: an int past it (10**400) had passed, then failed the whole step in the sampler.
        if not is_finite(self.repetition_penalty) or not 0 < self.repetition_penalty <= sys.float_info.max:
            raise bad("repetition_penalty", f"must be > 0 (and at most {sys.float_info.max:g}), got "
                                            f"{self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not is_finite(v) or not -2 <= v <= 2:
                raise bad(name, f"must be in [-2, 2], got {v!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise bad("logit_bias", f"must map token ids to biases, got {self.logit_bias!r}")
            for tok, b in self.logit_bias.items():
                if not is_int(tok) or tok < 0:
                    raise bad("logit_bias", f"keys must be token ids >= 0, got {tok!r}")
                if not is_finite(b) or not -100 <= b <= 100:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {b!r}")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise bad("seed", f"must be an integer in [-2**63, 2**63 - 1], got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or not 0 <= v <= 20):
                raise bad(name, f"must be an integer in [0, 20], got {v!r}")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be token ids >= 0")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
