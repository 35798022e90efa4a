"""Speculative decoding's configuration: vLLM's field names, validated once, with messages a user can act on.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft", "num_speculative_tokens": 3}                   # the shipped draft of the default model
    {"method": "draft", "num_speculative_tokens": 3, "model": PATH}    # any draft sharing the target's tokenizer
                                                                       # (vLLM's "draft_model" is taken too)
    {"method": "eagle", "num_speculative_tokens": 1}                   # the head shipped for the default model
    {"method": "eagle", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
                                       # prompt lookup where the text repeats itself, the head elsewhere
    {"method": "eagle", "num_speculative_tokens": 3, "speculative_token_tree": "[(0,), (1,), (2,)]"}
                                       # the head's three likeliest first tokens, verified side by side
    {"method": "suffix", "num_speculative_tokens": 32}              # the sequence's own text and earlier
                                       # requests' responses, drafts as long as the match earns (suffix.py)
    {"method": "eagle", "num_speculative_tokens": 8, "enable_suffix_decoding": true}
                                       # suffix decoding in front of the head: where the text or an earlier
                                       # response matches, it drafts; the head drafts the others

    {"model": PATH, "num_speculative_tokens": 3}                     # no method: as vLLM, it follows from
                                       # model ("ngram", an eagle head's file, else a draft)
    {"method": "eagle", "num_speculative_tokens": 4,
     "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 4, 2], [5, 256, 0]]}
                                       # vLLM's schedule of the most draft tokens by batch size

given as `LLM(..., speculative_config={...})` or `kvserve serve --speculative-config '{...}'`. vLLM's fields for
the draft's placement and loading are taken where they mean something here (max_model_len, quantization,
enforce_eager, draft_tensor_parallel_size 1) and refused with the reason where they cannot (revision: no model
hub; a tensor-parallel draft).
"""
from __future__ import annotations

import ast
import json
import logging
import math
from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.utils.value_checks import is_int, is_number

logger = logging.getLogger(__name__)

METHODS = ("ngram", "draft", "eagle", "suffix")
MODEL_FREE = ("ngram", "suffix")  # methods that draft from text alone
# vLLM's name for a standalone draft model, so that a config written for vLLM runs unchanged.
METHOD_ALIASES = {"draft_model": "draft", "[ngram]": "ngram"}
NGRAM_MODELS = ("ngram", "[ngram]")  # vLLM's model for prompt lookup, which has none

# Above this many running sequences in a step (prefilling ones included), nobody drafts (vLLM's
# disable_by_batch_size); per method,
# measured on a quiet 2-core AVX-512 machine with every method's engine taking turns at each point
# (benchmarks/results/speculative.md, speculative_c2_c3.md; drafting in every step against none; runs of
# identical work differ by up to ~20% on this host, so read the trend, not single cells):
# - ngram, output tok/s: copies (acceptance ~0.72) 1.65x at 1 sequence, 1.26x at 2, 1.15x at 3, 1.04x at 4,
#   0.92x at 32; summaries (~0.58) 1.27x, 1.18x, 1.07x, 1.06x, 1.02x; open chat (~0.30) 1.04x at 1, 0.81-0.89x
#   at 2-4, 0.64x at 32. Good drafts pay up to about 4 sequences, none at 32, so 4; chat's loss at 2-4 is
#   what that costs (a per-request acceptance threshold for batched steps was tried and did not recover it:
#   a short answer's first drafts come before its acceptance is known).
# - draft (the shipped draft, acceptance 0.07-0.15): 0.64-0.73x at 1 and about 0.5x at 4 and 32, so it
#   drafts only for a lone sequence, where the per-request pause bounds the loss (0.86-0.95x).
# - eagle (the shipped head, acceptance ~0.2-0.3 per draft token): about 1.05x at 1 sequence, 0.70x drafting
#   every step at 4 (copies; benchmarks/results/speculative.md, git a18a5c7): a lone sequence only, as draft.
#   Still so with the head trained on a GPU (~0.44 on chat) and the per-step draft length deciding alone:
#   0.92x at 2 sequences, 0.96x at 4 (AVX2, benchmarks/results/speculative_eagle_unlimited_avx2.md).
# - On a real AVX2 CPU (Zen 3, 2 cores; benchmarks/results/speculative_avx2.md, git 2999fc8) a step is
#   compute-bound already at 4 sequences, and drafting all k tokens there lost on chat (ngram-fixed 0.82-0.84x
#   at 4); the per-step draft length (adaptive_draft_length, draft_length.py) recovers most of that (0.92-0.98x)
#   without a lower limit that would cost AVX-512 machines their gains at 2-4 sequences.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
DRAFT_DEFAULT_DISABLE_BY_BATCH_SIZE = 1  # methods "draft" and "eagle"


class _MethodDefault:
    """disable_by_batch_size not given: the method's default above. Not an int, so that no value a user passes
    (-1 included) is taken for "not given"."""

    def __repr__(self) -> str:
        return "<the method's default>"


_METHOD_DEFAULT = _MethodDefault()
SUFFIX_DEPTH = 24  # vLLM's suffix_decoding_max_tree_depth
MAX_CORPUS_TOKENS = 1 << 26  # suffix_decoding_corpus_tokens' bound: ~3 GiB of arrays when full


@dataclass
class SpeculativeConfig:
    # Not given: vLLM's rule, from model (_method_from_model).
    method: str | None = None
    # Not given: required, except for method "suffix" (the depth, as vLLM's).
    num_speculative_tokens: int | None = None
    # n-gram (prompt lookup): match the last n tokens, n from prompt_lookup_max down to prompt_lookup_min,
    # against the sequence's earlier tokens and propose what followed the most recent match. With method
    # "draft" or "eagle", given bounds turn lookup on in front of the model (uses_lookup).
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # draft: a Hugging Face directory or GGUF file of a small model with the target's vocabulary, or a
    # draft checkpoint made by train_draft.py (kvserve/spec_decode/draft_format.py). None: the draft shipped
    # for the default model.
    model: str | None = None
    # Per step: no drafting when more sequences than this are running, prefilling ones included (None: always
    # draft). Not given: the
    # method's measured default (DEFAULT_DISABLE_BY_BATCH_SIZE for ngram, DRAFT_DEFAULT_... for draft, eagle).
    disable_by_batch_size: int | None | _MethodDefault = _METHOD_DEFAULT
    # The same limit for drafts from the text (prompt lookup, suffix decoding): disable_by_batch_size where given
    # or for methods "ngram" and "suffix"; in front of a model, ngram's default (they are free to make, a
    # model's are not).
    lookup_disable_by_batch_size: int | None = field(default=None, init=False)
    # Per request: once at least acceptance_window draft tokens have been tested, a request whose recent
    # acceptance (accepted / tested, a moving average over about that many tokens) is below
    # min_acceptance_rate stops drafting for a while: 8 steps, doubling while it stays low. 0 disables it.
    # A draft's tokens are tested up to its first rejected one (draft_length.tested_tokens).
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 16
    # Per step: carry only as many of the num_speculative_tokens draft tokens as this engine's measured step
    # times and acceptance say pay (kvserve/spec_decode/draft_length.py); false drafts all of them.
    adaptive_draft_length: bool = True
    # vLLM's token tree, a list of node paths ("[(0,), (0, 0), (1,), (2,)]": the head's top token, its own top
    # token after it, and its second and third choices for the first). Here of one shape: a chain (0,),
    # (0, 0), ... of the head's top choices plus alternatives (1,), (2,), ... to the first token alone, the
    # shape that pays on a CPU (benchmarks/README.md). One node per draft token, so num_speculative_tokens ==
    # len(tree), as in vLLM. Method "eagle" only, greedy requests only (sampled ones draft the chain), and an
    # attention backend that takes tree rows (the CPU's and Triton's). None: a chain of num_speculative_tokens.
    speculative_token_tree: str | None = None
    # Method "suffix" (suffix.py; or enable_suffix_decoding, below), vLLM's fields and defaults: the longest
    # match looked for, in tokens (a match in earlier responses takes 3 at least); how many finished requests'
    # responses are kept to draft from (0: the sequence's own text only), and how many tokens they may hold
    # together (the oldest leave first; 46 MiB for 2**20, measured); a draft's most tokens per matched token;
    # and, for a draft from earlier responses, the least share of their longest matches that must agree with it
    # up to each of its tokens. Without num_speculative_tokens, the depth (as vLLM's).
    suffix_decoding_max_tree_depth: int = SUFFIX_DEPTH
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_corpus_tokens: int = 1 << 20
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Methods "draft" and "eagle": suffix decoding (with the fields above) in front of the model, in place of
    # prompt lookup, as Arctic Inference's field of this name puts it in front of its speculator (with method
    # "suffix" it changes nothing). Unlike Arctic's, any match drafts rather than the model (the draft-length
    # rule then keeps what pays, by each kind's acceptance), and its drafts are bounded by
    # num_speculative_tokens (a tree's chain), as prompt lookup's are.
    enable_suffix_decoding: bool = False
    # vLLM's schedule of draft lengths by batch size: [[first, last, k], ...], ranges of running sequences from 1
    # on; a gap, and the sizes past the last range, take the range before's k (vLLM's rule). k caps a step's draft
    # tokens a sequence, a tree's chain and alternatives together (the chain first), 0 drafts nothing; the
    # draft-length rule still cuts below it unless adaptive_draft_length is false. Without
    # disable_by_batch_size, the schedule alone says where drafting stops. On CUDA a verification step's rows
    # are padded to 1 + num_speculative_tokens for its graphs, so there a smaller k saves no step time (k = 0
    # does: such steps replay the decode graphs).
    num_speculative_tokens_per_batch_size: list[list[int]] | None = None
    # vLLM's fields for the draft itself. max_model_len: drafting stops where a sequence would pass this many
    # tokens (None: the engine's max_model_len; a draft model also stops at its own context length).
    max_model_len: int | None = None
    # Methods "draft" and "eagle": the draft's or head's weight format, kvserve's names ("auto": the file's own,
    # a GGUF's blocks kept, float weights as floats). None: int8 for a draft checkpoint and int4 for a head on a
    # CPU, floats on a GPU or under --quantization none; a Hugging Face or GGUF draft as the target is loaded.
    quantization: str | None = None
    # True: the eagle head drafts without CUDA graphs (the only draft kvserve runs in graphs; the target's steps
    # follow the engine's enforce_eager). False or None: the head follows the engine (graphs where it has its own).
    enforce_eager: bool | None = None
    # The draft runs in the engine's process, on its device: 1 (or None) only.
    draft_tensor_parallel_size: int | None = None
    # Hub revisions: drafts are local paths here, so only None.
    revision: str | None = None
    code_revision: str | None = None
    draft_depth: int = field(default=0, init=False)       # the chain's tokens
    num_alternatives: int = field(default=0, init=False)  # alternatives to its first token
    # The schedule as ((first batch size, k), ...), sorted: see draft_tokens_at.
    batch_schedule: tuple[tuple[int, int], ...] = field(default=(), init=False, repr=False)
    # num_speculative_tokens was not given: suffix decoding's depth stands for it (messages then name the depth).
    k_from_depth: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config: {name} {why}")

        if self.method is None:
            self.method = self._method_from_model(bad)
        if isinstance(self.method, str):  # a list or object would not hash: the message below says what is wanted
            self.method = METHOD_ALIASES.get(self.method, self.method)
        if self.method not in METHODS:
            raise bad("method", f"must be one of {', '.join(map(repr, METHODS))} ('draft_model' is taken for "
                                f"'draft'), got {self.method!r}")
        if self.method == "ngram" and self.model in NGRAM_MODELS:
            self.model = None
        if self.num_speculative_tokens is None:
            if self.method != "suffix":
                raise bad("num_speculative_tokens", "is required")
            # vLLM's default for suffix decoding: as many as the deepest match (its drafts are sized per match).
            self.num_speculative_tokens, self.k_from_depth = self.suffix_decoding_max_tree_depth, True
        k = self.num_speculative_tokens
        if not is_int(k) or k < 1:
            raise bad("suffix_decoding_max_tree_depth" if self.k_from_depth else "num_speculative_tokens",
                      f"must be an integer >= 1, got {k!r}")
        # Prompt lookup: method "ngram" always (2..4 unless given); "draft" and "eagle" where a bound is given,
        # and then first: a sequence whose last tokens occurred before drafts their continuation, the model
        # drafts the others (draft_length.py keeps the two kinds' acceptance apart).
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not is_int(v) or v < 1):
                raise bad(name, f"must be an integer >= 1, got {v!r}")
        if lo is None and hi is None and self.method == "ngram":
            lo, hi = 2, 4
        e = self.enable_suffix_decoding
        if not isinstance(e, bool):
            raise bad("enable_suffix_decoding", f"must be true or false, got {e!r}")
        if e and self.method == "ngram":
            raise bad("enable_suffix_decoding", "puts suffix decoding in front of methods 'draft' and 'eagle' (method "
                                                "'suffix' is suffix decoding alone), got method 'ngram'")
        if self.suffix_decoding and (lo is not None or hi is not None):
            raise bad("prompt_lookup_min/prompt_lookup_max", "do not apply with suffix decoding, which matches up to "
                      "suffix_decoding_max_tree_depth tokens in place of prompt lookup")
        if lo is not None or hi is not None:
            # One bound given: the other defaults to it (a single n), as vLLM does.
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            if lo > hi:
                raise bad("prompt_lookup_min", f"({lo}) must be <= prompt_lookup_max ({hi})")
        self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        if self.model is not None and (self.method in MODEL_FREE or not isinstance(self.model, str) or not self.model):
            raise bad("model", "must be a path (a string), and applies only to methods 'draft' and 'eagle'")
        if self.num_speculative_tokens_per_batch_size is not None:
            self.batch_schedule = self._parse_schedule(bad)
        given = self.disable_by_batch_size is not _METHOD_DEFAULT
        if not given and self.batch_schedule:  # the schedule says where drafting stops
            self.disable_by_batch_size = None
        elif not given:
            self.disable_by_batch_size = (DEFAULT_DISABLE_BY_BATCH_SIZE if self.method in MODEL_FREE
                                          else DRAFT_DEFAULT_DISABLE_BY_BATCH_SIZE)
        self.lookup_disable_by_batch_size = (self.disable_by_batch_size
                                             if given or self.method in MODEL_FREE or self.batch_schedule
                                             else DEFAULT_DISABLE_BY_BATCH_SIZE)
        b = self.disable_by_batch_size
        if b is not None and (not is_int(b) or b < 1):
            raise bad("disable_by_batch_size", f"must be an integer >= 1 or null, got {b!r}")
        r = self.min_acceptance_rate
        if not is_number(r) or not 0 <= r <= 1:
            raise bad("min_acceptance_rate", f"must be in [0, 1], got {r!r}")
        if not is_int(self.acceptance_window) or self.acceptance_window < 1:
            raise bad("acceptance_window", f"must be an integer >= 1, got {self.acceptance_window!r}")
        if not isinstance(self.adaptive_draft_length, bool):
            raise bad("adaptive_draft_length", f"must be true or false, got {self.adaptive_draft_length!r}")
        self._check_suffix(bad)
        self._check_draft_fields(bad)
        self.draft_depth, self.num_alternatives = k, 0
        if self.speculative_token_tree is not None:
            self.draft_depth, self.num_alternatives = self._parse_tree(bad)
            if self.matches_text and self.draft_depth == 1:  # allowed, but rarely what was meant
                logger.warning("speculative_token_tree %s has a chain of one token, and drafts from the text "
                               "(prompt lookup, suffix decoding) are as long as the chain: one token each. A longer "
                               "chain lets them run on; the draft-length rule cuts the head's chain to what pays",
                               self.speculative_token_tree)

    def _method_from_model(self, bad) -> str:
        """vLLM's rule where method is not given: model "ngram" (or "[ngram]") is prompt lookup, a path a draft
        (here: the eagle head its file holds, else a draft model)."""
        m = self.model
        if m is None:
            raise bad("method", "is required (or model: a draft's path, the method following from what it holds)")
        if m in NGRAM_MODELS:
            return "ngram"  # model cleared below, as where method "ngram" is given with it
        if isinstance(m, str):
            from kvserve.spec_decode.eagle_head import is_head_file  # reads the file's metadata only
            return "eagle" if is_head_file(m) else "draft"
        return "draft"  # the check of model names what is wrong with it

    def _parse_schedule(self, bad) -> tuple[tuple[int, int], ...]:
        """num_speculative_tokens_per_batch_size as ((first batch size, k), ...), by first size, checked as vLLM
        checks it: ranges of positive sizes that do not overlap, the first from 1, k >= 0."""
        name, entries = "num_speculative_tokens_per_batch_size", self.num_speculative_tokens_per_batch_size
        form = "[first batch size, last batch size, k]"
        if not isinstance(entries, (list, tuple)) or not entries:
            raise bad(name, f"must be a non-empty list of {form} entries, got {entries!r}")
        ranges = []
        for e in entries:
            if isinstance(e, (list, tuple)) and len(e) == 5:
                raise bad(name, f"entries with context ranges (5 items) are not supported; give {form}, got {e!r}")
            if not (isinstance(e, (list, tuple)) and len(e) == 3 and all(is_int(v) for v in e)):
                raise bad(name, f"entries must be {form}, integers, got {e!r}")
            lo, hi, k = e
            if not 1 <= lo <= hi or k < 0:
                raise bad(name, f"entry {list(e)} needs 1 <= first <= last and k >= 0")
            ranges.append((lo, hi, k))
        ranges.sort()
        for (_, hi, _), (lo, _, _) in zip(ranges, ranges[1:]):
            if lo <= hi:
                raise bad(name, f"batch-size ranges must not overlap: one ends at {hi}, another starts at {lo}")
        if ranges[0][0] != 1:
            raise bad(name, f"the first range must start at batch size 1 (every batch size needs a k), got "
                            f"{ranges[0][0]}")
        if over := sorted({k for *_, k in ranges if k > self.num_speculative_tokens}):  # vLLM cuts them silently
            logger.warning("num_speculative_tokens_per_batch_size: k %s above num_speculative_tokens (%d) is taken "
                           "as %d", "/".join(map(str, over)), self.num_speculative_tokens, self.num_speculative_tokens)
        return tuple((lo, k) for lo, _, k in ranges)

    def _check_draft_fields(self, bad) -> None:
        """vLLM's fields for the draft's placement and loading: taken where they apply here, refused otherwise."""
        from kvserve.config import QUANTIZATIONS  # kvserve.config imports this module
        n = self.max_model_len
        if n is not None and (not is_int(n) or n < 1):
            raise bad("max_model_len", f"must be an integer >= 1 or null, got {n!r}")
        q = self.quantization
        if q is not None:
            if q not in QUANTIZATIONS:
                raise bad("quantization", f"is the draft's weight format, one of {', '.join(map(repr, QUANTIZATIONS))} "
                                          f"(a GGUF draft's own blocks are kept under 'auto'), got {q!r}")
            if self.method in MODEL_FREE:
                raise bad("quantization", f"applies to methods 'draft' and 'eagle' (a model's weights), got method "
                                          f"{self.method!r}")
        if self.enforce_eager is not None and not isinstance(self.enforce_eager, bool):
            raise bad("enforce_eager", f"must be true, false or null, got {self.enforce_eager!r}")
        tp = self.draft_tensor_parallel_size
        if tp is not None and (not is_int(tp) or tp != 1):
            raise bad("draft_tensor_parallel_size", f"must be 1: the draft runs in the engine's process, on its "
                                                    f"device (kvserve has no tensor parallelism), got {tp!r}")
        for name in ("revision", "code_revision"):
            if getattr(self, name) is not None:
                raise bad(name, "does not apply: kvserve loads a draft from a local path (there is no model hub to "
                                "take a revision from); pass that revision's directory or file as model")

    def draft_tokens_at(self, batch_size: int) -> int:
        """The most draft tokens a sequence carries in a step of batch_size running sequences, a tree's chain and
        alternatives together: num_speculative_tokens, or the schedule's k for that size (a gap, and the sizes past
        the last range, take the range before's k), at most num_speculative_tokens (vLLM's rule)."""
        k = self.num_speculative_tokens
        for first, scheduled in self.batch_schedule:
            if first > batch_size:
                break
            k = min(scheduled, self.num_speculative_tokens)
        return k

    def drafting_seqs(self, max_num_seqs: int) -> int:
        """How many sequences a step may draft for, at most max_num_seqs: what the verification graphs and a GPU's
        profiled worst-case step are sized by (0: a schedule that never drafts)."""
        most = self.max_drafting_seqs
        return max_num_seqs if most is None else min(most, max_num_seqs)

    def _parse_tree(self, bad) -> tuple[int, int]:
        """(chain depth, alternatives) of speculative_token_tree, or a ValueError saying what is supported."""
        text = self.speculative_token_tree
        shape = ("a chain of top choices (0,), (0, 0), ... and alternatives (1,), (2,), ... to the first token, "
                 "e.g. \"[(0,), (1,), (2,)]\"")
        try:
            nodes = ast.literal_eval(text) if isinstance(text, str) else None
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):  # e.g. "{[0]: 1}": TypeError
            nodes = None
        if (not isinstance(nodes, (list, tuple)) or not nodes
                or not all(isinstance(n, tuple) and n and all(is_int(i) and i >= 0 for i in n) for n in nodes)):
            raise bad("speculative_token_tree", f"must be a string listing node paths as tuples of indices, "
                                                f"e.g. \"[(0,), (1,), (2,)]\", got {text!r}")
        depth = sum(1 for n in nodes if all(i == 0 for i in n))
        alternatives = len(nodes) - depth
        expected = {(0,) * d for d in range(1, depth + 1)} | {(i,) for i in range(1, alternatives + 1)}
        # len(nodes) == len(expected), so equal sets also rule out repeated nodes.
        if depth == 0 or set(nodes) != expected:
            raise bad("speculative_token_tree", f"{text!r} is not of the supported shape: {shape}")
        if alternatives and self.method != "eagle":
            raise bad("speculative_token_tree", f"alternatives to the first token need method 'eagle' (the "
                                                f"head's next choices), got method {self.method!r}")
        # Checked last: a count that suffix decoding defaulted hid the reasons above.
        k = self.num_speculative_tokens
        if len(nodes) != k:
            defaulted = " (method 'suffix' defaults it to suffix_decoding_max_tree_depth)" if self.k_from_depth else ""
            raise bad("speculative_token_tree", f"has {len(nodes)} nodes; num_speculative_tokens must equal that "
                                                f"(one draft token a node), got {k}{defaulted}")
        return depth, alternatives

    def _check_suffix(self, bad) -> None:
        if not self.suffix_decoding:
            given = [f.name for f in fields(self) if f.name.startswith("suffix_decoding_")
                     and getattr(self, f.name) != f.default]
            if given:
                raise bad(given[0], f"applies only to method 'suffix', or to 'draft' and 'eagle' with "
                                    f"enable_suffix_decoding, got method {self.method!r}")
            return
        d, r = self.suffix_decoding_max_tree_depth, self.suffix_decoding_max_cached_requests
        f, p = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if not is_int(d) or d < 1:
            raise bad("suffix_decoding_max_tree_depth", f"must be an integer >= 1, got {d!r}")
        if not is_int(r) or r < 0:
            raise bad("suffix_decoding_max_cached_requests", f"must be an integer >= 0, got {r!r}")
        t = self.suffix_decoding_corpus_tokens
        if not is_int(t) or not 1 <= t <= MAX_CORPUS_TOKENS:
            raise bad("suffix_decoding_corpus_tokens", f"must be an integer in [1, {MAX_CORPUS_TOKENS}] (2**20 "
                                                       f"take 46 MiB), got {t!r}")
        if not is_number(f) or not 0 < f < math.inf:
            raise bad("suffix_decoding_max_spec_factor", f"must be a finite number > 0, got {f!r}")
        if not is_number(p) or not 0 <= p <= 1:
            raise bad("suffix_decoding_min_token_prob", f"must be in [0, 1], got {p!r}")

    @property
    def uses_lookup(self) -> bool:
        """Prompt lookup: method "ngram", or in front of a draft model or eagle head."""
        return self.prompt_lookup_max is not None

    @property
    def suffix_decoding(self) -> bool:
        """Suffix decoding (suffix.py): method "suffix", or in front of a draft model or eagle head."""
        return self.method == "suffix" or self.enable_suffix_decoding

    @property
    def matches_text(self) -> bool:
        """Whether drafts come from matching the sequence's text (prompt lookup, or suffix decoding)."""
        return self.uses_lookup or self.suffix_decoding

    @property
    def max_drafting_seqs(self) -> int | None:
        """The most sequences a step may draft for (None: no limit): what verification graphs are captured up to."""
        limits = [self.disable_by_batch_size] + ([self.lookup_disable_by_batch_size] if self.matches_text else [])
        most = None if None in limits else max(limits)
        schedule = self.batch_schedule
        if schedule and schedule[-1][1] == 0:  # the schedule drafts nothing from some size on
            j = len(schedule) - 1
            while j > 0 and schedule[j - 1][1] == 0:
                j -= 1
            last = schedule[j][0] - 1  # 0 where it never drafts
            most = last if most is None else min(most, last)
        return most

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """From a dict or its JSON text; unknown keys are errors (a typo must not silently disable speculation)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        known = [f.name for f in fields(cls) if f.init]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {unknown}; known: {known}")
        return cls(**value)
