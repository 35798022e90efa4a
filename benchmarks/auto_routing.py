"""Easy -> small routing (`model: "auto"`): quality against cost on held-out questions.

    nice -n 10 python benchmarks/auto_routing.py            # runs what the cache lacks, fits, evaluates
    python benchmarks/auto_routing.py --no-models           # refit and evaluate from the committed cache only

1. Questions with reference answers, made offline (benchmarks/auto_routing_tasks.py), split by a hash of the
   question: 60% train, 40% held out.
2. Both models answer every question greedily (benchmarks/auto_routing_models.py states each one's prompt
   format); answers and 0/1 scores are cached in benchmarks/results/auto_routing_outputs.jsonl.
3. A ridge regression on kvserve.gateway.difficulty's prompt features predicts the gain
   score(large) - score(small) on the training split (ridge strength by 5-fold cross-validation there);
   the fit ships as kvserve/gateway/difficulty_params.json.
4. On the held-out split, for each target share of requests sent to the large model: the router's
   accuracy, against always-small, always-large, random routing at the router's measured share (its
   expectation, exact: (1-s) * acc_small + s * acc_large) and the oracle. Also, as the alternative method,
   a cascade on the small model's own confidence (mean log-probability of its answer): it has to run the
   small model on every request first, so its cost is higher than its share suggests.
Writes benchmarks/results/auto_routing.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
import zlib

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from auto_routing_models import EXAMPLES, load_cache, run_likelihood, run_model  # noqa: E402
from auto_routing_tasks import make_tasks, score  # noqa: E402

from kvserve.gateway.difficulty import (MAX_CHARS, SHAPE_FEATURES, DifficultyParams, DifficultyRouter,  # noqa: E402
                                        featurize)

RESULTS = os.path.join(HERE, "results")
CACHE = os.path.join(RESULTS, "auto_routing_outputs.jsonl")
HELD_OUT = os.path.join(RESULTS, "auto_routing_held_out.jsonl")
LIKELIHOOD = os.path.join(RESULTS, "auto_routing_likelihood.jsonl")
PARAMS = os.path.join(os.path.dirname(HERE), "kvserve", "gateway", "difficulty_params.json")
SHARES = [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
NUM_BUCKETS = 512
NUM_TASKS = 1000


def is_train(question: str) -> bool:
    return zlib.crc32(question.encode("utf-8")) % 10 < 6


def load_rows(tasks) -> list[dict]:
    """One row per question both models answered: question, family, small/large scores and confidence."""
    cache = load_cache(CACHE)
    ll = load_cache(LIKELIHOOD)
    rows = []
    for t in tasks:
        s, l = cache.get(("small", t.question)), cache.get(("large", t.question))
        if s and l:
            # scored here, not from the cache, so a change to the scorer needs no model run
            rows.append({"question": t.question, "family": t.family, "small": score(s["text"], t.answer),
                         "large": score(l["text"], t.answer),
                         "small_conf": s["mean_logprob"], "train": is_train(t.question),
                         # the second measure: the chance each model gives the reference (None if not run)
                         "p_small": math.exp(ll[("small", t.question)]["ref_logprob"]) if ("small", t.question) in ll else None,
                         "p_large": math.exp(ll[("large", t.question)]["ref_logprob"]) if ("large", t.question) in ll else None})
    return rows


def design(questions: list[str]) -> np.ndarray:
    x = np.zeros((len(questions), len(SHAPE_FEATURES) + NUM_BUCKETS))
    for i, q in enumerate(questions):
        for j, v in featurize(q, NUM_BUCKETS).items():
            x[i, j] = v
    return x


def ridge(x: np.ndarray, y: np.ndarray, lam: float) -> np.ndarray:
    reg = lam * np.eye(x.shape[1])
    reg[0, 0] = 0.0  # the bias is not shrunk
    return np.linalg.solve(x.T @ x + reg, x.T @ y)


def curve(order_key: np.ndarray, small: np.ndarray, large: np.ndarray, share: float) -> float:
    """Accuracy when the `share` of prompts with the highest key go to the large model."""
    k = int(round(share * len(small)))
    pick = np.zeros(len(small), bool)
    pick[np.argsort(-order_key, kind="stable")[:k]] = True
    return float(np.where(pick, large, small).mean())


def area_over_random(key: np.ndarray, small: np.ndarray, large: np.ndarray) -> float:
    """Mean over interior shares of (accuracy - random's accuracy at that share)."""
    return float(np.mean([curve(key, small, large, s) - ((1 - s) * small.mean() + s * large.mean())
                          for s in SHARES[1:-1]]))


def fit(x: np.ndarray, rows: list[dict]) -> tuple[np.ndarray, float, dict]:
    small = np.array([r["small"] for r in rows])
    large = np.array([r["large"] for r in rows])
    y = large - small
    folds = np.arange(len(rows)) % 5
    cv = {}
    for lam in [0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0, 1000.0]:
        pred = np.zeros(len(rows))
        for f in range(5):
            w = ridge(x[folds != f], y[folds != f], lam)
            pred[folds == f] = x[folds == f] @ w
        cv[lam] = area_over_random(pred, small, large)
    best = max(cv, key=cv.get)
    return ridge(x, y, best), best, {str(k): round(v, 4) for k, v in cv.items()}


def unseen_family_gain(rows: list[dict], lam: float) -> float:
    """Leave one family out over all questions: each question's gain is predicted by a fit that never saw its
    family, so the area over random says how much of the routing carries to kinds of questions not trained on."""
    x = design([r["question"] for r in rows])
    small = np.array([r["small"] for r in rows])
    large = np.array([r["large"] for r in rows])
    fam = np.array([r["family"] for r in rows])
    pred = np.zeros(len(rows))
    for f in set(fam):
        w = ridge(x[fam != f], (large - small)[fam != f], lam)
        pred[fam == f] = x[fam == f] @ w
    return area_over_random(pred, small, large)


def time_choices(router: DifficultyRouter, questions: list[str]) -> dict:
    long_prompt = " ".join(questions) * 3   # far longer than any question: MAX_CHARS bounds the work
    per, cpu = [], []
    for q in questions:
        t0, c0 = time.perf_counter(), time.process_time()
        router.choose(q)
        per.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(20):
        router.choose(long_prompt)
    long_us = (time.perf_counter() - t0) / 20 * 1e6
    long_cpu_us = (time.process_time() - c0) / 20 * 1e6   # wall time on these shared cores includes waiting
    per_us = np.array(per) * 1e6
    return {"median_us": round(float(np.median(per_us)), 1), "p99_us": round(float(np.percentile(per_us, 99)), 1),
            "max_us": round(float(per_us.max()), 1), "cpu_max_us": round(max(cpu) * 1e6, 1),
            "long_prompt_chars": len(long_prompt),
            "long_prompt_us": round(long_us, 1), "long_prompt_cpu_us": round(long_cpu_us, 1)}


def bootstrap_gain(key: np.ndarray, small: np.ndarray, large: np.ndarray, n: int = 300) -> list[float]:
    """95% interval of the router's mean accuracy gain over random (interior shares), resampling prompts."""
    rng = np.random.default_rng(0)
    vals = []
    for _ in range(n):
        i = rng.integers(0, len(small), len(small))
        vals.append(area_over_random(key[i], small[i], large[i]))
    return [round(float(np.percentile(vals, 2.5)), 4), round(float(np.percentile(vals, 97.5)), 4)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-models", action="store_true", help="use only the cached answers")
    ap.add_argument("--num-tasks", type=int, default=NUM_TASKS)
    args = ap.parse_args()
    os.makedirs(RESULTS, exist_ok=True)
    tasks = make_tasks(args.num_tasks, seed=0, exclude=frozenset(q for q, _ in EXAMPLES))
    if not args.no_models:
        for which in ("small", "large"):  # one model in memory at a time
            run_model(which, tasks, CACHE)
            # only the held-out questions: P(ref) judges the router and is not fitted on (it runs slowly)
            run_likelihood(which, [t for t in tasks if not is_train(t.question)], LIKELIHOOD)
    rows = load_rows(tasks)
    train = [r for r in rows if r["train"]]
    test = [r for r in rows if not r["train"]]

    x_train = design([r["question"] for r in train])
    w, lam, cv = fit(x_train, train)
    q = np.percentile(x_train @ w, np.arange(101)).tolist()
    params = DifficultyParams(NUM_BUCKETS, [round(float(v), 6) for v in w], [round(v, 6) for v in q])
    with open(PARAMS, "w", encoding="utf-8") as f:
        json.dump(params.to_json(), f)
    params = DifficultyParams.load(PARAMS)   # evaluate exactly what ships (rounded)

    small = np.array([r["small"] for r in test])
    large = np.array([r["large"] for r in test])
    gain_pred = np.array([DifficultyRouter(params).predicted_gain(r["question"]) for r in test])
    conf = np.array([r["small_conf"] for r in test])
    # P(ref) on the held-out questions both models were scored on (all of them after a full run)
    has_p = np.array([r["p_small"] is not None and r["p_large"] is not None for r in test])
    with_p = bool(has_p.any())
    p_small = np.array([r["p_small"] for r in test], float)[has_p] if with_p else None
    p_large = np.array([r["p_large"] for r in test], float)[has_p] if with_p else None
    table = []
    for share in SHARES:
        router = DifficultyRouter(params, large_share=share)
        pick = np.array([router.choose(r["question"]) == "large" for r in test])
        got = float(pick.mean())
        table.append({
            "target_share": share, "router_share": round(got, 4),
            "router_acc": round(float(np.where(pick, large, small).mean()), 4),
            "random_acc": round(float((1 - got) * small.mean() + got * large.mean()), 4),
            "cascade_acc": round(curve(-conf, small, large, got), 4),   # least confident small answers go large
            "oracle_acc": round(curve(large - small, small, large, got), 4)})
        if with_p:  # the same choices, judged by the chance each model gives the reference
            pk = pick[has_p]
            got_p = float(pk.mean())
            table[-1]["router_p_ref"] = round(float(np.where(pk, p_large, p_small).mean()), 4)
            table[-1]["random_p_ref"] = round(float((1 - got_p) * p_small.mean() + got_p * p_large.mean()), 4)
    # The quality-first setting: large only where the predicted gain is positive, whatever share that gives.
    r0 = DifficultyRouter(params, threshold=0.0)
    pick0 = np.array([r0.choose(r["question"]) == "large" for r in test])
    s0 = float(pick0.mean())
    positive_gain = {"router_share": round(s0, 4), "router_acc": round(float(np.where(pick0, large, small).mean()), 4),
                     "random_acc": round(float((1 - s0) * small.mean() + s0 * large.mean()), 4)}
    timing = time_choices(DifficultyRouter(params), [r["question"] for r in test])
    families = sorted({r["family"] for r in rows})
    fam = {f: {"n": sum(r["family"] == f for r in test),
               "small": round(float(np.mean([r["small"] for r in test if r["family"] == f] or [0])), 3),
               "large": round(float(np.mean([r["large"] for r in test if r["family"] == f] or [0])), 3)}
           for f in families}
    result = {
        "benchmark": "auto_routing", "machine": {"platform": platform.platform(), "cpu": platform.processor(),
                                                  "isa": "AVX2", "load": os.getloadavg()},
        "models": {"small": "smollm2-135m (SmolLM2-135M-Instruct Q4_1)", "large": "gemma3-270m (Gemma 3 270M base Q4_K_M)"},
        "data": f"{args.num_tasks} generated questions (benchmarks/auto_routing_tasks.py, seed 0), "
                f"{len(train)} train / {len(test)} held out",
        "command": "nice -n 10 python benchmarks/auto_routing.py",
        "models_run_this_time": not args.no_models,   # else everything came from the cached answers
        "num_train": len(train), "ridge_lambda": lam, "cv_area_over_random": cv,
        "held_out": {"n": len(test), "always_small_acc": round(float(small.mean()), 4),
                     "always_large_acc": round(float(large.mean()), 4),
                     "router_gain_over_random_ci95": bootstrap_gain(gain_pred, small, large),
                     "router_mean_gain_over_random": round(area_over_random(gain_pred, small, large), 4),
                     "cascade_mean_gain_over_random": round(area_over_random(-conf, small, large), 4)},
        "unseen_family_mean_gain_over_random": round(unseen_family_gain(rows, lam), 4),
        "p_ref": None if not with_p else {
            "n": int(has_p.sum()), "always_small": round(float(p_small.mean()), 4), "always_large": round(float(p_large.mean()), 4),
            "router_mean_gain_over_random": round(float(np.mean([t["router_p_ref"] - t["random_p_ref"]
                                                                  for t in table[1:-1]])), 4),
            "router_gain_over_random_ci95": bootstrap_gain(gain_pred[has_p], p_small, p_large)},
        "table": table, "threshold_zero": positive_gain, "families_held_out": fam, "choose_timing": timing,
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip(),
    }
    with open(HELD_OUT, "w", encoding="utf-8") as f:   # what tests/test_auto_router.py checks the router on
        for r in test:
            f.write(json.dumps({"question": r["question"], "family": r["family"], "small": r["small"],
                                "large": r["large"]}) + "\n")
    with open(os.path.join(RESULTS, "auto_routing.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    md = render_md(result)
    with open(os.path.join(RESULTS, "auto_routing.md"), "w", encoding="utf-8") as f:
        f.write(md)
    print(md)
    plot(result)


def render_md(r: dict) -> str:
    h = r["held_out"]
    lines = [
        "# Easy -> small routing: quality against cost (held-out questions)", "",
        f"- Models: small = {r['models']['small']}, large = {r['models']['large']}; greedy, prompt formats in "
        "benchmarks/auto_routing_models.py (small: its chat template with eight example turns; large: the same "
        "examples as plain `Q:`/`A:` text).",
        f"- Data: {r['data']}; score = the answer's first line matches the reference.",
        f"- Machine: {r['machine']['platform']}, ISA {r['machine']['isa']}, load average "
        f"{', '.join(f'{v:.2f}' for v in r['machine']['load'])} at the end of the run"
        + ("" if r["models_run_this_time"] else " (models not run this time: answers from the cache)") + ".",
        f"- Command: `{r['command']}` (answers cached in benchmarks/results/auto_routing_outputs.jsonl).",
        f"- Router: ridge regression on prompt features predicting score(large) - score(small), lambda "
        f"{r['ridge_lambda']} by 5-fold CV on the training split.", "",
        f"Held out: {h['n']} questions; always-small {h['always_small_acc']:.3f}, always-large "
        f"{h['always_large_acc']:.3f}. Router's accuracy over random at equal share, mean over shares "
        f"0.1-0.9: {h['router_mean_gain_over_random']:+.4f} (95% bootstrap interval "
        f"{h['router_gain_over_random_ci95'][0]:+.4f} .. {h['router_gain_over_random_ci95'][1]:+.4f}); the "
        f"small-model-confidence cascade: {h['cascade_mean_gain_over_random']:+.4f}. Leaving each question family "
        f"out of the fit in turn (all {h['n'] + r['num_train']} questions), the gain over random on the family left "
        f"out: {r['unseen_family_mean_gain_over_random']:+.4f}.", "",
        "| target share to large | router's share | router acc | random acc (same share) | cascade acc (same share) "
        "| oracle acc | router P(ref) | random P(ref) |",
        "|---|---|---|---|---|---|---|---|"]
    for t in r["table"]:
        lines.append(f"| {t['target_share']:.1f} | {t['router_share']:.3f} | {t['router_acc']:.3f} | "
                     f"{t['random_acc']:.3f} | {t['cascade_acc']:.3f} | {t['oracle_acc']:.3f} | "
                     f"{t.get('router_p_ref', float('nan')):.3f} | {t.get('random_p_ref', float('nan')):.3f} |")
    if r["p_ref"]:
        p = r["p_ref"]
        lines += ["", "P(ref), the second measure: the probability the model gives the reference answer in its "
                  "prompt format (prompt logprobs of prompt + reference; exp of the sum over the reference's tokens), "
                  f"averaged over {p['n']} held-out questions. Always-small {p['always_small']:.3f}, always-large {p['always_large']:.3f}; the router "
                  "(fitted on accuracy, not on this) over random at equal share, mean over shares 0.1-0.9: "
                  f"{p['router_mean_gain_over_random']:+.4f} (95% bootstrap interval "
                  f"{p['router_gain_over_random_ci95'][0]:+.4f} .. {p['router_gain_over_random_ci95'][1]:+.4f})."]
    z = r["threshold_zero"]
    lines += ["", f"With `threshold=0` (large only where a gain is predicted): share {z['router_share']:.3f}, accuracy "
              f"{z['router_acc']:.3f} (random at that share {z['random_acc']:.3f})."]
    tm = r["choose_timing"]
    lines += ["", f"Cost of one choice (pure Python, this machine): median {tm['median_us']} us, p99 "
              f"{tm['p99_us']} us, max {tm['max_us']} us wall ({tm['cpu_max_us']} us of CPU: the rest is waiting for a core "
              f"at this load) over the held-out questions; a {tm['long_prompt_chars']}"
              f"-character prompt {tm['long_prompt_us']} us wall, {tm['long_prompt_cpu_us']} us of CPU (only the last {MAX_CHARS} characters are read).", "",
              "Per family (held out): accuracy small / large", "",
              "| family | n | small | large |", "|---|---|---|---|"]
    for f, v in r["families_held_out"].items():
        lines.append(f"| {f} | {v['n']} | {v['small']:.3f} | {v['large']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(r: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    t = r["table"]
    xs = [p["router_share"] for p in t]
    with_p = bool(r["p_ref"])
    fig, axes = plt.subplots(1, 2 if with_p else 1, figsize=(11 if with_p else 6, 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(xs, [p["router_acc"] for p in t], "o-", label="difficulty router")
    ax.plot(xs, [p["random_acc"] for p in t], "--", label="random")
    ax.plot(xs, [p["cascade_acc"] for p in t], "s:", label="cascade on small's confidence")
    ax.plot(xs, [p["oracle_acc"] for p in t], "k:", alpha=0.5, label="oracle")
    ax.set_ylabel("held-out accuracy")
    if with_p:
        ax2 = axes[0][1]
        ax2.plot(xs, [p["router_p_ref"] for p in t], "o-", label="difficulty router")
        ax2.plot(xs, [p["random_p_ref"] for p in t], "--", label="random")
        ax2.set_ylabel("held-out mean P(reference answer)")
    for a in axes[0]:
        a.set_xlabel("share of requests sent to the large model")
        a.legend()
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(RESULTS, "auto_routing.png"), dpi=100)


if __name__ == "__main__":
    main()
