"""The sampler's logits stages, each batched over rows with per-row parameters.

Every stage edits `logits` [N, V] in place and is a no-op for a row whose parameter is neutral
(bias absent, penalty 1 / 0, top_p 1, top_k 0, min_p 0), bit for bit: a seeded request must draw the
same tokens whether or not its batch-mates made the stage run. Masking is done by setting logits to
-inf, so the final probabilities are always one softmax of the surviving logits.

Which stages and rows run is decided from the host-side parameters the caller passes, never by reading
a tensor back: on a GPU, every such read (.any(), int(t.max()), nonzero()) would stall the step.
"""
from __future__ import annotations

from itertools import chain

import torch
from torch import Tensor

from kvserve.kernels import cpu as cpu_kernels
from kvserve.utils.device import to_device

_NEG_INF = float("-inf")


def apply_logit_bias(logits: Tensor, params: list) -> None:
    """Adds each row's SamplingParams.logit_bias. A bias is turned into tensors once per request and kept on its
    params: walked entry by entry every step, a bias over the whole vocabulary had cost 16 ms a step for one row
    and 0.25 s for n = 16, a delay every request in the batch paid."""
    vocab = logits.shape[1]
    rows: list[Tensor] = []
    cols: list[Tensor] = []
    vals: list[Tensor] = []
    for i, p in enumerate(params):
        if not p.logit_bias:
            continue
        ids, biases = _bias_tensors(p, vocab)
        rows.append(torch.full_like(ids, i))
        cols.append(ids)
        vals.append(biases)
    if rows:
        device = logits.device
        idx = (_host_to(torch.cat(rows), device), _host_to(torch.cat(cols), device))
        logits.index_put_(idx, _host_to(torch.cat(vals), device).to(logits.dtype), accumulate=True)


def _bias_tensors(p, vocab: int) -> tuple[Tensor, Tensor]:
    """(token ids, biases as float64) of p.logit_bias below `vocab` (ids past the model's vocabulary can never be
    sampled anyway), built on first use and cached on p. float64: each bias reaches the logits' dtype in one
    rounding, as from the Python float it is."""
    by_vocab = p.__dict__.setdefault("_logit_bias_tensors", {})  # a draft model's vocabulary may differ
    if vocab not in by_vocab:
        ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
        biases = torch.tensor(list(p.logit_bias.values()), dtype=torch.float64)
        keep = ids < vocab
        by_vocab[vocab] = (ids[keep], biases[keep])
    return by_vocab[vocab]


def _host_to(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on `device`; to CUDA through pinned memory without waiting (as utils.device.to_device)."""
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def apply_token_mask(logits: Tensor, banned: list[list[int]]) -> None:
    """Set banned[i]'s ids to -inf in row i (used for min_tokens)."""
    rows = [i for i, ids in enumerate(banned) for _ in ids]
    cols = [t for ids in banned for t in ids]
    keep = [k for k, t in enumerate(cols) if t < logits.shape[1]]
    if keep:
        r = to_device([rows[k] for k in keep], logits.device)
        c = to_device([cols[k] for k in keep], logits.device)
        logits[r, c] = _NEG_INF


def _pad(seqs: list[list[int]], pad: int, device: torch.device) -> Tensor:
    width = max(1, max((len(s) for s in seqs), default=0))
    return to_device([s + [pad] * (width - len(s)) for s in seqs], device, torch.long)


def apply_penalties(
    logits: Tensor,
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    repetition: Tensor,   # [N]; 1.0 = off
    presence: Tensor,     # [N]; 0.0 = off
    frequency: Tensor,    # [N]; 0.0 = off
    use_repetition: bool = True,  # the caller's host-side view: does any row have a repetition penalty,
    use_counts: bool = True,      # a presence or a frequency penalty (False skips that stage)
) -> None:
    """Repetition penalty over prompt+output tokens (HF/vLLM: positive logits divided, negative
    multiplied); presence/frequency over output-token counts (OpenAI: logit -= p*(c>0) + f*c)."""
    if stage_kernels_apply(logits):
        # Each row's own tokens only (kvserve/kernels/cpu/argmax.cpp), the same values, where the count tensors
        # below took several passes over [N, V] (~0.3 ms a row for a 300-token prompt).
        def flat(rows: list[list[int]]) -> tuple[Tensor, Tensor]:
            offsets = [0]
            for ids in rows:
                offsets.append(offsets[-1] + len(ids))
            return torch.tensor(list(chain.from_iterable(rows)), dtype=torch.long), torch.tensor(offsets)
        cpu_kernels.ops().apply_penalties_(logits, *flat(prompt_token_ids), *flat(output_token_ids),
                                           repetition.float().contiguous(), presence.float().contiguous(),
                                           frequency.float().contiguous(), use_repetition, use_counts)
        return
    n, vocab = logits.shape
    # One scratch column at index `vocab` absorbs the padding, so ragged lists scatter in one call.
    out_ids = _pad(output_token_ids, vocab, logits.device).clamp_(max=vocab)
    counts = torch.zeros(n, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]

    if use_repetition:
        prompt_ids = _pad(prompt_token_ids, vocab, logits.device).clamp_(max=vocab)
        seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=logits.device)
        seen.scatter_(1, prompt_ids, True)
        seen = seen[:, :vocab] | (counts > 0)
        rep = repetition.unsqueeze(1)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalised, logits))

    if use_counts:
        logits -= presence.unsqueeze(1) * (counts > 0).to(logits.dtype) + frequency.unsqueeze(1) * counts


def apply_min_p(logits: Tensor, min_p: Tensor) -> None:
    """Drop tokens whose probability is below min_p times the row's largest probability."""
    probs = torch.softmax(logits, dim=-1)
    if stage_kernels_apply(logits):  # the same cut in two passes (kvserve/kernels/cpu/argmax.cpp)
        cpu_kernels.ops().min_p_mask_(logits, probs, min_p.float().contiguous())
        return
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k(logits: Tensor, top_k: Tensor, max_k: int) -> None:
    """Keep each row's top_k logits (0 = all). Ties with the k-th value are all kept, as in vLLM.
    max_k: the largest top_k of the batch, known on the host (at most the vocabulary)."""
    if stage_kernels_apply(logits):
        # The same k-th value, from the few values near each row's maximum (kvserve/kernels/cpu/argmax.cpp)
        # rather than torch's topk of the whole row.
        cpu_kernels.ops().top_k_mask_(logits, top_k.long().contiguous())
        return
    vocab = logits.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.ones_like(top_k))  # 1: unused, keeps topk small
    max_k = max(1, min(max_k, vocab))
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth = torch.where((top_k > 0).unsqueeze(1), kth, torch.full_like(kth, _NEG_INF))
    logits.masked_fill_(logits < kth, _NEG_INF)


def stage_kernels_apply(logits: Tensor) -> bool:
    """Whether apply_penalties, apply_min_p, apply_top_k and apply_top_p run in the CPU kernels: float32
    [N, V] logits, contiguous, on the CPU."""
    return logits.dtype == torch.float32 and logits.is_contiguous() and cpu_kernels.applies(logits)


def apply_top_p(logits: Tensor, top_p: Tensor, rows: list[int] | None = None) -> None:
    """Keep the smallest most-likely set whose probability reaches top_p (at least one token).

    The set is cut at a probability threshold, so tokens tied with the last one kept are kept too
    (as apply_top_k does), whatever order a sort puts ties in. Rows with top_p == 1 keep everything
    outright: rounding in the cumsum could otherwise drop a tail token and make a seeded row's draw
    depend on whether a batch-mate enabled top_p.

    rows: those with top_p < 1, as the caller knows them (None: found here, a host sync)."""
    probs = torch.softmax(logits, dim=-1)
    if stage_kernels_apply(logits):
        # The same cut from the same probabilities, sorting only the few values that can be in the set
        # (kvserve/kernels/cpu/argmax.cpp), where the topk below took most of a sampled row's time.
        rows = (top_p < 1.0).nonzero().squeeze(1).tolist() if rows is None else rows
        cpu_kernels.ops().top_p_mask_(logits, probs, top_p.float().contiguous(), rows)
        return
    threshold = torch.zeros(logits.shape[0], 1, dtype=probs.dtype, device=probs.device)
    vocab = logits.shape[1]
    rows_t = ((top_p < 1.0).nonzero().squeeze(1) if rows is None
              else to_device(rows, logits.device, torch.long))
    # On a CPU the set usually closes within the few hundred most likely tokens, and a partial topk is
    # much cheaper than sorting the vocabulary; rows it doesn't cover (flat distributions) sort fully.
    # Finding those rows reads a mask back, so on a GPU every row sorts fully, in one pass with no sync.
    if logits.device.type != "cuda" and _TOP_P_CANDIDATES < vocab and rows_t.numel():
        thr, closed = _top_p_threshold(probs[rows_t], top_p[rows_t], _TOP_P_CANDIDATES)
        threshold[rows_t[closed]] = thr[closed]
        rows_t = rows_t[~closed]
    if rows_t.numel():
        threshold[rows_t] = _top_p_threshold(probs[rows_t], top_p[rows_t], vocab)[0]
    logits.masked_fill_(probs < threshold, _NEG_INF)


def _top_p_threshold(probs: Tensor, top_p: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """From each row's k most likely tokens: the probability of the last one top_p keeps ([R, 1]), and
    whether those k tokens reach top_p at all ([R]; with k = vocab, always)."""
    p = top_p.unsqueeze(1)
    vals = probs.topk(k, dim=-1).values                      # descending
    mass = vals.cumsum(dim=-1)
    n_keep = ((mass - vals) < p).sum(dim=-1, keepdim=True)   # mass before each token < top_p
    # A row of NaN probabilities (NaN logits, or all -inf) keeps none: its threshold is then its first value,
    # NaN, and nothing compares below it (as in the CPU kernel), rather than an index of -1.
    n_keep = n_keep.clamp(min=1)
    return vals.gather(1, n_keep - 1), (mass[:, -1:] >= p).squeeze(1) | (k == probs.shape[1])


_TOP_P_CANDIDATES = 256
