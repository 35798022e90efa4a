"""Step CUDA graphs without a GPU: the bucketing and padding as pure functions, and what a replay repeats
(StepGraphs.load + forward over the persistent buffers) run with the Triton kernels under the interpreter
against the ordinary eager step, for decode steps and for verification steps of rows padded to one width.
The capture and replay themselves need CUDA."""
from __future__ import annotations

from collections import Counter

import torch

from kvserve.worker import blas_choice
from kvserve.worker.blas_choice import blas_candidates, fastest
from kvserve.worker.cuda_graphs import StepInputs, capture_sizes, padded_size, samples_every_token


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


def test_blas_choice_keeps_the_preferred_library_unless_another_is_clearly_faster(monkeypatch) -> None:
    """Each shape is captured with torch's preferred BLAS library and the other of cuBLAS and cuBLASLt;
    the other replaces the preferred one only where it is faster by more than the margin (replay noise)."""
    assert fastest([1.0, 0.99]) == 0 and fastest([1.0, 0.9]) == 1 and fastest([0.9, 1.0]) == 0
    assert fastest([2.0, 1.0], margin=0.6) == 0 and fastest([1.0]) == 0
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert blas_candidates("default") == ["default", "cublaslt"]
    assert blas_candidates("cublaslt") == ["cublaslt", "cublas"]
    monkeypatch.setattr(blas_choice, "CHOOSE_BLAS", False)
    assert blas_candidates("default") == ["default"]
    monkeypatch.setattr(blas_choice, "CHOOSE_BLAS", True)
    monkeypatch.setattr(torch.version, "cuda", None)  # a ROCm or CPU build: nothing to choose from
    assert blas_candidates("default") == ["default"]


def test_decode_inputs_padding_rows_write_nothing() -> None:
    step = StepInputs([5, 6], [9, 2], [37, 10], [1, 1], [10, 3], [[4, 7, 9], [2]])
    p = step.padded(4, 1)
    assert p.input_ids == [5, 6, 0, 0] and p.positions == [9, 2, 0, 0]
    assert p.slots == [37, 10, -1, -1] and p.seq_lens == [10, 3, 1, 1] and p.query_lens == [1] * 4
    assert p.tables_tensor().tolist() == [[4, 7, 9], [2, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert step.padded(2, 1) == step
    assert step.padded_rows(1) == [0, 1]


def test_verification_rows_padded_at_their_ends() -> None:
    """Rows of 1 and 3 tokens as width 3: the short row's padding follows its token at its position, writes
    nothing and lengthens the row by 2, so its token's position (length minus the tokens after it) stays 9."""
    step = StepInputs([5, 6, 7, 8], [9, 2, 3, 4], [37, 10, 11, 12], [1, 3], [10, 5], [[4, 7, 9], [2]])
    p = step.padded(4, 3)
    assert p.input_ids == [5, 0, 0, 6, 7, 8] + [0] * 6
    assert p.positions == [9, 9, 9, 2, 3, 4] + [0] * 6
    assert p.slots == [37, -1, -1, 10, 11, 12] + [-1] * 6
    assert p.query_lens == [3] * 4 and p.seq_lens == [12, 5, 3, 3]
    assert step.padded_rows(3) == [0, 3, 4, 5]


def test_only_steps_that_sample_every_token_use_graphs() -> None:
    assert samples_every_token([1, 1, 1], 3, False)
    assert samples_every_token([1, 4, 1], 6, False)      # a verification row: its last token and 3 drafts
    assert not samples_every_token([1, 4, 1], 3, False)  # a prefill chunk samples at most its last token
    assert not samples_every_token([1, 1], 1, False)     # a row not sampled (a prefill's last chunk pending)
    assert not samples_every_token([1, 1], 2, True)      # prompt logprobs need hidden states
    assert not samples_every_token([], 0, False)


def test_shape_for_picks_the_smallest_captured_shape() -> None:
    from kvserve.worker.cuda_graphs import StepGraphs
    graphs = StepGraphs.__new__(StepGraphs)  # the bucketing only: no model, no buffers
    graphs.sizes = {1: capture_sizes(16), 5: capture_sizes(4)}
    graphs.widths, graphs.max_cols, graphs.block_size = [1, 5], 4, 16  # max_model_len 64
    assert graphs.shape_for([1, 1, 1], [10, 20, 30]) == (4, 1)
    assert graphs.shape_for([1] * 16, [10] * 16) == (16, 1)
    assert graphs.shape_for([1] * 17, [10] * 17) is None            # more rows than captured
    assert graphs.shape_for([1, 3, 1], [10, 20, 30]) == (4, 5)
    assert graphs.shape_for([2] * 5, [10] * 5) is None              # verification captured up to 4 rows
    assert graphs.shape_for([6], [10]) is None                      # wider than any graph
    assert graphs.step_tokens(3, 3, 0) == 4 and graphs.step_tokens(3, 3, 2) == 20  # what those steps run
    assert graphs.step_tokens(5, 5, 1) is None                       # eager: 5 rows, verification up to 4
    assert graphs.step_tokens(3, 10, 0) is None                      # eager: rows still in prefill
    assert graphs.shape_for([2, 1], [61, 10]) == (2, 5)             # padded to 64 keys: the table's end
    assert graphs.shape_for([2, 1], [62, 10]) is None               # 65: past it, so eager


def test_triton_step_graph_inputs_match_eager_step(tiny_model_dirs) -> None:
    """Padded to a captured shape, a decode or verification step's logits and hidden states are the eager
    step's, and padding (tokens and rows) leaves the KV cache untouched; later, smaller steps over the same
    buffers (stale table columns and tokens) too."""
    from triton_helpers import triton_device
    device = triton_device()
    from paged_helpers import PagedSeqs, make_backend, make_kv_caches

    from kvserve.models.loader import load_model
    from kvserve.worker.cuda_graphs import StepGraphs

    path, _ = tiny_model_dirs["llama"]
    loaded = load_model(str(path), torch.float32, device)
    model, cfg = loaded.model, loaded.config
    bs = 4
    backend = make_backend(model, cfg, 16, bs, kind="triton", device=device)
    caches = make_kv_caches(backend)
    seqs = PagedSeqs(backend)
    g = torch.Generator().manual_seed(0)
    rand = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    with torch.inference_mode():
        ids, pos, meta = seqs.batch({0: rand(9), 1: rand(2), 2: rand(5)})
        model(ids, pos, meta, caches)
        graph_caches = [(k.clone(), v.clone()) for k, v in caches]
        graphs = StepGraphs(model, backend, graph_caches, 4, 64, bs, verify_width=3, verify_max_seqs=2)
        steps = [({0: rand(1), 1: rand(1), 2: rand(1)}, (4, 1)),
                 ({0: rand(3), 2: rand(1)}, (2, 3)),            # a verification row beside a decode row
                 ({1: rand(2)}, (1, 3)),
                 ({1: rand(1)}, (1, 1))]
        for step, want_shape in steps:
            before = {s: seqs.lens[s] for s in step}
            ids, pos, meta = seqs.batch(step)
            want_hidden = model(ids, pos, meta, caches)
            want = model.compute_logits(want_hidden)
            slots = [seqs.blocks[s][p // bs] * bs + p % bs for s, b in before.items() for p in range(b, seqs.lens[s])]
            inputs = StepInputs(ids.tolist(), pos.tolist(), slots, [len(t) for t in step.values()],
                                [seqs.lens[s] for s in step], [list(seqs.blocks[s]) for s in step])
            snapshot = [(k.clone(), v.clone()) for k, v in graph_caches]
            shape = graphs.shape_for(inputs.query_lens, inputs.seq_lens)
            assert shape == want_shape
            graphs.load(inputs, shape)
            hidden, logits = graphs.forward(shape)
            rows = inputs.padded_rows(shape[1])
            torch.testing.assert_close(logits[rows], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(hidden[rows], want_hidden, atol=1e-5, rtol=1e-5)
            # The step's own slots hold its K/V (as eager wrote them, up to the batch shape's rounding); every
            # other slot is as it was: the padding (slot -1) wrote nothing.
            others = torch.ones(16 * bs, dtype=torch.bool)
            others[slots] = False
            for (k, v), (gk, gv), (k0, v0) in zip(caches, graph_caches, snapshot):
                for new, eager, old in ((gk, k, k0), (gv, v, v0)):
                    new, eager, old = (x.flatten(0, 1) for x in (new, eager, old))  # [slot, Hkv, D]
                    torch.testing.assert_close(new[slots], eager[slots], atol=1e-5, rtol=1e-5)
                    assert not torch.equal(new[slots], old[slots])
                    assert torch.equal(new[others], old[others])


def test_engine_steps_through_graph_inputs_give_the_eager_tokens(tiny_model_dirs) -> None:
    """The engine with its decode and verification steps sent through StepGraphs (load + forward, what a
    replay repeats, standing in for capture and replay) under Triton's interpreter: drafts right and wrong at
    every position give the greedy tokens of an engine without graphs or speculation, with the KV
    bookkeeping checked after every step; decode and padded verification shapes both ran; no block leaks.
    On CUDA, test_cuda_engine.py runs the real graphs."""
    from triton_helpers import triton_device
    device = triton_device()
    from spec_helpers import every_step_ngram, make_engine, prompts, reference_and_drafts, run_waves

    from kvserve.sampling_params import SamplingParams
    from kvserve.worker.cuda_graphs import StepGraphs

    class ForwardNotReplay(StepGraphs):
        def replay(self, shape):
            return self.forward(shape)

        def run(self, inputs, shape, want_hidden=False):
            shapes.append((shape, set(inputs.query_lens)))
            return super().run(inputs, shape, want_hidden)

    path, _ = tiny_model_dirs["llama"]
    ps = prompts(7, [5, 13, 9])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    wave = [[(str(i), p, params) for i, p in enumerate(ps)]]
    kw = dict(device=str(device), attention_backend="triton", max_num_seqs=4)
    ref, proposer = reference_and_drafts(path, ps, params, 0.3, **kw)
    engine = make_engine(path, every_step_ngram(3), **kw)
    engine.speculator.proposer = proposer
    runner, shapes, timed = engine.runner, [], []
    runner.graphs = ForwardNotReplay(runner.model, runner.attn_backend, runner.kv_caches, 4,
                                     engine.max_model_len, runner.block_size, verify_width=4, verify_max_seqs=4)
    observe_step = engine.speculator.observe_step
    engine.speculator.observe_step = lambda n, seconds: timed.append(n) or observe_step(n, seconds)
    got = run_waves(engine, wave, check=True)
    # Each graph step's time is kept under the tokens its padded shape ran, as step_tokens predicts them.
    ran = Counter(size * width for (size, width), _ in shapes)
    assert ran and not ran - Counter(timed)
    assert any(shape[1] == 1 for shape, _ in shapes)
    assert any(shape[1] == 4 and lens != {4} for shape, lens in shapes)  # verification rows padded to 4
    stats = engine.get_stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    for i in range(len(ps)):
        assert got[str(i)].outputs[0].token_ids == ref[i].token_ids
