"""How well an eagle head's own confidence predicts whether its draft is accepted: the basis for drafting by
confidence (EAGLE-2's dynamic drafts: skip a draft the head doubts, add a second token where it is sure).

Teacher-forced on train_eagle.py's held-out answers (its caches: --data-cache, --feature-cache from a run
with the same data arguments), greedy: at every answer position the head drafts two tokens from the
target's feature; per bucket of its top-1 probability p1 (softmax over its own vocabulary): the share of
drafts, how often the first token is accepted, and how often the second is, given the first was.

    python benchmarks/eagle_confidence.py --data-cache /tmp/s22/data.pt --feature-cache /tmp/s22/feat.pt

Writes results/<name>.{json,md}. No model runs here but the head: a few seconds on two cores.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import report
from train_draft import target_tensors
from train_eagle import examples
from kvserve.spec_decode.eagle_head import SHIPPED_HEAD, EagleHeadReference, read_head

EDGES = [0.0, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
DEPTH = 2  # draft tokens per position: the first, and the second given the first


@torch.no_grad()
def draft_pairs(head: EagleHeadReference, rows: list[tuple]) -> dict[str, torch.Tensor]:
    """Per kind of held-out answer ('bench': the benchmark's chat questions; 'other': the rest), one row per
    answer position: p1, first token accepted, p2, second token accepted."""
    out: dict[str, list[torch.Tensor]] = {"bench": [], "other": []}
    for ids, labels, feats, answer_start, kind in rows:
        first, end = max(answer_start - 1, 0), ids.shape[0] - DEPTH - 1  # as train_eagle.acceptance()
        if end <= first:
            continue
        chains = head.unrolled(feats.float(), ids, DEPTH)
        cols = []
        for j in range(DEPTH):
            p, pred = head.logits(chains[j][first:end]).float().softmax(-1).max(-1)
            cols += [p, (pred == labels[first + 1 + j:end + 1 + j]).float()]
        out["bench" if kind == "bench" else "other"].append(torch.stack(cols, 1))
    return {k: torch.cat(v) for k, v in out.items() if v}


def buckets(pairs: torch.Tensor) -> list[dict]:
    p1, ok1, _, ok2 = pairs.T
    rows = []
    for lo, hi in zip(EDGES, EDGES[1:]):
        m = (p1 >= lo) & ((p1 < hi) if hi < 1.0 else (p1 <= hi))
        both = m & (ok1 > 0)
        rows.append({"p1": [lo, hi], "share": m.float().mean().item(),
                     "first_accepted": ok1[m].mean().item() if m.any() else None,
                     "second_given_first": ok2[both].mean().item() if both.any() else None})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default=None, help="a head file (default: the shipped head)")
    ap.add_argument("--data-cache", required=True)
    ap.add_argument("--feature-cache", required=True)
    ap.add_argument("--name", default="eagle_confidence")
    args = ap.parse_args()

    data = torch.load(args.data_cache, weights_only=False)
    feats = torch.load(args.feature_cache, weights_only=False)["features"][len(data["train"]):]
    fcfg, embedding, _, _ = target_tensors([])
    head_path = Path(args.head) if args.head else SHIPPED_HEAD
    cfg, tensors, _ = read_head(head_path)
    head = EagleHeadReference(cfg, embedding, tensors)  # its tensors become float parameters
    pairs = draft_pairs(head, examples(data["held"], feats, head.vocab_ids, fcfg.vocab_size, "cpu"))

    def cell(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}"

    table = ""
    results = {}
    for kind, t in pairs.items():
        rows = buckets(t)
        results[kind] = {"drafts": len(t), "first_accepted": t[:, 1].mean().item(),
                         "both_accepted": (t[:, 1] * t[:, 3]).mean().item(), "mean_p1": t[:, 0].mean().item(),
                         "buckets": rows}
        r = results[kind]
        table += (f"**{kind}**: {r['drafts']} drafts, first token accepted {r['first_accepted']:.3f}, both "
                  f"{r['both_accepted']:.3f}, mean p1 {r['mean_p1']:.3f}\n\n"
                  "| p1 | share of drafts | first token accepted | second accepted, given the first |\n"
                  "|---|---:|---:|---:|\n")
        table += "".join(f"| {b['p1'][0]:.1f}-{b['p1'][1]:.1f} | {b['share']:.3f} | {cell(b['first_accepted'])} | "
                         f"{cell(b['second_given_first'])} |\n" for b in rows) + "\n"
    setup = (f"Head: {head_path.name}. Held-out answers of {args.data_cache} ({len(data['held'])} rows; "
             "'bench' is the benchmark's chat questions, 'other' the rest), teacher-forced, greedy; p1 is the "
             "head's top-1 probability over its vocabulary.")
    report(args.name, "Eagle head: confidence against acceptance", args, setup, table, results)


if __name__ == "__main__":
    main()
