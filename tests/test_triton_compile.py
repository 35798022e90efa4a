"""The Triton kernels (attention with and without tree rows, KV write, the elementwise ops) through Triton's
real compiler for an H100/H200 (sm_90), on the CPU: the interpreter, which runs the kernels' tests here, accepts
code that the compiler rejects. Run in a subprocess because this process's kernels were decorated under
TRITON_INTERPRET=1 (conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

CHECK = r"""
import sys
import triton
from triton_helpers import compile_for_gpu
from kvserve.attention.triton import cache_write as cw, paged_attention as pa

def attention(dt, kv_dt, H, Hkv, D, splits, tree=False):
    g_pad, block_q = pa.tile_rows(H, Hkv)
    types = {n: "i64" for n in pa._paged_attention_kernel.arg_names}
    types.update(q_ptr="*" + dt, out_ptr="*" + dt, k_cache_ptr="*" + kv_dt, v_cache_ptr="*" + kv_dt,
                 block_tables_ptr="*i64", seq_lens_ptr="*i64", query_start_loc_ptr="*i64", tile_seq_ptr="*i32",
                 tile_start_ptr="*i32", positions_ptr="*i64", scale="fp32", k_scale="fp32", v_scale="fp32",
                 window="i32",
                 part_out_ptr="*fp32" if splits > 1 else "*" + dt, part_lse_ptr="*fp32" if splits > 1 else "*" + dt)
    d_pad = triton.next_power_of_2(D)
    k = compile_for_gpu(pa._paged_attention_kernel, types, dict(
        G=H // Hkv, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_q * g_pad, BLOCK_N=64, NUM_HEADS=H,
        HEAD_DIM=D, D_PAD=d_pad, BLOCK_SIZE=16, KV_FP8=kv_dt == "fp8e4nv", TREE=tree, DOT_F32=False,
        NUM_SPLITS=splits))
    # bf16 dots on the tensor cores; float32 ones in plain float32 (input_precision="ieee")
    assert ("mma.sync" in k.asm["ptx"]) == (dt == "bf16"), (dt, kv_dt)
    if splits > 1:
        types = {n: "i64" for n in pa._merge_splits_kernel.arg_names}
        types.update(out_ptr="*" + dt, part_out_ptr="*fp32", part_lse_ptr="*fp32", tile_seq_ptr="*i32",
                     tile_start_ptr="*i32", query_start_loc_ptr="*i64")
        compile_for_gpu(pa._merge_splits_kernel, types, dict(
            G=H // Hkv, G_PAD=g_pad, BLOCK_M=block_q * g_pad, NUM_HEADS=H, HEAD_DIM=D, D_PAD=d_pad,
            NUM_SPLITS=splits))
    types = {n: "i64" for n in cw._write_kv_kernel.arg_names}
    types.update(k_ptr="*" + dt, v_ptr="*" + dt, k_cache_ptr="*" + kv_dt, v_cache_ptr="*" + kv_dt,
                 slot_ptr="*i64", k_scale="fp32", v_scale="fp32")
    compile_for_gpu(cw._write_kv_kernel, types, dict(
        NUM_KV_HEADS=Hkv, HEAD_DIM=D, H_PAD=triton.next_power_of_2(Hkv), D_PAD=d_pad, BLOCK_SIZE=16,
        FP8=kv_dt == "fp8e4nv", ROUND_FP8=False))

# Qwen3-0.6B's heads (16/8 x 128), SmolLM2-135M's (9/3 x 64, a group padded to 4), Gemma 3 270M's (4/1 x 256),
# the tiny test models' (4/2 x 24, a head size padded to 32)
# This process's share: "dt/kv_dt" pairs of attention (a pair of one dtype with the tree rows too), elementwise dtypes.
PAIRS = [p.split("/") for p in sys.argv[1].split(",") if p]
ELEMENTWISE_DTYPES = [d for d in sys.argv[2].split(",") if d]
for dt, kv_dt in PAIRS:
    for H, Hkv, D in ((16, 8, 128), (9, 3, 64), (4, 1, 256), (4, 2, 24)):
        for splits in (1, 4):
            attention(dt, kv_dt, H, Hkv, D, splits)
    if kv_dt == dt:
        for splits in (1, 4):  # tree drafts' rows (positions given), on the default model's heads
            attention(dt, dt, 9, 3, 64, splits, tree=True)
from kvserve.kernels.cuda import elementwise as ew

def elementwise(dt):
    compile_for_gpu(ew._fused_add_rms_norm_kernel, dict(x_ptr="*" + dt, r_ptr="*" + dt, w_ptr="*" + dt,
                    stride_x="i64", stride_r="i64", eps="fp32"), dict(N=1024, BLOCK=1024))
    compile_for_gpu(ew._rms_norm_kernel, dict(x_ptr="*" + dt, out_ptr="*" + dt, w_ptr="*" + dt, stride_t="i64",
                    stride_h="i64", eps="fp32"), dict(HEADS=16, H_PAD=16, N=128, BLOCK=128))
    compile_for_gpu(ew._rotary_kernel, dict(x_ptr="*" + dt, pos_ptr="*i64", cos_sin_ptr="*fp32", stride_t="i64",
                    stride_h="i64", stride_p="i64"), dict(HEADS=24, H_PAD=32, HALF=64, HALF_PAD=64))
    compile_for_gpu(ew._silu_and_mul_kernel, dict(x_ptr="*" + dt, out_ptr="*" + dt, stride_x="i64"),
                    dict(I=3072, BLOCK=1024))

for dt in ELEMENTWISE_DTYPES:
    elementwise(dt)
print("compiled")
"""


# Two processes, one per core: each compile is single-threaded, and one process took 88-116 s for the whole set.
# Split by measured cost (2-core Zen 4, fresh Triton cache): float32 attention 40 s with a float32 cache, 31 s with
# float8, bfloat16 ~25 s for both caches, the elementwise kernels ~1 s.
SHARDS = [("fp32/fp32,bf16/fp8e4nv", ""), ("fp32/fp8e4nv,bf16/bf16", "bf16,fp16,fp32")]


def test_triton_kernels_compile_for_hopper() -> None:
    # Between them, the shards compile every attention pair (activations, cache) and every elementwise dtype.
    pairs = sorted(p for attention, _ in SHARDS for p in attention.split(",") if p)
    assert pairs == sorted(f"{dt}/{kv}" for dt in ("bf16", "fp32") for kv in (dt, "fp8e4nv"))
    assert sorted(d for _, ew in SHARDS for d in ew.split(",") if d) == ["bf16", "fp16", "fp32"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    procs = [subprocess.Popen([sys.executable, "-c", CHECK, *shard], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for shard in SHARDS]
    try:
        for shard, proc in zip(SHARDS, procs):
            out, err = proc.communicate(timeout=600)
            assert proc.returncode == 0 and "compiled" in out, (shard, err[-4000:])
    finally:
        for proc in procs:  # the other shard, where one failed or timed out
            proc.kill()
