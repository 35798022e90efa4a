"""Prefix-cache content hashes: sha256 chains, the same in every process, separated by salt."""
import hashlib
import os
import struct
import subprocess
import sys

from kvserve.engine.block_hash import block_hashes, hash_block, root_hash
from kvserve.engine.block_manager import BlockManager
from kvserve.engine.sequence import Sequence
from kvserve.sampling_params import SamplingParams

TOKENS = [1, 2, 3, 4, 50000, 6, 7, 8, 9]   # two full blocks of 4 and one token


def make_seq(tokens: list[int], salt: str | None = None, seq_id: int = 0) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, token_ids=list(tokens),
                    num_prompt_tokens=len(tokens), params=SamplingParams(), cache_salt=salt)


def compute(bm: BlockManager, seq: Sequence) -> None:
    assert bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_full_blocks(seq)


def test_digests_follow_the_documented_layout():
    """An independent rebuild from hashlib + struct: the layout a router in any language can reproduce."""
    root = hashlib.sha256(b"kvserve-block-hash-v1" + b"\x01" + "tenant-ä".encode()).digest()
    first = hashlib.sha256(root + struct.pack("<4i", 1, 2, 3, 4)).digest()
    second = hashlib.sha256(first + struct.pack("<4i", 50000, 6, 7, 8)).digest()
    assert block_hashes(TOKENS, 4, "tenant-ä") == [first, second]
    assert root_hash(None) == hashlib.sha256(b"kvserve-block-hash-v1").digest()
    assert root_hash("") != root_hash(None)


def test_digests_are_equal_across_processes():
    code = ("import sys; from kvserve.engine.block_hash import block_hashes; "
            f"print(','.join(h.hex() for h in block_hashes({TOKENS}, 4, sys.argv[1])))")
    outs = []
    for seed in ("1", "2"):  # Python's str/bytes hashing differs between these; our digests must not
        env = {**os.environ, "PYTHONHASHSEED": seed}
        res = subprocess.run([sys.executable, "-c", code, "salt"], env=env, capture_output=True, text=True,
                             check=True)
        outs.append(res.stdout.strip())
    assert outs[0] == outs[1] == ",".join(h.hex() for h in block_hashes(TOKENS, 4, "salt"))


def test_a_digest_covers_the_whole_prefix():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4), block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different parent
    assert hash_block(a[0], [5, 6, 7, 8]) == a[1]


def test_two_salts_never_share_blocks_and_one_salt_does():
    bm = BlockManager(num_blocks=32, block_size=4)
    owner = make_seq(TOKENS, salt="tenant-a", seq_id=1)
    compute(bm, owner)
    for i, other_salt in enumerate(["tenant-b", None, "", "tenant-a "]):
        other = make_seq(TOKENS, salt=other_salt, seq_id=10 + i)
        assert bm.match_prefix(other) == 0
        compute(bm, other)
        assert not set(other.block_table) & set(owner.block_table)
        assert not set(other.block_hashes) & set(owner.block_hashes)
    same = make_seq(TOKENS, salt="tenant-a", seq_id=2)
    assert bm.match_prefix(same) == 8 and same.block_table == owner.block_table[:2]


def test_hashes_outlive_preemption_and_match_after_resume():
    bm = BlockManager(num_blocks=16, block_size=4)
    seq = make_seq(TOKENS, seq_id=3)
    compute(bm, seq)
    digests = list(seq.block_hashes)
    bm.free(seq)                             # preempted: blocks back to the pool (and still cached)
    assert seq.block_hashes == digests and seq.num_committed_blocks == 0
    assert bm.match_prefix(seq) == 8         # resumes from its own cached blocks
    compute(bm, seq)
    assert seq.block_hashes == digests and seq.num_committed_blocks == 2
