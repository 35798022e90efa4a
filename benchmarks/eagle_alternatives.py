"""How often the target's next token is among an eagle head's top k choices: what alternatives to a draft's
first token (a token tree, speculative_token_tree "[(0,), (1,), (2,)]") can add over its first choice alone.

Teacher-forced on held-out answers made as train_eagle.py makes them (train_draft.py's prompts, answered
greedily by the default model; 'bench' is benchmarks/speculative.py's chat questions): at every answer
position the head drafts from the target's feature, and a position counts for top-k where the target's
token is one of the head's k likeliest. "chain, 2nd" is the share of positions where a 2-token chain of top
choices is accepted whole, for comparison (what a second row spent on the chain brings).

    python benchmarks/eagle_alternatives.py     # ~30 s on two cores: 40 prompts' data, half held out

Writes results/<name>.{json,md}. The data and features are cached in --data-cache and --feature-cache.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from common import report
from train_draft import target_tensors
from train_eagle import examples, load_data, target_features
from kvserve.spec_decode.eagle_head import SHIPPED_HEAD, EagleHeadReference, read_head

TOP = 6


@torch.no_grad()
def coverage(head: EagleHeadReference, rows: list[tuple]) -> dict:
    """Over the rows' answer positions: the share whose next token is in the head's top k (k = 1..TOP), and
    whose next two tokens a 2-token chain of top choices drafts."""
    hits, chain, positions = torch.zeros(TOP), 0, 0
    for ids, labels, feats, answer_start, _ in rows:
        first, end = max(answer_start - 1, 0), ids.shape[0] - 3  # as train_eagle.acceptance() with k = 2
        if end <= first:
            continue
        chains = head.unrolled(feats.float(), ids, 2)
        top = head.logits(chains[0][first:end]).topk(TOP, dim=-1).indices
        label = labels[first + 1:end + 1]
        hits += (top == label[:, None]).cumsum(-1).clamp(max=1).sum(0).float()
        second = head.logits(chains[1][first:end]).argmax(-1) == labels[first + 2:end + 2]
        chain += int(((top[:, 0] == label) & second).sum())
        positions += end - first
    n = max(1, positions)
    return {"positions": positions, "top_k": (hits / n).tolist(), "chain_2nd": chain / n}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default=None, help="a head file (default: the shipped head)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--num-texts", type=int, default=10)
    ap.add_argument("--held-out", type=float, default=0.5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--data-cache", default="/tmp/kvserve-eagle-alternatives-data.pt")
    ap.add_argument("--feature-cache", default="/tmp/kvserve-eagle-alternatives-features.pt")
    ap.add_argument("--name", default="eagle_alternatives")
    args = ap.parse_args()
    # train_eagle.py's data and feature steps, with its defaults for what this script does not vary.
    data_args = argparse.Namespace(**vars(args), chat_subjects="model", gen_batch=64, train_rows=None, max_len=512,
                                   dtype="float32", device="cpu", fuse_layers=[])
    _, held, _ = load_data(data_args)
    feats, _ = target_features(data_args, held, {"held_only": [args.seed, args.num_prompts, args.num_texts,
                                                               args.held_out, args.max_tokens]})
    fcfg, embedding, _, _ = target_tensors([])
    head_path = Path(args.head) if args.head else SHIPPED_HEAD
    cfg, tensors, _ = read_head(head_path)
    head = EagleHeadReference(cfg, embedding, tensors)  # its tensors become float parameters
    rows = examples(held, feats, head.vocab_ids, fcfg.vocab_size, "cpu")
    results = {kind: coverage(head, [r for r in rows if kind == "all" or r[4] == kind])
               for kind in sorted({r[4] for r in rows}) + ["all"]}
    table = ("| held out | positions | " + " | ".join(f"top {k}" for k in range(1, TOP + 1)) + " | chain, 2nd |\n"
             "|---|---:|" + "---:|" * (TOP + 1) + "\n")
    table += "".join(f"| {kind} | {r['positions']} | " + " | ".join(f"{x:.3f}" for x in r["top_k"])
                     + f" | {r['chain_2nd']:.3f} |\n" for kind, r in results.items())
    setup = (f"Head: {head_path.name}. Held-out answers: {len(held)} rows of train_draft.py's data (seed "
             f"{args.seed}, {args.num_prompts} prompts, {args.held_out:.0%} held out), answered greedily by the "
             "default model in float32; teacher-forced, the target's feature at every answer position.")
    report(args.name, "Eagle head: the target's next token among its top k choices", args, setup, table, results)


if __name__ == "__main__":
    main()
