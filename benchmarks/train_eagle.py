"""Train the eagle head shipped for the default model (speculative decoding, method "eagle").

    python benchmarks/train_eagle.py --num-prompts 6000 --num-texts 300 --gen-batch 256 --steps 1500
        # the shipped head (results/train_eagle.md): ~6 min on an H200 (STAGE=eagle bash
        # benchmarks/gpu_speculative.sh); on 2 AVX2 cores, with --dtype float32, several hours (estimated)
    python benchmarks/train_eagle.py --dtype float32   # the head shipped before it (train_eagle_cpu_2000.md): ~75 min
    python benchmarks/train_eagle.py --num-prompts 40 --num-texts 10 --steps 20 --out /tmp/h.safetensors \
        --data-cache /tmp/smoke-data.pt --feature-cache /tmp/smoke-features.pt --name train_eagle_smoke   # smoke
    STAGE=fuse bash benchmarks/gpu_speculative.sh   # --fuse-layers 2 15 against the same head without, from one
        # data set (results/train_eagle_fused.md): an experiment; no better, and the engine refuses such heads
    python benchmarks/train_eagle.py --num-prompts 1000 --num-texts 50 --steps 250 --dtype float32 --attention \
        --compare HEAD ...   # a head with self-attention, scored beside other heads on the same held-out answers
        # (results/train_eagle_attention_cpu_1000.md): an experiment; no better, and the engine refuses such heads
    ... --soft-labels 0.5   # half the token loss on the target's whole distribution (distillation):
        # results/train_eagle_soft_labels_cpu_1000.md, +0.01 first-token acceptance, within a re-run's spread
    python benchmarks/train_eagle.py --seed 1 --num-prompts 2000 --num-texts 0 --held-out 0.05 --steps 300 \
        --lr 0.001 --init kvserve/spec_decode/drafts/smollm2-135m-eagle.safetensors --out /tmp/h.safetensors \
        --compare kvserve/spec_decode/drafts/smollm2-135m-eagle.safetensors   # the shipped head trained on
        # 1900 answers it never saw (another seed's questions): results/train_eagle_more_data_cpu_2000.md

Data: train_draft.py's (the target, SmolLM2-135M-Instruct Q4_1, answers offline chat, summarise and
repeat prompts greedily; its top-1 choice at every position is the label; same held-out split), with chat
messages the target writes itself (--chat-subjects model: it continues a numbered list of example questions,
sampled, seeded); a head trained on templated questions (--chat-subjects vocab, the head shipped before,
results/train_eagle_templates.md) drafted worse on free chat and on the benchmark's questions.
Features: the target's final hidden state (after the last norm) at every position, from a forward of its
dequantized weights in plain torch (draft_reference.py with all 30 layers; bfloat16 autocast where the CPU
has native bfloat16, else float32: --dtype). Cached in --feature-cache.

Training (kvserve/spec_decode/eagle_head.py, EagleHeadReference.training_loss): from each position's
feature and the next token, the head predicts the next feature and the target's next choice, then drafts
on from its own prediction, --unroll steps, as at inference; cross-entropy on the choice plus
--feature-weight x smooth-L1 on the feature. fc starts as "copy the feature", the LM head as the target's
tied embedding restricted to the --vocab tokens most frequent in the labels.

Acceptance is measured teacher-forced on the held-out answers: from every answer position, the head
drafts k tokens from the target's feature and its own predictions after it, and a draft token counts while
it and all before it equal the target's choices (what greedy verification accepts).
Writes the head file and benchmarks/results/train_eagle.{json,md}.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import time
from pathlib import Path

import torch

from common import report
from train_draft import make_prompts, generate, target_tensors
from kvserve.spec_decode.draft_reference import DraftReference
from kvserve.spec_decode.eagle_head import SHIPPED_HEAD, EagleHeadConfig, EagleHeadReference, read_head, save_head
from kvserve.utils.device import cpu_has_native_bf16, resolve_device

NUM_TARGET_LAYERS = 30


def load_data(args) -> tuple[list[dict], list[dict], float]:
    """train_draft.py's data (generated once, then read from --data-cache)."""
    key = {"seed": args.seed, "num_prompts": args.num_prompts, "num_texts": args.num_texts,
           "held_out": args.held_out, "max_tokens": args.max_tokens, "chat_subjects": args.chat_subjects}
    cache = Path(args.data_cache)
    cached = torch.load(cache) if cache.exists() else None
    if cached is not None and cached["key"] == key:
        return cached["train"], cached["held"], 0.0
    t0 = time.monotonic()
    train_items, held_items = make_prompts(args)  # --chat-subjects model runs the target here already
    data = generate(args, train_items + held_items)
    train, held = data[:len(train_items)], data[len(train_items):]
    torch.save({"key": key, "train": train, "held": held}, cache)
    return train, held, time.monotonic() - t0


@torch.no_grad()
def target_features(args, rows: list[dict], key: dict) -> tuple[list[torch.Tensor], float]:
    """Per row: the target's final hidden states [T, hidden] (bfloat16), for its last --max-len tokens; with
    --fuse-layers, [T, (1 + n) * hidden], those layers' outputs after it. A cache with more layers serves a
    run that wants fewer (a side-by-side run of heads with and without fusing computes them once)."""
    taps = tuple(args.fuse_layers)
    cache = Path(args.feature_cache)
    cached = torch.load(cache) if cache.exists() else None
    have = list(cached.get("taps", ())) if cached is not None else []
    if cached is not None and cached["key"] == key and set(taps) <= set(have):
        d = cached["features"][0].shape[-1] // (1 + len(have))
        cols = torch.cat([torch.arange(d)] + [torch.arange(d) + d * (1 + have.index(t)) for t in taps])
        return [f[:, cols] for f in cached["features"]], 0.0
    t0 = time.monotonic()
    fcfg, embedding, tensors, _ = target_tensors(list(range(NUM_TARGET_LAYERS)))
    tensors["vocab_ids"] = torch.arange(fcfg.vocab_size)
    tensors["lm_head.weight"] = embedding
    target = DraftReference(fcfg, embedding, tensors).eval().to(args.device)
    feats: list[torch.Tensor | None] = [None] * len(rows)
    # Rows of similar length together, right-padded (causal attention: padding changes no earlier position).
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["ids"]))
    for b in range(0, len(order), 8):
        batch = [rows[i]["ids"][-args.max_len:] for i in order[b:b + 8]]
        ids = torch.zeros((len(batch), max(map(len, batch))), dtype=torch.int64)
        for j, r in enumerate(batch):
            ids[j, :len(r)] = torch.tensor(r)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
            h = target.hidden(ids.to(args.device), taps).to(torch.bfloat16).cpu()
        for j, i in enumerate(order[b:b + 8]):
            feats[i] = h[j, :len(batch[j])].clone()
        if b % 400 == 0:
            print(f"features: {b}/{len(rows)} rows ({time.monotonic() - t0:.0f} s)", flush=True)
    torch.save({"key": key, "taps": taps, "features": feats}, cache)
    return feats, time.monotonic() - t0


def examples(rows: list[dict], feats: list[torch.Tensor], vocab_ids: torch.Tensor, vocab_size: int,
             device: str) -> list[tuple]:
    """Per row, aligned to its features: ids [T], labels as indices into a head's vocab_ids [T] (-100: none
    or outside that vocabulary; labels[t] is the choice after position t), where its answer starts, its kind.
    The tensors on the training device."""
    index_of = torch.full((vocab_size,), -100, dtype=torch.int64)
    index_of[vocab_ids] = torch.arange(len(vocab_ids))
    out = []
    for r, f in zip(rows, feats):
        n = f.shape[0]
        cut = len(r["ids"]) - n
        ids = torch.tensor(r["ids"][cut:])
        labels = torch.full((n,), -100, dtype=torch.int64)
        lab = torch.tensor(r["labels"][cut:])
        labels[:len(lab)] = torch.where(index_of[lab] >= 0, index_of[lab], -100)
        out.append((ids.to(device), labels.to(device), f.to(device), max(0, r["answer_start"] - cut), r["kind"]))
    return out


@torch.no_grad()
def acceptance(head: EagleHeadReference, rows: list[tuple], k: int) -> dict:
    """Teacher-forced greedy acceptance on answers: per draft position the fraction of k-token drafts whose
    first i + 1 tokens are accepted (vLLM's per-position counter over drafts), and their sum."""
    per_pos, num_drafts = [0] * k, 0
    for ids, labels, feats, answer_start, _ in rows:
        # A draft from position t: the feature at t and token t + 1 (both the target's); tokens t + 2.. drafted.
        first, end = max(answer_start - 1, 0), ids.shape[0] - k - 1
        if end <= first:  # an answer shorter than a draft
            continue
        chains = head.unrolled(feats.float(), ids, k)  # chains[j][t]: the draft from t after j + 1 steps
        alive = torch.ones(end - first, dtype=torch.bool, device=ids.device)
        for j in range(k):
            pred = head.logits(chains[j][first:end]).argmax(-1)
            alive &= pred == labels[first + 1 + j:end + 1 + j]
            per_pos[j] += int(alive.sum())
        num_drafts += end - first
    rates = [c / max(1, num_drafts) for c in per_pos]
    return {"num_drafts": num_drafts, "accepted_per_pos": rates, "mean_accepted": sum(rates)}


def held_out_scores(head: EagleHeadReference, held: list[tuple], k: int) -> tuple[dict, dict]:
    """acceptance() on all held-out answers, and by kind."""
    by_kind = {kind: acceptance(head, [x for x in held if x[4] == kind], k) for kind in sorted({x[4] for x in held})}
    return acceptance(head, held, k), by_kind


def one_cycle(progress: float, peak: float, warmup: float) -> tuple[float, float]:
    """(learning rate, Adam's beta1) at a fraction of training done: torch's OneCycleLR with its defaults
    (cosine from peak / 25 up to peak over the warm-up, then down to peak / 25e4; beta1 0.95 -> 0.85 -> 0.95),
    as a function of progress, so that a run stopped by --time-limit still ends annealed."""
    if progress < warmup:
        c = (1 - math.cos(math.pi * progress / warmup)) / 2
        return peak / 25 + (peak - peak / 25) * c, 0.95 - 0.1 * c
    c = (1 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-9, 1 - warmup)))) / 2  # no anneal left: peak
    return peak / 25e4 + (peak - peak / 25e4) * c, 0.85 + 0.1 * (1 - c)


def initial_head(hcfg: EagleHeadConfig, embedding: torch.Tensor, vocab_ids: torch.Tensor, seed: int) -> EagleHeadReference:
    d, inter = hcfg.hidden_size, hcfg.intermediate_size
    g = torch.Generator().manual_seed(seed)
    fc = torch.zeros(d, 2 * d)
    fc[:, :d] = torch.eye(d)                      # start by copying the feature,
    fc[:, d:] = 0.01 * torch.randn(d, d, generator=g)   # barely reading the token
    tensors = {"fc.weight": fc, "mlp_norm.weight": torch.ones(d),
               "mlp.gate_proj.weight": torch.randn(inter, d, generator=g) / d ** 0.5,
               "mlp.up_proj.weight": torch.randn(inter, d, generator=g) / d ** 0.5,
               "mlp.down_proj.weight": 0.1 * torch.randn(d, inter, generator=g) / inter ** 0.5,
               "norm.weight": torch.ones(d), "lm_head.weight": embedding[vocab_ids].clone(), "vocab_ids": vocab_ids}
    if hcfg.fuse_layers:  # start from the final feature alone
        tensors["fuse.weight"] = torch.cat([torch.eye(d)] + [torch.zeros(d, d)] * len(hcfg.fuse_layers), 1)
    if hcfg.num_attention_heads:  # the attention's output starts small: at first, the head without it
        qd, kvd = hcfg.num_attention_heads * hcfg.head_dim, hcfg.num_key_value_heads * hcfg.head_dim
        tensors.update({"attn_norm.weight": torch.ones(d),
                        "self_attn.q_proj.weight": torch.randn(qd, d, generator=g) / d ** 0.5,
                        "self_attn.k_proj.weight": torch.randn(kvd, d, generator=g) / d ** 0.5,
                        "self_attn.v_proj.weight": torch.randn(kvd, d, generator=g) / d ** 0.5,
                        "self_attn.o_proj.weight": 0.1 * torch.randn(d, qd, generator=g) / qd ** 0.5})
    return EagleHeadReference(hcfg, embedding, tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-prompts", type=int, default=2000, help="prompts the target answers")
    ap.add_argument("--num-texts", type=int, default=100, help="passages the target only reads (prefill)")
    ap.add_argument("--chat-subjects", choices=["model", "vocab", "list"], default="model",
                    help="chat messages the target writes itself (model), templated questions about words of its "
                         "vocabulary (vocab) or about train_draft.py's list")
    ap.add_argument("--held-out", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=128, help="length of the target's answers")
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--train-rows", type=int, default=None,
                    help="train on the first this many training rows only (their target features cost ~0.6 s a "
                         "row in float32 on two AVX2 cores); default: all")
    ap.add_argument("--max-len", type=int, default=512, help="tokens of each row the head trains on (its end)")
    ap.add_argument("--vocab", type=int, default=4096, help="tokens the head predicts")
    ap.add_argument("--intermediate", type=int, default=1536, help="the head's MLP width")
    ap.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="features and training under bfloat16 autocast or in float32; auto: bfloat16 where "
                         "the CPU has native bfloat16, as the engine's --dtype auto (with AVX2 only, on Zen 3, a "
                         "bfloat16 training step took over 30 s, a float32 one ~4 s); float32 on a GPU")
    ap.add_argument("--device", default="auto",
                    help="where the features are computed and the head trained (auto: CUDA when present); the "
                         "data step's engine picks its device itself, with float32 on a GPU")
    ap.add_argument("--fuse-layers", type=int, nargs="*", default=[],
                    help="target layers (0-based) whose outputs the head fuses with the final feature for its "
                         "first drafting step (EagleHeadConfig.fuse_layers; an experiment: the engine refuses such "
                         "heads, see benchmarks/README); default: none")
    ap.add_argument("--attention", action="store_true",
                    help="give the head a causal self-attention layer (the target's head counts and rotary "
                         "base) over its inputs at earlier positions, as EAGLE's decoder layer; an experiment: "
                         "the engine refuses such heads (benchmarks/README)")
    ap.add_argument("--compare", nargs="*", default=[], metavar="HEAD",
                    help="head files also scored on this run's held-out answers, side by side (e.g. the shipped one)")
    ap.add_argument("--soft-labels", type=float, default=0.0,
                    help="share of the token loss against the target's whole distribution (from its features and "
                         "tied LM head) instead of its choice alone: distillation; default 0, choices only")
    ap.add_argument("--unroll", type=int, default=3, help="drafting steps trained per position")
    ap.add_argument("--feature-weight", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds of training after which it stops early, short of --steps (a lease's call has a "
                         "hard limit; a head trained fewer steps beats none); recorded as steps_done")
    ap.add_argument("--tokens-per-step", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--k", type=int, default=4, help="draft length for the held-out acceptance")
    ap.add_argument("--data-cache", type=str, default="/tmp/kvserve-eagle-data.pt")
    ap.add_argument("--feature-cache", type=str, default="/tmp/kvserve-eagle-features.pt")
    ap.add_argument("--init", type=str, default=None, metavar="HEAD",
                    help="go on training this head file (its shape and vocabulary; --vocab and --intermediate unused) "
                         "instead of a new one: more data on top of a head made before")
    ap.add_argument("--out", type=str, default=str(SHIPPED_HEAD))
    ap.add_argument("--name", type=str, default="train_eagle", help="results/<name>.{json,md}")
    ap.add_argument("--data-only", action="store_true", help="generate the data and features, then stop")
    args = ap.parse_args()
    args.device = str(resolve_device(args.device))  # a string: the args are recorded as JSON
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device == "cpu" and cpu_has_native_bf16() else "float32"
    torch.manual_seed(args.seed)
    # A head to go on training is read first: a mismatch stops the run before the data and features are made.
    init_cfg, init_tensors = read_head(args.init)[:2] if args.init else (None, None)
    if init_cfg and (init_cfg.fuse_layers != args.fuse_layers or bool(init_cfg.num_attention_heads) != args.attention):
        raise SystemExit(f"--init {args.init}: its layers differ from this run's --fuse-layers / --attention")

    train_rows, held_rows, t_data = load_data(args)
    all_train_rows = train_rows  # the head's vocabulary comes from all of them
    if args.train_rows is not None:
        train_rows = train_rows[:args.train_rows]
    key = {"data": [args.seed, args.num_prompts, args.num_texts, args.held_out, args.max_tokens, args.chat_subjects],
           "train_rows": args.train_rows, "max_len": args.max_len, "dtype": args.dtype}
    feats, t_feat = target_features(args, train_rows + held_rows, key)
    if args.data_only:
        return
    fcfg, embedding, _, eos_ids = target_tensors([])

    counts = torch.bincount(torch.tensor([t for r in all_train_rows for t in r["labels"]]), minlength=fcfg.vocab_size)
    rank = counts.clone()
    rank[eos_ids] = rank.max() + 1  # always predictable
    vocab_ids = rank.argsort(descending=True)[:args.vocab].sort().values
    if init_tensors:  # the vocabulary and shape the head was made with
        vocab_ids = init_tensors["vocab_ids"]
    coverage = counts[vocab_ids].sum().item() / max(1, counts.sum().item())
    train = examples(train_rows, feats[:len(train_rows)], vocab_ids, fcfg.vocab_size, args.device)
    held = examples(held_rows, feats[len(train_rows):], vocab_ids, fcfg.vocab_size, args.device)
    num_positions = sum(int((x[1] >= 0).sum()) for x in train)

    hcfg = EagleHeadConfig(hidden_size=fcfg.hidden_size, intermediate_size=args.intermediate,
                           vocab_size=fcfg.vocab_size, rms_norm_eps=fcfg.rms_norm_eps, target="SmolLM2-135M-Instruct",
                           fuse_layers=args.fuse_layers)
    if args.attention:
        hcfg = dataclasses.replace(hcfg, num_attention_heads=fcfg.num_attention_heads,
                                   num_key_value_heads=fcfg.num_key_value_heads, head_dim=fcfg.head_dim,
                                   rope_theta=fcfg.rope_theta)
    if init_cfg:
        hcfg = init_cfg
        head = EagleHeadReference(hcfg, embedding, init_tensors).to(args.device)  # its tensors become float
    else:
        head = initial_head(hcfg, embedding, vocab_ids, args.seed).to(args.device)
    # --soft-labels reads the target's distribution off its LM head, which is its embedding (tied).
    soft_lm_head = embedding[vocab_ids].to(args.device) if args.soft_labels > 0 else None
    before = acceptance(head, held, args.k)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    warmup = max(0.05, 2 / args.steps)
    rng = random.Random(args.seed)
    order: list[int] = []
    t0 = time.monotonic()
    steps_done = 0
    for step in range(1, args.steps + 1):
        # Progress by steps, or by time where --time-limit would stop it sooner.
        progress = (step - 1) / max(1, args.steps - 1)
        if args.time_limit is not None:
            by_time = (time.monotonic() - t0) / args.time_limit
            if by_time >= 1:
                print(f"stopped by --time-limit after {steps_done} steps", flush=True)
                break
            progress = max(progress, by_time)
        lr, beta1 = one_cycle(progress, args.lr, warmup)
        for group in opt.param_groups:
            group["lr"], group["betas"] = lr, (beta1, group["betas"][1])
        loss, n = 0.0, 0
        while n < args.tokens_per_step:
            if not order:
                order = list(range(len(train)))
                rng.shuffle(order)
            ids, labels, f, _, _ = train[order.pop()]
            with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                loss = loss + head.training_loss(ids, labels, f.float(), args.unroll, args.feature_weight,
                                                 args.soft_labels, soft_lm_head) * len(ids)
            n += len(ids)
        loss = loss / n
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        steps_done = step
        if step % 50 == 0 or step == 1:
            print(f"step {step}/{args.steps} loss {loss.item():.3f} ({time.monotonic() - t0:.0f} s)", flush=True)
    t_train = time.monotonic() - t0

    after, by_kind = held_out_scores(head, held, args.k)
    compared = {}
    for other in args.compare:  # other head files, scored on the same answers with their own vocabularies
        ocfg, otensors, _ = read_head(other)
        if ocfg.fuse_layers != args.fuse_layers:
            raise SystemExit(f"--compare {other}: it fuses target layers {ocfg.fuse_layers}, this run's features "
                             f"have {args.fuse_layers}")
        ohead = EagleHeadReference(ocfg, embedding, otensors).to(args.device)
        oheld = examples(held_rows, feats[len(train_rows):], ohead.vocab_ids.cpu(), fcfg.vocab_size, args.device)
        compared[other] = held_out_scores(ohead, oheld, args.k)
    training = {"args": vars(args), "train_rows": len(train), "train_labelled_positions": num_positions,
                "vocab_coverage": coverage, "held_out": after, "held_out_by_kind": by_kind,
                "before_training": before, "data_seconds": round(t_data), "feature_seconds": round(t_feat),
                "train_seconds": round(t_train), "steps_done": steps_done,
                "compared": {k: {"held_out": a, "held_out_by_kind": b} for k, (a, b) in compared.items()}}
    stored = {k: (v if k == "vocab_ids" else v.to(torch.bfloat16)).cpu() for k, v in head.state_tensors().items()}
    save_head(args.out, hcfg, stored, training)
    size = Path(args.out).stat().st_size / 2**20
    print(f"wrote {args.out} ({size:.1f} MiB)")

    table = ("| head | held out | answers | mean accepted of k | " + " | ".join(f"pos {i}" for i in range(args.k))
             + " |\n|---|---|---|---|" + "---|" * args.k + "\n")
    for name, (a_all, a_kind) in [("this run's", (after, by_kind))] + [(Path(k).name, v) for k, v in compared.items()]:
        for kind, r in [("all", a_all)] + list(a_kind.items()):
            n = len(held) if kind == "all" else sum(1 for x in held if x[4] == kind)
            table += (f"| {name} | {kind} | {n} | {r['mean_accepted']:.2f} | "
                      + " | ".join(f"{a:.2f}" for a in r["accepted_per_pos"]) + " |\n")
    fused = f"fusing layers {args.fuse_layers} with the final feature, " if args.fuse_layers else ""
    fused += f"causal self-attention ({hcfg.num_attention_heads} heads), " if args.attention else ""
    fused += f"trained further from {Path(args.init).name}, " if args.init else ""
    setup = (f"Head: {fused}fc + one MLP of width {hcfg.intermediate_size}, reduced LM head over {len(vocab_ids)} "
             f"tokens "
             f"({coverage:.1%} of label tokens), {size:.1f} MiB. Data: train_draft.py's, {len(train)} rows, "
             f"{num_positions} labelled positions (generated in {t_data:.0f} s; 0: from the cache); target "
             f"features {t_feat:.0f} s (0: cached); training {steps_done} steps of ~{args.tokens_per_step} positions "
             f"x {args.unroll} drafting steps, {t_train:.0f} s. Acceptance teacher-forced on {len(held)} held-out "
             f"answers, greedy, k = {args.k}, per position: the fraction of drafts whose first i + 1 tokens are "
             f"accepted (before training: {before['mean_accepted']:.2f} accepted of {args.k}).")
    report(args.name, "Eagle head for SmolLM2-135M-Instruct: held-out acceptance", args, setup, table, training,
           script="train_eagle")


if __name__ == "__main__":
    main()
