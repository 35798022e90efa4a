"""The block pool and prefix cache on their own, without a model."""
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.sequence import Sequence
from kvserve.sampling_params import SamplingParams

_ids = iter(range(10**9))


def make_seq(tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(seq_id=next(_ids), request_id="r", index=0, token_ids=list(tokens),
                    num_prompt_tokens=len(tokens), params=SamplingParams(), cache_salt=salt)


def compute(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model ran over all of seq's tokens."""
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)


def test_blocks_allocated_on_demand_and_returned():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    assert bm.allocate(seq, 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    seq.num_computed_tokens = 10
    assert bm.allocate(seq, 2)  # tokens 10, 11 fit in block 2
    assert len(seq.block_table) == 3
    assert bm.allocate(seq, 3)  # token 12 opens block 3
    assert len(seq.block_table) == 4
    bm.free(seq)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0


def test_allocation_refused_when_pool_short_takes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_prefix_reused_across_sequences_with_ref_counts():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(13)))            # 3 full blocks + 1 token
    compute(bm, a)
    b = make_seq(list(range(12)) + [99, 98])  # shares the 3 full blocks
    assert bm.match_prefix(b) == 12
    assert b.block_table == a.block_table[:3]
    assert all(bm.blocks[i].ref_count == 2 for i in b.block_table)
    bm.free(a)
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)
    bm.free(b)
    assert bm.num_free_blocks == 16


def test_match_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute(bm, make_seq(list(range(8))))
    # Same 8 tokens again: only the first block may be reused, so the 8th token still yields logits.
    assert bm.match_prefix(make_seq(list(range(8)))) == 4


def test_chain_hash_distinguishes_same_block_after_different_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Block 2 has the same tokens but follows a different first block: no hit at all.
    assert bm.match_prefix(make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])) == 0


def test_salt_isolates_cache_entries():
    bm = BlockManager(num_blocks=16, block_size=4)
    compute(bm, make_seq(list(range(9)), salt="tenant-a"))
    assert bm.match_prefix(make_seq(list(range(9)), salt="tenant-b")) == 0
    assert bm.match_prefix(make_seq(list(range(9)), salt="tenant-a")) == 8


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(num_blocks=4, block_size=4)
    old = make_seq(list(range(5)))          # block 0 cached after free
    compute(bm, old)
    bm.free(old)
    new = make_seq(list(range(100, 105)))   # cached after free, more recently
    compute(bm, new)
    bm.free(new)
    assert bm.num_free_blocks == 4
    # Needs 3 blocks: 2 empty ones first, then evicts the least recently freed cache entry (old's).
    filler = make_seq(list(range(200, 212)))
    assert bm.allocate(filler, 12)
    assert bm.match_prefix(make_seq(list(range(5)))) == 0
    assert bm.match_prefix(make_seq(list(range(100, 105)))) == 4


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    compute(bm, make_seq(list(range(9))))
    assert bm.match_prefix(make_seq(list(range(9)))) == 0


def test_reset_keeps_the_entry_of_a_copy_still_in_use():
    """Two sequences computed the same block at once (neither found the other's): the cache names the first
    copy. With the second copy freed and the first still in use, reset_prefix_cache forgets only what is not
    in use, so the prefix still hits."""
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(list(range(5))), make_seq(list(range(5)))
    for seq in (a, b):                                # both allocate before either commits
        assert bm.allocate(seq, 5)
    for seq in (b, a):                                # b commits first: its copy is the entry
        seq.num_computed_tokens = 5
        bm.commit_full_blocks(seq)
    bm.free(a)                                        # a's copy is free and cached, b's in use
    bm.reset_prefix_cache()
    c = make_seq(list(range(5)))
    assert bm.match_prefix(c) == 4 and c.block_table == b.block_table[:1]
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 8
