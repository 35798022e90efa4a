"""Block-quantized weights: every GGUF block type decoded against gguf's own dequantization, the
quant_linear kernel against x @ W^T of the dequantized weights, kvserve's int8/int4 quantizers, and the
linear layers' shape-checked loaders."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvserve.kernels import cpu as cpu_kernels
from kvserve.layers.linear import QKVLinear
from kvserve.layers.quantization import BlockMethod, FloatMethod, QuantConfig
from kvserve.layers.quantization.blocks import BlockWeight, pack_q4, quantize_int4, quantize_int8
from kvserve.layers.quantization.methods import kernel_available
from kvserve.models.gguf import GGUFTensor
from kvserve.models.gguf_blocks import SUPPORTED, to_block_weight
from paged_helpers import native_ops

Q = gguf.GGMLQuantizationType


def gguf_raw(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, bytes] of a GGUF tensor: quantized by gguf's own code where it has a quantizer, else random
    blocks with sane float16 scales (K-quants: every bit pattern of the integer parts is valid)."""
    rng = np.random.default_rng(seed)
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scale = lambda: (rng.random((n, k // block)) * 0.01).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    if qtype == Q.Q4_K:
        raw[..., 0:2], raw[..., 2:4] = scale(), scale()
    else:  # Q6_K: d is the last two bytes
        raw[..., 208:210] = scale()
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED, key=lambda t: t.name), ids=lambda t: t.name)
def test_gguf_block_types_decode_exactly_as_gguf_dequantizes(qtype: Q) -> None:
    n, k = 6, 512
    raw = gguf_raw(qtype, n, k)
    ours = to_block_weight(raw, qtype, (n, k)).dequantize().numpy()
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype).reshape(n, k))


def test_unsupported_gguf_type_is_a_clear_load_error() -> None:
    raw = np.zeros((4, 512 // 256 * gguf.GGML_QUANT_SIZES[Q.Q5_K][1]), dtype=np.uint8)
    with pytest.raises(ValueError, match="Q5_K cannot be kept quantized.*--quantization none"):
        to_block_weight(raw, Q.Q5_K, (4, 512))


def test_q_k_row_unpermutation_is_the_same_on_blocks_and_floats() -> None:
    raw = gguf_raw(Q.Q4_1, 8, 64)
    t = GGUFTensor("blk.0.attn_q.weight", raw, Q.Q4_1, (8, 64), unpermute_heads=2)
    torch.testing.assert_close(t.to_blocks().dequantize(), t.to_float(), rtol=0, atol=0)


def test_int8_is_per_channel_and_within_half_a_step() -> None:
    w = torch.randn(64, 256) * torch.logspace(-2, 1, 64)[:, None]  # rows of very different scale
    bw = quantize_int8(w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert bw.layout == "q8" and bw.qs.dtype == torch.int8
    assert ((bw.dequantize() - w).abs() <= 0.5 * step * (1 + 2 ** -10) + 1e-7).all()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_is_groupwise_asymmetric_and_within_half_a_step(group: int) -> None:
    k = 576  # SmolLM2's hidden size: 4.5 groups of 128, so the last one is 64 wide
    w = torch.randn(16, k) + 3.0  # off-centre: a symmetric scheme would waste half its range
    bw = quantize_int4(w, group)
    assert bw.layout == "q4" and bw.qs.shape == (16, k // 2)
    bounds = list(range(0, k, group)) + [k]
    for lo, hi in zip(bounds, bounds[1:]):
        g = w[:, lo:hi]
        step = ((g.amax(-1) - g.amin(-1)) / 15)[:, None]
        assert ((bw.dequantize()[:, lo:hi] - g).abs() <= 0.5 * step * 1.01 + 1e-3).all()
        # one scale and min shared by a group's blocks
        assert (bw.scales[:, lo // 32:hi // 32] == bw.scales[:, lo // 32:lo // 32 + 1]).all()


def block_weights() -> dict[str, BlockWeight]:
    torch.manual_seed(0)
    n, k = 48, 576  # k: the default model's hidden size, 18 blocks; n: three tiles of 16, six of 8
    q4 = torch.randint(0, 16, (n, k))
    return {
        "q4_f16": BlockWeight(pack_q4(q4), torch.rand(n, k // 32).half() * 0.02,
                              -torch.rand(n, k // 32).half() * 0.1),
        "q4_f32": BlockWeight(pack_q4(q4), torch.rand(n, k // 32) * 0.02, -torch.rand(n, k // 32) * 0.1),
        "q8_g32": BlockWeight(torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n, k // 32).half() * 0.01,
                              None),
        "q8_g16": BlockWeight(torch.randint(-32, 32, (n, k), dtype=torch.int8), torch.rand(n, k // 16) * 0.01, None,
                              group=16),
    }


needs_kernel = pytest.mark.skipif(not kernel_available(torch.float32), reason="no quant_linear kernel for this CPU")


def quantized_reference(x: torch.Tensor, bw: BlockWeight) -> torch.Tensor:
    """x @ W^T as the kernels define it, in float64: each activation row quantized to int8 per block of 32
    the way quant_act.h does (scale = max|x| / 127 in float32, values rounded half to even), then exact
    integer dot products per weight group, scaled. What is left between this and a kernel is float32
    summation order, so it checks the kernels' lane and tile bookkeeping far more tightly than the float
    reference can."""
    xf = x.float().view(x.shape[0], -1, 32)
    mx = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(mx > 0, torch.tensor(127.0) / mx, torch.zeros_like(mx))
    q = (xf * inv).round().double().view(x.shape[0], -1)  # float32 product, then round: as the kernel
    d = (mx / 127).double().repeat_interleave(32, dim=1).squeeze(-1)  # [M, K]: the block scale per value
    n, k = bw.shape
    _, scales, mins = bw._rows(None)
    w = bw.values().double().view(n, k // bw.group, bw.group) * scales.double()[..., None]
    y = (q * d.view(x.shape[0], -1)) @ w.view(n, k).t()
    if mins is not None:  # min * d * sum(q) per block
        qsum = (q.view(x.shape[0], -1, 32).sum(-1) * (mx / 127).double().squeeze(-1))
        y = y + qsum @ mins.double().t()
    return y


@needs_kernel
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("name", list(block_weights()))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 7, 9, 64, 65, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tile", [0, 8, 16], ids=["rows", "x8", "x16"])
def test_quant_linear_kernel_matches_dequantized_reference(isa: str, name: str, rows: int, dtype: torch.dtype,
                                                           tile: int) -> None:
    ops = native_ops(isa)  # both variants have both tiled kernels
    bw = block_weights()[name]
    x = (torch.randn(rows, bw.shape[1]) * 2).to(dtype)
    ref = x.float() @ bw.dequantize().t()
    exact = quantized_reference(x, bw)
    if tile:
        if not bw.can_interleave(tile):
            pytest.skip("groups of 16 stay row-major")
        bw = bw.interleave(tile)
        y = (ops.quant_linear_x16 if tile == 16 else ops.quant_linear_x8)(x, bw.qs, bw.scales, bw.mins)
    else:
        y = ops.quant_linear(x, bw.qs, bw.scales, bw.mins, bw.group)
    assert y.dtype == dtype and y.shape == (rows, exact.shape[1])
    # Activations are quantized to int8 per block of 32 (as llama.cpp does): error ~ 1 / 254 per block,
    # averaged over the row; bf16 output adds its rounding.
    err = (y.float() - ref).norm(dim=1) / ref.norm(dim=1)
    assert err.max() < (0.01 if dtype == torch.float32 else 0.015), err.max()
    # Against the same quantization done in float64, only float32 rounding (and bf16's output) is left.
    exact_err = (y.double() - exact).norm(dim=1) / exact.norm(dim=1)
    assert exact_err.max() < (1e-5 if dtype == torch.float32 else 4e-3), exact_err.max()


@needs_kernel
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("name", list(block_weights()))
@pytest.mark.parametrize("tile", [0, 8, 16], ids=["rows", "x8", "x16"])
def test_float32_output_is_the_sum_before_its_rounding(isa: str, name: str, tile: int) -> None:
    """out_dtype float32 (an LM head's logits under bfloat16 activations) gives the float32 sums that a bfloat16
    output rounds once."""
    ops = native_ops(isa)
    bw = block_weights()[name]
    x = (torch.randn(5, bw.shape[1]) * 2).to(torch.bfloat16)
    if tile:
        if not bw.can_interleave(tile):
            pytest.skip("groups of 16 stay row-major")
        bw = bw.interleave(tile)
        op = ops.quant_linear_x16 if tile == 16 else ops.quant_linear_x8
        run = lambda out=None: op(x, bw.qs, bw.scales, bw.mins, out)
    else:
        run = lambda out=None: ops.quant_linear(x, bw.qs, bw.scales, bw.mins, bw.group, out)
    y32 = run(torch.float32)
    assert y32.dtype == torch.float32 and not torch.equal(y32, y32.to(torch.bfloat16).float())
    assert torch.equal(y32.to(torch.bfloat16), run())


@needs_kernel
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("name", ["q4_f16", "q4_f32", "q8_g32"])
@pytest.mark.parametrize("tile", [8, 16])
def test_a_row_gives_the_same_bits_whatever_rows_share_its_call(isa: str, name: str, tile: int) -> None:
    """The tiled kernels take activation rows a few per pass over the weights (16-row tiles on AVX-512: four,
    and a call's last rows up to eight in one pass): each row's sums are its own, so a verification step's
    rows round as decode rows do, which greedy speculation's identity rests on."""
    ops = native_ops(isa)
    bw = block_weights()[name].interleave(tile)
    op = ops.quant_linear_x16 if tile == 16 else ops.quant_linear_x8
    x = (torch.randn(13, bw.shape[1]) * 2).to(torch.bfloat16)
    alone = torch.cat([op(x[i:i + 1], bw.qs, bw.scales, bw.mins) for i in range(13)])
    for rows in (2, 3, 4, 5, 6, 7, 8, 9, 12, 13):
        assert torch.equal(op(x[:rows], bw.qs, bw.scales, bw.mins), alone[:rows]), rows


@needs_kernel
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_row_major_q4_bits_do_not_depend_on_threads_or_rows_sharing_the_call(isa: str) -> None:
    """Weights whose row count is not a multiple of 8 stay row-major (quant_linear.cpp), where rows go in
    tiles of 1-4 activation rows by 1-4 weight rows depending on the call's shape and the thread split. The
    q4 min term was left to the compiler to contract, differently per tile shape: up to 3e-5 apart."""
    ops = native_ops(isa)
    torch.manual_seed(0)
    n, k = 17, 4096
    bw = BlockWeight(pack_q4(torch.randint(0, 16, (n, k))), torch.rand(n, k // 32) * 0.02,
                     -torch.rand(n, k // 32) * 0.1)
    x = torch.randn(9, k) * 2
    run = lambda rows: ops.quant_linear(rows, bw.qs, bw.scales, bw.mins, bw.group)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = run(x)
        alone = torch.cat([run(x[i:i + 1]) for i in range(9)])
        torch.set_num_threads(2)
        assert torch.equal(run(x), one_thread)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, alone)


@needs_kernel
@pytest.mark.parametrize("name", ["q4_f16", "q4_f32", "q8_g32"])
def test_avx2_tile_layouts_give_the_same_bits(name: str) -> None:
    """The AVX2 build's two tiled kernels do the same float work in the same order, so the loader's move
    from 8-row to 16-row tiles changed no output bit there."""
    ops = native_ops("avx2")
    bw = block_weights()[name]
    by8, by16 = bw.interleave(8), bw.interleave(16)
    for rows in (1, 2, 3, 4, 7, 65):
        x = torch.randn(rows, bw.shape[1]) * 2
        assert torch.equal(ops.quant_linear_x8(x, by8.qs, by8.scales, by8.mins),
                           ops.quant_linear_x16(x, by16.qs, by16.scales, by16.mins)), rows


@needs_kernel
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
def test_q8_sixteen_row_tiles_keep_float32_precision_with_one_signed_activations(isa: str) -> None:
    """Activations of one sign (post-norm hidden states often are) make a block's sum large. q8's +128
    offset taken out as a float term then cancelled against it: AVX-512 was 6.7e-5 off the exact sums (an
    outlier input feature, x = |randn| + 1) where AVX2's exact integer products were 1.1e-7. Now the offset
    leaves in integers, and both builds do the same float work: the same bits."""
    ops = native_ops(isa)
    torch.manual_seed(0)
    w = torch.randn(48, 576)
    w[:, 5] *= 50  # an outlier input feature: every row's scale is set by it
    bw = quantize_int8(w).interleave(16)
    x = torch.randn(9, 576).abs() + 1
    exact = quantized_reference(x, quantize_int8(w))
    y = ops.quant_linear_x16(x, bw.qs, bw.scales, bw.mins)
    err = ((y.double() - exact).norm(dim=1) / exact.norm(dim=1)).max()
    assert err < 1e-6, err  # was 6.7e-5 on AVX-512
    if cpu_kernels.cpu_supports("avx2"):
        assert torch.equal(y, native_ops("avx2").quant_linear_x16(x, bw.qs, bw.scales, bw.mins))


@pytest.mark.parametrize("name", ["q4_f16", "q4_f32", "q8_g32"])
@pytest.mark.parametrize("tile", [8, 16])
def test_interleaved_blocks_hold_the_same_weights(name: str, tile: int) -> None:
    bw = block_weights()[name]
    tiled = bw.interleave(tile)
    assert tiled.tile == tile and tiled.shape == bw.shape and tiled.nbytes == bw.nbytes
    assert torch.equal(tiled.dequantize(), bw.dequantize())
    rows = torch.tensor([39, 0, 7, 8, 13, 15, 47])
    assert torch.equal(tiled.values(rows), bw.values(rows))
    assert torch.equal(tiled.dequantize(rows), bw.dequantize(rows))


@needs_kernel
@pytest.mark.parametrize("isa", cpu_kernels.ISAS)
@pytest.mark.parametrize("name", ["q4_f16", "q4_f32", "q8_g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tile", [8, 16])
def test_embedding_rows_from_interleaved_blocks(isa: str, name: str, dtype: torch.dtype, tile: int) -> None:
    ops = native_ops(isa)  # both variants have both tiled kernels
    bw = block_weights()[name].interleave(tile)
    embed = ops.quant_embedding_x16 if tile == 16 else ops.quant_embedding_x8
    ids = torch.tensor([39, 0, 7, 8, 13, 13, 21, 47])
    rows = embed(ids, bw.qs, bw.scales, bw.mins, dtype)
    ref = bw.dequantize(ids, dtype)
    # q * scale + min in one fused multiply-add or two roundings: a last-bit difference at most
    torch.testing.assert_close(rows, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    with pytest.raises(RuntimeError, match="out of range"):
        embed(torch.tensor([48]), bw.qs, bw.scales, bw.mins, dtype)


@needs_kernel
def test_quant_linear_kernel_rejects_mismatched_shapes() -> None:
    bw = block_weights()["q4_f16"]
    with pytest.raises(RuntimeError, match="does not match in_features"):
        cpu_kernels.ops().quant_linear(torch.randn(2, 512), bw.qs, bw.scales, bw.mins, 32)


def test_linear_loader_checks_each_shards_shape() -> None:
    layer = QKVLinear(64, 64, 32, False, FloatMethod(torch.float32, torch.device("cpu")), "model.layers.0.self_attn")
    layer.weight_loader(0, torch.randn(64, 64))
    with pytest.raises(ValueError, match=r"k_proj.weight.*\(16, 64\), expected \(32, 64\)"):
        layer.weight_loader(1, torch.randn(16, 64))
    assert layer.missing() == ["model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"]


@pytest.mark.parametrize("source", ["int8", "int4"])
def test_fused_layer_quantizes_each_shard_and_computes_x_wT(source: str) -> None:
    torch.manual_seed(1)
    method = QuantConfig(source).method(["q", "k", "v"])
    assert isinstance(method, BlockMethod)
    layer = QKVLinear(128, 64, 32, True, method, "p")
    shards = [torch.randn(64, 128), torch.randn(32, 128), torch.randn(32, 128)]
    for i, w in enumerate(shards):
        layer.weight_loader(i, w)
        layer.bias_loader(i, torch.full((w.shape[0],), float(i)))
    layer.finalize()
    x = torch.randn(5, 128)
    ref = x @ torch.cat(shards).t() + torch.cat([torch.full((w.shape[0],), float(i)) for i, w in enumerate(shards)])
    rel = ((layer(x) - ref).norm() / ref.norm()).item()
    assert rel < (0.02 if source == "int8" else 0.12), rel  # int4 of Gaussian weights: ~8% per weight


@needs_kernel  # without it, auto dequantizes GGUF weights at load
def test_gguf_shards_of_different_layouts_stay_separate_segments() -> None:
    """A Q4_K_M file mixes Q4_K (q4) and Q6_K (q8, groups of 16) inside one fused projection."""
    method = QuantConfig("auto", quantized_tensors={"q": True, "k": True, "v": True}).method(["q", "k", "v"])
    layer = QKVLinear(256, 32, 16, False, method, "p")
    raws = [(Q.Q4_K, 32), (Q.Q4_K, 16), (Q.Q6_K, 16)]
    tensors = [GGUFTensor(f"t{i}", gguf_raw(t, n, 256, seed=i), t, (n, 256)) for i, (t, n) in enumerate(raws)]
    for i, t in enumerate(tensors):
        layer.weight_loader(i, t)
    layer.finalize()
    assert [s.layout for s in layer.segments] == ["q4", "q8"]
    x = torch.randn(3, 256)
    ref = x @ torch.cat([t.to_float() for t in tensors]).t()
    assert ((layer(x) - ref).norm() / ref.norm()).item() < 0.01
