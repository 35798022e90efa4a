"""Logprobs of the raw model distribution (before penalties, temperature or truncation: vLLM's
default), for sampled tokens and for prompt tokens."""
from __future__ import annotations

import torch
from torch import Tensor

from kvserve.outputs import Logprob, PositionLogprobs


def gather_logprobs(logprobs: Tensor, token_ids: Tensor, num_top: list[int]) -> list[PositionLogprobs]:
    """One dict per row: {token_ids[i]: ..., then row i's num_top[i] most likely tokens}.

    logprobs: [N, V] log-softmaxed; token_ids: [N]. A token's rank is 1 + the number of tokens with a
    strictly greater logprob, so tied tokens share a rank, and the chosen token's rank is consistent
    whether or not it is also among the top ones."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))                       # [N, 1]
    chosen_rank = (logprobs > chosen).sum(dim=1) + 1                          # [N]
    max_top = max(num_top, default=0)
    if max_top > 0:
        top_vals, top_ids = logprobs.topk(max_top, dim=-1)                    # sorted descending
        # Anything strictly above a top-k value is itself in the top-k, so ranks come from the top-k.
        top_ranks = (top_vals.unsqueeze(1) > top_vals.unsqueeze(2)).sum(dim=2) + 1
        top_vals_l, top_ids_l, top_ranks_l = top_vals.tolist(), top_ids.tolist(), top_ranks.tolist()

    out: list[PositionLogprobs] = []
    for i, (tok, lp, rank) in enumerate(zip(token_ids.tolist(), chosen.squeeze(1).tolist(),
                                            chosen_rank.tolist())):
        entry: PositionLogprobs = {tok: Logprob(lp, rank)}
        for j in range(num_top[i]):
            tid = top_ids_l[i][j]
            if tid not in entry:
                entry[tid] = Logprob(top_vals_l[i][j], top_ranks_l[i][j])
        out.append(entry)
    return out


def compute_prompt_logprobs(logits: Tensor, target_token_ids: list[int], k: int) -> list[PositionLogprobs]:
    """logits: [L, V], row i predicting target_token_ids[i]. Returns one dict per target.

    (A request's first prompt token has no prediction; the caller puts None in front of these.)"""
    assert logits.shape[0] == len(target_token_ids), (logits.shape, len(target_token_ids))
    if not target_token_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_token_ids, dtype=torch.long, device=logits.device)
    return gather_logprobs(logprobs, targets, [k] * len(target_token_ids))
