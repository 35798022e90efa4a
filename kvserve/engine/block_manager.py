"""The KV block pool: allocation on demand, reference counts, and the prefix cache.

Every full block is identified by its content hash (kvserve/engine/block_hash.py): a sha256 chain over
the salt and every token up to the block's end. Equal digests mean equal prefixes under the same salt, so
a new sequence can take over every cached full block of its prompt. A block whose last user is gone keeps
its hash and stays in the free list as a cache entry; it is evicted (hash dropped) only when the pool hands
it out again, least recently freed first.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvserve.engine.block_hash import BlockHash, hash_block, root_hash
from kvserve.engine.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: BlockHash | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks holding nothing reusable are handed out first; then cached ones, in LRU order
        # (dict insertion order: the block freed longest ago is evicted first).
        self.free_empty: deque[int] = deque(range(num_blocks))
        self.free_cached: dict[int, None] = {}
        self.hash_to_block: dict[BlockHash, int] = {}

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_empty) + len(self.free_cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    # ---- prefix cache --------------------------------------------------------------------------
    def _caching(self, seq: Sequence) -> bool:
        return self.enable_prefix_caching or seq.cache_salt is not None

    def _block_hash(self, seq: Sequence, i: int) -> BlockHash:
        """Digest of seq's full block i. Computed once per block and kept on the sequence: it depends only on
        the tokens, which never change, so it survives preemption."""
        hashes, bs = seq.block_hashes, self.block_size
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[-1] if hashes else root_hash(seq.cache_salt)
            hashes.append(hash_block(parent, seq.token_ids[j * bs:(j + 1) * bs]))
        return hashes[i]

    def match_prefix(self, seq: Sequence) -> int:
        """Take every cached full block that starts this sequence's tokens. Returns the tokens covered.

        At most num_tokens - 1 tokens are taken, so the last token is always computed and yields logits.
        """
        assert not seq.block_table and seq.num_computed_tokens == 0
        if seq.skip_prefix_cache or not self._caching(seq):
            return 0
        bs = self.block_size
        for i in range((seq.num_tokens - 1) // bs):
            # The digest covers the salt and the whole prefix: equality is the whole check.
            block_id = self.hash_to_block.get(self._block_hash(seq, i))
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_cached[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        seq.num_committed_blocks = len(seq.block_table)
        seq.num_computed_tokens = len(seq.block_table) * bs
        return seq.num_computed_tokens

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks this sequence has just filled, so later requests can find them."""
        if not self._caching(seq):
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(seq.num_committed_blocks, num_full):
            h = self._block_hash(seq, i)
            block = self.blocks[seq.block_table[i]]
            block.hash = h
            # If another sequence computed the same prefix at the same time, keep the first entry.
            self.hash_to_block.setdefault(h, block.block_id)
        seq.num_committed_blocks = max(seq.num_committed_blocks, num_full)

    # ---- allocation ----------------------------------------------------------------------------
    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more tokens of seq. False (and nothing taken) if the pool is short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need):
            if self.free_empty:
                block_id = self.free_empty.popleft()
            else:
                block_id = next(iter(self.free_cached))
                del self.free_cached[block_id]
            block = self.blocks[block_id]
            if block.hash is not None:  # evict the cache entry this block was holding
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash = None
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the one seq's next token goes in: those only rejected drafts had written
        (never hashed: only blocks full of kept tokens are). Kept for the next step's drafts, they could force
        a preemption that the drafts themselves were not allowed to."""
        keep = -(-(seq.num_computed_tokens + 1) // self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.hash is None and block.ref_count == 1, "a trimmed block held kept tokens"
            block.ref_count = 0
            self.free_empty.append(block.block_id)

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Its tail blocks go on the free list first, so they are evicted first
        (a prefix is more likely to be shared than the end of one sequence)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, "block freed twice"
            if block.ref_count == 0:
                if block.hash is None:
                    self.free_empty.append(block_id)
                else:
                    self.free_cached[block_id] = None
        seq.block_table = []
        seq.num_committed_blocks = 0
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cache entry not in use (e.g. to benchmark without warm caches)."""
        for block_id in self.free_cached:
            block = self.blocks[block_id]
            # Two sequences that computed the same block at once each hold a copy; the entry may name the
            # other copy, still in use, and stays.
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash = None
            self.free_empty.append(block_id)
        self.free_cached = {}
