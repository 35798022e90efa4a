"""The attention plan's kernel rows (kvserve/attention/torch_plan.py): a step of a few tokens builds them from
the host lists, a larger one with tensor ops; both must name the same rows."""
import random

import pytest
import torch

from kvserve.attention import torch_plan
from kvserve.attention.backend import StepBatch


def random_batch(rng: random.Random, tree: bool) -> StepBatch:
    """Decodes, verification rows and prefill chunks over cached contexts; with tree, a verification's last
    rows are alternatives at its first draft's position."""
    query_lens = [rng.choice([1, 1, 2, 4, 7]) for _ in range(rng.randint(1, 6))]
    seq_lens = [q + rng.randrange(0, 40) for q in query_lens]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    positions = []
    for q, n in zip(query_lens, seq_lens):
        rows = list(range(n - q, n))
        if tree and q >= 4:  # a chain of q - 2 tokens after the last one, then two alternatives to its first
            rows[-2:] = [n - q + 1] * 2
        positions += rows
    tables = [[rng.randrange(100) for _ in range(-(-n // 16))] for n in seq_lens]
    slots = [rng.randrange(1600) for _ in range(starts[-1])]
    return StepBatch.from_host(tables, slots, starts, seq_lens, 16, torch.device("cpu"),
                               positions if tree else None)


@pytest.mark.parametrize("tree", [False, True])
def test_kernel_rows_from_the_host_lists_are_the_tensor_paths(tree, monkeypatch):
    rng = random.Random(0)
    for _ in range(200):
        batch = random_batch(rng, tree)
        excluded = sorted(rng.sample(range(batch.num_seqs), rng.randint(0, batch.num_seqs)))
        host = torch_plan._kernel_rows(batch, excluded)
        assert batch.num_tokens <= torch_plan._HOST_ROWS_MAX_TOKENS
        with monkeypatch.context() as m:
            m.setattr(torch_plan, "_HOST_ROWS_MAX_TOKENS", 0)
            tensors = torch_plan._kernel_rows(batch, excluded)
        if tensors is None:
            assert host is None
            continue
        for field in ("token", "seq", "len", "last"):
            a, b = getattr(host, field), getattr(tensors, field)
            assert (a is None and b is None) or torch.equal(a, b), field
