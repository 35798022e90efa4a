"""GGUF quantized tensors -> kvserve's block layouts (kvserve/layers/quantization/blocks.py), exactly.

Each GGUF type is a sequence of fixed-size blocks along a row. The types below map onto the two layouts
the kernel reads with no rounding: integer values are kept and each block's scale (and min) is computed
the way GGUF's own dequantization computes it, in float32 where the type multiplies two stored factors
(Q4_K, Q6_K) and float16 where it stores the scale itself.

    Q4_0 -> q4 (min = -8 * d)      Q4_1 -> q4      Q4_K -> q4 (scale d * sc, min -dmin * m, float32)
    Q8_0 -> q8                     Q5_0 -> q8 (value - 16)      Q6_K -> q8, groups of 16 (scale d * sc)
"""
from __future__ import annotations

import gguf
import numpy as np
import torch

from kvserve.layers.quantization.blocks import QK, BlockWeight

Q = gguf.GGMLQuantizationType
SUPPORTED = {Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q6_K}
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16}


def to_block_weight(data: np.ndarray, qtype: Q, shape: tuple[int, int]) -> BlockWeight:
    """data: the reader's uint8 rows [N, bytes per row] of a tensor of logical shape (N, K)."""
    if qtype not in SUPPORTED:
        raise ValueError(f"GGUF type {qtype.name} cannot be kept quantized (supported: "
                         f"{', '.join(sorted(t.name for t in SUPPORTED))}); load with --quantization none")
    n, k = shape
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if k % block_size or data.shape != (n, k // block_size * type_size):
        raise ValueError(f"{qtype.name} data of shape {data.shape} does not hold a [{n}, {k}] matrix")
    blocks = np.ascontiguousarray(data).reshape(n, k // block_size, type_size)
    return _CONVERTERS[qtype](blocks, n, k)


def _f16(b: np.ndarray) -> np.ndarray:
    """[.., 2] bytes -> float16 [..]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _q4_0(b: np.ndarray, n: int, k: int) -> BlockWeight:
    d = _f16(b[..., 0:2])
    return BlockWeight(_t(b[..., 2:18].reshape(n, k // 2)), _t(d), _t(d * np.float16(-8)))


def _q4_1(b: np.ndarray, n: int, k: int) -> BlockWeight:
    return BlockWeight(_t(b[..., 4:20].reshape(n, k // 2)), _t(_f16(b[..., 0:2])), _t(_f16(b[..., 2:4])))


def _q8_0(b: np.ndarray, n: int, k: int) -> BlockWeight:
    return BlockWeight(_t(b[..., 2:34].view(np.int8).reshape(n, k)), _t(_f16(b[..., 0:2])), None)


def _q5_0(b: np.ndarray, n: int, k: int) -> BlockWeight:
    d = _f16(b[..., 0:2])
    high = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # bit j: the fifth bit of value j
    high_bits = (high >> np.arange(QK, dtype=np.uint32)) & 1                       # [n, nb, 32]
    qs = b[..., 6:22]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)                              # values 0-15, then 16-31
    values = (low | (high_bits.astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    return BlockWeight(_t(values.reshape(n, k)), _t(d), None)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins per super-block."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def _q4_k(b: np.ndarray, n: int, k: int) -> BlockWeight:
    nsb = k // 256
    d = _f16(b[..., 0:2]).astype(np.float32)[..., None]
    dmin = _f16(b[..., 2:4]).astype(np.float32)[..., None]
    sc, mn = _k_scales(b[..., 4:16])
    # 128 bytes = four chunks of 32; chunk c's low nibbles are sub-block 2c, its high nibbles 2c + 1.
    chunks = b[..., 16:144].reshape(n, nsb, 4, 1, 32)
    values = (chunks >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F   # [n, nsb, 4, 2, 32]
    values = values.reshape(n, nsb * 8, QK)
    packed = values[..., :16] | (values[..., 16:] << 4)
    scales = (d * sc.astype(np.float32)).reshape(n, nsb * 8)
    mins = -(dmin * mn.astype(np.float32)).reshape(n, nsb * 8)
    return BlockWeight(_t(packed.reshape(n, k // 2)), _t(scales), _t(mins))


def _q6_k(b: np.ndarray, n: int, k: int) -> BlockWeight:
    nsb = k // 256
    ql, qh = b[..., 0:128], b[..., 128:192]
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210]).astype(np.float32)[..., None]
    # Each half of 128 values: low 4 bits from 64 bytes of ql (low nibbles: values 0-63, high: 64-127),
    # high 2 bits from 32 bytes of qh (bits 2i..2i+1: values 32i..32i+31).
    low = (ql.reshape(n, nsb, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(n, nsb, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)) & 0x03
    values = (low.reshape(n, nsb, 8, 32) | (high.reshape(n, nsb, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    return BlockWeight(_t(values.reshape(n, k)), _t((d * sc).reshape(n, nsb * 16)), None, group=16)


_CONVERTERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k, Q.Q6_K: _q6_k}
