"""The draft length a step carries (kvserve/spec_decode/draft_length.py): the length that maximises expected
tokens per second under the engine's measured step times, worked out by hand here; and through the engine,
where a step's cost grows with its tokens (a compute-bound machine, modelled by the step times reported to
the speculator) drafting stops for drafts that fail, and where it does not (every step reports the same
time) good drafts go at full length."""
import random
from collections.abc import Callable

import pytest

from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.draft_length import (MAX_AGE, PRIOR_OUTCOMES, PROBE_EVERY, PROBE_RUN, TREE_CLASS,
                                              DraftLength, StepTimes)
from engine_helpers import assert_no_leaks, drain
from spec_helpers import ScriptedProposer, make_engine


def times(points: dict[int, float]) -> StepTimes:
    t = StepTimes()
    for n, s in points.items():
        t.observe(n, s)
    return t


def test_step_times_interpolate_between_measured_counts_and_extrapolate_past_them():
    assert StepTimes().estimate(3) is None
    one = times({4: 2.0})
    assert one.estimate(1) == one.estimate(9) == 2.0  # only one count known: flat both ways
    t = times({1: 1.0, 5: 3.0})
    assert t.estimate(3) == pytest.approx(2.0)
    assert t.estimate(9) == pytest.approx(5.0)         # the last slope, 0.5 a token
    t.observe(5, 4.0)                                  # after a step of its own size: the steady average
    assert t.estimate(5) == 4.0
    t.observe(5, 2.0)                                  # a moving average, not the last sample
    assert 2.0 < t.estimate(5) < 4.0
    falling = times({1: 2.0, 2: 1.0})                  # noise never makes more tokens cheaper
    assert falling.estimate(10) == 1.0


def test_steps_after_a_step_of_another_size_are_averaged_apart():
    """A switch between sizes costs more than a step of the same size (StepTimes' doc): the estimate is the
    steady average where there is one, the switch's where there is nothing else."""
    t = times({1: 1.0})
    t.observe(1, 1.0)
    t.observe(2, 1.5)              # a lone probe step after 1-token steps
    assert t.estimate(2) == 1.5    # all there is
    t.observe(2, 1.1)
    t.observe(2, 1.1)
    assert t.estimate(2) == pytest.approx(1.1)
    t.observe(1, 1.3)              # the switch back
    assert t.estimate(1) == 1.0


def test_drafting_that_pays_while_it_runs_is_kept_though_the_switch_to_it_costs():
    """Steady 2-token steps 1.1x a 1-token step, the first after 1-token steps 1.5x: at 43% acceptance and a
    draft costing 0.08 of a step, drafting gives 1.43 / 1.18 of the tokens per second. Timing the probes
    alone made it look like 1.43 / 1.58 and turned it off."""
    p = DraftLength(1)
    p.times = times({1: 1.0})
    p.times.observe(1, 1.0)
    p.times.observe(2, 1.5)
    p.continue_rate = {0: [0.43]}
    p.draft_seconds = 0.08
    assert p.choose(1, [(1, 1.0, 0)]) == [0]   # the probe alone says no
    p.times.observe(2, 1.1)
    p.times.observe(2, 1.1)
    assert p.choose(1, [(1, 1.0, 0)]) == [1]


def policy(points: dict[int, float], q: list[float], draft_seconds: float = 0.0) -> DraftLength:
    """q[i]: P(draft tokens 0..i all accepted), for class 0."""
    p = DraftLength(len(q))
    p.times = times(points)
    # The rate of token i given the ones before it: q[i] / q[i - 1] (0 once a position is never reached).
    p.continue_rate = {0: [q[0]] + [q[i] / q[i - 1] if q[i - 1] else 0.0 for i in range(1, len(q))]}
    assert p.acceptance_by_position(0) == pytest.approx(q)
    p.draft_seconds = draft_seconds
    return p


def test_memory_bound_steps_draft_every_position_that_has_a_chance():
    # Rows cost nothing extra: any expected accepted token raises the rate.
    p = policy({1: 1.0, 5: 1.0}, [0.8, 0.6, 0.4, 0.2])
    assert p.choose(1, [(4, 1.0, 0)]) == [4]


def test_compute_bound_steps_draft_only_what_pays():
    # Each extra row costs 0.25 of a step. rate(d) = (1 + q0 + .. + q(d-1)) / (1 + 0.25 d):
    # d=0: 1, d=1: 1.6 / 1.25 = 1.28, d=2: 1.9 / 1.5 = 1.267, d=3: 2.0 / 1.75 = 1.14 -> 1.
    p = policy({1: 1.0, 5: 2.0}, [0.6, 0.3, 0.1, 0.05])
    assert p.choose(1, [(4, 1.0, 0)]) == [1]
    # At acceptance 0.2 no length pays (1.2 / 1.25 < 1).
    assert policy({1: 1.0, 5: 2.0}, [0.2, 0.1, 0.05, 0.0]).choose(1, [(4, 1.0, 0)]) == [0]
    # A sequence that drafts twice as well as the average (a copy among chats) makes two positions pay:
    # q scaled by 2 = [1.0, 0.6, 0.2, 0.1]: d=1: 2.0 / 1.25 = 1.6, d=2: 2.6 / 1.5 = 1.73, d=3: 2.8 / 1.75 = 1.6.
    assert p.choose(1, [(4, 2.0, 0)]) == [2]
    # A sequence with fewer drafts caps nothing for the others, and costs only its own rows.
    assert policy({1: 1.0, 2: 1.0, 8: 1.0}, [0.9, 0.9]).choose(2, [(1, 1.0, 0), (2, 1.0, 0)]) == [1, 2]


def test_expectations_are_scaled_by_what_kept_drafts_brought():
    """gain_scale: accepted against expected tokens over the drafts `choose` kept. A sequence judged twice as
    good as the average (scale 2) whose drafts land only as often as the average's brings half what was
    expected of it. Drafts that never land bring the class's rate, so what is expected of them, to ~0 (probes
    still keep some): the scale goes back toward 1, and stays finite."""
    rng = random.Random(0)
    p = policy({1: 1.0, 2: 1.0}, [0.9])  # one draft token, rows free: drafting always pays
    assert p.gain_scale == 1.0
    for _ in range(600):
        k = p.choose(1, [(1, 2.0, 0)])
        if k[0]:
            p.record(1, int(rng.random() < 0.3))
    assert p.acceptance_by_position(0)[0] == pytest.approx(0.3, abs=0.12)  # expected of it: 0.6 a draft
    assert 0.35 < p.gain_scale < 0.7
    assert p.expected_gain(0, 1) == pytest.approx(p.acceptance_by_position(0)[0] * p.gain_scale)
    for _ in range(3000):
        k = p.choose(1, [(1, 2.0, 0)])
        if k[0]:
            p.record(1, 0)
    assert p.acceptance_by_position(0)[0] < 0.01
    assert p.gain_scale == pytest.approx(1.0, abs=0.1)


def test_a_shortfall_of_sized_drafts_does_not_scale_a_trees_gain():
    """gain_scale is measured on the drafts `choose` sizes, not on trees (the head's confidence sizes a tree's
    rows once it is drafted, and its class rate is the head's own record), so it scales only those: where kept
    drafts brought a quarter of what was expected, a draft at a class rate of 0.5 no longer pays for a row that
    costs a fifth of a step, while the head's tree at the same rate still does."""
    p = policy({1: 1.0, 2: 1.2}, [0.5])
    p.continue_rate[TREE_CLASS] = [0.5]
    p._predicted, p._realized = 100.0, 22.0
    assert p.gain_scale == pytest.approx(0.25)
    assert p.choose(1, [(1, 1.0, 0)]) == [0]
    assert p.choose(1, [(1, 1.0, TREE_CLASS)]) == [1]


def test_graph_steps_cost_full_width_from_the_first_draft_token():
    """With CUDA graphs a step of 4 decoding sequences runs 4 x 1 tokens, or 4 x 5 once any of them drafts
    (times as measured on an H200: 1.57 and 2.19 ms). One chat-like draft (cumulative acceptance 57 / 33 /
    19 / 9%, 1.18 tokens expected) does not pay for the wider step: (4 + 1.18) / 2.19 < 4 / 1.57. A copy's
    (2.84 expected) does, and then at full length: past the first token the rows are free."""
    def graph(seqs: int, tokens: int, drafts: int) -> int:
        return seqs * (5 if drafts else 1)
    chat, copy = [0.57, 0.33, 0.19, 0.09], [0.86, 0.74, 0.67, 0.57]
    for q, want in ((chat, [0, 0, 0, 0]), (copy, [4, 0, 0, 0])):
        p = policy({4: 1.57, 20: 2.19}, q)
        p.step_tokens = graph
        assert p.choose(4, [(4, 1.0, 0)] + [(0, 1.0, 0)] * 3, num_seqs=4) == want
    # Timed by their own token counts instead (as before graphs had shapes), the same steps made one chat
    # draft token look cheap: t(5) interpolated between 4 and 8 tokens, where the graph had cost 2.19 ms.
    assert policy({4: 1.57, 8: 2.19}, chat).choose(4, [(4, 1.0, 0)] + [(0, 1.0, 0)] * 3) == [1, 0, 0, 0]


def test_the_proposers_time_counts_against_drafting():
    q = [0.5, 0.5]
    assert policy({1: 1.0, 3: 1.0}, q).choose(1, [(2, 1.0, 0)]) == [2]
    # 0.3 a position: d=1: 1.5 / 1.3 = 1.15, d=2: 2.0 / 1.6 = 1.25; 0.6 a position: 1.5 / 1.6 < 1.
    assert policy({1: 1.0, 3: 1.0}, q, draft_seconds=0.3).choose(1, [(2, 1.0, 0)]) == [2]
    assert policy({1: 1.0, 3: 1.0}, q, draft_seconds=0.6).choose(1, [(2, 1.0, 0)]) == [0]


def test_only_the_models_drafts_pay_its_drafting_time():
    """Prompt lookup in front of a model: a lookup draft (class 2 here) costs no drafting time, so with a
    model too slow to pay it still goes at full length, and the model's draft beside it does not."""
    q = [0.5, 0.5]
    p = policy({1: 1.0, 2: 1.0, 5: 1.0}, q, draft_seconds=0.6)
    p.continue_rate[2] = list(p.continue_rate[0])
    assert p.choose(2, [(2, 1.0, 0), (2, 1.0, 2)]) == [0, 2]


def test_rows_already_drafted_are_kept_best_first_while_they_pay():
    """A tree's rows come drafted, each with its gain (the head's confidence, confidence.py): a step keeps the
    count of highest rate, its drafting no longer weighed. Rows a tenth of a step each: gains 0.9, 0.5, 0.1
    give rates 1, 1.73, 2.0, 1.92 for 0-3 rows, so 2; at 0.4 of a step, 1 (1.36 against 1.33 for 2)."""
    p = policy({n: 1.0 + 0.1 * (n - 1) for n in range(1, 6)}, [0.5], draft_seconds=5.0)
    assert p.best_row_count(1, 1, [0.9, 0.5, 0.1]) == 2
    assert p.best_row_count(1, 1, [0.05, 0.04]) == 0  # a head with little idea: no rows, a plain step
    p = policy({n: 1.0 + 0.4 * (n - 1) for n in range(1, 6)}, [0.5])
    assert p.best_row_count(1, 1, [0.9, 0.5, 0.1]) == 1
    # Beside 2 rows kept anyway (another sequence's drafts, bringing 1.0) in a step of 2 tokens, rows a fifth of a
    # step: 3 / 1.6, then 3.9 / 1.8 = 2.17, then 4.4 / 2.0 = 2.2 with a second row of 0.5, 2.1 with one of 0.3.
    p = policy({n: 1.0 + 0.2 * (n - 1) for n in range(1, 8)}, [0.5])
    assert p.best_row_count(2, 2, [0.9, 0.5], fixed_rows=2, fixed_gain=1.0) == 2
    assert p.best_row_count(2, 2, [0.9, 0.3], fixed_rows=2, fixed_gain=1.0) == 1
    # The other draft's drafting time weighs on every count alike, so rows cost less against it: 4.2 / 5.0 wins.
    assert p.best_row_count(2, 2, [0.9, 0.3], fixed_rows=2, fixed_gain=1.0, fixed_seconds=3.0) == 2


def test_a_tree_is_judged_as_its_chain_and_its_kept_alternatives_count_as_accepted():
    """The rule only says whether a tree should be drafted, as a chain of its class; a kept alternative is the
    chain's first token rejected, and an accepted draft for the engine-wide acceptance."""
    p = DraftLength(2)
    for step in range(200):
        kept = step % 2 == 0
        p.record(2, int(kept), TREE_CLASS, kept_alternative=kept)  # a kept alternative: 1 accepted token
    assert p.acceptance_by_position(TREE_CLASS)[0] < 0.01
    assert p.acceptance == pytest.approx(0.25, abs=0.02)  # 1 of 2 drafted, every other step


def test_every_probe_th_decision_starts_a_run_of_one_position_more():
    # One token more rates 1.2 / 1.2 against 1 / 1.0 (then a little less, as the probes' expectations go
    # unmet): close enough to the best to be probed at the shortest spacing.
    p = policy({1: 1.0, 2: 1.2}, [0.2, 0.1, 0.05, 0.0])
    lengths = [p.choose(1, [(4, 1.0, 0)])[0] for _ in range(3 * PROBE_EVERY)]
    starts = [k * PROBE_EVERY - 1 for k in (1, 2, 3)]  # the 16th, 32nd and 48th decisions
    assert lengths == [int(any(s <= i < s + PROBE_RUN for s in starts)) for i in range(3 * PROBE_EVERY)]


def test_a_model_whose_drafting_time_tips_it_below_no_drafts_is_still_probed():
    """With its drafting time the model's one draft token rates 1.3 / 1.4 against 1 / 1.0 without it, so the
    best step keeps none of the model's tokens; a probe must still try one (the token is only in the list
    that allows the model), or a few slow steps turn the model off until its times are forgotten."""
    p = policy({1: 1.0, 2: 1.2}, [0.3], draft_seconds=0.2)
    lengths = [p.choose(1, [(1, 1.0, 0)])[0] for _ in range(30)]
    # A run of 3 at 1 - 1.3 / 1.4 below the best costs 0.21 of a decision: every 22nd decision costs 1%.
    assert lengths == [int(21 <= i < 21 + PROBE_RUN) for i in range(30)]


def test_probes_of_a_length_well_below_the_best_are_spaced_to_cost_one_percent():
    """A draft model right one time in three whose drafting costs 0.7 of a step rates 1.3 / 1.7 against 1 / 1.0:
    a run of 3 decisions costs 0.71 of one, so runs go every 71st decision, not every PROBE_EVERY-th (a draft
    model right one time in five, probed 3 decisions in every 16, made a run of copies at one stream 0.91x)."""
    p = policy({1: 1.0, 2: 1.0}, [0.3], draft_seconds=0.7)
    lengths = [p.choose(1, [(1, 1.0, 0)])[0] for _ in range(100)]
    assert lengths == [int(70 <= i < 70 + PROBE_RUN) for i in range(100)]


def test_a_length_far_worse_than_the_best_is_probed_rarely():
    # An H200's decode step replays a graph (1.86 ms) while a step with drafts runs eagerly (13.4 ms): even
    # drafts that are always right (two tokens a step) rate 2 / 13.4 against 1 / 1.86, about 0.28 of the best.
    p = policy({1: 1.86, 2: 13.4}, [1.0, 1.0])
    lengths = [p.choose(1, [(2, 1.0, 0)])[0] for _ in range(2 * MAX_AGE)]
    assert lengths.count(0) == 2 * MAX_AGE - 2 and lengths.count(1) == 2


def test_a_step_size_never_timed_without_drafts_goes_without_them_once():
    p = DraftLength(3)
    assert p.choose(2, [(3, 1.0, 0), (1, 1.0, 0)]) == [0, 0]
    p.times.observe(2, 1.0)
    assert p.choose(2, [(3, 1.0, 0), (1, 1.0, 0)]) == [3, 1]  # 6 tokens unmeasured: as cheap as 2, so tried


def test_record_moves_the_acceptance_of_each_verified_position():
    p = DraftLength(3)
    for _ in range(200):
        p.record(3, 1)  # position 0 always accepted, 1 and 2 never
    q = p.acceptance_by_position(0)
    assert q[0] == 1.0
    assert q[1] < 0.01 and q[2] < 0.01
    # Per tested token: the third was never tested, so one of two accepted (not one of three).
    assert p.acceptance == pytest.approx(1 / 2, abs=0.01)


def test_a_class_learns_from_its_first_drafts_as_a_mean_then_as_a_moving_average():
    """A class's first outcomes at a position count as in a mean with PRIOR_OUTCOMES outcomes at its prior rate
    (1.0 for a first position), so three rejections take it to 2 / 5; once that weight would fall below the moving
    average's, each outcome moves it by that weight (1/32). A position's prior is the one before's rate."""
    p = DraftLength(2)
    assert PRIOR_OUTCOMES == 2
    for _ in range(3):
        p.record(2, 0)
    assert p.continue_rate[0] == [pytest.approx(2 / 5), None]
    p.record(2, 1)  # the first position's 4th outcome (a mean of 6: 0.5), then the second's first, from it
    assert p.continue_rate[0] == [pytest.approx(1 / 2), pytest.approx(1 / 2 * 2 / 3)]
    q = DraftLength(1)
    for _ in range(40):
        q.record(1, 1)
    before = q.continue_rate[0][0]
    q.record(1, 0)
    assert before == 1.0 and q.continue_rate[0][0] == pytest.approx(1 - 1 / 32)
    # Other classes learn apart: a fresh one starts over.
    q.record(1, 0, draft_class=3)
    assert q.continue_rate[3][0] == pytest.approx(2 / 3)


K = 4


def run_with_drafts(path, wrong: float, adaptive: bool, step_seconds: Callable[[int], float],
                    params: SamplingParams | None = None):
    """One request (greedy unless params says otherwise) with and without speculation: the stats of the
    speculative engine, once its output equals the other's and no block leaked. step_seconds(num_tokens):
    the time each step reports to the speculator instead of the time it took, a modelled machine without
    the noise of real time (with a real sleep per token, a shared CI host once let the adaptive run draft a
    third of what the fixed one did, where the test allows a quarter)."""
    params = params or SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    prompt = [random.Random(2).randrange(256) for _ in range(6)]
    ref = drain(_add(make_engine(path), prompt, params))["r"].outputs[0].token_ids
    engine = make_engine(path, {"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": None,
                                "min_acceptance_rate": 0.0, "adaptive_draft_length": adaptive})
    engine.speculator.proposer = ScriptedProposer({tuple(prompt): ref}, wrong)
    observe = engine.speculator.observe_step
    engine.speculator.observe_step = lambda num_tokens, _seconds: observe(num_tokens, step_seconds(num_tokens))
    out = drain(_add(engine, prompt, params))["r"].outputs[0].token_ids
    assert out == ref
    assert_no_leaks(engine)
    return engine.get_stats()


def compute_bound(num_tokens: int) -> float:
    """A step whose cost grows with its tokens: 3 ms a token over a 2 ms floor."""
    return 0.002 + 0.003 * num_tokens


def _add(engine, prompt, params):
    engine.add_request("r", prompt, params)
    return engine


def test_compute_bound_steps_stop_drafting_tokens_that_fail(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama"]
    fixed = run_with_drafts(path, 1.0, adaptive=False, step_seconds=compute_bound)
    adaptive = run_with_drafts(path, 1.0, adaptive=True, step_seconds=compute_bound)
    assert fixed.spec_num_draft_tokens >= 70 * K
    # The first steps draft (nothing measured yet), then only the probes, a position at a time, while the
    # position's acceptance decays from its optimistic start.
    assert adaptive.spec_num_draft_tokens < 0.25 * fixed.spec_num_draft_tokens, (adaptive, fixed)


def test_cheap_rows_and_right_drafts_go_at_full_length(tiny_model_dirs):
    path, _ = tiny_model_dirs["llama"]
    s = run_with_drafts(path, 0.0, adaptive=True, step_seconds=lambda _n: 0.01)
    assert s.spec_num_accepted_tokens == s.spec_num_draft_tokens
    assert s.spec_accepted_per_pos[K - 1] >= 0.9 * s.spec_num_drafts  # almost every draft was K long


def test_a_step_size_not_seen_for_max_age_steps_is_forgotten():
    t = times({1: 1.0, 5: 9.0})
    for _ in range(MAX_AGE):
        t.observe(1, 1.0)
        t.observe(2, 1.5)
    assert not t.measured(5)
    assert t.estimate(5) == pytest.approx(3.0)  # from the fresh counts' slope, not the stale 9.0


def test_seeded_sampling_draws_the_same_tokens_whatever_lengths_the_steps_carry(tiny_model_dirs):
    """Half-right drafts on a compute-bound machine: the chosen length changes from step to step (full
    length while nothing is measured, then probes), and a seeded request's output is still exactly that of
    decoding without speculation."""
    path, _ = tiny_model_dirs["llama"]
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=3, max_tokens=80, ignore_eos=True)
    s = run_with_drafts(path, 0.5, adaptive=True, step_seconds=compute_bound, params=params)
    assert 0 < s.spec_num_accepted_tokens < s.spec_num_draft_tokens


def test_acceptance_is_kept_per_draft_class_and_each_class_gets_its_own_length():
    # n-gram drafts after a long match are right, after a one-token match wrong: recorded per class, the
    # same step cost drafts the first at full length and the second not at all.
    p = policy({1: 1.0, 5: 2.0}, [1.0] * 4)
    for _ in range(200):
        p.record(4, 4, draft_class=4)
        p.record(4, 0, draft_class=1)
    assert p.acceptance_by_position(4) == pytest.approx([1.0] * 4)
    assert max(p.acceptance_by_position(1)) < 0.01
    assert p.choose(1, [(4, 1.0, 4)]) == [4]
    lengths = [p.choose(1, [(4, 1.0, 1)])[0] for _ in range(PROBE_EVERY)]
    assert lengths.count(0) >= PROBE_EVERY - PROBE_RUN  # only a probe drafts
    # A class never drafted starts optimistic, so it is tried.
    assert p.choose(1, [(4, 1.0, 3)]) == [4]
    # In one step each sequence keeps what its own class pays. Two sequences, a row costing 0.25 from 2 up:
    # the 4-gram's 4 tokens alone give (2 + 4) / 2.0 = 3 tokens a second; one length for both would add
    # the other's 4 useless rows, (2 + 4) / 3.0 = 2, no better than not drafting (2 / 1.0).
    p = policy({1: 1.0, 2: 1.0, 6: 2.0}, [1.0] * 4)
    p.continue_rate = {4: [1.0] * 4, 1: [0.0] * 4}
    assert p.choose(2, [(4, 1.0, 1), (4, 1.0, 4)]) == [0, 4]


def test_a_position_never_drafted_continues_at_the_rate_of_the_last_one_that_was():
    # Only first tokens were ever drafted, accepted half the time: the second is expected to be accepted
    # with the first half the time too (0.25 in all), not every time the first is.
    p = DraftLength(4)
    for _ in range(300):
        p.record(1, 1)
        p.record(1, 0)
    assert p.acceptance_by_position(0) == pytest.approx([0.5, 0.25, 0.125, 0.0625], abs=0.03)
    # Once the second is drafted and always accepted after the first, it is 0.5 and the rest follow it.
    for _ in range(300):
        p.record(2, 2)
        p.record(2, 0)
    assert p.acceptance_by_position(0) == pytest.approx([0.5, 0.5, 0.5, 0.5], abs=0.03)
    # A class never drafted is optimistic: drafting gets tried.
    assert p.acceptance_by_position(7) == [1.0] * 4
