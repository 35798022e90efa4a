"""Weights kept in blocks of 32 along the input dimension, in the two layouts the quant_linear kernel reads
(kvserve/kernels/cpu/quant_linear.cpp):

    q8: int8 values [N, K], one scale per group of 32 (or 16) values:   w = q * scale
    q4: 4-bit values packed [N, K/2], a scale and a min per 32 values:  w = q * scale + min
        (block b's 16 bytes hold value j in the low nibble of byte j, value j + 16 in the high nibble)

Every GGUF type kvserve reads converts to one of them without rounding (kvserve/models/gguf_blocks.py), and
so do kvserve's own int8 (per channel) and int4 (group-wise, asymmetric) quantizers below.

Both are loaded row by row, then (groups of 32) re-laid once with their rows interleaved in tiles, the
order the faster kernels read: tiles of sixteen rows (quant_linear_x16.cpp, N a multiple of 16), else of
eight (quant_linear_x8.cpp, N a multiple of 8). Same values, another order (x16's q8 stores w + 128,
unsigned: what vpdpbusd multiplies).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QK = 32  # values per block along K
TILE = 8  # rows per x8 tile
# Lane of the kernel's result vector -> row within the tile, and back: its horizontal adds leave the rows
# of a tile in this order, so scales and mins are stored in it.
LANE_ROW = [0, 2, 4, 6, 1, 3, 5, 7]
ROW_LANE = [LANE_ROW.index(r) for r in range(TILE)]


@dataclass
class BlockWeight:
    """One block-quantized matrix of logical shape [N, K]."""
    qs: torch.Tensor                 # q8: int8 [N, K]; q4: uint8 [N, K / 2] (tiled: see interleave8 / 16)
    scales: torch.Tensor             # [N, K / group], float16 or float32 (tiled: [N / tile, K / 32, tile])
    mins: torch.Tensor | None        # q4: like scales; q8: None
    group: int = QK                  # 32, or 16 (q8 only: GGUF Q6_K)
    tile: int = 0                    # rows per interleaved tile (8 or 16); 0: row-major

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.tile:
            return  # built by interleave8 / interleave16 from a checked row-major weight
        if self.scales.shape != (n, k // self.group) or k % QK:
            raise ValueError(f"block weight of shape {(n, k)} has scales {tuple(self.scales.shape)} "
                             f"(group {self.group}); K must be a multiple of {QK}")
        if self.mins is not None and (self.mins.shape != self.scales.shape or self.group != QK):
            raise ValueError("q4 blocks need one min per scale, in groups of 32")

    @property
    def layout(self) -> str:
        return "q8" if self.mins is None else "q4"

    @property
    def interleaved(self) -> bool:
        return self.tile > 0

    @property
    def shape(self) -> tuple[int, int]:
        if self.tile:
            return self.qs.shape[0] * self.tile, self.qs.shape[1] * QK
        n, cols = self.qs.shape
        return n, cols * (2 if self.mins is not None else 1)

    def can_interleave(self, tile: int = TILE) -> bool:
        return not self.tile and self.group == QK and self.shape[0] % tile == 0

    def interleave(self, tile: int) -> BlockWeight:
        return self.interleave8() if tile == 8 else self.interleave16()

    def interleave8(self) -> BlockWeight:
        """The same weight with rows in tiles of eight, as quant_linear_x8 reads it. Within a tile, block b,
        pair p (rows 2p, 2p + 1): q4 keeps each row's 16 stored bytes, [N/8, nb, 4, 2, 16]; q8 puts values
        0-15 of both rows before values 16-31, [N/8, nb, 4, 2, 2, 16]. Scales / mins: [N/8, nb, 8] in
        LANE_ROW order."""
        if not self.can_interleave(8):
            raise ValueError("only row-major blocks of 32 with N a multiple of 8 can be interleaved")
        n, k = self.shape
        t, nb = n // TILE, k // QK
        if self.mins is not None:
            qs = self.qs.view(t, 4, 2, nb, 16).permute(0, 3, 1, 2, 4)
        else:
            qs = self.qs.view(t, 4, 2, nb, 2, 16).permute(0, 3, 1, 4, 2, 5)

        def lanes(v: torch.Tensor) -> torch.Tensor:
            return v.view(t, TILE, nb)[:, LANE_ROW].permute(0, 2, 1).contiguous()

        return BlockWeight(qs.contiguous(), lanes(self.scales), None if self.mins is None else lanes(self.mins),
                           self.group, tile=8)

    def interleave16(self) -> BlockWeight:
        """The same weight with rows in tiles of sixteen, as quant_linear_x16 reads it: per tile and block,
        groups of 64 bytes holding four bytes of each of the 16 rows, [N/16, nb, G, 16 * 4]. q4 (G = 4):
        group g holds bytes 4g .. 4g + 3 of each row's 16 stored bytes (values 4g.. in the low nibbles,
        16 + 4g.. in the high ones). q8 (G = 8): group g holds values 4g .. 4g + 3, stored as w + 128
        (uint8). Scales / mins: [N/16, nb, 16] in row order."""
        if not self.can_interleave(16):
            raise ValueError("only row-major blocks of 32 with N a multiple of 16 can be interleaved in 16s")
        n, k = self.shape
        t, nb = n // 16, k // QK
        if self.mins is not None:
            qs = self.qs.view(t, 16, nb, 4, 4).permute(0, 2, 3, 1, 4).reshape(t, nb, 4, 64)
        else:
            unsigned = self.qs.view(torch.uint8) ^ 0x80
            qs = unsigned.view(t, 16, nb, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, nb, 8, 64)

        def rows16(v: torch.Tensor) -> torch.Tensor:
            return v.view(t, 16, nb).permute(0, 2, 1).contiguous()

        return BlockWeight(qs.contiguous(), rows16(self.scales), None if self.mins is None else rows16(self.mins),
                           self.group, tile=16)

    def _rows(self, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Row-major (qs, scales, mins) of the given rows (all rows if None)."""
        if not self.tile:
            if rows is None:
                return self.qs, self.scales, self.mins
            return self.qs[rows], self.scales[rows], None if self.mins is None else self.mins[rows]
        if rows is None:
            rows = torch.arange(self.shape[0])
        if self.tile == 16:
            t, r = rows // 16, rows % 16
            q = self.qs.view(*self.qs.shape[:3], 16, 4)[t, :, :, r].reshape(rows.numel(), -1)  # [n, nb * G * 4]
            if self.mins is None:
                q = (q ^ 0x80).view(torch.int8)
            return q, self.scales[t, :, r], None if self.mins is None else self.mins[t, :, r]
        t, r = rows // TILE, rows % TILE
        p, h, lane = r // 2, r % 2, torch.tensor(ROW_LANE)[r]
        n = rows.numel()
        if self.mins is not None:
            qs = self.qs[t, :, p, h].reshape(n, -1)
        else:
            qs = self.qs[t, :, p, :, h].reshape(n, -1)
        return qs, self.scales[t, :, lane], None if self.mins is None else self.mins[t, :, lane]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def values(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The integer values as int16 [N, K] (or of the given rows only)."""
        qs = self._rows(rows)[0]
        if self.mins is None:
            return qs.to(torch.int16)
        b = qs.view(qs.shape[0], -1, QK // 2).to(torch.int16)
        return torch.cat([b & 0xF, b >> 4], dim=-1).view(qs.shape[0], -1)

    def dequantize(self, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """float [N, K] (or [len(rows), K]): the exact weights the kernel computes with."""
        q = self.values(rows).float()
        n, k = q.shape
        _, scales, mins = self._rows(rows)
        w = q.view(n, k // self.group, self.group) * scales.float()[..., None]
        if mins is not None:
            w = w + mins.float()[..., None]
        return w.view(n, k).to(dtype)


def cat_rows(parts: list[BlockWeight]) -> BlockWeight:
    """Stack matrices of one layout along N (the shards of a fused projection)."""
    first = parts[0]
    if any(p.interleaved for p in parts):
        raise ValueError("interleaved blocks cannot be stacked; stack row-major ones, then interleave")
    if any(p.layout != first.layout or p.group != first.group or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("only blocks of one layout, group and width can be stacked")
    dtype = torch.float32 if any(p.scales.dtype == torch.float32 for p in parts) else first.scales.dtype
    mins = None if first.mins is None else torch.cat([p.mins.to(dtype) for p in parts])
    return BlockWeight(torch.cat([p.qs for p in parts]), torch.cat([p.scales.to(dtype) for p in parts]), mins,
                       first.group)


def pack_q4(values: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> the q4 byte layout [N, K / 2]."""
    n, k = values.shape
    v = values.to(torch.uint8).view(n, k // QK, QK)
    return (v[..., : QK // 2] | (v[..., QK // 2:] << 4)).reshape(n, k // 2).contiguous()


def quantize_int8(w: torch.Tensor) -> BlockWeight:
    """Per-output-channel symmetric int8 (scale = max|w| / 127), stored as q8 blocks sharing the row's scale."""
    w = w.float()
    n, k = w.shape
    _check_width(k)
    exact = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float16).tiny)
    # Stored in float16, rounded up so that +-127 steps still reach max|w|; values are quantized
    # against the stored scale, the one the kernel multiplies by.
    scale = exact.to(torch.float16)
    scale = torch.where(scale.float() < exact, torch.nextafter(scale, torch.tensor(torch.inf, dtype=scale.dtype)),
                        scale)
    q = torch.round(w / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    # The kernel reads a scale per block; a channel's scale is repeated for each of its blocks.
    scales = scale[:, None].expand(n, k // QK).contiguous()
    return BlockWeight(q.contiguous(), scales, None)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> BlockWeight:
    """Group-wise asymmetric 4-bit: per group of `group_size` values along K, scale = (max - min) / 15 and
    w ~ q * scale + min. Where K is not a multiple of the group (576 = 4.5 x 128 in SmolLM2), the last
    group is shorter (a multiple of 32)."""
    if group_size not in (32, 128):
        raise ValueError(f"int4 group size must be 32 or 128, got {group_size}")
    w = w.float()
    n, k = w.shape
    _check_width(k)
    nb, per = k // QK, group_size // QK  # blocks, blocks per group
    blocks = w.view(n, nb, QK)
    # Per-group min / max from per-block ones; padding (+inf / -inf) fills the short last group.
    pad = -nb % per
    lo = F.pad(blocks.amin(-1), (0, pad), value=float("inf")).view(n, -1, per).amin(-1)
    hi = F.pad(blocks.amax(-1), (0, pad), value=float("-inf")).view(n, -1, per).amax(-1)
    # Scales and mins are stored in float16 (as GGUF's Q4_1 does), one per block (a group's blocks
    # share them); values are quantized against the stored ones.
    scale = ((hi - lo) / 15).clamp_min(1e-8).to(torch.float16).repeat_interleave(per, dim=1)[:, :nb]
    mins = lo.to(torch.float16).repeat_interleave(per, dim=1)[:, :nb]
    q = torch.round((blocks - mins.float()[..., None]) / scale.float()[..., None]).clamp_(0, 15)
    return BlockWeight(pack_q4(q.view(n, k)), scale.contiguous(), mins.contiguous())


def _check_width(k: int) -> None:
    if k % QK:
        raise ValueError(f"in_features {k} is not a multiple of {QK}: block-quantized weights need that (load the "
                         f"model with --quantization none to keep its weights in floats)")
