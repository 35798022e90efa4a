"""Would a datastore of the target's own answers draft the tokens the eagle head misses? (Retrieval drafts,
as REST does: the longest suffix of the context, up to MAX_N tokens, found in answers the target gave to
other prompts, and the token that followed it there most often.)

Teacher-forced on held-out answers made as train_eagle.py makes them (train_draft.py's prompts, answered
greedily by the default model; 'bench' is benchmarks/speculative.py's chat questions): at every answer
position, the head's first choice and the datastore's draft for the next token, each right or wrong. The
table splits the datastore's drafts by the length of the suffix it matched and by how often its token
followed that suffix (its share), and counts what it gets right where the head is wrong: what a
datastore row beside the head's draft (a second alternative) could add.

    python benchmarks/eagle_datastore.py    # the data of train_eagle.py --seed 1 --num-prompts 2000
        # --num-texts 0 --held-out 0.05 (~6 min to make on two AVX-512 cores; --data-cache takes that run's)

Writes results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import collections

import torch

from common import report
from train_draft import target_tensors
from train_eagle import examples, load_data, target_features
from kvserve.spec_decode.eagle_head import SHIPPED_HEAD, EagleHeadReference, read_head
from kvserve.utils.device import cpu_has_native_bf16

MAX_N = 6


def build_datastore(rows: list[dict], kinds: set[str]) -> list[dict[tuple, collections.Counter]]:
    """tables[n][n-gram] = counts of the token after it, over whole rows (prompt and answer) of the kinds."""
    tables: list[dict[tuple, collections.Counter]] = [{} for _ in range(MAX_N + 1)]
    for r in rows:
        if r["kind"] not in kinds:
            continue
        ids = r["ids"]
        for i in range(len(ids) - 1):
            for n in range(1, min(MAX_N, i + 1) + 1):
                tables[n].setdefault(tuple(ids[i + 1 - n:i + 1]), collections.Counter())[ids[i + 1]] += 1
    return tables


def draft(tables: list[dict[tuple, collections.Counter]], context: list[int]) -> tuple[int, int, float] | None:
    """(token, suffix length matched, the token's share after that suffix) for the longest suffix found."""
    for n in range(min(MAX_N, len(context)), 0, -1):
        counts = tables[n].get(tuple(context[-n:]))
        if counts:
            token, c = counts.most_common(1)[0]
            return token, n, c / sum(counts.values())
    return None


def bucket(n: int, share: float) -> str:
    return f"suffix {min(n, 4)}{'+' if n >= 4 else ''}, share " + (">= 0.8" if share >= 0.8 else
                                                                    ">= 0.5" if share >= 0.5 else "< 0.5")


@torch.no_grad()
def score(head: EagleHeadReference, rows: list[tuple], raw: list[dict], tables) -> dict:
    per: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])  # drafts, right, head wrong, right there
    positions = head_right = 0
    for (ids, _, feats, answer_start, _), r in zip(rows, raw):
        cut = len(r["ids"]) - ids.shape[0]
        first_choice = head.vocab_ids[head.logits(head.unrolled(feats.float(), ids, 1)[0]).argmax(-1)]
        # The head drafts token cut + t + 2 from the feature at t and token t + 1 (as train_eagle.acceptance).
        for t in range(max(answer_start - 1, 0), ids.shape[0] - 2):
            truth = r["ids"][cut + t + 2]
            head_ok = int(first_choice[t]) == truth
            positions += 1
            head_right += head_ok
            d = draft(tables, r["ids"][:cut + t + 2])
            if d is None:
                continue
            token, n, share = d
            c = per[bucket(n, share)]
            c[0] += 1
            c[1] += token == truth
            c[2] += not head_ok
            c[3] += token == truth and not head_ok
    return {"positions": positions, "head_right": head_right / max(1, positions),
            "buckets": {k: {"drafts": v[0], "right": v[1], "head_wrong": v[2], "right_where_head_wrong": v[3]}
                        for k, v in sorted(per.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=2000)
    ap.add_argument("--held-out", type=float, default=0.05)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--datastore-kinds", nargs="+", default=["chat", "summarise", "repeat"],
                    help="which training rows go into the datastore")
    ap.add_argument("--data-cache", default="/tmp/kvserve-eagle-datastore-data.pt")
    ap.add_argument("--feature-cache", default="/tmp/kvserve-eagle-datastore-features.pt")
    ap.add_argument("--name", default="eagle_datastore")
    args = ap.parse_args()
    # train_eagle.py's data and feature steps, with its defaults for what this script does not vary.
    data_args = argparse.Namespace(**vars(args), num_texts=0, chat_subjects="model", gen_batch=64, train_rows=None,
                                   max_len=512, dtype="bfloat16" if cpu_has_native_bf16() else "float32",
                                   device="cpu", fuse_layers=[])
    train, held, _ = load_data(data_args)
    feats, _ = target_features(data_args, held, {"held_only": [args.seed, args.num_prompts, args.held_out,
                                                               args.max_tokens]})
    tables = build_datastore(train, set(args.datastore_kinds))
    fcfg, embedding, _, _ = target_tensors([])
    cfg, tensors, _ = read_head(SHIPPED_HEAD)
    head = EagleHeadReference(cfg, embedding, tensors)  # its tensors become float parameters
    rows = examples(held, feats, head.vocab_ids, fcfg.vocab_size, "cpu")
    results = {kind: score(head, [x for x in rows if x[4] == kind], [r for r in held if r["kind"] == kind], tables)
               for kind in ("bench", "chat")}
    table = ("| held out | datastore draft | share of positions | right | right where the head is wrong "
             "(share of positions) |\n|---|---|---:|---:|---:|\n")
    for kind, res in results.items():
        n = max(1, res["positions"])
        table += f"| {kind} | (the head's first choice) | 1.000 | {res['head_right']:.3f} | |\n"
        for b, c in res["buckets"].items():
            table += (f"| {kind} | {b} | {c['drafts'] / n:.3f} | {c['right'] / max(1, c['drafts']):.3f} | "
                      f"{c['right_where_head_wrong'] / n:.3f} |\n")
        extra = sum(c["right_where_head_wrong"] for c in res["buckets"].values()) / n
        table += f"| {kind} | all of them | | | {extra:.3f} |\n"
    setup = (f"Datastore: {sum(len(t) for t in tables)} n-grams (n = 1..{MAX_N}) of {len(train)} training rows' "
             f"prompts and answers ({', '.join(args.datastore_kinds)}); head: {SHIPPED_HEAD.name}. Held out: "
             f"train_draft.py's split (seed {args.seed}, {args.num_prompts} prompts, {args.held_out:.0%}) and the "
             "benchmark's 16 chat questions, teacher-forced at every answer position.")
    report(args.name, "Eagle head: what a datastore of the target's answers would draft", args, setup, table,
           results)


if __name__ == "__main__":
    main()
