"""Decode CUDA graphs without a GPU: the bucketing and padding as pure functions, and what a replay
repeats (DecodeGraphs.load + forward over the persistent buffers) run with the Triton kernels under the
interpreter against the ordinary eager step. The capture and replay themselves need CUDA."""
from __future__ import annotations

import pytest
import torch

from kvserve.worker.cuda_graphs import DecodeInputs, capture_sizes, is_pure_decode, padded_size


def test_capture_sizes_and_padding_bucket() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]
    sizes = capture_sizes(100)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 16, 17, 97, 100)] == [1, 4, 8, 16, 32, 100, 100]
    assert padded_size(101, sizes) is None
    for n in range(1, 101):  # never more than 15 padding rows above 16, never fewer rows than asked
        assert 0 <= padded_size(n, sizes) - n <= (15 if n > 16 else n)


def test_decode_inputs_padding_rows_write_nothing() -> None:
    step = DecodeInputs([5, 6], [9, 2], [37, 10], [10, 3], [[4, 7, 9], [2]])
    p = step.padded(4)
    assert p.input_ids == [5, 6, 0, 0] and p.positions == [9, 2, 0, 0]
    assert p.slots == [37, 10, -1, -1] and p.seq_lens == [10, 3, 1, 1]
    assert p.tables_tensor().tolist() == [[4, 7, 9], [2, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert step.padded(2) == step


def test_only_pure_decode_steps_use_graphs() -> None:
    assert is_pure_decode([1, 1, 1], 3, False)
    assert not is_pure_decode([1, 4, 1], 3, False)      # a chunk or speculative row
    assert not is_pure_decode([1, 1], 1, False)          # a row not sampled (a prefill's last chunk pending)
    assert not is_pure_decode([1, 1], 2, True)           # prompt logprobs need hidden states
    assert not is_pure_decode([], 0, False)


def test_triton_decode_graph_inputs_match_eager_step(tiny_model_dirs) -> None:
    """Padded to a captured size, a decode step's logits are the eager step's and the padding rows leave
    the KV cache untouched; a later, smaller step over the same buffers (stale table columns) too."""
    from triton_helpers import triton_device
    device = triton_device()
    from paged_helpers import PagedSeqs, make_backend, make_kv_caches

    from kvserve.models.loader import load_model
    from kvserve.worker.cuda_graphs import DecodeGraphs

    path, _ = tiny_model_dirs["llama"]
    loaded = load_model(str(path), torch.float32, device)
    model, cfg = loaded.model, loaded.config
    backend = make_backend(model, cfg, 16, 4, kind="triton", device=device)
    caches = make_kv_caches(backend)
    seqs = PagedSeqs(backend)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    with torch.inference_mode():
        ids, pos, meta = seqs.batch({0: rand(9), 1: rand(2), 2: rand(5)})
        model(ids, pos, meta, caches)
        graph_caches = [(k.clone(), v.clone()) for k, v in caches]
        graphs = DecodeGraphs(model, backend, graph_caches, 4, 64, 4)
        for step in ({0: rand(1), 1: rand(1), 2: rand(1)}, {1: rand(1)}):
            before = {s: seqs.lens[s] for s in step}
            ids, pos, meta = seqs.batch(step)
            want = model.compute_logits(model(ids, pos, meta, caches))
            bs = 4
            inputs = DecodeInputs(ids.tolist(), pos.tolist(),
                                  [seqs.blocks[s][p // bs] * bs + p % bs for s, p in before.items()],
                                  [seqs.lens[s] for s in step], [list(seqs.blocks[s]) for s in step])
            snapshot = [(k.clone(), v.clone()) for k, v in graph_caches]
            size = graphs.load(inputs)
            assert size == {3: 4, 1: 1}[len(step)]
            got = graphs.forward(size)[:len(step)]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            # The step's own slots hold its K/V (as eager wrote them, up to the batch shape's rounding); every
            # other slot is as it was: the padding rows (slot -1) wrote nothing.
            others = torch.ones(16 * bs, dtype=torch.bool)
            others[inputs.slots] = False
            for (k, v), (gk, gv), (k0, v0) in zip(caches, graph_caches, snapshot):
                for new, eager, old in ((gk, k, k0), (gv, v, v0)):
                    new, eager, old = (x.flatten(0, 1) for x in (new, eager, old))  # [slot, Hkv, D]
                    torch.testing.assert_close(new[inputs.slots], eager[inputs.slots], atol=1e-5, rtol=1e-5)
                    assert not torch.equal(new[inputs.slots], old[inputs.slots])
                    assert torch.equal(new[others], old[others])
