"""How many draft tokens a step should carry: as many as pay, judged by this engine's own step times.

Whether a verified draft token pays depends on the machine as much as on the drafts. Where a step is
memory-bound (AVX-512 VNNI, a GPU at small batch) an extra row costs almost nothing; where the matmuls are
compute-bound (two AVX2 cores: a 5-row verification step took about twice a 1-row decode step) it costs a
quarter of a decode step. A crossover batch size measured on one machine is wrong on the next: drafting
all 4 tokens below disable_by_batch_size 4, measured on AVX-512, lost 16-18% on open chat at 4 sequences on
AVX2 (benchmarks/results/speculative_avx2.md, speculative_adaptive_avx2.md).

So the engine times its forward steps by the number of tokens they carry (StepTimes) and the outcome of
every draft position (DraftLength.record), and before each step picks how many of its draft tokens each
sequence r keeps, d_r, to maximise the expected tokens per second:

    rate = (n + sum_r E_r(d_r)) / (t(run(n, sum_r d_r)) + max_r d_r * t_draft)

n: the step's tokens without drafts; run(n, D): the tokens the step will run with D draft tokens, n + D
unless CUDA graphs pad it to a captured shape (StepTokens); E_r(d): sequence r's expected accepted tokens
among its first d drafts (from the acceptance at each draft position so far among drafts of r's draft's
class, scaled by r's own recent acceptance against the average); t(T): the measured time of a step that ran
T tokens; t_draft: the model's measured time per draft position (the draft model's or eagle head's), the
max over the sequences it drafts for (prompt lookup's drafts cost nothing to make). A draft token is
accepted only with all before it, so its expected gain is at most that of the one before it: the best step
with T draft tokens keeps the T of highest gain over all sequences, and the rule takes the T of the highest
rate. It is SmartSpec's (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language
Models Using Goodput") with costs measured, not modelled, and a length per sequence rather than one for
the step: a copy in a long match drafts while a chat beside it does not.

A draft's class says how far to trust it before it is verified: for prompt lookup, the length of the
n-gram its continuation follows (replayed on the default model's copies, a 4-token draft after a 4-gram
had 3.2 tokens accepted on average, after a single token 0.6), for a model's drafts MODEL_CLASS (0), or
TREE_CLASS for a greedy request's eagle draft of more than one token (below). Acceptance
by position is kept per class, so a step drafts long after a long match and little or nothing after a
short one. It is kept as the rate at which token i is accepted where all before it were: a position not
yet drafted in a class is assumed to continue at the rate of the last one that was (the first at 1.0, so
drafting gets tried). Starting every position at 1.0 instead promised that a class whose first token was
accepted half the time would keep all later tokens whenever it kept the first. A position's first outcomes
count as in a mean with PRIOR_OUTCOMES outcomes at that prior, then as a moving average: a class seen a few
times (suffix decoding's) learns its rate in a few drafts.

A step whose size without drafts was never measured goes without drafts, to measure it; unmeasured sizes
with drafts are estimated from the nearest measured ones (optimistically flat above the largest when only
one is known), so drafting is tried and then measured. Every so often a decision starts a probe: the
next PROBE_RUN decisions keep one draft token more than the best, to keep the estimates for the next
length current. Probes are spaced so that they cost about PROBE_COST of the best rate (every PROBE_EVERY-th
decision where that length is estimated close to the best, further apart below it; one decision every
MAX_AGE-th where it is estimated at under half the best rate), and a step size not seen for MAX_AGE steps is
forgotten, so a length that stopped paying is estimated afresh and tried again. A probe is a run, not one
step, so that it times the length as it runs, not only the step that switches to it (StepTimes). Where the
best keeps none of a model's tokens, a probe adds the model's first one.

A greedy request's eagle draft of more than one token (TREE_CLASS: a chain, with alternatives to its first
token where the config has a token tree) is judged here like a chain, which says whether the head should draft
at all; which of its rows a step keeps is decided once they are drafted, by the head's confidence in each
(`best_row_count`, confidence.py).
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable

_TIME_WEIGHT = 0.2        # moving-average weight of a new step time
POSITION_WEIGHT = 1 / 32  # ... of one draft's outcome at a position, once the position has seen enough of them
# A class's first outcomes at a position weigh as in a mean with this many prior outcomes at its prior rate, until
# that weight falls to POSITION_WEIGHT: a class seen a few times (suffix decoding's ~45 match lengths) learns its
# rate in a few drafts instead of ~32.
PRIOR_OUTCOMES = 2
MODEL_CLASS = 0           # a draft model's or eagle head's drafts (a greedy eagle tree's: TREE_CLASS); lookup: n >= 1
# A greedy request's eagle draft as a token tree: with alternatives to its first token where the config has them,
# or with the rule a chain of k > 1, the rows sized by the head's confidence (speculator.py).
TREE_CLASS = -1
PROBE_EVERY = 16
PROBE_RUN = 3              # decisions a probe lasts: its first step follows another size, the others time it as it runs
PROBE_MIN_RATE = 0.5       # below this share of the best rate, a length is probed every MAX_AGE decisions
PROBE_COST = 0.01          # above it, runs are spaced to cost this share of the best rate on average
MAX_AGE = 256              # steps
_CALIBRATION_WEIGHT = 1 / 64  # per decision, of the expected and accepted tokens behind `gain_scale`
_CALIBRATION_PRIOR = 4.0      # tokens added to each side: scale 1 before any draft, and never 0 after

# (sequences, tokens without drafts, draft tokens) -> the tokens the step will run, what StepTimes keys its time
# by. Its own tokens where steps run as they come; a captured graph's padded shape on a GPU, where a step
# with any draft runs every row at full width, so a step's cost jumps at the first draft token and then stays
# flat, which interpolating between token counts would not guess.
StepTokens = Callable[[int, int, int], int]


def tested_tokens(num_drafted: int, num_accepted: int) -> int:
    """The draft tokens a verification tested: each up to the first rejected one. Those after it were never
    judged on their own (a token is accepted only with all before it), so an acceptance rate that counts them
    as rejected falls with the draft's length: a 16-token draft rejected at its first token read as 16 misses,
    and one such draft paused a copy that had every earlier draft accepted."""
    return min(num_drafted, num_accepted + 1)


class StepTimes:
    """Seconds of a forward step by the number of tokens in it: moving averages per count, forgotten once
    no step of that count has run for MAX_AGE steps (checked every MAX_AGE steps). The work behind a count
    drifts: a copy's long contexts make its 5-row steps dearer than a chat's, and a length no longer
    drafted is no longer timed.

    Two averages per count: of steps that follow a step of the same count (steady) and of steps that follow
    another count (a switch); estimates take the steady one where there is one. In adaptive runs at one stream
    of chat on two AVX2 cores a 2-token step after 1-token steps took a median 8.2-8.6 ms, after 2-token steps
    7.1 ms; but a run alternating the two in fixed patterns measured no difference (7.55-7.73 against
    7.58-7.88 ms), so those switches were dear for other reasons than the switch. Keeping them apart costs
    nothing where there is no difference, and keeps one dear step from standing for a length that runs cheaper."""

    def __init__(self) -> None:
        self._steady: dict[int, float] = {}
        self._switch: dict[int, float] = {}
        self._last_seen: dict[int, int] = {}    # any step of the count
        self._steady_seen: dict[int, int] = {}  # a steady step of it: a steady average goes stale on its own
        self._counts: list[int] = []            # sorted keys of _last_seen: the counts with an estimate
        self._clock = 0                         # steps observed
        self._previous: int | None = None       # the last step's count

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._clock += 1
        steady = num_tokens == self._previous
        self._previous = num_tokens
        table = self._steady if steady else self._switch
        old = table.get(num_tokens)
        table[num_tokens] = seconds if old is None else old + _TIME_WEIGHT * (seconds - old)
        if steady:
            self._steady_seen[num_tokens] = self._clock
        if num_tokens not in self._last_seen:
            bisect.insort(self._counts, num_tokens)
        self._last_seen[num_tokens] = self._clock
        if self._clock % MAX_AGE == 0:
            self._forget(self._clock - MAX_AGE)

    def _forget(self, before: int) -> None:
        for n in [n for n, seen in self._steady_seen.items() if seen <= before]:
            del self._steady[n], self._steady_seen[n]
        for n in [n for n, seen in self._last_seen.items() if seen <= before]:
            del self._last_seen[n]
            self._switch.pop(n, None)
        self._counts = sorted(self._last_seen)

    def measured(self, num_tokens: int) -> bool:
        return num_tokens in self._last_seen

    def _seconds(self, num_tokens: int) -> float:
        t = self._steady.get(num_tokens)
        return self._switch[num_tokens] if t is None else t

    def estimate(self, num_tokens: int) -> float | None:
        """Measured, else interpolated between the nearest measured counts; None before any step."""
        counts = self._counts
        if num_tokens in self._last_seen:
            return self._seconds(num_tokens)
        if not counts:
            return None
        seconds = self._seconds
        i = bisect.bisect_left(counts, num_tokens)
        if i == 0:
            return seconds(counts[0])  # a smaller step than any measured costs at most the smallest one
        if i == len(counts):
            last = seconds(counts[-1])
            if len(counts) == 1:
                return last
            a, b = counts[-2], counts[-1]
            return last + max(0.0, (last - seconds(a)) / (b - a)) * (num_tokens - b)
        a, b = counts[i - 1], counts[i]
        return seconds(a) + (seconds(b) - seconds(a)) * (num_tokens - a) / (b - a)


class DraftLength:
    """The draft tokens a step carries (see the module's docstring)."""

    def __init__(self, max_length: int, step_tokens: StepTokens | None = None) -> None:
        self.times = StepTimes()
        self.step_tokens = step_tokens
        self.max_length = max_length
        # Per draft class, P(draft token i accepted | the tokens before it were), None before it is observed.
        self.continue_rate: dict[int, list[float | None]] = {}
        self._outcomes: dict[int, list[int]] = {}  # per class and position, the outcomes seen there
        self.prior_outcomes = PRIOR_OUTCOMES
        self.acceptance = 1.0         # accepted / tested, a moving average over all sequences
        self.draft_seconds = 0.0      # the proposer's time per draft position
        self._since_probe = 0         # decisions since the last probe started
        self.probe_cost = PROBE_COST  # > 0 (inf: every PROBE_EVERY-th decision near the best, the rule before)
        self._probe_left = 0          # decisions left in the probe under way
        # Tokens the kept drafts were expected to bring and those they brought, decayed per decision; their
        # ratio scales the expectations of all drafts but trees (see `gain_scale`).
        self._predicted = 0.0
        self._realized = 0.0

    @property
    def gain_scale(self) -> float:
        """Accepted tokens per token expected, over the recent drafts the rule kept and sized (all but trees).
        The rule keeps the drafts it expects most of, so its expectations of them run high (and `choose` ranks
        by them): at 4 streams of chat on AVX-512, kept lookup drafts brought 1.34 tokens a step where 1.89 were
        expected. It scales those drafts' gains, not a tree's (see `choose`)."""
        return (self._realized + _CALIBRATION_PRIOR) / (self._predicted + _CALIBRATION_PRIOR)

    def acceptance_by_position(self, draft_class: int) -> list[float]:
        """[i]: P(draft tokens 0..i all accepted) for a draft of this class."""
        out, p, c = [], 1.0, 1.0
        for rate in self.continue_rate.get(draft_class) or [None] * self.max_length:
            c = c if rate is None else rate  # not yet observed: the last observed position's rate
            p *= c
            out.append(p)
        return out

    def record(self, num_drafted: int, num_accepted: int, draft_class: int = 0, kept_alternative: bool = False
               ) -> None:
        """A verified draft: num_accepted of its num_drafted chain tokens, its first ones; or, with
        kept_alternative, a token tree's alternative to its first token kept in that token's place (then
        num_accepted is 1, as the engine counts it, and the chain's first token was rejected)."""
        chain_accepted = 0 if kept_alternative else num_accepted
        rates = self.continue_rate.setdefault(draft_class, [None] * self.max_length)
        seen = self._outcomes.setdefault(draft_class, [0] * self.max_length)
        # Token i's outcome given all before it were accepted is seen for i up to the first rejection.
        for i in range(tested_tokens(num_drafted, chain_accepted)):
            old = rates[i] if rates[i] is not None else (rates[i - 1] if i else 1.0)
            weight = max(POSITION_WEIGHT, 1.0 / (seen[i] + 1 + self.prior_outcomes))
            rates[i] = old + weight * ((1.0 if i < chain_accepted else 0.0) - old)
            seen[i] += 1
        # As a request's own acceptance counts it (speculator.py): a kept alternative as its first token.
        self.acceptance += POSITION_WEIGHT * (num_accepted / tested_tokens(num_drafted, num_accepted)
                                              - self.acceptance)
        if draft_class != TREE_CLASS:  # a tree's rows are sized by the head's confidence, not by `choose`
            self._realized += num_accepted

    def observe_drafting(self, seconds: float, depth: int) -> None:
        per_position = seconds / depth
        if self.draft_seconds == 0.0:  # the first drafting step
            self.draft_seconds = per_position
        else:
            self.draft_seconds += _TIME_WEIGHT * (per_position - self.draft_seconds)

    def choose(self, num_tokens: int, drafts: list[tuple[int, float, int]], num_seqs: int | None = None
               ) -> list[int]:
        """num_tokens: the step's tokens without drafts; drafts: per sequence that may draft, (draft tokens
        it has, its acceptance relative to the average, its draft's class); num_seqs: the step's sequences
        (for step_tokens). How many of its draft tokens each sequence keeps (0: none)."""
        keep = [0] * len(drafts)
        if not self.times.measured(self._run_tokens(num_seqs, num_tokens, 0)):
            # Measure the step without drafts first: every rate is relative to it. (A step with a prefill
            # chunk, whose size seldom repeats, so goes without drafts.)
            return keep
        # Every draft token of every sequence, the likeliest to be accepted first. A token is accepted only
        # with all before it, so its gain never rises along its draft and each sequence's tokens come in
        # order: the first T of the list are the best T rows a step can add. Each entry: (-gain, position,
        # sequence, the gain before gain_scale). gain_scale is measured on the drafts `choose` sizes, so it
        # scales those; a tree's rows are sized by the head's confidence once drafted, and its class rate is
        # already the head's own record (scaled by lookup's shortfall, the head skipped up to a quarter of the
        # steps at one stream of chat, and passes over the same questions took 656-737 steps where they took
        # 646-676 without).
        gain_scale = self.gain_scale
        ranked: list[tuple[float, int, int, float]] = []
        for r, (avail, scale, draft_class) in enumerate(drafts):
            q = self.acceptance_by_position(draft_class)
            factor = 1.0 if draft_class == TREE_CLASS else gain_scale
            for i in range(avail):
                gain = min(1.0, q[i] * scale)
                ranked.append((-gain * factor, i, r, gain))
        ranked.sort()
        # The model drafts every sequence it drafts for to the deepest of their kept tokens, and that time is
        # the same whatever else the step carries; so each cap on the model's depth is tried (a lookup
        # draft beside a model too slow to pay still goes), and the best rate over all caps wins.
        model_depths = [avail for avail, _, draft_class in drafts if draft_class <= MODEL_CLASS]
        caps = range(max(model_depths) + 1) if model_depths and self.draft_seconds > 0 else [None]
        options = []  # per cap: (the tokens it allows, the rate of keeping the first T of them for each T)
        for cap in caps:
            subset = ranked if cap is None else [x for x in ranked if drafts[x[2]][2] > MODEL_CLASS or x[1] < cap]
            options.append((subset, self._rates(num_seqs, num_tokens, subset, drafts)))
        chosen = max(range(len(options)), key=lambda c: (max(options[c][1]), -c))
        kept, rates = options[chosen]
        # Where the best keeps every token its cap allows, one token more (a probe's) is in the next cap's list.
        # Without it a model judged not to pay (cap 0) was never tried again: at one stream of chat on two AVX2
        # cores the eagle head stayed off for 200 decisions in a row, until its step time was forgotten.
        following = options[chosen + 1] if chosen + 1 < len(options) else None
        n = self.best_or_probe(rates, following[1] if following else None)
        if n >= len(rates):
            kept = following[0]
        expected = 0.0
        for _, _, r, gain in kept[:n]:
            keep[r] += 1
            if drafts[r][2] != TREE_CLASS:
                expected += gain
        self._realized *= 1 - _CALIBRATION_WEIGHT
        self._predicted = self._predicted * (1 - _CALIBRATION_WEIGHT) + expected
        return keep

    def best_row_count(self, num_tokens: int, num_seqs: int | None, gains: list[float], fixed_rows: int = 0,
                       fixed_gain: float = 0.0, fixed_seconds: float = 0.0) -> int:
        """For rows already drafted (the eagle head's trees, with a gain per row from its confidence), how many
        of them, best first (gains falling), a step should add to the fixed_rows draft tokens it keeps anyway
        (expected to bring fixed_gain tokens, drafted in fixed_seconds): the count of the highest expected rate.
        The rows' drafting is done, so only the step's time is weighed against them."""
        best, best_rate, tokens = 0, 0.0, num_tokens + fixed_gain
        for k in range(len(gains) + 1):
            tokens += gains[k - 1] if k else 0.0
            seconds = self.times.estimate(self._run_tokens(num_seqs, num_tokens, fixed_rows + k))
            if seconds is None:
                return len(gains)
            rate = tokens / (seconds + fixed_seconds)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def expected_gain(self, draft_class: int, num_drafts: int) -> float:
        """The tokens a draft of this class is expected to add with num_drafts tokens kept."""
        return sum(self.acceptance_by_position(draft_class)[:num_drafts]) * self.gain_scale

    def _run_tokens(self, num_seqs: int | None, num_tokens: int, num_drafts: int) -> int:
        if self.step_tokens is None or num_seqs is None:
            return num_tokens + num_drafts
        return self.step_tokens(num_seqs, num_tokens, num_drafts)

    def _rates(self, num_seqs: int | None, num_tokens: int, ranked: list[tuple[float, int, int, float]],
               drafts: list[tuple[int, float, int]]) -> list[float]:
        """[T]: the expected tokens per second of the step that keeps the first T of ranked (`choose`'s, gains
        already scaled)."""
        rates = [num_tokens / self.times.estimate(self._run_tokens(num_seqs, num_tokens, 0))]
        tokens, depth = float(num_tokens), 0
        for added, (neg_gain, i, r, _) in enumerate(ranked, 1):
            tokens -= neg_gain
            if drafts[r][2] <= MODEL_CLASS:
                depth = max(depth, i + 1)
            run = self._run_tokens(num_seqs, num_tokens, added)
            rates.append(tokens / (self.times.estimate(run) + depth * self.draft_seconds))
        return rates

    def best_or_probe(self, rates: list[float], following: list[float] | None = None) -> int:
        """The index of the highest rate (the lowest of equal ones), or one more on a probing decision;
        following: where rates ends at the best, a list whose entry one past it is the rate of one token more."""
        best = max(range(len(rates)), key=lambda t: (rates[t], -t))
        self._since_probe += 1
        ahead = rates if best + 1 < len(rates) else following
        if ahead is None or best + 1 >= len(ahead):
            self._probe_left = 0
            return best
        ratio = ahead[best + 1] / rates[best] if rates[best] > 0 else 1.0
        near = ratio >= PROBE_MIN_RATE
        if not near:
            self._probe_left = 0  # a run under way stops where its length fell far behind
        elif self._probe_left > 0:
            self._probe_left -= 1
            return best + 1
        # A run costs about PROBE_RUN * (1 - ratio) of a decision's rate, so runs are spaced to cost PROBE_COST
        # of it on average: every PROBE_EVERY decisions for a length estimated close to the best, further apart
        # for one estimated well below it (a draft model right one time in five, tried for 3 decisions in every
        # 16, made a run of copies at one stream 0.91x). A length estimated at under half the best rate is probed for
        # one decision every MAX_AGE-th: where a step with drafts costs many times one without (on an H200
        # before verification steps had CUDA graphs: 13.4 ms eager against a 1.86 ms decode graph), probing
        # that often would cost more than speculation gains.
        every = max(PROBE_EVERY, math.ceil(PROBE_RUN * (1 - ratio) / self.probe_cost)) if near else MAX_AGE
        if self._since_probe >= every:
            self._since_probe = 0
            self._probe_left = PROBE_RUN - 1 if near else 0
            best += 1
        return best
