"""The easy -> small router (kvserve.gateway.difficulty): shipped parameters load, choices are deterministic,
monotone in the cost knob and cheap, torch stays out, and on the committed held-out questions (both models'
answers scored by benchmarks/auto_routing.py, no model run here) it beats random routing at equal share."""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time

import pytest

from kvserve.gateway.auto_route import AutoRouter
from kvserve.gateway.difficulty import (SHAPE_FEATURES, DifficultyParams, DifficultyRouter, featurize,
                                        load_default_router)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELD_OUT = os.path.join(ROOT, "benchmarks", "results", "auto_routing_held_out.jsonl")


def held_out() -> list[dict]:
    with open(HELD_OUT, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


PROMPTS = ["What is the capital of France?", "What is 347 * 8?", "Repeat this line exactly: To be, or not to be",
           "", "Write a haiku about caches.", "Which letter comes after Q in the alphabet?"]


def test_shipped_parameters_load_and_fit_the_features() -> None:
    p = DifficultyParams.load()
    assert len(p.weights) == len(SHAPE_FEATURES) + p.num_buckets
    assert all(math.isfinite(w) for w in p.weights)
    assert len(p.gain_quantiles) == 101 and p.gain_quantiles == sorted(p.gain_quantiles)
    router: AutoRouter = load_default_router()
    assert router.choose("What is 2 + 2?") in ("small", "large")


def test_choice_is_deterministic_across_processes() -> None:
    # CRC-32 hashing, not Python's salted hash(): another interpreter must choose the same.
    here = [round(load_default_router(0.5).predicted_gain(p), 9) for p in PROMPTS]
    code = ("import json; from kvserve.gateway.difficulty import load_default_router as l; "
            f"print(json.dumps([round(l(0.5).predicted_gain(p), 9) for p in {PROMPTS!r}]))")
    env = dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == here
    assert [load_default_router(0.5).choose(p) for p in PROMPTS] == [load_default_router(0.5).choose(p) for p in PROMPTS]


def test_predicted_gain_is_the_dot_product_of_features_and_weights() -> None:
    p = DifficultyParams.load()
    text = "What is 12 + 345?"
    vec = featurize(text, p.num_buckets)
    assert vec[0] == 1.0                                     # bias
    assert vec[SHAPE_FEATURES.index("arith_op")] == 1.0
    assert vec[SHAPE_FEATURES.index("max_number_digits")] == pytest.approx(3 / 4)
    want = sum(p.weights[i] * v for i, v in vec.items())
    assert DifficultyRouter(p).predicted_gain(text) == pytest.approx(want)


def test_more_share_never_sends_a_prompt_back_to_small() -> None:
    questions = [r["question"] for r in held_out()] + PROMPTS
    previous: set[str] = set()
    shares = [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0]
    counts = []
    for share in shares:
        router = load_default_router(share)
        large = {q for q in questions if router.choose(q) == "large"}
        assert previous <= large, f"share {share} sent {sorted(previous - large)[:3]} back to small"
        previous = large
        counts.append(len(large))
    assert counts[0] == 0 and counts[-1] == len(set(questions))
    # The knob means what it says: the held-out share is near the target (the split is by question hash).
    n = len(set(questions))
    for share, c in zip(shares, counts):
        assert abs(c / n - share) < 0.12, (share, c / n)


def test_a_choice_costs_well_under_a_decode_step() -> None:
    router = load_default_router()
    questions = [r["question"] for r in held_out()][:200]
    long_prompt = "You are a helpful assistant. " * 2000 + "What is the capital of Peru?"
    per = []
    for q in questions:
        t0 = time.perf_counter()
        router.choose(q)
        per.append(time.perf_counter() - t0)
    # A decode step of the small model is tens of ms here; budget 1 ms, median over many against noisy cores.
    assert statistics.median(per) < 1e-3
    # The long prompt too (only its tail is read); CPU time, since wall time on shared cores includes waiting.
    c0 = time.process_time()
    for _ in range(20):
        router.choose(long_prompt)
    assert (time.process_time() - c0) / 20 < 1e-3


def test_the_router_does_not_import_torch() -> None:
    code = ("import sys; from kvserve.gateway.difficulty import load_default_router; "
            "load_default_router().choose('What is 2 + 2?'); assert 'torch' not in sys.modules, 'torch'; "
            "assert 'numpy' not in sys.modules, 'numpy'")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ, PYTHONPATH=ROOT))


def test_router_beats_random_at_equal_share_on_held_out_questions() -> None:
    rows = held_out()
    small = [r["small"] for r in rows]
    large = [r["large"] for r in rows]
    acc_small, acc_large = statistics.fmean(small), statistics.fmean(large)
    wins = []
    for share in (0.2, 0.3, 0.4, 0.5, 0.6):
        router = load_default_router(share)
        picks = [router.choose(r["question"]) == "large" for r in rows]
        got = sum(picks) / len(rows)
        acc = statistics.fmean(l if p else s for p, s, l in zip(picks, small, large))
        random_acc = (1 - got) * acc_small + got * acc_large   # random routing's expectation at that share
        wins.append(acc - random_acc)
    assert min(wins) > 0, wins
    assert statistics.fmean(wins) > 0.02, wins
