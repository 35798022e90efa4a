"""The table an eagle head's drafts are first trusted by (kvserve/spec_decode/confidence.py), measured by the
engine itself on held-out prompts and written beside the head file (NAME.calibration.json).

Without it, a fresh engine trusts each row at the head's own probability for its token and corrects that by
what the target does, 1/32 of the way per outcome. The shipped head is over-confident in its middle buckets and
far more so for later chain tokens, so a fresh server drafts rows that do not pay until a few hundred drafts
have taught it otherwise. Here the engine drafts as a user's would (greedy, one request at a time, a chain of 4
with two alternatives to its first token, every row the head drafts checked against the target's tokens) on
prompts none of the benchmark's: train_draft.py's mix (60% chat questions the target writes itself, the
benchmark's own questions banned; 20% summaries; 20% copies of text and code), drawn with another seed than
the head's training data. Each bucket's rate is the share of its rows the target took, with 4 observations at
the bucket's centre added (an empty bucket keeps the centre). Rows are counted as the engine drafts them, so
later chain tokens are those of chains the rule chose to extend (while the chain so far was 40% likely by the
table as it learnt): the same selection as when the table is used.

    python benchmarks/eagle_calibration.py   # ~4 min on two cores: the shipped head's table

Writes the table file (--out, default beside --head) and results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from common import git_rev, report
from train_draft import make_prompts
from kvserve import LLM, SamplingParams
from kvserve.spec_decode.confidence import KINDS, bucket_centres, calibration_path
from kvserve.spec_decode.eagle_head import SHIPPED_HEAD

TREE = "[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (1,), (2,)]"
PRIOR = 4  # observations at a bucket's centre added to its own


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default=None, help="a head file (default: the shipped head)")
    ap.add_argument("--out", default=None, help="the table file (default: beside the head)")
    ap.add_argument("--seed", type=int, default=7, help="of the prompts (the shipped head's data: seed 0)")
    ap.add_argument("--num-prompts", type=int, default=240)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--gen-batch", type=int, default=64, help="batch of the target writing the chat questions")
    ap.add_argument("--name", default="eagle_calibration")
    args = ap.parse_args()
    head = Path(args.head) if args.head else SHIPPED_HEAD
    out = Path(args.out) if args.out else calibration_path(head)

    data_args = argparse.Namespace(seed=args.seed, num_prompts=args.num_prompts, num_texts=0, held_out=1.0,
                                   chat_subjects="model", gen_batch=args.gen_batch)
    _, held = make_prompts(data_args)
    items = [(kind, message) for kind, message in held if kind != "bench"]  # not the benchmark's questions

    llm = LLM(speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 6,
                                  "speculative_token_tree": TREE})
    cal = llm.engine.speculator.calibration
    cal.rate = [bucket_centres() for _ in KINDS]  # not a table already beside the head
    cal.count_outcomes()

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    t0 = time.monotonic()
    tokens = sum(len(llm.chat([[{"role": "user", "content": m}]], params)[0].outputs[0].token_ids)
                 for _, m in items)
    seconds = time.monotonic() - t0

    counts = cal.counts
    centres = bucket_centres()
    table = {kind: [(taken + PRIOR * c) / (rows + PRIOR) for (taken, rows), c in zip(counts[k], centres)]
             for k, kind in enumerate(KINDS)}
    source = {"script": "benchmarks/eagle_calibration.py", "git": git_rev(), "head": head.name,
              "prompts": {"seed": args.seed, "num_prompts": len(items), "max_tokens": args.max_tokens},
              "observations": {kind: [rows for _, rows in counts[k]] for k, kind in enumerate(KINDS)}}
    out.write_text(json.dumps({**{k: [round(x, 4) for x in v] for k, v in table.items()}, "source": source},
                              indent=1) + "\n")

    lines = []
    for k, kind in enumerate(KINDS):
        total = sum(rows for _, rows in counts[k])
        lines += [f"**{kind}** ({total} rows)\n", "| head's probability | rows | taken by the target | table |",
                  "|---|---:|---:|---:|"]
        for b, ((taken, rows), value) in enumerate(zip(counts[k], table[kind])):
            rate = f"{taken / rows:.2f}" if rows else ""
            lines.append(f"| {b / 10:.1f}-{(b + 1) / 10:.1f} | {rows} | {rate} | {value:.2f} |")
        lines.append("")
    setup = (f"Head: {head.name}. {len(items)} held-out prompts (train_draft.py's mix, seed {args.seed}), greedy, "
             f"one at a time, tree {TREE} under the draft-length rule; {tokens} tokens in {seconds:.0f} s. "
             f"Table written to {out.name}.")
    report(args.name, "Eagle head: the calibration table it starts from", args, setup, "\n".join(lines),
           {"table": table, "counts": counts, "tokens": tokens, "seconds": seconds}, script="eagle_calibration")


if __name__ == "__main__":
    main()
